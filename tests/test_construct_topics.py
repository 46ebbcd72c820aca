"""Topic admission: sequential in arrival order, batched matching, multi-label, creation, identity."""

from __future__ import annotations

import json
import math
from typing import Any

import pytest

from tests.fakes import FakeChatModel, edited, replies, scene
from tmem.construct import admit_topics
from tmem.construct.topics import topic_id
from tmem.devtools.responders import request_input
from tmem.domain import Topic
from tmem.errors import ValidationFailure

KEYWORDS = [f"word{n}" for n in range(12)]


def admit_none(operation: str, request_json: dict[str, Any]) -> str:
    """Admits nothing; proposes a topic named after the scene when allowed."""
    data = request_input(request_json)
    proposal = {"title": data["scene"]["title"], "keywords": KEYWORDS} if data["may_open_new"] else None
    return json.dumps({"admitted": [], "new_topic": proposal})


def topic(seq: int, title: str, scene_ids: tuple[str, ...], keywords: tuple[str, ...] = tuple(KEYWORDS)) -> Topic:
    return Topic(
        conversation_id="conv-t", topic_id=f"tpc_{seq}", seq=seq, title=title, keywords=keywords, scene_ids=scene_ids
    )


def test_sequential_in_arrival_order_with_batched_matching() -> None:
    scenes = [scene(n, f"Unrelated event number {n}") for n in range(8)]
    chat = FakeChatModel({"topic_match": admit_none})
    pool = admit_topics("conv-t", list(reversed(scenes)), chat, batch=3)
    # pool size before scene k is k: ceil(k / 3) matching calls each
    assert chat.count("topic_match") == sum(math.ceil(k / 3) for k in range(8)) == 12
    assert chat.count("topic_create") == 1  # only the first scene; later ones use the proposal
    assert [t.title for t in pool.topics] == [s.title for s in scenes]  # creation follows arrival (seq) order
    assert [t.seq for t in pool.topics] == list(range(8))
    assert [t.scene_ids for t in pool.topics] == [(s.scene_id,) for s in scenes]
    # the matching calls of one scene see the pool in batches of at most 3, and only the last may open a topic
    calls = chat.of("topic_match")
    assert all(len(c.input["topics"]) <= 3 for c in calls)
    last_scene_calls = calls[-3:]
    assert [len(c.input["topics"]) for c in last_scene_calls] == [3, 3, 1]
    assert [c.input["may_open_new"] for c in last_scene_calls] == [False, False, True]


def test_multi_label_admission_keeps_topic_identity_and_merges_keywords() -> None:
    existing = (
        topic(0, "Ana's pottery class", ("scn_a",), ("pottery", "bowl", *KEYWORDS)),
        topic(1, "Ana's gifts for her mother", ("scn_b",)),
        topic(2, "Ben's marathon", ("scn_c",)),
    )
    answer = {
        "admitted": [
            {"ref": "T1", "new_keywords": ["glaze", "Pottery"]},
            {"ref": "T2", "new_keywords": ["birthday"]},
        ],
        "new_topic": None,
    }
    chat = FakeChatModel({"topic_match": replies(answer)})
    new = scene(5, "Ana glazes a bowl for her mother's birthday")
    pool = admit_topics("conv-t", [new], chat, existing=existing, batch=10)
    assert chat.count("topic_match") == 1 and chat.count("topic_create") == 0
    assert [t.topic_id for t in pool.topics] == ["tpc_0", "tpc_1", "tpc_2"]
    pottery, gifts, marathon = pool.topics
    assert pottery.title == "Ana's pottery class" and pottery.scene_ids == ("scn_a", new.scene_id)
    assert pottery.keywords[:2] == ("pottery", "bowl") and "glaze" in pottery.keywords
    assert [k.lower() for k in pottery.keywords].count("pottery") == 1  # merged case-insensitively
    assert gifts.scene_ids == ("scn_b", new.scene_id) and "birthday" in gifts.keywords
    assert marathon == existing[2]
    assert pool.topics_of(new.scene_id) == ("tpc_0", "tpc_1")


def test_admissions_from_several_batches_are_united() -> None:
    existing = tuple(topic(n, f"Thread {n}", (f"scn_{n}",)) for n in range(4))

    def admit_first(operation: str, request_json: dict[str, Any]) -> str:
        data = request_input(request_json)
        return json.dumps({"admitted": [{"ref": data["topics"][0]["ref"]}], "new_topic": None})

    chat = FakeChatModel({"topic_match": admit_first})
    new = scene(9, "Something")
    pool = admit_topics("conv-t", [new], chat, existing=existing, batch=2)
    assert chat.count("topic_match") == 2
    assert pool.topics_of(new.scene_id) == ("tpc_0", "tpc_2")
    calls = chat.of("topic_match")
    # the last batch may open a topic for a second matter, and is told what batch 1 admitted
    assert [c.input["may_open_new"] for c in calls] == [False, True]
    assert "already_admitted" not in calls[0].input and calls[1].input["already_admitted"] == ["Thread 0"]
    assert len(pool.topics) == 4  # no proposal: no new topic


def test_a_second_matter_of_an_admitted_scene_opens_its_own_topic() -> None:
    existing = (topic(0, "Jon's dance studio", ("scn_a",)),)
    second = {"admitted": [{"ref": "T1"}], "new_topic": {"title": "Gina's clothing store", "keywords": KEYWORDS}}
    chat = FakeChatModel({"topic_match": replies(second)})
    new = scene(2, "Jon's studio search and Gina's new store")
    pool = admit_topics("conv-t", [new], chat, existing=existing)
    assert [t.title for t in pool.topics] == ["Jon's dance studio", "Gina's clothing store"]
    assert pool.topics_of(new.scene_id) == ("tpc_0", pool.topics[1].topic_id)
    assert chat.count("topic_create") == 0


def test_new_topic_is_created_when_nothing_admits_and_no_usable_proposal() -> None:
    existing = (topic(0, "Ben's marathon", ("scn_c",)),)
    thin = {"admitted": [], "new_topic": {"title": "Ana's puppy", "keywords": ["puppy", "dog"]}}
    chat = FakeChatModel({"topic_match": replies(thin)})
    new = scene(3, "Ana adopts a puppy named Biscuit from the shelter", "Ana adopted a puppy named Biscuit.")
    pool = admit_topics("conv-t", [new], chat, existing=existing)
    assert chat.count("topic_create") == 1
    founded = pool.topics[-1]
    assert founded.topic_id == topic_id("conv-t", new.scene_id)
    assert founded.seq == 1 and founded.scene_ids == (new.scene_id,)
    assert len(founded.keywords) >= 10


def test_topic_with_too_few_distinct_keywords_is_reasked_then_fails() -> None:
    repeated = {"title": "Ana's puppy", "keywords": ["puppy", "Puppy", " puppy "] + ["dog"] * 8}
    chat = FakeChatModel({"topic_create": replies(repeated)})
    with pytest.raises(ValidationFailure) as caught:
        admit_topics("conv-t", [scene(0, "Ana's puppy")], chat)
    assert caught.value.operation == "topic_create"
    assert "at least 10" in caught.value.reason
    assert chat.count("topic_create") == 2


def test_unknown_topic_ref_raises() -> None:
    existing = (topic(0, "Ben's marathon", ("scn_c",)),)
    chat = FakeChatModel({"topic_match": replies({"admitted": [{"ref": "T7"}], "new_topic": None})})
    with pytest.raises(ValidationFailure, match="T7") as caught:
        admit_topics("conv-t", [scene(1, "x")], chat, existing=existing)
    assert caught.value.operation == "topic_match"


def test_scenes_already_admitted_cost_nothing() -> None:
    scenes = [scene(n, f"Ana's pottery class session {n}", "Ana made bowls at her pottery class.") for n in range(3)]
    chat = FakeChatModel()
    first = admit_topics("conv-t", scenes[:2], chat)
    calls_before = len(chat.calls)
    second = admit_topics("conv-t", scenes, chat, existing=first.topics)
    assert len(chat.calls) - calls_before == max(1, math.ceil(len(first.topics) / 10))  # only the new scene
    assert {sid for t in second.topics for sid in t.scene_ids} == {s.scene_id for s in scenes}


def test_synth_admission_is_deterministic_and_ids_fixed_at_creation() -> None:
    scenes = [
        scene(0, "Ana adopts a puppy", "Ana adopted a shelter puppy named Biscuit; the puppy chews shoes."),
        scene(1, "Biscuit the puppy at the vet", "Ana took her shelter puppy Biscuit to the vet for shoes chewing."),
        scene(2, "Ben trains for a marathon", "Ben runs twenty miles every Sunday for his spring marathon."),
    ]
    runs = [admit_topics("conv-t", scenes, FakeChatModel()) for _ in range(2)]
    assert runs[0] == runs[1]
    ids = {t.topic_id for t in runs[0].topics}
    assert topic_id("conv-t", scenes[0].scene_id) in ids
    assert all(t.topic_id == topic_id("conv-t", t.scene_ids[0]) for t in runs[0].topics)


def test_proposal_from_the_match_call_is_cleaned() -> None:
    def messy(answer: dict[str, Any], data: dict[str, Any]) -> dict[str, Any]:
        if answer["new_topic"]:
            answer["new_topic"]["keywords"] = ["  spaced   out  ", *answer["new_topic"]["keywords"]]
        return answer

    existing = (topic(0, "Ben's marathon", ("scn_c",)),)
    chat = FakeChatModel({"topic_match": edited("topic_match", messy)})
    new = scene(4, "Ana paints a sunset over the lake", "Ana painted a sunset over the lake with new brushes and oils.")
    pool = admit_topics("conv-t", [new], chat, existing=existing)
    assert chat.count("topic_create") == 0
    assert pool.topics[-1].keywords[0] == "spaced out"


# --------------------------------------------------------------------------- shortlist (settings.topic_shortlist)

THREADS = ["pottery glaze kiln bowl", "marathon training race pace", "puppy shelter leash vet", "violin lesson bow",
           "kitchen renovation tiles", "garden tomato compost", "chess club tournament", "bakery sourdough starter",
           "camping tent lake", "guitar band gig", "tax return accountant", "wedding venue dress", "car repair brakes",
           "novel draft publisher", "yoga studio mat"]


def threads() -> tuple[Topic, ...]:
    return tuple(topic(n, f"Thread {n}: {words.split()[0]}", (f"scn_{n}",), tuple(words.split()) + tuple(KEYWORDS))
                 for n, words in enumerate(THREADS))


def test_shortlist_is_one_call_listing_the_most_similar_topics_and_the_next_by_title() -> None:
    chat = FakeChatModel({"topic_match": admit_none})
    new = scene(20, "Ana fires a glazed bowl in the kiln", "Ana said the glaze on her pottery bowl cracked in the kiln.")
    admit_topics("conv-t", [new], chat, existing=threads(), batch=4, shortlist=10)
    assert chat.count("topic_match") == 1 and chat.count("topic_create") == 0  # paper batches: ceil(15 / 4) = 4 calls
    data = chat.of("topic_match")[0].input
    assert len(data["topics"]) == 4 and len(data["other_topics"]) == 6  # the last 5 topics are not shown
    listed = [t["title"] for t in data["topics"]]
    assert "Thread 0: pottery" in listed  # the one topic sharing the scene's words
    assert all("keywords" in t for t in data["topics"]) and all(set(t) == {"ref", "title"} for t in data["other_topics"])
    # refs run on across both lists; each list keeps creation order
    assert [t["ref"] for t in data["topics"] + data["other_topics"]] == [f"T{n}" for n in range(1, 11)]
    seqs = [int(t["title"].split(":")[0].split()[1]) for t in data["topics"]]
    assert seqs == sorted(seqs) and data["may_open_new"] is True and "already_admitted" not in data
    assert "other_topics by title only" in chat.of("topic_match")[0].prompt.messages[0].content


def test_a_topic_offered_by_title_only_can_be_admitted_and_gains_keywords() -> None:
    def admit_last_title(operation: str, request_json: dict[str, Any]) -> str:
        data = request_input(request_json)
        return json.dumps({"admitted": [{"ref": data["other_topics"][-1]["ref"], "new_keywords": ["kiln"]}],
                           "new_topic": None})

    chat = FakeChatModel({"topic_match": admit_last_title})
    new = scene(20, "Ana fires a glazed bowl in the kiln")
    pool = admit_topics("conv-t", [new], chat, existing=threads(), batch=4, shortlist=10)
    title = chat.of("topic_match")[0].input["other_topics"][-1]["title"]
    (joined,) = [t for t in pool.topics if new.scene_id in t.scene_ids]
    assert joined.title == title and "kiln" in joined.keywords and len(pool.topics) == 15


def test_shortlist_grows_one_call_per_scene_where_batches_grow_with_the_pool() -> None:
    scenes = [scene(n, f"Unrelated event number {n}") for n in range(12)]
    batches, short = FakeChatModel({"topic_match": admit_none}), FakeChatModel({"topic_match": admit_none})
    a = admit_topics("conv-t", scenes, batches, batch=3)
    b = admit_topics("conv-t", scenes, short, batch=3, shortlist=6)
    assert batches.count("topic_match") == sum(math.ceil(k / 3) for k in range(12)) == 26
    assert short.count("topic_match") == 11  # every scene after the first: one call
    assert [t.title for t in a.topics] == [t.title for t in b.topics]


def test_a_pool_within_one_batch_asks_exactly_as_the_paper_batches_do() -> None:
    # the same request, so responses recorded or cached before the setting still answer it
    existing = threads()[:4]
    new = scene(20, "Ana fires a glazed bowl in the kiln")
    plain, short = FakeChatModel({"topic_match": admit_none}), FakeChatModel({"topic_match": admit_none})
    admit_topics("conv-t", [new], plain, existing=existing, batch=4)
    admit_topics("conv-t", [new], short, existing=existing, batch=4, shortlist=10)
    assert short.of("topic_match")[0].request == plain.of("topic_match")[0].request


def test_a_shortlist_not_above_the_batch_is_refused() -> None:
    with pytest.raises(ValueError, match="must exceed the batch"):
        admit_topics("conv-t", [scene(20, "x")], FakeChatModel(), existing=threads(), batch=10, shortlist=10)

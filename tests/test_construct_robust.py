"""Construction that survives real answers (issue 13, point 3): splits, clipping, unit quarantine.

Every test runs a stage over :class:`tests.fakes.FakeChatModel` with ``budgets=True``: an answer
longer than the prompt's completion budget (4 characters a token) is cut there and raised as the
adapter raises it (:class:`LLMTruncatedError`). The old code repaired such an answer by re-asking
the same request (cut again) and then failed the whole stage.
"""

from __future__ import annotations

import json
from typing import Any

import pytest

from tests.fakes import FakeChatModel, dialogue, edited, replies, scene
from tests.test_construct_items import build_topic
from tmem.construct import (
    admit_topics_outcome,
    extract_items,
    extract_items_outcome,
    item_triggers,
    item_triggers_outcome,
    persona,
    persona_outcome,
    scene_triggers_outcome,
    segment,
    segment_outcome,
)
from tmem.devtools.responders import request_input
from tmem.domain import Item, Topic
from tmem.errors import LLMTruncatedError, ValidationFailure
from tmem.llm.response_cache import CachedChatModel, InMemoryResponseCache
from tmem.llm.usage import InMemoryUsageLedger
from tmem.prompts import persona as persona_prompt
from tmem.prompts import topic_create, topic_match

# -- item extraction -------------------------------------------------------------------------------


def items_per_scene(count: int, huge_title: str | None = None) -> Any:
    """``count`` atomic items of ~150 characters per scene; the scene titled ``huge_title`` gets 60."""

    def respond(operation: str, request_json: dict[str, Any]) -> str:
        out = []
        for s in request_input(request_json)["scenes"]:
            n = 60 if s["title"] == huge_title else count
            out += [{"kind": "atomic", "content": f"In {s['title']} Ana said fact number {k} " + "x" * 80,
                     "sources": [s["ref"]], "date": None, "keywords": ["fact"]} for k in range(n)]
        return json.dumps({"items": out})

    return respond


def test_a_chunk_whose_answer_is_cut_is_extracted_in_halves_down_to_one_scene() -> None:
    topic, scenes, turns = build_topic(4)
    # 3 items x ~190 characters per scene: one scene fits in 200 tokens (800 characters), two do not.
    chat = FakeChatModel({"item_extract": items_per_scene(3)}, budgets=True, output_budgets={"item_extract": 200})
    done = extract_items_outcome("conv-t", topic, scenes, turns, chat)
    asked = [[s["ref"] for s in c.input["scenes"]] for c in chat.of("item_extract")]
    assert asked == [["S1", "S2", "S3", "S4"], ["S1", "S2"], ["S1"], ["S1"], ["S1", "S2"], ["S1"], ["S1"]]
    assert [c.truncated for c in chat.of("item_extract")] == [True, True, False, False, True, False, False]
    assert len(done.value.items) == 12 and done.quarantined == ()
    assert {sid for i in done.value.items for sid in i.source_scene_ids} == set(topic.scene_ids)
    assert [n.kind for n in done.notes] == ["split"] * 3
    assert "4 scenes asked again as 2 + 2" in done.notes[0].detail
    # The split requests are functions of the input: a rerun behind the response cache asks nothing.
    cache, ledger = InMemoryResponseCache(), InMemoryUsageLedger()
    inner = FakeChatModel({"item_extract": items_per_scene(3)}, budgets=True, output_budgets={"item_extract": 200})
    for run in ("r1", "r2"):
        again = extract_items_outcome("conv-t", topic, scenes, turns,
                                      CachedChatModel(inner, cache=cache, ledger=ledger, run_id=run))
        assert again.value == done.value
    # A cut answer is no answer and is never cached: a rerun asks only the 3 cut requests again.
    assert inner.count("item_extract") == 10
    first, second = ledger.summary("r1")["item_extract"], ledger.summary("r2")["item_extract"]
    assert (first.calls, first.truncations, first.output_errors, first.cache_hits) == (7, 3, 3, 0)
    assert (second.calls, second.cache_hits, second.truncations) == (7, 4, 3)
    cut = [r for r in ledger.records if r.truncated]
    assert all(r.completion_tokens == 200 and r.attempts == 1 and not r.cache_hit for r in cut)


def test_a_scene_whose_items_never_fit_is_quarantined_and_the_others_kept() -> None:
    topic, scenes, turns = build_topic(3)
    chat = FakeChatModel({"item_extract": items_per_scene(2, huge_title="Scene 1")}, budgets=True,
                         output_budgets={"item_extract": 400})
    done = extract_items_outcome("conv-t", topic, scenes, turns, chat)
    assert {i.source_scene_ids for i in done.value.items} == {(scenes[0].scene_id,), (scenes[2].scene_id,)}
    [unit] = done.quarantined
    assert (unit.operation, unit.unit_kind, unit.unit_id, unit.error_type) == (
        "item_extract", "topic_chunk", "tpc_pets", "LLMTruncatedError")
    assert "(1 scenes)" in unit.input_ref and "400 tokens" in unit.reason
    assert unit.input_digest == chat.of("item_extract")[-2].prompt.input_digest()  # the one-scene request
    assert unit.raw_output and len(unit.raw_output) == 1600
    assert [n.kind for n in done.notes].count("quarantined") == 1
    with pytest.raises(LLMTruncatedError) as caught:  # the plain function is strict
        extract_items("conv-t", topic, scenes, turns, FakeChatModel(
            {"item_extract": items_per_scene(2, huge_title="Scene 1")}, budgets=True,
            output_budgets={"item_extract": 400}))
    assert caught.value.max_tokens == 400


def test_an_invalid_chunk_is_quarantined_without_splitting() -> None:
    topic, scenes, turns = build_topic(2)
    blank = {"items": [{"kind": "atomic", "content": " ", "sources": ["S1"], "keywords": []}]}
    chat = FakeChatModel({"item_extract": replies(blank)})
    done = extract_items_outcome("conv-t", topic, scenes, turns, chat)
    assert done.value.items == () and chat.count("item_extract") == 2  # the answer and its checked re-ask
    [unit] = done.quarantined
    assert (unit.unit_kind, unit.error_type) == ("topic_chunk", "ValidationFailure") and "blank" in unit.reason


def test_item_keywords_beyond_the_cap_are_clipped_and_noted() -> None:
    topic, scenes, turns = build_topic(1)
    many = {"items": [{"kind": "atomic", "content": "Ana has hobbies.", "sources": ["S1"],
                       "keywords": [f"hobby {n}" for n in range(11)]}]}
    done = extract_items_outcome("conv-t", topic, scenes, turns, FakeChatModel({"item_extract": replies(many)}))
    assert len(done.value.items[0].keywords) == 8
    [note] = done.notes
    assert note.kind == "clipped" and "11 entries, kept the first 8" in note.detail


# -- triggers ---------------------------------------------------------------------------------------


def items(n: int) -> list[Item]:
    topic, scenes, _turns = build_topic(1)
    return [Item(conversation_id="conv-t", item_id=f"itm_{k}", topic_id=topic.topic_id, kind="atomic",
                 content=f"Ana's fact number {k} about her puppy.", source_scene_ids=(scenes[0].scene_id,),
                 event_time=scenes[0].start_time, keywords=("puppy",)) for k in range(n)]


def padded_triggers(heavy: str | None = None, entities: int = 2) -> Any:
    """Triggers of ~240 characters per item; the item whose content mentions ``heavy`` gets 40 bridges."""

    def respond(operation: str, request_json: dict[str, Any]) -> str:
        out = []
        for it in request_input(request_json)["items"]:
            bridges = 40 if heavy and heavy in it["content"] else 1
            out.append({"ref": it["ref"], "entities": [f"concept {k}" for k in range(entities)],
                        "bridges": [{"situation": "planning a trip " + "y" * 100, "rationale": "it matters"}] * bridges})
        return json.dumps({"items": out})

    return respond


def test_an_item_trigger_batch_is_halved_and_an_item_that_never_fits_is_quarantined_alone() -> None:
    chat = FakeChatModel({"item_triggers": padded_triggers(heavy="number 4")}, budgets=True,
                         output_budgets={"item_triggers": 250})  # 1000 characters: 3 items fit, 6 do not
    done = item_triggers_outcome("conv-t", items(6), chat, batch=6)
    assert [t.item_id for t in done.value] == ["itm_0", "itm_1", "itm_2", "itm_3", "itm_5"]
    [unit] = done.quarantined
    assert (unit.unit_kind, unit.unit_id, unit.error_type) == ("item", "itm_4", "LLMTruncatedError")
    sizes = [len(c.input["items"]) for c in chat.of("item_triggers")]
    assert sizes == [6, 3, 3, 1, 2, 1, 1]  # 6 -> 3 + 3; the second 3 (itm_3, itm_4, itm_5) -> 1 + 2 -> 1 + 1
    assert [n.kind for n in done.notes].count("split") == 3


def test_an_item_whose_triggers_stay_invalid_is_found_by_bisection_and_quarantined() -> None:
    def blank_for_item_2(answer: dict[str, Any], data: dict[str, Any]) -> dict[str, Any]:
        for entry, item in zip(answer["items"], data["items"], strict=True):
            if "number 2" in item["content"]:
                entry["bridges"] = [{"situation": " ", "rationale": "x"}]
        return answer

    chat = FakeChatModel({"item_triggers": edited("item_triggers", blank_for_item_2)})
    done = item_triggers_outcome("conv-t", items(4), chat, batch=4)
    assert [t.item_id for t in done.value] == ["itm_0", "itm_1", "itm_3"]
    [unit] = done.quarantined
    assert (unit.unit_id, unit.error_type) == ("itm_2", "ValidationFailure") and "bridge" in unit.reason
    with pytest.raises(ValidationFailure):  # strict: no bisection, the batch's failure is raised
        item_triggers("conv-t", items(4), FakeChatModel({"item_triggers": edited("item_triggers", blank_for_item_2)}),
                      batch=4)


def test_entity_and_bridge_lists_beyond_their_limits_are_clipped_not_rejected() -> None:
    chat = FakeChatModel({"item_triggers": padded_triggers(heavy="number 0", entities=9)})
    done = item_triggers_outcome("conv-t", items(2), chat, batch=2)
    assert chat.count("item_triggers") == 1 and done.quarantined == ()
    assert [len(t.entities) for t in done.value] == [5, 5]
    assert [len(t.bridges) for t in done.value] == [4, 1]
    clipped = [n.detail for n in done.notes if n.kind == "clipped"]
    assert clipped == ["entities of I1: 9 entries, kept the first 5", "bridges of I1: 40 entries, kept the first 4",
                       "entities of I2: 9 entries, kept the first 5"]


def test_a_scene_whose_triggers_never_fit_is_quarantined_alone() -> None:
    turns = dialogue(sessions=(8,))
    by_id = {t.turn_id: t for t in turns}
    scenes = [scene(n, f"Scene {n}", "Ana talked about her puppy. " * (40 if n == 2 else 1),
                    turn_ids=[turns[2 * n].turn_id, turns[2 * n + 1].turn_id]) for n in range(4)]

    def echo_narrative(answer: dict[str, Any], data: dict[str, Any]) -> dict[str, Any]:
        for entry, s in zip(answer["scenes"], data["scenes"], strict=True):
            entry["situation"] = s["narrative"]
        return answer

    chat = FakeChatModel({"scene_triggers": edited("scene_triggers", echo_narrative)}, budgets=True,
                         output_budgets={"scene_triggers": 300})
    done = scene_triggers_outcome("conv-t", scenes, by_id, chat, batch=4)
    assert [t.scene_id for t in done.value] == [scenes[0].scene_id, scenes[1].scene_id, scenes[3].scene_id]
    [unit] = done.quarantined
    assert (unit.unit_kind, unit.unit_id, unit.operation) == ("scene", scenes[2].scene_id, "scene_triggers")


# -- persona ----------------------------------------------------------------------------------------


def traits_per_turn(answer: dict[str, Any], data: dict[str, Any]) -> dict[str, Any]:
    """One long trait per turn read: the answer grows with the chunk."""
    read = [t["id"] for block in data["turns"] for t in block["turns"]]
    return {**answer, "traits": [f"trait seen in {tid} " + "z" * 60 for tid in read]}


def test_a_persona_chunk_whose_answer_is_cut_is_folded_as_two_halves_and_long_lists_clipped() -> None:
    turns = dialogue(sessions=(16,))  # 8 turns of Ana
    chat = FakeChatModel({"persona": edited("persona", traits_per_turn)}, budgets=True,
                         output_budgets={"persona": 200})  # 800 characters: 4 traits fit, 8 do not
    done = persona_outcome("conv-t", "Ana", turns, chat)
    calls = chat.of("persona")
    assert [sum(len(b["turns"]) for b in c.input["turns"]) for c in calls] == [8, 4, 4]
    assert "persona_so_far" not in calls[1].input and calls[2].input["persona_so_far"]["traits"]  # folded in order
    assert done.value is not None and done.quarantined == ()
    assert [n.kind for n in done.notes] == ["split"]
    many = FakeChatModel({"persona": edited("persona", traits_per_turn)})
    clipped = persona_outcome("conv-t", "Ana", dialogue(sessions=(40,)), many)
    assert clipped.value is not None and len(clipped.value.traits) == persona_prompt.MAX_ENTRIES
    assert [(n.kind, n.detail) for n in clipped.notes] == [("clipped", "traits: 20 entries, kept the first 12")]


def test_a_speaker_whose_persona_never_fits_is_quarantined_and_the_plain_function_raises() -> None:
    turns = dialogue(sessions=(4,))
    chat = FakeChatModel({"persona": edited("persona", traits_per_turn)}, budgets=True,
                         output_budgets={"persona": 64})
    done = persona_outcome("conv-t", "Ana", turns, chat)
    assert done.value is None
    [unit] = done.quarantined
    assert (unit.unit_kind, unit.unit_id, unit.error_type) == ("speaker", "Ana", "LLMTruncatedError")
    # 2 turns cut; the first turn alone fits, the second (folded onto it) is cut again: no half-folded persona.
    assert [sum(len(b["turns"]) for b in c.input["turns"]) for c in chat.of("persona")] == [2, 1, 1]
    assert [c.truncated for c in chat.of("persona")] == [True, False, True]
    with pytest.raises(LLMTruncatedError):
        persona("conv-t", "Ana", turns, FakeChatModel({"persona": edited("persona", traits_per_turn)}, budgets=True,
                                                      output_budgets={"persona": 64}))


# -- segmentation and topics (the spine: split, else fail the conversation) ------------------------


def close_every_turn(operation: str, request_json: dict[str, Any]) -> str:
    data = request_input(request_json)
    new = [t["id"] for block in data["new_turns"] for t in block["turns"]]
    return json.dumps({"closed": [{"last_turn": tid, "title": f"Scene at {tid}", "summary": "s" * 40,
                                   "narrative": "n" * 100} for tid in new]})


def test_segmentation_halves_a_window_whose_answer_is_cut_and_continues_with_full_windows() -> None:
    turns = dialogue(sessions=(20,))
    # ~230 characters per closed scene: 8 fit in 600 tokens (2400 characters), 16 do not.
    chat = FakeChatModel({"scene_boundaries": close_every_turn}, budgets=True, output_budgets={"scene_boundaries": 600})
    done = segment_outcome("conv-t", turns, chat, window=16)
    windows = [[t["id"] for b in c.input["new_turns"] for t in b["turns"]] for c in chat.of("scene_boundaries")]
    assert [(w[0], len(w)) for w in windows] == [("D1:1", 16), ("D1:1", 8), ("D1:9", 12), ("D1:9", 6), ("D1:15", 6)]
    assert [c.input["final"] for c in chat.of("scene_boundaries")] == [False, False, True, False, True]
    assert [len(s.turn_ids) for s in done.value] == [1] * 20
    assert [n.kind for n in done.notes] == ["split", "split"]
    with pytest.raises(LLMTruncatedError):  # one turn that still does not fit fails the conversation
        segment("conv-t", turns, FakeChatModel({"scene_boundaries": close_every_turn}, budgets=True,
                                                output_budgets={"scene_boundaries": 40}))


def test_topic_match_keywords_beyond_the_stated_limit_are_clipped() -> None:
    first = scene(0, "Ana adopts a puppy")
    second = scene(1, "Ana trains her puppy")
    existing = Topic(conversation_id="conv-t", topic_id="tpc_x", seq=0, title="Ana's puppy",
                     keywords=tuple(f"k{n}" for n in range(topic_create.MIN_KEYWORDS)), scene_ids=(first.scene_id,))
    answer = {"admitted": [{"ref": "T1", "new_keywords": [f"new {n}" for n in range(8)]}], "new_topic": None}
    done = admit_topics_outcome("conv-t", [first, second], FakeChatModel({"topic_match": replies(answer)}),
                                existing=[existing])
    [topic] = done.value.topics
    assert len(topic.keywords) == topic_create.MIN_KEYWORDS + topic_match.MAX_NEW_KEYWORDS
    [note] = done.notes
    assert (note.kind, note.operation) == ("clipped", "topic_match") and "8 entries, kept the first 5" in note.detail


def test_a_packing_batch_whose_answer_is_cut_is_halved() -> None:
    def pack_long(operation: str, request_json: dict[str, Any]) -> str:
        return json.dumps({"scenes": [{"ref": s["ref"], "title": f"Scene {s['ref']}", "summary": "s" * 50,
                                       "narrative": "n" * 250} for s in request_input(request_json)["scenes"]]})

    chat = FakeChatModel({"scene_boundaries": replies({"closed": []}), "scene_pack": pack_long}, budgets=True,
                         output_budgets={"scene_pack": 200})  # 800 characters: 2 scenes fit, 4 do not
    done = segment_outcome("conv-t", dialogue(sessions=(12,)), chat, window=12, max_scene_turns=2)
    assert [len(c.input["scenes"]) for c in chat.of("scene_pack")] == [4, 2, 2, 2]
    assert len(done.value) == 6 and all(s.narrative == "n" * 250 for s in done.value)
    assert [n.kind for n in done.notes] == ["split"]

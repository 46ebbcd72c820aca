"""Item extraction: one call per topic, sources checked, atomic vs connected, event time, ids."""

from __future__ import annotations

from datetime import UTC, datetime, timedelta
from typing import Any

import pytest

from tests.fakes import FakeChatModel, dialogue, edited, replies
from tmem.construct import dedupe_items, extract_items, extract_items_detailed, extract_items_outcome
from tmem.construct.items import item_id
from tmem.domain import Scene, Topic, Turn
from tmem.errors import ValidationFailure
from tmem.ids import content_id


def build_topic(scene_count: int) -> tuple[Topic, list[Scene], dict[str, Turn]]:
    """``scene_count`` scenes of 4 turns (one session each, a week apart) and a topic over all of them."""
    turns = dialogue(sessions=(4,) * scene_count)
    scenes = []
    for n in range(scene_count):
        own = turns[4 * n : 4 * n + 4]
        scenes.append(
            Scene(
                conversation_id="conv-t",
                scene_id=content_id("scn", n),
                seq=n,
                title=f"Scene {n}",
                summary="s",
                narrative="n",
                turn_ids=tuple(t.turn_id for t in own),
                start_time=own[0].event_time,
                end_time=own[-1].event_time,
            )
        )
    topic = Topic(
        conversation_id="conv-t",
        topic_id="tpc_pets",
        seq=0,
        title="Ana's puppy",
        keywords=tuple(f"k{n}" for n in range(10)),
        scene_ids=tuple(s.scene_id for s in scenes),
    )
    return topic, scenes, {t.turn_id: t for t in turns}


def item(
    kind: str, sources: list[str], date: str | None = "2023-05-07", content: str = "Ana adopted a puppy."
) -> dict[str, Any]:
    return {"kind": kind, "content": content, "sources": sources, "when": date, "keywords": ["puppy", "Puppy"]}


def test_one_call_per_topic_atomic_and_connected_from_synth() -> None:
    topic, scenes, turns = build_topic(3)
    chat = FakeChatModel()
    items = extract_items("conv-t", topic, scenes, turns, chat)
    assert chat.count("item_extract") == 1
    sent = chat.calls[0].input
    assert [s["ref"] for s in sent["scenes"]] == ["S1", "S2", "S3"]
    assert sent["scenes"][1]["dialogue"][0]["date"].startswith("2023-05-15")  # dated dialogue
    kinds = {i.kind for i in items}
    assert kinds == {"atomic", "connected"}
    for it in items:
        assert set(it.source_scene_ids) <= set(topic.scene_ids)
        assert (len(it.source_scene_ids) == 1) == (it.kind == "atomic")
        assert it.topic_id == topic.topic_id
        assert it.event_time is not None and it.event_time.tzinfo is not None


def test_blank_content_raises_validation_failure_after_one_reask() -> None:
    topic, scenes, turns = build_topic(2)
    chat = FakeChatModel({"item_extract": replies({"items": [item("atomic", ["S1"], content="  ")]})})
    with pytest.raises(ValidationFailure) as caught:
        extract_items("conv-t", topic, scenes, turns, chat)
    assert caught.value.operation == "item_extract"
    assert "tpc_pets" in caught.value.input_ref
    assert "blank" in caught.value.reason
    assert chat.count("item_extract") == 2  # asked again once with the reason


def test_a_source_outside_the_topic_is_dropped_and_noted_not_reasked() -> None:
    topic, scenes, turns = build_topic(2)
    answer = {"items": [item("atomic", ["S9"], content="only elsewhere"), item("connected", ["S1", "S9"])]}
    chat = FakeChatModel({"item_extract": replies(answer)})
    done = extract_items_outcome("conv-t", topic, scenes, turns, chat)
    assert chat.count("item_extract") == 1
    [kept] = done.value.items  # the item citing only S9 is gone; the other keeps S1 and becomes atomic
    assert (kept.content, kept.kind, kept.source_scene_ids) == ("Ana adopted a puppy.", "atomic", (scenes[0].scene_id,))
    kinds = [n.kind for n in done.notes]
    assert kinds.count("dropped_ref") == 2 and kinds.count("reclassified") == 1
    assert all("S9" in n.detail for n in done.notes if n.kind == "dropped_ref")
    assert all(n.operation == "item_extract" and "tpc_pets" in n.input_ref for n in done.notes)
    assert done.quarantined == ()


def test_an_answer_whose_items_all_cite_scenes_outside_the_topic_is_reasked() -> None:
    topic, scenes, turns = build_topic(2)
    chat = FakeChatModel({"item_extract": replies({"items": [item("atomic", ["S9"])]}, {"items": [item("atomic", ["S2"])]})})
    done = extract_items_outcome("conv-t", topic, scenes, turns, chat)
    assert [i.source_scene_ids for i in done.value.items] == [(scenes[1].scene_id,)]
    assert chat.count("item_extract") == 2 and "no item cites a scene of this topic" in str(chat.calls[1].request)
    assert done.notes == ()  # the rejected answer leaves no note


@pytest.mark.parametrize(
    ("kind", "sources", "becomes"),
    [
        ("atomic", ["S1", "S2"], "connected"),
        ("connected", ["S2"], "atomic"),
        ("connected", ["S2", "S2"], "atomic"),
    ],
)
def test_a_kind_contradicting_its_source_count_is_reclassified(kind: str, sources: list[str], becomes: str) -> None:
    topic, scenes, turns = build_topic(2)
    chat = FakeChatModel({"item_extract": replies({"items": [item(kind, sources)]})})
    done = extract_items_outcome("conv-t", topic, scenes, turns, chat)
    [found] = done.value.items
    assert found.kind == becomes and (len(found.source_scene_ids) == 1) == (becomes == "atomic")
    assert [(n.kind, n.operation) for n in done.notes] == [("reclassified", "item_extract")]
    assert chat.count("item_extract") == 1
    assert extract_items("conv-t", topic, scenes, turns, FakeChatModel({"item_extract": replies(
        {"items": [item(kind, sources)]})}))[0].kind == becomes  # the plain function too


def test_reask_recovers_an_invalid_answer() -> None:
    topic, scenes, turns = build_topic(2)
    chat = FakeChatModel(
        {"item_extract": replies({"items": [item("atomic", ["S1"], content=" ")]}, {"items": [item("atomic", ["S2"])]})}
    )
    items = extract_items("conv-t", topic, scenes, turns, chat)
    assert [i.source_scene_ids for i in items] == [(scenes[1].scene_id,)]
    assert "blank" in chat.calls[1].prompt.messages[-1].content
    assert chat.calls[1].prompt.checked_reask and not chat.calls[0].prompt.checked_reask


def test_event_time_from_the_model_else_from_the_latest_source_scene() -> None:
    topic, scenes, turns = build_topic(2)
    answer = {
        "items": [
            item("atomic", ["S1"], "2023-05-07", content="dated"),
            item("atomic", ["S1"], None, content="undated"),
            item("connected", ["S1", "S2"], "last spring", content="vague"),
            item("atomic", ["S2"], "2023-02-30", content="impossible"),
        ]
    }
    chat = FakeChatModel({"item_extract": replies(answer)})
    result = extract_items_detailed("conv-t", topic, scenes, turns, chat)
    by_content = {i.content: i for i in result.items}
    assert by_content["dated"].event_time == datetime(2023, 5, 7, tzinfo=UTC)
    assert by_content["undated"].event_time == scenes[0].start_time
    assert by_content["vague"].event_time == scenes[1].start_time  # the latest source
    assert by_content["impossible"].event_time == scenes[1].start_time
    fallback = {by_content[c].item_id for c in ("undated", "vague", "impossible")}
    assert result.dated_from_scene == fallback
    assert by_content["dated"].keywords == ("puppy",)  # case-insensitively unique


def test_event_time_at_the_precision_the_dialogue_gives() -> None:
    """A month, a year or a span is kept as such (never a made-up day), with the dialogue's words."""
    topic, scenes, turns = build_topic(2)
    answer = {"items": [
        {**item("atomic", ["S1"], "2023-04", content="month"), "when_phrase": "last month"},
        {**item("atomic", ["S1"], "2021", content="year"), "when_phrase": "two years ago"},
        {**item("atomic", ["S1"], "2023-05-01/2023-05-07", content="span"), "when_phrase": "last week"},
        {**item("atomic", ["S1"], "2023-05-09/2023-05-01", content="backwards")},
    ]}
    result = extract_items_detailed("conv-t", topic, scenes, turns, FakeChatModel({"item_extract": replies(answer)}))
    got = {i.content: i for i in result.items}
    assert (got["month"].event_time, got["month"].time_granularity, got["month"].time_phrase) == (
        datetime(2023, 4, 1, tzinfo=UTC), "month", "last month")
    assert (got["year"].event_time, got["year"].time_granularity) == (datetime(2021, 1, 1, tzinfo=UTC), "year")
    assert (got["span"].event_time, got["span"].event_end, got["span"].time_granularity) == (
        datetime(2023, 5, 1, tzinfo=UTC), datetime(2023, 5, 7, tzinfo=UTC), "span")
    assert got["span"].time_source == "stated"
    assert got["backwards"].time_source == "scene"  # an end before its start is not a time


def test_a_fact_without_a_time_is_dated_by_the_turn_that_says_it() -> None:
    """A scene spanning weeks: the fact said in its last session gets that day, not the scene's start."""
    topic, scenes, turns = build_topic(1)
    ids = list(scenes[0].turn_ids)
    late = turns[ids[-1]].model_copy(update={"event_time": turns[ids[0]].event_time + timedelta(days=17)})
    turns = {**turns, late.turn_id: late}
    answer = {"items": [
        {**item("atomic", ["S1"], None, content="said late"), "said_in": late.turn_id},
        {**item("atomic", ["S1"], None, content="said elsewhere"), "said_in": "D99:1"},  # not a turn of the scene
    ]}
    result = extract_items_detailed("conv-t", topic, scenes, turns, FakeChatModel({"item_extract": replies(answer)}))
    got = {i.content: i for i in result.items}
    assert got["said late"].event_time.date() == late.event_time.date() and got["said late"].time_source == "said"
    assert got["said elsewhere"].event_time == scenes[0].start_time and got["said elsewhere"].time_source == "scene"
    assert result.dated_from_scene == {got["said elsewhere"].item_id}


def test_the_scene_s_other_topics_are_named_in_the_request() -> None:
    topic, scenes, turns = build_topic(2)
    chat = FakeChatModel()
    extract_items("conv-t", topic, scenes, turns, chat, other_topics={scenes[1].scene_id: ["Ben's new job"]})
    sent = chat.calls[0].input["scenes"]
    assert [s.get("other_topics", []) for s in sent] == [[], ["Ben's new job"]]


def test_large_topics_are_read_in_bounded_chunks() -> None:
    topic, scenes, turns = build_topic(5)
    chat = FakeChatModel()
    items = extract_items("conv-t", topic, scenes, turns, chat, max_scenes=2)
    assert chat.count("item_extract") == 3
    assert [len(c.input["scenes"]) for c in chat.of("item_extract")] == [2, 2, 1]
    assert {sid for i in items for sid in i.source_scene_ids} == set(topic.scene_ids)


def test_scene_of_another_topic_is_a_caller_error() -> None:
    topic, scenes, turns = build_topic(2)
    stranger = scenes[0].model_copy(update={"scene_id": "scn_other"})
    with pytest.raises(ValueError, match="not scenes of topic"):
        extract_items("conv-t", topic, [*scenes, stranger], turns, FakeChatModel())


def test_item_ids_are_content_derived_and_duplicates_collapse() -> None:
    topic, scenes, turns = build_topic(3)
    first = extract_items("conv-t", topic, scenes, turns, FakeChatModel())
    again = extract_items("conv-t", topic, scenes, turns, FakeChatModel())
    assert first == again
    one = first[0]
    assert one.item_id == item_id("conv-t", one.content, one.source_scene_ids, "fake-model")
    assert one.item_id != item_id("conv-t", one.content, one.source_scene_ids, "other-model")

    def doubled(answer: dict[str, Any], data: dict[str, Any]) -> dict[str, Any]:
        return {"items": answer["items"] + answer["items"]}

    chat = FakeChatModel({"item_extract": edited("item_extract", doubled)})
    twice = extract_items("conv-t", topic, scenes, turns, chat)
    assert [i.item_id for i in twice] == [i.item_id for i in first]
    other_topic = [i.model_copy(update={"topic_id": "tpc_other"}) for i in first]
    assert dedupe_items([first, other_topic]) == first

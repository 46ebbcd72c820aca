"""Prefix stability, what makes incremental builds cheap: when a conversation grows, the requests
for its earlier part stay byte-identical (so the LLM response cache answers them). Segmentation
windows, persona chunks and trigger batches (tmem.construct.stable_batches) are checked here
without Prefect; the price table behind the build report's cost estimate too (tmem.pricing)."""

from __future__ import annotations

from datetime import timedelta

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from tests.factories import T0
from tests.fakes import FakeChatModel, dialogue
from tmem.construct import persona, segment
from tmem.construct.persona import chunks
from tmem.construct.stable_batches import item_trigger_batches, scene_trigger_batches
from tmem.domain import Item, Scene, Topic
from tmem.pricing import ModelPrice, estimate_cost, price_for, price_table

CID = "conv-x"


def scene(n: int) -> Scene:
    return Scene(conversation_id=CID, scene_id=f"s{n}", seq=n, title=f"t{n}", summary="s", narrative="n",
                 turn_ids=(f"D1:{n}",), start_time=T0 + timedelta(minutes=n), end_time=T0 + timedelta(minutes=n))


def topic(n: int, scene_ids: tuple[str, ...]) -> Topic:
    return Topic(conversation_id=CID, topic_id=f"t{n}", seq=n, title=f"topic {n}",
                 keywords=tuple(f"k{i}" for i in range(10)), scene_ids=scene_ids)


def item(topic_no: int, sources: tuple[int, ...], tag: str) -> Item:
    return Item(conversation_id=CID, item_id=f"i-{topic_no}-{tag}", topic_id=f"t{topic_no}", kind="atomic",
                content=tag, source_scene_ids=tuple(f"s{s}" for s in sources), event_time=None, keywords=())


def ids(batches: list[list[Item]]) -> list[list[str]]:
    return [[i.item_id for i in b] for b in batches]


def test_a_topic_gaining_items_changes_only_its_own_tail_batches() -> None:
    scenes = [scene(n) for n in range(8)]
    seq = {s.scene_id: s.seq for s in scenes}
    before_topics = [topic(0, ("s0", "s1")), topic(1, ("s2",)), topic(2, ("s3",))]
    before_items = [item(0, (0,), "a"), item(0, (1,), "b"), item(0, (0, 1), "c"), item(1, (2,), "d"),
                    item(1, (2,), "e"), item(1, (2,), "f"), item(2, (3,), "g")]
    before = ids(item_trigger_batches(before_topics, before_items, seq, size=2))

    # Topic 0 gains scene 7 and two items; a new topic 3 appears. The flat list would shift every batch.
    after_topics = [topic(0, ("s0", "s1", "s7")), *before_topics[1:], topic(3, ("s7",))]
    after_items = [*before_items[:3], item(0, (7,), "h"), item(0, (1, 7), "i"), *before_items[3:],
                   item(3, (7,), "j")]
    after = ids(item_trigger_batches(after_topics, after_items, seq, size=2))

    assert before == [["i-0-a", "i-0-b"], ["i-0-c"], ["i-1-d", "i-1-e"], ["i-1-f"], ["i-2-g"]]
    unchanged = [b for b in before if b in after]
    assert unchanged == [["i-0-a", "i-0-b"], ["i-1-d", "i-1-e"], ["i-1-f"], ["i-2-g"]]
    assert [b for b in after if b not in before] == [["i-0-c", "i-0-h"], ["i-0-i"], ["i-3-j"]]


def test_items_are_ordered_by_latest_source_scene_whatever_the_answer_order() -> None:
    seq = {f"s{n}": n for n in range(5)}
    topics = [topic(0, ("s0", "s1", "s2"))]
    items = [item(0, (0, 2), "late"), item(0, (1,), "mid"), item(0, (0,), "early")]
    assert ids(item_trigger_batches(topics, items, seq, size=10)) == [["i-0-early", "i-0-mid", "i-0-late"]]
    assert item_trigger_batches(topics, items, seq, size=10) == item_trigger_batches(topics, items[::-1], seq, 10)


def test_items_of_unknown_topics_or_scenes_are_caller_errors() -> None:
    seq = {"s0": 0}
    with pytest.raises(ValueError, match="topic t9"):
        item_trigger_batches([topic(0, ("s0",))], [item(9, (0,), "x")], seq, size=2)
    with pytest.raises(ValueError, match="scene s4"):
        item_trigger_batches([topic(0, ("s0",))], [item(0, (4,), "x")], seq, size=2)


@given(st.integers(1, 30), st.integers(0, 10), st.integers(1, 6))
def test_scene_batches_of_a_prefix_are_kept_except_the_last_partial_one(n: int, extra: int, size: int) -> None:
    scenes = [scene(k) for k in range(n + extra)]
    before = [[s.scene_id for s in b] for b in scene_trigger_batches(scenes[:n], size)]
    after = [[s.scene_id for s in b] for b in scene_trigger_batches(scenes[::-1], size)]  # any input order
    full_before = [b for b in before if len(b) == size]
    assert after[: len(full_before)] == full_before
    assert [s for b in after for s in b] == [s.scene_id for s in scenes]


def test_prices_match_exactly_then_by_longest_prefix_and_unknown_models_have_none() -> None:
    table = price_table({"my-local": {"input": 0, "output": 0}, "gpt-4o": ModelPrice(3.0, 12.0)})
    assert price_for("gpt-4o-mini-2024-07-18", table) == ModelPrice(0.15, 0.60)
    assert price_for("gpt-4o-2024-08-06", table) == ModelPrice(3.0, 12.0)
    assert estimate_cost("gpt-4o-mini", 2_000_000, 1_000_000, table) == pytest.approx(0.30 + 0.60)
    assert estimate_cost("my-local", 10, 10, table) == 0.0
    assert estimate_cost("scripted-model", 10, 10, table) is None
    with pytest.raises(ValueError, match="lacks"):
        price_table({"x": {"input": 1.0}})


def _bodies(chat: FakeChatModel, operation: str) -> list[str]:
    return [repr(c.request["messages"]) for c in chat.of(operation)]


@settings(deadline=None, max_examples=30)
@given(st.lists(st.integers(3, 25), min_size=2, max_size=5), st.integers(1, 4))
def test_segmentation_of_a_grown_conversation_repeats_every_boundary_request_but_the_last_window(
    sessions: list[int], added: int
) -> None:
    turns = dialogue(sessions=(*sessions, *([12] * added)))
    n, window = sum(sessions), 8
    before, after = FakeChatModel(), FakeChatModel()
    segment("conv-t", turns[:n], before, window=window)
    segment("conv-t", turns, after, window=window)
    old, new = _bodies(before, "scene_boundaries"), _bodies(after, "scene_boundaries")
    assert len(old) == -(-n // window)
    assert new[: len(old) - 1] == old[:-1]  # only the earlier build's last (final) window is asked again


@given(st.integers(1, 60), st.integers(1, 40))
def test_persona_chunks_of_a_prefix_are_kept_except_the_last(n: int, extra: int) -> None:
    turns = dialogue(sessions=(n + extra,))
    before, after = chunks(turns[:n], 7, 400), chunks(turns, 7, 400)
    assert after[: len(before) - 1] == before[:-1]
    assert after[len(before) - 1][: len(before[-1])] == before[-1]


def test_persona_of_a_grown_conversation_repeats_the_requests_of_its_full_chunks() -> None:
    turns = dialogue(sessions=(30, 30))
    before, after = FakeChatModel(), FakeChatModel()
    persona("conv-t", "Ana", turns[:40], before, chunk_turns=6)
    persona("conv-t", "Ana", turns, after, chunk_turns=6)
    old, new = _bodies(before, "persona"), _bodies(after, "persona")
    assert len(old) == 4 and len(new) == 5  # Ana has 20 turns, then 30
    assert new[:3] == old[:3] and new[3] != old[3]

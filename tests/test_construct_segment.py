"""Segmentation: one boundary call per window, open scene carried, sessions crossed, ids checked."""

from __future__ import annotations

import json
import math
import random
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from tests.fakes import FakeChatModel, dialogue, replies
from tmem.construct import segment
from tmem.devtools.responders import request_input
from tmem.errors import ValidationFailure

PACK = {"title": "t", "summary": "s", "narrative": "n"}


def close_only_at_end(operation: str, request_json: dict[str, Any]) -> str:
    """Never closes an event before the conversation ends."""
    data = request_input(request_json)
    if not data["final"]:
        return '{"closed": []}'
    last = data["new_turns"][-1]["turns"][-1]["id"]
    return json.dumps({"closed": [{"last_turn": last, **PACK}]})


def never_close(operation: str, request_json: dict[str, Any]) -> str:
    return '{"closed": []}'


def open_scene_ids(call_input: dict[str, Any]) -> list[str]:
    return [t["id"] for block in call_input["open_scene"] for t in block["turns"]]


def test_one_boundary_call_per_window_not_per_turn() -> None:
    turns = dialogue(sessions=(22, 18, 25, 15))  # 80 turns
    chat = FakeChatModel()
    scenes = segment("conv-t", turns, chat, window=16)
    assert chat.count("scene_boundaries") == math.ceil(80 / 16) == 5
    assert chat.count("scene_pack") == 0  # synth closes the last scene on the final window
    assert len(chat.calls) < len(turns) / 10
    # the scenes partition the turns, in order
    assert [tid for s in scenes for tid in s.turn_ids] == [t.turn_id for t in turns]
    assert [s.seq for s in scenes] == list(range(len(scenes)))
    assert 4 <= len(scenes) <= 16


def test_open_scene_is_carried_into_the_next_window_and_crosses_sessions() -> None:
    turns = dialogue(sessions=(10, 10, 4))  # 24 turns, 3 sessions
    chat = FakeChatModel({"scene_boundaries": close_only_at_end})
    scenes = segment("conv-t", turns, chat, window=8)
    calls = chat.of("scene_boundaries")
    assert len(calls) == 3
    assert open_scene_ids(calls[0].input) == []
    assert open_scene_ids(calls[1].input) == [t.turn_id for t in turns[:8]]
    assert open_scene_ids(calls[2].input) == [t.turn_id for t in turns[:16]]
    assert [c.input["final"] for c in calls] == [False, False, True]
    assert len(scenes) == 1
    assert scenes[0].turn_ids == tuple(t.turn_id for t in turns)
    assert {t.session_id for t in turns} == {"session_1", "session_2", "session_3"}
    assert scenes[0].start_time == turns[0].event_time
    assert scenes[0].end_time == turns[-1].event_time


def test_runaway_open_scene_is_cut_and_packed_in_batches() -> None:
    turns = dialogue(sessions=(50,))
    chat = FakeChatModel({"scene_boundaries": never_close})
    scenes = segment("conv-t", turns, chat, window=8, max_scene_turns=20, pack_batch=4)
    assert [len(s.turn_ids) for s in scenes] == [20, 20, 10]
    assert all(len(open_scene_ids(c.input)) <= 20 for c in chat.of("scene_boundaries"))
    assert chat.count("scene_boundaries") == math.ceil(50 / 8)
    assert chat.count("scene_pack") == 1  # three unpacked scenes, one packing call
    assert all(s.title and s.narrative for s in scenes)


def test_boundary_at_unknown_turn_raises_validation_failure_after_one_reask() -> None:
    turns = dialogue(sessions=(12,))
    bad = {"closed": [{"last_turn": "D9:99", **PACK}]}
    chat = FakeChatModel({"scene_boundaries": replies(bad)})
    with pytest.raises(ValidationFailure) as caught:
        segment("conv-t", turns, chat, window=16)
    error = caught.value
    assert error.operation == "scene_boundaries"
    assert "conv-t" in error.input_ref and "D1:1..D1:12" in error.input_ref
    assert "D9:99" in error.reason
    assert chat.count("scene_boundaries") == 2
    assert "D9:99" in chat.calls[1].prompt.messages[-1].content  # the re-ask says what was wrong


def test_boundary_inside_the_open_scene_is_rejected() -> None:
    turns = dialogue(sessions=(16,))
    first = {"closed": []}
    inside_open = {"closed": [{"last_turn": "D1:2", **PACK}]}
    chat = FakeChatModel({"scene_boundaries": replies(first, inside_open)})
    with pytest.raises(ValidationFailure, match="open scene"):
        segment("conv-t", turns, chat, window=8)


def test_reask_recovers_from_a_bad_boundary() -> None:
    turns = dialogue(sessions=(6,))
    good = {"closed": [{"last_turn": "D1:6", **PACK}]}
    chat = FakeChatModel({"scene_boundaries": replies({"closed": [{"last_turn": "nope", **PACK}]}, good)})
    scenes = segment("conv-t", turns, chat)
    assert len(scenes) == 1 and len(scenes[0].turn_ids) == 6


def test_turns_are_ordered_by_seq_not_by_id_text() -> None:
    turns = dialogue(sessions=(3,) * 11)  # session ids D1..D11: "D10" < "D2" as text
    shuffled = turns[:]
    random.Random(7).shuffle(shuffled)
    scenes = segment("conv-t", shuffled, FakeChatModel(), window=16)
    assert [tid for s in scenes for tid in s.turn_ids] == [t.turn_id for t in turns]


def test_scene_ids_are_content_derived() -> None:
    turns = dialogue(sessions=(20, 20))
    first = segment("conv-t", turns, FakeChatModel())
    again = segment("conv-t", turns, FakeChatModel())
    other_model = segment("conv-t", turns, FakeChatModel(model_name="other-model"))
    assert [s.scene_id for s in first] == [s.scene_id for s in again]
    assert first == again
    assert {s.scene_id for s in first}.isdisjoint(s.scene_id for s in other_model)
    assert len({s.scene_id for s in first}) == len(first)


def test_foreign_or_duplicated_turns_are_caller_errors() -> None:
    turns = dialogue(sessions=(4,))
    with pytest.raises(ValueError, match="do not belong"):
        segment("other", turns, FakeChatModel())
    with pytest.raises(ValueError, match="duplicated"):
        segment("conv-t", [*turns, turns[0].model_copy(update={"seq": 99})], FakeChatModel())


@settings(max_examples=40, deadline=None)
@given(
    sessions=st.lists(st.integers(min_value=1, max_value=30), min_size=1, max_size=5),
    window=st.integers(min_value=1, max_value=20),
    max_scene_turns=st.integers(min_value=1, max_value=25),
    seed=st.integers(min_value=0, max_value=10_000),
)
def test_any_valid_boundary_answers_partition_the_turns(
    sessions: list[int], window: int, max_scene_turns: int, seed: int
) -> None:
    """Whatever valid closes the model picks: the scenes partition the turns in order, the
    carried context and the scenes stay bounded, and calls are one per window plus the packing."""
    rng = random.Random(seed)

    def random_closes(operation: str, request_json: dict[str, Any]) -> str:
        ids = [t["id"] for block in request_input(request_json)["new_turns"] for t in block["turns"]]
        chosen = [tid for tid in ids if rng.random() < 0.2]
        return json.dumps({"closed": [{"last_turn": tid, **PACK} for tid in chosen]})

    turns = dialogue(sessions=sessions)
    chat = FakeChatModel({"scene_boundaries": random_closes})
    scenes = segment("conv-t", turns, chat, window=window, max_scene_turns=max_scene_turns, pack_batch=3)
    assert [tid for s in scenes for tid in s.turn_ids] == [t.turn_id for t in turns]
    assert all(1 <= len(s.turn_ids) <= max_scene_turns + window for s in scenes)
    assert all(len(open_scene_ids(c.input)) <= max_scene_turns for c in chat.of("scene_boundaries"))
    assert chat.count("scene_boundaries") == math.ceil(len(turns) / window)
    packed_by_boundary = sum(len(json.loads(c.content)["closed"]) for c in chat.of("scene_boundaries"))
    assert chat.count("scene_pack") == math.ceil((len(scenes) - packed_by_boundary) / 3)


def test_the_open_scene_can_close_at_its_own_last_turn() -> None:
    """A finished exchange left open by the previous window is not glued to the next matter."""
    turns = dialogue(sessions=(2, 6))  # D1:1-2 a short exchange, then a session about something else
    wait = {"closed": []}
    chat = FakeChatModel({"scene_boundaries": replies(
        wait,  # D1:1-2: the model waits (the exchange might go on)
        {"closed": [{"last_turn": "D1:2", **PACK}]},  # D2:1-2 start something else: close the open scene as it is
        wait,  # D2:3-4
        {"closed": [{"last_turn": "D2:6", **PACK}]},  # final
    )})
    scenes = segment("conv-t", turns, chat, window=2)
    assert [s.turn_ids for s in scenes] == [("D1:1", "D1:2"), ("D2:1", "D2:2", "D2:3", "D2:4", "D2:5", "D2:6")]
    assert chat.count("scene_boundaries") == 4


def test_a_close_inside_the_open_scene_names_what_is_allowed() -> None:
    turns = dialogue(sessions=(3, 2))
    chat = FakeChatModel({"scene_boundaries": replies(
        {"closed": []}, {"closed": [{"last_turn": "D1:2", **PACK}]}, {"closed": [{"last_turn": "D1:2", **PACK}]}
    )})
    with pytest.raises(ValidationFailure, match="open scene's last turn 'D1:3'"):
        segment("conv-t", turns, chat, window=3)

"""The whole construction chain on LoCoMo conv-26 through the fake model: calls and structure.

Run as a script for the calls-per-100-turns table:  python -m tests.test_construct_chain
"""

from __future__ import annotations

import json
import math
import time
from collections import Counter
from dataclasses import dataclass
from datetime import datetime, timedelta

import pytest

from tests.fakes import FakeChatModel
from tests.paths import LOCOMO10 as LOCOMO
from tmem.construct import (
    TopicPool,
    admit_topics,
    dedupe_items,
    extract_items,
    item_triggers,
    persona,
    scene_triggers,
    segment,
)
from tmem.devtools import synth
from tmem.domain import Item, ItemTriggers, Persona, Scene, SceneTriggers, Turn

OPERATIONS = (
    "scene_boundaries",
    "scene_pack",
    "topic_match",
    "topic_create",
    "item_extract",
    "item_triggers",
    "scene_triggers",
    "persona",
)
CALL_BUDGET_PER_100_TURNS = 60


def locomo_turns(sample_id: str) -> list[Turn]:
    """Turns of one LoCoMo sample: sessions in numeric order, turn i at session time + i seconds,
    an image turn's caption appended to its text."""
    sample = next(s for s in json.loads(LOCOMO.read_text()) if s["sample_id"] == sample_id)
    conv = sample["conversation"]
    numbers = sorted(int(k.split("_")[1]) for k, v in conv.items() if k.startswith("session_") and isinstance(v, list))
    turns: list[Turn] = []
    for number in numbers:
        began = datetime.strptime(conv[f"session_{number}_date_time"], "%I:%M %p on %d %B, %Y")
        for i, raw in enumerate(conv[f"session_{number}"]):
            caption = raw.get("blip_caption")
            turns.append(
                Turn(
                    conversation_id=sample_id,
                    session_id=f"session_{number}",
                    turn_id=raw["dia_id"],
                    seq=len(turns),
                    speaker=raw["speaker"],
                    text=raw["text"] + (f" [shares a photo: {caption}]" if caption else ""),
                    event_time=began + timedelta(seconds=i),
                )
            )
    return turns


@dataclass(frozen=True)
class Build:
    turns: list[Turn]
    scenes: list[Scene]
    pool: TopicPool
    items: list[Item]
    item_triggers: list[ItemTriggers]
    scene_triggers: list[SceneTriggers]
    personas: list[Persona]
    chat: FakeChatModel


def build_memory(conversation_id: str, turns: list[Turn], chat: FakeChatModel) -> Build:
    scenes = segment(conversation_id, turns, chat, window=16)
    pool = admit_topics(conversation_id, scenes, chat, batch=10)
    turns_by_id = {t.turn_id: t for t in turns}
    scenes_by_id = {s.scene_id: s for s in scenes}
    items = dedupe_items(
        extract_items(conversation_id, topic, [scenes_by_id[sid] for sid in topic.scene_ids], turns_by_id, chat)
        for topic in pool.topics
    )
    return Build(
        turns=turns,
        scenes=scenes,
        pool=pool,
        items=items,
        item_triggers=item_triggers(conversation_id, items, chat, batch=6),
        scene_triggers=scene_triggers(conversation_id, scenes, turns_by_id, chat, batch=4),
        personas=[
            persona(conversation_id, speaker, turns, chat) for speaker in dict.fromkeys(t.speaker for t in turns)
        ],
        chat=chat,
    )


class TimedChat(FakeChatModel):
    """Measures the time spent in the synth responders alone."""

    def __init__(self) -> None:
        timed = {op: self._timed(responder) for op, responder in synth.RESPONDERS.items()}
        super().__init__(timed)
        self.seconds: list[float] = []

    def _timed(self, responder: synth.Responder) -> synth.Responder:
        def run(operation: str, request_json: dict[str, object]) -> str:
            started = time.perf_counter()
            content = responder(operation, request_json)
            self.seconds.append(time.perf_counter() - started)
            return content

        return run


@pytest.fixture(scope="module")
def conv26() -> Build:
    return build_memory("conv-26", locomo_turns("conv-26"), TimedChat())


def per_100(count: int, turns: int) -> float:
    return 100.0 * count / turns


def test_calls_stay_within_budget_and_segmentation_is_per_window(conv26: Build) -> None:
    turns = len(conv26.turns)
    counts = conv26.chat.counts()
    assert turns == 419
    assert counts["scene_boundaries"] == math.ceil(turns / 16)
    assert per_100(sum(counts.values()), turns) <= CALL_BUDGET_PER_100_TURNS
    # topic matching: ceil(pool / 10) calls per scene, pool growing in arrival order
    assert counts["topic_match"] >= len(conv26.scenes) - 1
    assert counts["item_extract"] == len(conv26.pool.topics)
    assert counts["item_triggers"] == math.ceil(len(conv26.items) / 6)
    assert counts["scene_triggers"] == math.ceil(len(conv26.scenes) / 4)


def test_structure_is_rich_and_consistent(conv26: Build) -> None:
    scenes, topics, items = conv26.scenes, conv26.pool.topics, conv26.items
    assert [tid for s in scenes for tid in s.turn_ids] == [t.turn_id for t in conv26.turns]
    sessions = {t.turn_id: t.session_id for t in conv26.turns}
    assert any(len({sessions[tid] for tid in s.turn_ids}) > 1 for s in scenes)  # a scene crosses sessions
    assert 25 <= len(scenes) <= 70
    assert len(topics) >= 5 and any(len(t.scene_ids) > 1 for t in topics)
    assert all(len(t.keywords) >= 10 for t in topics)
    assert {sid for t in topics for sid in t.scene_ids} == {s.scene_id for s in scenes}
    kinds = Counter(i.kind for i in items)
    assert kinds["atomic"] >= len(scenes) and kinds["connected"] >= 5
    topic_scenes = {t.topic_id: set(t.scene_ids) for t in topics}
    assert all(set(i.source_scene_ids) <= topic_scenes[i.topic_id] for i in items)
    assert [t.item_id for t in conv26.item_triggers] == [i.item_id for i in items]
    assert [t.scene_id for t in conv26.scene_triggers] == [s.scene_id for s in scenes]
    assert {p.speaker for p in conv26.personas} == {"Caroline", "Melanie"}


def test_responders_are_fast(conv26: Build) -> None:
    seconds = sorted(conv26.chat.seconds)  # type: ignore[attr-defined]
    assert seconds[len(seconds) // 2] < 0.005  # median
    assert sum(seconds) / len(seconds) < 0.005


def test_rebuild_gives_identical_ids_and_objects(conv26: Build) -> None:
    again = build_memory("conv-26", conv26.turns, FakeChatModel())
    assert again.scenes == conv26.scenes
    assert again.pool == conv26.pool
    assert again.items == conv26.items
    assert again.item_triggers == conv26.item_triggers
    assert again.scene_triggers == conv26.scene_triggers
    assert again.personas == conv26.personas


def report(build: Build) -> str:
    turns = len(build.turns)
    counts = build.chat.counts()
    lines = [
        f"{build.turns[0].conversation_id}: {turns} turns, {len({t.session_id for t in build.turns})} sessions",
        "",
    ]
    lines.append(f"{'operation':<18}{'calls':>7}{'per 100 turns':>15}")
    for op in OPERATIONS:
        lines.append(f"{op:<18}{counts[op]:>7}{per_100(counts[op], turns):>15.1f}")
    total = sum(counts.values())
    lines.append(f"{'total':<18}{total:>7}{per_100(total, turns):>15.1f}")
    kinds = Counter(i.kind for i in build.items)
    entities = sum(len(t.entities) for t in build.item_triggers)
    bridges = sum(len(t.bridges) for t in build.item_triggers)
    horizons = sum(1 for t in build.scene_triggers for text in t.horizons.values() if text)
    structure = {
        "scenes": len(build.scenes),
        "topics": len(build.pool.topics),
        "items atomic": kinds["atomic"],
        "items connected": kinds["connected"],
        "entity triggers": entities,
        "bridge triggers": bridges,
        "scene trigger sets (4 attrs)": len(build.scene_triggers),
        "horizon sentences (non-empty)": horizons,
    }
    lines += ["", f"{'object':<32}{'count':>7}{'per 100 turns':>15}"]
    lines += [f"{name:<32}{n:>7}{per_100(n, turns):>15.1f}" for name, n in structure.items()]
    multi = sum(1 for s in build.scenes if len(build.pool.topics_of(s.scene_id)) > 1)
    sessions = {t.turn_id: t.session_id for t in build.turns}
    crossing = sum(1 for s in build.scenes if len({sessions[tid] for tid in s.turn_ids}) > 1)
    lines += ["", f"multi-topic scenes {multi}; session-crossing scenes {crossing}"]
    return "\n".join(lines)


if __name__ == "__main__":
    chat = TimedChat()
    started = time.perf_counter()
    built = build_memory("conv-26", locomo_turns("conv-26"), chat)
    elapsed = time.perf_counter() - started
    print(report(built))
    print(
        f"\nwall {elapsed:.2f} s; responder mean {1000 * sum(chat.seconds) / len(chat.seconds):.2f} ms, "
        f"max {1000 * max(chat.seconds):.2f} ms over {len(chat.seconds)} calls"
    )

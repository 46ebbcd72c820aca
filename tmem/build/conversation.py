"""One conversation's build, in process (DESIGN.md §2):

    turns ─▶ segment (serial) ─▶ admit topics (serial, arrival order) ─▶ items (one unit per topic)
        ─▶ item triggers (stable batches)          ┐
       [scene triggers (stable batches), from the scenes on]   ├─▶ memory ─▶ embedded views
       [personas (one unit per speaker), from the start]       ┘

Segmentation and topic admission run in order in the calling thread; personas start at once,
scene triggers as soon as the scenes exist, items when the topics do, then their triggers — each
unit in the conversation's fan-out pool. Every unit goes through :class:`ConversationStages`
(stage cache, retries, progress events). Trigger batches are cut so that a grown conversation
keeps its earlier batches and their cached answers (:mod:`tmem.construct.stable_batches`).

Segmentation and topic admission are the spine: an answer of theirs that stays invalid fails the
conversation. The other units quarantine a failing unit and the conversation goes on without it;
:class:`ConversationBuild` carries those units and every stage's notes.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import numpy as np
import numpy.typing as npt
from pydantic import TypeAdapter

from tmem import domain
from tmem.build.embed_views import embed_memory_views, prefetch_scene_views
from tmem.build.runtime import BuildRuntime
from tmem.build.stages import Codec, ConversationStages, LogObserver, StageObserver, Unit
from tmem.construct import (
    BuildNote,
    ExtractedItems,
    QuarantinedUnit,
    StageOutcome,
    TopicPool,
    admit_topics_outcome,
    dedupe_items,
    extract_items_outcome,
    item_triggers_outcome,
    persona_outcome,
    scene_triggers_outcome,
    segment_outcome,
)
from tmem.construct.families import TriggerFamily, added_families
from tmem.construct.stable_batches import item_trigger_batches, scene_trigger_batches
from tmem.domain import ConversationMemory, Item, ItemTriggers, Persona, Scene, SceneTriggers, Topic, Turn
from tmem.errors import LLMError
from tmem.ports import JournalBatch
from tmem.store.conversations import load_turns
from tmem.store.vector_rows import VectorRow

if TYPE_CHECKING:
    import pyarrow as pa

SCENES: Codec[list[Scene]] = Codec(TypeAdapter(list[Scene]))
POOL: Codec[TopicPool] = Codec(TypeAdapter(TopicPool))
ITEMS: Codec[ExtractedItems] = Codec(TypeAdapter(ExtractedItems))
ITEM_TRIGGERS: Codec[list[ItemTriggers]] = Codec(TypeAdapter(list[ItemTriggers]))
SCENE_TRIGGERS: Codec[list[SceneTriggers]] = Codec(TypeAdapter(list[SceneTriggers]))
PERSONA: Codec[Persona | None] = Codec(TypeAdapter(Persona | None))
FAMILY_TRIGGERS: Codec[list[domain.FamilyTriggers]] = Codec(TypeAdapter(list[domain.FamilyTriggers]))


@dataclass(frozen=True)
class ConversationBuild:
    memory: ConversationMemory
    vectors: list[VectorRow]
    watermark_turn_seq: int
    journal: JournalBatch | None = None  # built on a Dask worker: its cache/ledger writes, for the publisher
    notes: tuple[BuildNote, ...] = ()  # what the stages clipped, reclassified, dropped, split, quarantined
    quarantined: tuple[QuarantinedUnit, ...] = ()  # the units left out of ``memory``
    seconds: float = 0.0
    # Made by the publisher as the build arrives (tmem.build.publish.ready_to_publish), never sent anywhere:
    # the build id, and the vector rows as the Arrow table the Lance write sends, which then replaces
    # ``vectors`` (emptied). None: the publish makes them from ``vectors``.
    build_id: str | None = None
    vector_table: pa.Table | None = None

    def __reduce__(self) -> tuple[Callable[..., ConversationBuild], tuple[object, ...]]:
        """Pickled with its vectors as one matrix. A conversation has ~200 vector rows; pickled one by
        one, each row's vector is an array of its own — an out-of-band buffer, so a frame, of every Dask
        message that returns a build from a worker — where the matrix is one buffer of the same bytes.
        What the publisher made of it (``build_id``, ``vector_table``) stays in the publisher's process."""
        rows = tuple((v.conversation_id, v.owner_kind, v.owner_id, v.view, v.ordinal, v.text) for v in self.vectors)
        matrix = np.stack([v.vector for v in self.vectors]) if self.vectors else None
        return _unpickle_build, (self.memory, rows, matrix, self.watermark_turn_seq, self.journal, self.notes,
                                 self.quarantined, self.seconds)


def _unpickle_build(memory: ConversationMemory, rows: Sequence[tuple[Any, ...]], matrix: npt.NDArray[np.float32] | None,
                    watermark_turn_seq: int, journal: JournalBatch | None, notes: tuple[BuildNote, ...],
                    quarantined: tuple[QuarantinedUnit, ...], seconds: float) -> ConversationBuild:
    vectors = ([VectorRow(cid, kind, owner, view, ordinal, text, matrix[n])
                for n, (cid, kind, owner, view, ordinal, text) in enumerate(rows)] if matrix is not None else [])
    return ConversationBuild(memory, vectors, watermark_turn_seq, journal, notes, quarantined, seconds)


def build_conversation(rt: BuildRuntime, conversation_id: str, observer: StageObserver | None = None, *,
                       sleep: Callable[[float], None] = time.sleep,
                       handed_over: Callable[[], None] | None = None) -> ConversationBuild:
    """Build the memory and vectors of one conversation from its stored turns (``sleep``: how a
    retry waits; ``handed_over``: called once the memory is built and only its embedding is left,
    so a batch starts its next conversation then, :func:`tmem.build.batch.build_in_turn`)."""
    started = time.perf_counter()
    with rt.reading() as cur:
        turns: tuple[Turn, ...] = load_turns(cur, conversation_id)
    if not turns:
        raise LLMError("load-turns", conversation_id, "conversation has no turns")
    cid, chat, settings = conversation_id, rt.chat, rt.settings
    by_id = {t.turn_id: t for t in turns}
    with ConversationStages(rt, cid, observer or LogObserver(), fanout=settings.build_concurrency,
                            sleep=sleep) as stages:
        persona_from = time.perf_counter()
        persona_futs = [stages.submit(_persona(rt, cid, spk, [t for t in turns if t.speaker == spk]))
                        for spk in sorted({t.speaker for t in turns})]
        scenes = stages.run(Unit("segment", cid, {"turns": turns}, lambda: segment_outcome(
            cid, list(turns), chat, window=settings.segment_window), SCENES), lambda v: f"{len(v)} scenes")
        prefetch_scene_views(scenes, by_id, rt.embedder)  # the encoder starts on them while the LLM works
        scene_from = time.perf_counter()
        scene_trig_futs = [stages.submit(_scene_triggers(rt, cid, n, batch, [by_id[t] for s in batch for t in s.turn_ids]))
                           for n, batch in enumerate(scene_trigger_batches(scenes, settings.scene_trigger_batch))]
        pool = stages.run(Unit("topics", cid, {"scenes": scenes}, lambda: admit_topics_outcome(
            cid, list(scenes), chat, batch=settings.topic_batch, shortlist=settings.topic_shortlist), POOL), lambda v: f"{len(v.topics)} topics")
        topics = list(pool.topics)
        items_from = time.perf_counter()
        extracted = stages.gather("items", [stages.submit(_items(rt, cid, topic, scenes, by_id, topics))
                                            for topic in topics], items_from,
                                  lambda v: f"{sum(len(x.items) for x in v)} items")
        items = dedupe_items(x.items for x in extracted)
        scene_seq = {s.scene_id: s.seq for s in scenes}
        item_from = time.perf_counter()
        item_trig_futs = [stages.submit(_item_triggers(rt, cid, n, batch))
                          for n, batch in enumerate(item_trigger_batches(topics, items, scene_seq, settings.trigger_batch))]
        family_futs = {family.name: stages.submit(_family_triggers(rt, cid, family, items))
                       for family in added_families()}
        personas = stages.gather("persona", persona_futs, persona_from, lambda v: f"{sum(p is not None for p in v)} personas")
        item_triggers = stages.gather("item-triggers", item_trig_futs, item_from,
                                      lambda v: f"triggers of {sum(len(b) for b in v)} items")
        scene_triggers = stages.gather("scene-triggers", scene_trig_futs, scene_from,
                                       lambda v: f"triggers of {sum(len(b) for b in v)} scenes")
        family_triggers = [t for name, fut in family_futs.items()
                           for t in stages.gather(name, [fut], item_from, lambda v: f"texts of {len(v[0])} items")[0]]
        memory = ConversationMemory(
            conversation_id=cid, scenes=tuple(scenes), topics=tuple(topics), items=tuple(items),
            item_triggers=tuple(t for batch in item_triggers for t in batch),
            scene_triggers=tuple(t for batch in scene_triggers for t in batch),
            personas=tuple(p for p in personas if p is not None),
            family_triggers=tuple(family_triggers),
        )
        if handed_over is not None:
            handed_over()
        vectors = stages.run(Unit("embed", cid, {}, lambda: StageOutcome(embed_memory_views(memory, by_id, rt.embedder)),
                                  None), lambda v: f"{len(v)} vectors")
        rt.flush_ledger()  # the conversation's usage rows committed before it is reported built
        return ConversationBuild(memory=memory, vectors=vectors, watermark_turn_seq=max(t.seq for t in turns),
                                 notes=stages.notes, quarantined=stages.quarantined,
                                 seconds=time.perf_counter() - started)


def _persona(rt: BuildRuntime, cid: str, speaker: str, turns: Sequence[Turn]) -> Unit[Persona | None]:
    return Unit("persona", f"{cid}/{speaker}", {"speaker": speaker, "turns": turns},
                lambda: persona_outcome(cid, speaker, list(turns), rt.chat), PERSONA)


def _scene_triggers(rt: BuildRuntime, cid: str, batch_no: int, scenes: Sequence[Scene],
                    turns: Sequence[Turn]) -> Unit[list[SceneTriggers]]:
    by_id = {t.turn_id: t for t in turns}
    return Unit("scene-triggers", f"{cid}/{batch_no}", {"batch_no": batch_no, "scenes": scenes, "turns": turns},
                lambda: scene_triggers_outcome(cid, list(scenes), by_id, rt.chat, batch=max(1, len(scenes))),
                SCENE_TRIGGERS)


def _items(rt: BuildRuntime, cid: str, topic: Topic, scenes: Sequence[Scene], by_id: dict[str, Turn],
           topics: Sequence[Topic]) -> Unit[ExtractedItems]:
    scene_by_id = {s.scene_id: s for s in scenes}
    members = [scene_by_id[sid] for sid in topic.scene_ids]
    member_turns = [by_id[t] for s in members for t in s.turn_ids]
    others = {sid: [t.title for t in topics if t.topic_id != topic.topic_id and sid in t.scene_ids]
              for sid in topic.scene_ids}
    other_topics = {sid: titles for sid, titles in others.items() if titles}
    turns_by_id = {t.turn_id: t for t in member_turns}
    return Unit("items", f"{cid}/{topic.topic_id}",
                {"topic": topic, "scenes": members, "turns": member_turns, "other_topics": other_topics},
                lambda: extract_items_outcome(cid, topic, members, turns_by_id, rt.chat, other_topics=other_topics),
                ITEMS)


def _item_triggers(rt: BuildRuntime, cid: str, batch_no: int, items: Sequence[Item]) -> Unit[list[ItemTriggers]]:
    return Unit("item-triggers", f"{cid}/{batch_no}", {"batch_no": batch_no, "items": items},
                lambda: item_triggers_outcome(cid, list(items), rt.chat, batch=max(1, len(items))), ITEM_TRIGGERS)


def _family_triggers(rt: BuildRuntime, cid: str, family: TriggerFamily, items: Sequence[Item]) -> Unit[list[domain.FamilyTriggers]]:
    """One declared trigger family over the conversation's items (tmem.construct.families)."""
    build = family.build
    assert build is not None  # an added family always has one

    def run() -> StageOutcome[list[domain.FamilyTriggers]]:
        texts = build(cid, list(items), rt.chat)
        return StageOutcome([domain.FamilyTriggers(conversation_id=cid, family=family.name, item_id=item.item_id,
                                            texts=tuple(texts[item.item_id]))
                             for item in sorted(items, key=lambda i: i.item_id) if texts.get(item.item_id)])

    inputs = {"family": family.name, "operation": family.operation, "version": family.version, "items": items}
    return Unit(family.name, f"{cid}/{family.name}", inputs, run, FAMILY_TRIGGERS)

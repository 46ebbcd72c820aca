"""Pure conversions for the explorer: a conversation's memory, a traced search, run records → JSON.

Nothing here reads a store; :mod:`tmem.explorer.routes` hands in what it read from the pinned
snapshot, so one response never mixes two snapshots.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from typing import Literal

from tmem.domain import SCENE_ATTRIBUTES, ConversationMemory, Turn
from tmem.explorer.schemas import (
    BridgeView,
    CandidateView,
    ContextOut,
    ContextUnit,
    ConversationRow,
    FailureView,
    GateView,
    ItemView,
    QuarantineDetail,
    QuarantineView,
    RunView,
    SceneView,
    StageView,
    TopicView,
)
from tmem.query.memory import QueryContext
from tmem.query.schemas import context_report_out
from tmem.retrieval.config import RetrievalConfig
from tmem.retrieval.context import estimate_tokens, render_item, render_persona, render_scene
from tmem.retrieval.index import ConversationIndex
from tmem.retrieval.trace import StageTrace
from tmem.store.quarantine import QuarantineRecord
from tmem.store.runs import RunRecord
from tmem.store.snapshot.catalog import ConversationCounts

STAGE_KINDS: dict[str, Literal["topic", "scene", "item"]] = {
    "topic_prefilter": "topic", "scene_cue": "scene", "scene_selection": "scene",
    "trig_recall": "item", "item_selection": "item",
}


def conversation_row(counts: ConversationCounts, *, pending_turns: int, quarantined: bool) -> ConversationRow:
    return ConversationRow(
        conversation_id=counts.conversation_id, speakers=list(counts.speakers), build_id=counts.build_id,
        run_id=counts.run_id, built_at=counts.built_at, turns=counts.turns, sessions=counts.sessions,
        first_turn_at=counts.first_turn_at, last_turn_at=counts.last_turn_at, scenes=counts.scenes,
        topics=counts.topics, items=counts.items, atomic_items=counts.atomic_items,
        connected_items=counts.connected_items, entity_triggers=counts.entity_triggers,
        bridge_triggers=counts.bridge_triggers, scene_triggers=counts.scene_triggers,
        horizon_triggers=counts.horizon_triggers, personas=counts.personas, unbuilt_turns=counts.unbuilt_turns,
        pending_turns=pending_turns, quarantined=quarantined,
    )


def memory_views(memory: ConversationMemory, turns: tuple[Turn, ...]) -> tuple[list[SceneView], list[TopicView], list[ItemView]]:
    """Scenes (timeline order) with their topics, items, sessions and triggers; topics; items with
    their entity and bridge triggers."""
    session_of = {t.turn_id: t.session_id for t in turns}
    topics_of: dict[str, list[str]] = {}
    for topic in memory.topics:
        for sid in topic.scene_ids:
            topics_of.setdefault(sid, []).append(topic.topic_id)
    items_of: dict[str, list[str]] = {}
    for item in memory.items:
        for sid in item.source_scene_ids:
            items_of.setdefault(sid, []).append(item.item_id)
    triggers = {t.scene_id: t for t in memory.scene_triggers}
    scenes = []
    for scene in sorted(memory.scenes, key=lambda s: s.seq):
        trig = triggers.get(scene.scene_id)
        scenes.append(
            SceneView(
                scene_id=scene.scene_id, seq=scene.seq, title=scene.title, summary=scene.summary,
                narrative=scene.narrative, start_time=scene.start_time, end_time=scene.end_time,
                turn_count=len(scene.turn_ids),
                session_ids=list(dict.fromkeys(session_of[t] for t in scene.turn_ids if t in session_of)),
                topic_ids=topics_of.get(scene.scene_id, []), item_ids=items_of.get(scene.scene_id, []),
                triggers={a: getattr(trig, a) for a in SCENE_ATTRIBUTES} if trig is not None else {},
                horizons=dict(trig.horizons) if trig is not None else {},
            )
        )
    topics = [
        TopicView(topic_id=t.topic_id, seq=t.seq, title=t.title, keywords=list(t.keywords), scene_ids=list(t.scene_ids))
        for t in sorted(memory.topics, key=lambda t: t.seq)
    ]
    item_triggers = {t.item_id: t for t in memory.item_triggers}
    items = []
    for item in memory.items:
        it = item_triggers.get(item.item_id)
        items.append(
            ItemView(
                item_id=item.item_id, kind=item.kind, content=item.content, event_time=item.event_time,
                source_scene_ids=list(item.source_scene_ids), topic_id=item.topic_id, keywords=list(item.keywords),
                entities=list(it.entities) if it is not None else [],
                bridges=[BridgeView(situation=b.situation, rationale=b.rationale) for b in it.bridges] if it else [],
            )
        )
    return scenes, topics, items


def labels_of(index: ConversationIndex) -> dict[str, dict[str, str]]:
    """Display labels of every topic, scene and item of the searched index, by kind then id."""
    return {
        "topic": dict(zip(index.topics.ids, index.topics.titles, strict=True)),
        "scene": dict(zip(index.scenes.ids, index.scenes.titles, strict=True)),
        "item": dict(zip(index.items.ids, index.items.contents, strict=True)),
    }


def stage_limits(stage: str, config: RetrievalConfig) -> tuple[dict[str, int], int]:
    """Per rank list, the rank within which it *reaches* a hit (trace.py's attribution), and how
    many the stage keeps."""
    kt, ks, ki, kc, r = config.k_topics, config.k_scenes, config.k_items, config.k_cue, config.trigger_cap
    return {
        "topic_prefilter": ({"lexical": kt, "dense": kt}, kt),
        "scene_cue": ({"dialogue": kc, "scene_trigger": kc, "horizon": kc}, kc),
        "scene_selection": ({"lexical": ks, "dense": ks, "scene_cue": kc}, ks),
        "trig_recall": ({"entity_bridge": r}, r),
        "item_selection": ({"lexical": ki, "dense": ki, "entity_bridge": r}, ki),
    }[stage]


def _finite(value: float) -> float:
    return value if math.isfinite(value) else 0.0


def stage_view(stage: StageTrace, config: RetrievalConfig, labels: Mapping[str, Mapping[str, str]]) -> StageView:
    kind = STAGE_KINDS[stage.stage]
    limits, keep = stage_limits(stage.stage, config)
    names = labels[kind]
    return StageView(
        stage=stage.stage, kind=kind, lists=list(stage.lists), limits={k: v for k, v in limits.items() if k in stage.lists},
        keep=keep, fusion=stage.fusion, pool_size=stage.pool_size, selected=list(stage.selected),
        candidates=[
            CandidateView(
                id=c.id, label=names.get(c.id, ""), ranks=dict(c.ranks),
                scores={k: _finite(v) for k, v in c.scores.items()}, fused=_finite(c.fused), selected=c.selected,
                channels=list(c.channels), pools=list(c.pools), detail=c.detail,
            )
            for c in stage.candidates
        ],
        note=stage.note,
        threshold=stage.threshold,
    )


def gate_view(stage: StageTrace | None, config: RetrievalConfig) -> GateView | None:
    """TrigRecall's gate: how many of the listed nearest items reached τ (the trace lists the 2R
    nearest, so the count is exact below 2R)."""
    if stage is None:
        return None
    best = [c.scores["max"] for c in stage.candidates if "max" in c.scores]
    robust = config.trigger_gate_rule == "robust_z"
    tau = stage.threshold if stage.threshold is not None else (1.0 if robust else config.trigger_gate)
    return GateView(
        tau=tau, rule=config.trigger_gate_rule, z=config.trigger_gate_z if robust else None,
        cap=config.trigger_cap, listed=len(stage.candidates),
        passed=sum(1 for c in stage.candidates if "entity_bridge" in c.ranks),
        best=max(best) if best else None,
    )


def context_view(recalled: QueryContext) -> ContextOut:
    result, context = recalled.result, recalled.context
    scenes, items = set(context.scene_ids_kept), set(context.item_ids_kept)
    units = [
        ContextUnit(kind="scene", id=s.scene_id, label=s.title, tokens=estimate_tokens(render_scene(s)),
                    in_context=s.scene_id in scenes, turns=len(s.turns),
                    turns_in_context=len(context.kept_turns.get(s.scene_id, ())))
        for s in result.scenes
    ]
    units += [
        ContextUnit(kind="item", id=i.item_id, label=i.content, tokens=estimate_tokens(render_item(i)),
                    in_context=i.item_id in items)
        for i in result.items
    ]
    units += [
        ContextUnit(kind="persona", id=p.speaker, label=p.speaker, tokens=estimate_tokens(render_persona(p)),
                    in_context=True)
        for p in result.personas
    ]
    return ContextOut(report=context_report_out(context.report), units=units, text=context.text)


def run_view(run: RunRecord, current_snapshot: str, publishing_runs: set[str]) -> RunView:
    """A run as recorded at publish; the run that published the served snapshot is still
    ``running`` in that record (it finishes after publishing)."""
    published_current = run.snapshot_id == current_snapshot or (run.status == "running" and run.run_id in publishing_runs)
    return RunView(
        run_id=run.run_id, started_at=run.started_at, finished_at=run.finished_at, seconds=run.seconds,
        status=run.status, label=run.inputs.get("label"), only_changed=run.inputs.get("only_changed"),
        conversations_requested=len(run.inputs.get("conversation_ids") or ()), llm_calls=run.llm_calls,
        llm_cache_hits=run.llm_cache_hits, prompt_tokens=run.prompt_tokens, completion_tokens=run.completion_tokens,
        failures=[
            FailureView(conversation_id=f.get("conversation_id"), error_type=f.get("error_type"),
                        message=f.get("message"), operation=f.get("operation"), quarantined=bool(f.get("quarantined")))
            for f in run.failures
        ],
        snapshot_id=run.snapshot_id if run.snapshot_id else (current_snapshot if published_current else None),
        published_current=published_current,
    )


def quarantine_view(record: QuarantineRecord, published: bool) -> QuarantineView:
    return QuarantineView(
        conversation_id=record.conversation_id, run_id=record.run_id, error_type=record.error_type,
        operation=record.operation, input_ref=record.input_ref, reason=record.reason,
        quarantined_at=record.quarantined_at, state=record.state, cleared_at=record.cleared_at,
        cleared_by_run=record.cleared_by_run, published=published,
    )


def quarantine_detail(record: QuarantineRecord, published: bool) -> QuarantineDetail:
    return QuarantineDetail(
        **quarantine_view(record, published).model_dump(), input_digest=record.input_digest,
        input_excerpt=record.input_excerpt, raw_output=record.raw_output,
    )

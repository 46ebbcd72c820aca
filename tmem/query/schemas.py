"""JSON shapes of query results, shared by ``tmem query --json`` and the HTTP service.

Every response names the snapshot it was computed on (``snapshot_id``), so a client can tell
which published memory answered, and a test can prove no response mixes two snapshots.
"""

from __future__ import annotations

import dataclasses
from datetime import datetime
from typing import Any, Literal

from pydantic import BaseModel, Field

from tmem.domain import Persona
from tmem.query.memory import Answer
from tmem.retrieval.cascade import ScoredItem, ScoredScene, SearchResult
from tmem.retrieval.context import ContextReport, format_item_time


class TurnOut(BaseModel):
    turn_id: str
    session_id: str
    speaker: str
    text: str
    event_time: datetime


class SceneOut(BaseModel):
    scene_id: str
    title: str
    start_time: datetime
    end_time: datetime
    score: float = Field(description="Fused score of the scene-selection stage.")
    channels: list[str] = Field(description="The channels that reached this scene (see the trace docs).")
    turns: list[TurnOut]


class ItemOut(BaseModel):
    item_id: str
    kind: Literal["atomic", "connected"]
    content: str
    event_time: datetime | None
    when: str = Field(description="The time as the context shows it: 'May 2023', '1–7 May 2023, \"last week\"', "
                                  "'said on 8 May 2023', 'around 8 May 2023' (approximate).")
    event_end: datetime | None = Field(default=None, description="Last day of a span.")
    time_granularity: Literal["day", "month", "year", "span"] = "day"
    time_source: Literal["stated", "said", "scene"] = "stated"
    source_scene_ids: list[str]
    score: float = Field(description="Fused score of the item-selection stage.")
    channels: list[str] = Field(description="The channels that reached this item.")


class PersonaOut(BaseModel):
    speaker: str
    identity: list[str]
    preferences: list[str]
    traits: list[str]
    relations: list[str]
    timeline: list[dict[str, str | None]]


class ContextReportOut(BaseModel):
    budget: int
    tokens_used: int
    persona_tokens: int
    total_tokens: int
    scenes_kept: int
    scenes_dropped: int
    items_kept: int
    items_dropped: int
    scenes_partial: int = Field(0, description="Of the kept scenes, those shown by their best-matching turns only.")
    turns_kept: int = Field(0, description="Turns of the kept scenes that the context shows.")


class SearchOut(BaseModel):
    snapshot_id: str
    conversation_id: str
    query: str
    mode: Literal["hybrid", "lexical"]
    preset: str
    scenes: list[SceneOut]
    items: list[ItemOut]
    personas: list[PersonaOut]
    trace: dict[str, Any] | None = Field(default=None, description="Per-stage candidates, ranks and fused scores.")
    took_ms: float


class AnswerOut(BaseModel):
    snapshot_id: str
    conversation_id: str
    question: str
    answer: str
    model: str
    preset: str
    context_report: ContextReportOut
    context: str | None = Field(default=None, description="The context text sent to the model, when asked for.")
    scenes: list[SceneOut]
    items: list[ItemOut]
    trace: dict[str, Any] | None = None
    took_ms: float


def scene_out(scene: ScoredScene) -> SceneOut:
    return SceneOut(
        scene_id=scene.scene_id,
        title=scene.title,
        start_time=scene.start_time,
        end_time=scene.end_time,
        score=scene.score,
        channels=list(scene.channels),
        turns=[
            TurnOut(turn_id=t.turn_id, session_id=t.session_id, speaker=t.speaker, text=t.text, event_time=t.event_time)
            for t in scene.turns
        ],
    )


def item_out(item: ScoredItem) -> ItemOut:
    return ItemOut(
        item_id=item.item_id,
        kind=item.kind,
        content=item.content,
        event_time=item.event_time,
        when=format_item_time(item.time, item.event_time),
        event_end=item.time.end if item.time else None,
        time_granularity=item.time.granularity if item.time else "day",
        time_source=item.time.source if item.time else "stated",
        source_scene_ids=list(item.source_scene_ids),
        score=item.score,
        channels=list(item.channels),
    )


def persona_out(persona: Persona) -> PersonaOut:
    return PersonaOut(
        speaker=persona.speaker,
        identity=list(persona.identity),
        preferences=list(persona.preferences),
        traits=list(persona.traits),
        relations=list(persona.relations),
        timeline=[{"fact": p.fact, "since": p.since} for p in persona.timeline],
    )


def trace_out(result: SearchResult) -> dict[str, Any] | None:
    return dataclasses.asdict(result.trace) if result.trace is not None else None


def context_report_out(report: ContextReport) -> ContextReportOut:
    return ContextReportOut(**dataclasses.asdict(report))


def search_out(result: SearchResult, *, snapshot_id: str, preset: str, took_ms: float) -> SearchOut:
    return SearchOut(
        snapshot_id=snapshot_id,
        conversation_id=result.conversation_id,
        query=result.query,
        mode=result.mode,
        preset=preset,
        scenes=[scene_out(s) for s in result.scenes],
        items=[item_out(i) for i in result.items],
        personas=[persona_out(p) for p in result.personas],
        trace=trace_out(result),
        took_ms=round(took_ms, 3),
    )


def answer_out(answer: Answer, *, preset: str, took_ms: float, include_context: bool = False) -> AnswerOut:
    return AnswerOut(
        snapshot_id=answer.snapshot_id,
        conversation_id=answer.conversation_id,
        question=answer.question,
        answer=answer.answer,
        model=answer.model,
        preset=preset,
        context_report=context_report_out(answer.context.report),
        context=answer.context.text if include_context else None,
        scenes=[scene_out(s) for s in answer.scenes],
        items=[item_out(i) for i in answer.items],
        trace=trace_out(answer.result),
        took_ms=round(took_ms, 3),
    )

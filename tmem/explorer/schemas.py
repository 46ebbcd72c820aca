"""JSON shapes of the memory explorer's data endpoints (``/explorer/api/...``).

Requests carry the conversation id in the JSON body, as ``/search`` does: an id may hold any
character ingest accepts (``/``, ``%``, NUL, spaces), and a body keeps it out of URLs and
access logs. Every response names the snapshot it was read from.
"""

from __future__ import annotations

from datetime import datetime
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field

from tmem.query.limits import MAX_CONVERSATION_ID_CHARS, MAX_QUERY_CHARS, PRESET_PATTERN
from tmem.query.schemas import ContextReportOut, ItemOut, PersonaOut, SceneOut, TurnOut


class ScopedRequest(BaseModel):
    model_config = ConfigDict(extra="forbid")

    conversation_id: str = Field(min_length=1, max_length=MAX_CONVERSATION_ID_CHARS,
                                 description="The conversation to read: its exact id.")


class TurnsRequest(ScopedRequest):
    scene_id: str = Field(min_length=1, max_length=MAX_CONVERSATION_ID_CHARS, description="A scene of that conversation.")


class ExplainRequest(ScopedRequest):
    query: str = Field(min_length=1, max_length=MAX_QUERY_CHARS)
    speaker: str | None = Field(default=None, max_length=200, description="Speaker of the question (picks the persona).")
    preset: str = Field(default="default", pattern=PRESET_PATTERN)
    embed: bool = Field(default=True, description="Embed the query (false: lexical only).")
    budget_tokens: int | None = Field(default=None, ge=0, le=1_000_000,
                                      description="Context token budget (default TMEM_CONTEXT_TOKEN_BUDGET).")


class SnapshotOut(BaseModel):
    snapshot_id: str
    created_at: str
    image_format: int | None
    conversations: int
    lance_versions: dict[str, int]


class ConversationRow(BaseModel):
    conversation_id: str
    speakers: list[str]
    build_id: str
    run_id: str
    built_at: datetime = Field(description="When its memory was built (published by run_id).")
    turns: int
    sessions: int
    first_turn_at: datetime | None
    last_turn_at: datetime | None
    scenes: int
    topics: int
    items: int
    atomic_items: int
    connected_items: int
    entity_triggers: int
    bridge_triggers: int
    scene_triggers: int
    horizon_triggers: int
    personas: int
    unbuilt_turns: int = Field(description="Turns ingested after its build, as of this snapshot: not in the memory yet.")
    pending_turns: int = Field(description="Turns posted by a live assistant and not yet ingested (waiting for the next build).")
    quarantined: bool = Field(description="Its latest build was quarantined (it keeps this earlier memory).")


class Defaults(BaseModel):
    k_topics: int
    k_scenes: int
    k_items: int
    k_cue: int
    trigger_cap: int
    trigger_gate: float
    trigger_gate_z: float
    rrf_k0: int
    context_token_budget: int


class OverviewOut(BaseModel):
    snapshot: SnapshotOut
    conversations: list[ConversationRow]
    quarantine_active: int = Field(description="Conversations whose latest build was quarantined, published or not.")
    presets: list[str]
    defaults: Defaults
    version: str


class SceneView(BaseModel):
    scene_id: str
    seq: int
    title: str
    summary: str
    narrative: str
    start_time: datetime
    end_time: datetime
    turn_count: int
    session_ids: list[str]
    topic_ids: list[str]
    item_ids: list[str]
    triggers: dict[str, str] = Field(description="Scene trigger (Q IV): situation, object, event, emotion.")
    horizons: dict[str, str] = Field(description="Horizon triggers (Q III) per channel; empty when none.")


class TopicView(BaseModel):
    topic_id: str
    seq: int
    title: str
    keywords: list[str]
    scene_ids: list[str]


class BridgeView(BaseModel):
    situation: str
    rationale: str


class ItemView(BaseModel):
    item_id: str
    kind: Literal["atomic", "connected"]
    content: str
    event_time: datetime | None
    source_scene_ids: list[str]
    topic_id: str
    keywords: list[str]
    entities: list[str] = Field(description="Entity triggers (Q I).")
    bridges: list[BridgeView] = Field(description="Bridge triggers (Q II) with their rationale.")


class ConversationOut(BaseModel):
    snapshot_id: str
    conversation: ConversationRow
    scenes: list[SceneView]
    topics: list[TopicView]
    items: list[ItemView]
    personas: list[PersonaOut]


class TurnsOut(BaseModel):
    snapshot_id: str
    conversation_id: str
    scene_id: str
    turns: list[TurnOut]


class CandidateView(BaseModel):
    id: str
    label: str = Field(description="Title (topic, scene) or content (item) of the candidate.")
    ranks: dict[str, int] = Field(description="1-based rank in each list it is present in.")
    scores: dict[str, float]
    fused: float
    selected: bool
    channels: list[str]
    pools: list[str]
    detail: str


class StageView(BaseModel):
    stage: str
    kind: Literal["topic", "scene", "item"]
    lists: list[str]
    limits: dict[str, int] = Field(description="Per list, the rank within which it 'reaches' a hit (kT, kS, k_cue, kI).")
    keep: int = Field(description="How many the stage keeps (kT, k_cue, kS, R, kI).")
    fusion: str
    pool_size: int
    selected: list[str]
    candidates: list[CandidateView]
    note: str
    threshold: float | None = None  # TrigRecall: the cosine the gate required for this query


class GateView(BaseModel):
    tau: float = Field(description="The cosine an item's best trigger had to reach for this query.")
    rule: Literal["cosine", "robust_z"] = Field(
        default="cosine", description="cosine: τ itself; robust_z: z standard deviations above the median of this "
        "query's trigger scores over the conversation's items (τ is that cosine).")
    z: float | None = None
    cap: int
    listed: int = Field(description="Items the trace lists: the 2R nearest by best trigger cosine.")
    passed: int = Field(description="Listed items whose best trigger cosine reached τ (exact when below 2R).")
    best: float | None = Field(description="The highest trigger cosine of any item.")


class ContextUnit(BaseModel):
    kind: Literal["scene", "item", "persona"]
    id: str
    label: str
    tokens: int = Field(description="Estimated tokens of its rendered text (the whole scene).")
    in_context: bool
    turns_in_context: int | None = Field(default=None, description="A scene: how many of its turns the context shows.")
    turns: int | None = Field(default=None, description="A scene: its number of turns.")


class ContextOut(BaseModel):
    report: ContextReportOut
    units: list[ContextUnit]
    text: str = Field(description="The context text an /answer call sends to the model.")


class ExplainOut(BaseModel):
    snapshot_id: str
    conversation_id: str
    query: str
    mode: Literal["hybrid", "lexical"]
    preset: str
    config: dict[str, Any]
    query_tokens: list[str]
    took_ms: float
    scenes: list[SceneOut]
    items: list[ItemOut]
    personas: list[PersonaOut]
    persona_speaker: str | None
    persona_matched: bool
    stages: list[StageView]
    gate: GateView | None
    context: ContextOut


class FailureView(BaseModel):
    conversation_id: str | None
    error_type: str | None
    message: str | None
    operation: str | None
    quarantined: bool


class RunView(BaseModel):
    run_id: str
    started_at: datetime
    finished_at: datetime | None
    seconds: float | None
    status: str
    label: str | None
    only_changed: bool | None
    conversations_requested: int
    llm_calls: int
    llm_cache_hits: int
    prompt_tokens: int
    completion_tokens: int
    failures: list[FailureView]
    snapshot_id: str | None
    published_current: bool = Field(description="This run published the snapshot being served.")


class PublishedSnapshot(BaseModel):
    snapshot_id: str
    created_at: str
    conversations: int
    current: bool


class RunsOut(BaseModel):
    snapshot_id: str
    recorded: bool = Field(description="Whether this snapshot carries the build records (published by a tmem that copies them).")
    note: str
    runs: list[RunView]
    snapshots: list[PublishedSnapshot]


class QuarantineView(BaseModel):
    conversation_id: str
    run_id: str
    error_type: str
    operation: str
    input_ref: str
    reason: str
    quarantined_at: datetime
    state: str
    cleared_at: datetime | None
    cleared_by_run: str | None
    published: bool = Field(description="The snapshot holds (earlier) memory for this conversation.")


class QuarantineDetail(QuarantineView):
    input_digest: str | None
    input_excerpt: str | None
    raw_output: str | None


class QuarantineOut(BaseModel):
    snapshot_id: str
    recorded: bool
    note: str
    records: list[QuarantineView]


class ConversationQuarantineOut(BaseModel):
    snapshot_id: str
    conversation_id: str
    recorded: bool
    records: list[QuarantineDetail]

"""The memory's objects (DESIGN.md §1), frozen and typed.

Two times are kept apart on purpose: *event time* is when something happened in the
conversation (from the archive's timestamps); *record time* is when tmem learned it. Only
event time appears here; record time lives in the store's bookkeeping columns.
"""

from __future__ import annotations

from datetime import datetime
from typing import Literal

from pydantic import BaseModel, ConfigDict, Field

ItemKind = Literal["atomic", "connected"]
TimeGranularity = Literal["day", "month", "year", "span"]
"""How precisely the dialogue placed an item in time: a day, a month, a year, or a span of days."""
TimeSource = Literal["stated", "said", "scene"]
"""Where an item's time came from: ``stated`` resolved from the dialogue's words; ``said`` the day of
the turn that says it (the dialogue gives no time of its own); ``scene`` its source scene's start, a
fallback shown as approximate."""
HorizonChannel = Literal["personal_arc", "avoidance_habit", "goal_arc", "belief_in_action", "legacy_anchor"]
HORIZON_CHANNELS: tuple[HorizonChannel, ...] = (
    "personal_arc",
    "avoidance_habit",
    "goal_arc",
    "belief_in_action",
    "legacy_anchor",
)
SceneAttribute = Literal["situation", "object", "event", "emotion"]
SCENE_ATTRIBUTES: tuple[SceneAttribute, ...] = ("situation", "object", "event", "emotion")


class Frozen(BaseModel):
    model_config = ConfigDict(frozen=True, extra="forbid")


class Turn(Frozen):
    """One utterance. ``seq`` is its 0-based position in the whole conversation."""

    conversation_id: str
    session_id: str
    turn_id: str
    seq: int
    speaker: str
    text: str
    event_time: datetime
    metadata: dict[str, str] = Field(default_factory=dict)


class Session(Frozen):
    """A session of a conversation; ``index`` orders sessions numerically (1-based)."""

    conversation_id: str
    session_id: str
    index: int
    started_at: datetime


class QAItem(Frozen):
    """A benchmark question kept for evaluation (LoCoMo categories: 1 multi-hop, 2 temporal,
    3 open-domain, 4 single-hop, 5 adversarial)."""

    conversation_id: str
    index: int
    question: str
    answer: str | None
    evidence: tuple[str, ...]
    category: int
    adversarial_answer: str | None = None


class Conversation(Frozen):
    """A conversation with its ordered sessions and turns."""

    conversation_id: str
    speakers: tuple[str, ...]
    sessions: tuple[Session, ...]
    turns: tuple[Turn, ...]
    qa: tuple[QAItem, ...] = ()
    source: str = ""


class Scene(Frozen):
    """A coherent stretch of turns that closes one event; may cross session boundaries."""

    conversation_id: str
    scene_id: str
    seq: int
    title: str
    summary: str
    narrative: str
    turn_ids: tuple[str, ...]
    start_time: datetime
    end_time: datetime


class Topic(Frozen):
    """A growing label for a recurring subject. Prefilter only; never shown to the QA model."""

    conversation_id: str
    topic_id: str
    seq: int
    title: str
    keywords: tuple[str, ...]
    scene_ids: tuple[str, ...]

    @property
    def summary(self) -> str:
        """DESIGN §1: summary = title ×2 ‖ keywords."""
        return f"{self.title}. {self.title}. {', '.join(self.keywords)}"


class ItemTime(Frozen):
    """When an item happened, as precisely as the dialogue said (see :class:`Item`)."""

    start: datetime | None
    end: datetime | None = None
    granularity: TimeGranularity = "day"
    phrase: str = ""
    source: TimeSource = "stated"


class Item(Frozen):
    """An atomic (one source scene) or connected (several scenes of a topic) fact.

    ``event_time`` is when it happened: the start of the day, month, year or span
    (``time_granularity``) that the dialogue gave, ``event_end`` the last day of a span;
    ``time_phrase`` keeps the dialogue's words ("last week"); ``time_source`` says how it was found.
    """

    conversation_id: str
    item_id: str
    topic_id: str
    kind: ItemKind
    content: str
    source_scene_ids: tuple[str, ...]
    event_time: datetime | None
    keywords: tuple[str, ...]
    event_end: datetime | None = None
    time_granularity: TimeGranularity = "day"
    time_phrase: str = ""
    time_source: TimeSource = "stated"

    @property
    def time(self) -> ItemTime:
        return ItemTime(start=self.event_time, end=self.event_end, granularity=self.time_granularity,
                        phrase=self.time_phrase, source=self.time_source)


class BridgeTrigger(Frozen):
    situation: str
    rationale: str


class ItemTriggers(Frozen):
    """Q I (entity concepts) and Q II (bridge situations) of one item."""

    conversation_id: str
    item_id: str
    entities: tuple[str, ...]
    bridges: tuple[BridgeTrigger, ...]


class FamilyTriggers(Frozen):
    """The texts of one item for a trigger family declared beyond the built-in four
    (:mod:`tmem.construct.families`)."""

    conversation_id: str
    family: str
    item_id: str
    texts: tuple[str, ...]


class SceneTriggers(Frozen):
    """Q IV (four attributes) and Q III (five horizon channels, each possibly empty) of one scene."""

    conversation_id: str
    scene_id: str
    situation: str
    object: str
    event: str
    emotion: str
    horizons: dict[str, str]


class PersonaFact(Frozen):
    fact: str
    since: str | None = None


class Persona(Frozen):
    """Per speaker: identity, preferences, traits and attitudes, relations, standing-facts timeline."""

    conversation_id: str
    speaker: str
    identity: tuple[str, ...]
    preferences: tuple[str, ...]
    traits: tuple[str, ...]
    relations: tuple[str, ...]
    timeline: tuple[PersonaFact, ...]


class ConversationMemory(Frozen):
    """The whole memory of one conversation, as a build produces it."""

    conversation_id: str
    scenes: tuple[Scene, ...]
    topics: tuple[Topic, ...]
    items: tuple[Item, ...]
    item_triggers: tuple[ItemTriggers, ...]
    scene_triggers: tuple[SceneTriggers, ...]
    personas: tuple[Persona, ...]
    family_triggers: tuple[FamilyTriggers, ...] = ()  # of the declared families beyond the built-in four

"""Construction stages (DESIGN §2): pure library functions over a :class:`ChatModel`.

segment -> admit_topics (serial, arrival order) -> extract_items (per topic)
-> item_triggers / scene_triggers / persona (independent). Every function is deterministic
given the model's answers. The plain functions raise :class:`tmem.errors.ValidationFailure` (or
another :class:`tmem.errors.LLMOutputError`) when an answer stays invalid; the ``*_outcome``
functions return what they built with typed notes and, for the stages after topic admission,
quarantine the failing unit instead (:mod:`tmem.construct.outcome`).
"""

from tmem.construct.items import (
    ExtractedItems,
    dedupe_items,
    extract_items,
    extract_items_detailed,
    extract_items_outcome,
)
from tmem.construct.outcome import BuildNote, QuarantinedUnit, StageOutcome
from tmem.construct.persona import persona, persona_outcome
from tmem.construct.segment import segment, segment_outcome
from tmem.construct.topics import TopicPool, admit_scene, admit_topics, admit_topics_outcome
from tmem.construct.triggers import item_triggers, item_triggers_outcome, scene_triggers, scene_triggers_outcome

__all__ = [
    "BuildNote",
    "ExtractedItems",
    "QuarantinedUnit",
    "StageOutcome",
    "TopicPool",
    "admit_scene",
    "admit_topics",
    "admit_topics_outcome",
    "dedupe_items",
    "extract_items",
    "extract_items_detailed",
    "extract_items_outcome",
    "item_triggers",
    "item_triggers_outcome",
    "persona",
    "persona_outcome",
    "scene_triggers",
    "scene_triggers_outcome",
    "segment",
    "segment_outcome",
]

"""Construction stages (DESIGN §2): pure library functions over a :class:`ChatModel`.

segment -> admit_topics (serial, arrival order) -> extract_items (per topic)
-> item_triggers / scene_triggers / persona (independent). Every function is deterministic
given the model's answers and raises :class:`tmem.errors.ValidationFailure` when an answer
contradicts its input.
"""

from tmem.construct.items import ExtractedItems, dedupe_items, extract_items, extract_items_detailed
from tmem.construct.persona import persona
from tmem.construct.segment import segment
from tmem.construct.topics import TopicPool, admit_scene, admit_topics
from tmem.construct.triggers import item_triggers, scene_triggers

__all__ = [
    "ExtractedItems",
    "TopicPool",
    "admit_scene",
    "admit_topics",
    "dedupe_items",
    "extract_items",
    "extract_items_detailed",
    "item_triggers",
    "persona",
    "scene_triggers",
    "segment",
]

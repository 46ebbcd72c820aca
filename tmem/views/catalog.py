"""Every embedding view, declared once: whose rows it holds, and whether an owner has several.

The texts of each view are :mod:`tmem.views.texts`'s to write; the vector store accepts these view
names (:mod:`tmem.store.lance`) and the query side loads these keys (:mod:`tmem.retrieval.index`).
A new view is a row here and its text in :func:`tmem.views.texts.memory_views`.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

OwnerKind = Literal["topic", "scene", "item"]
ViewKey = tuple[OwnerKind, str]


@dataclass(frozen=True)
class View:
    owner: OwnerKind
    name: str
    what: str
    several: bool = False  # several rows per owner, scored by the best one


VIEWS: tuple[View, ...] = (
    View("topic", "summary", "topic summary (title ×2 ‖ keywords)"),
    View("scene", "summary", "scene title + summary"),
    View("scene", "dlg", "the scene's dialogue, one row per window of a few turns"),
    View("scene", "scn", "the four scene-trigger attributes"),
    View("scene", "hor", "one row per non-empty horizon sentence", several=True),
    View("item", "content", "the item's content"),
    View("item", "con", "entity triggers"),
    View("item", "brg", "bridge triggers"),
    View("item", "joint", "entity ‖ bridge ‖ rationale"),
)

VIEW_KEYS: tuple[ViewKey, ...] = tuple((v.owner, v.name) for v in VIEWS)
VIEW_NAMES: frozenset[str] = frozenset(v.name for v in VIEWS)
# The item-trigger views TrigRecall scores an item by (NaN-aware max over them).
ITEM_TRIGGER_VIEWS: tuple[str, ...] = ("con", "brg", "joint")

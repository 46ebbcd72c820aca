"""Every embedding view, declared once: whose rows it holds, and whether an owner has several.

The texts of each view are :mod:`tmem.views.texts`'s to write; the vector store accepts these view
names (:mod:`tmem.store.lance`) and the query side loads these keys (:mod:`tmem.retrieval.index`).
A new view is a row here and its text in :func:`tmem.views.texts.memory_views`; a declared trigger
family (:mod:`tmem.construct.families`) brings its own view, which :func:`view_keys` adds.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

from tmem.construct.families import added_families

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
# The item-trigger views TrigRecall scores an item by (NaN-aware max over them).
ITEM_TRIGGER_VIEWS: tuple[str, ...] = ("con", "brg", "joint")


def family_views() -> tuple[str, ...]:
    """The item views of the trigger families declared beyond the built-in four, by family name."""
    return tuple(f.view for f in added_families())


def view_keys() -> tuple[ViewKey, ...]:
    """Every view key a conversation's vectors may hold now: :data:`VIEW_KEYS` and the declared families'."""
    return VIEW_KEYS + tuple(("item", view) for view in family_views())

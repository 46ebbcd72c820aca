"""Trigger families, declared once: what a family is called in the store, which embedding view
holds its texts, which LLM operation writes them, and the construction function that does.

The four families of the paper are built in: entity (Q I) and bridge (Q II) triggers of items,
scene (Q IV) and horizon (Q III) triggers of scenes, each with stages of its own
(:mod:`tmem.construct.triggers`). A new family of item triggers is three things, and nothing
else changes:

1. its prompt module (``tmem/prompts/<operation>.py``, and its row in ``tmem/prompts/operations.py``);
2. its construction function, ``(conversation id, items, chat model) -> {item id: texts}``;
3. one declaration, :func:`register_trigger_family` — made in every process that builds or queries
   (as a provider's registration is): a snapshot holding a family's vectors is read by processes
   that know the family.

The build then runs the function once per conversation after item extraction (a stage of its
own, named after the family, cached like every stage); the texts are stored as rows of
``item_triggers`` with the family's name, embedded as the family's view, and scored by TrigRecall
with the built-in trigger views (an item's best view decides; the trace names it).
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Literal

from tmem.domain import Item
from tmem.ports import ChatModel

# (conversation id, the conversation's items, the build's chat model) -> texts per item id
BuildTriggers = Callable[[str, Sequence[Item], ChatModel], Mapping[str, Sequence[str]]]


@dataclass(frozen=True)
class TriggerFamily:
    name: str  # the ``family`` of its rows in item_triggers / scene_triggers
    host: Literal["item", "scene"]
    view: str  # the embedding view its texts are embedded as (tmem/views/catalog.py)
    operation: str  # the LLM operation that writes them
    build: BuildTriggers | None = None  # None: a built-in family, built by stages of its own
    version: str = ""  # its prompt's version: a new one rebuilds the family's stage (the stage cache key)
    what: str = ""


BUILT_IN: tuple[TriggerFamily, ...] = (
    TriggerFamily("entity", "item", "con", "item_triggers", what="Q I: superordinate concepts naming the item"),
    TriggerFamily("bridge", "item", "brg", "item_triggers", what="Q II: situations where the item would matter"),
    TriggerFamily("scene", "scene", "scn", "scene_triggers", what="Q IV: situation, object, event, emotion"),
    TriggerFamily("horizon", "scene", "hor", "scene_triggers", what="Q III: forward-looking channels"),
)

_ADDED: dict[str, TriggerFamily] = {}


def register_trigger_family(family: TriggerFamily) -> None:
    """Declare a family of item triggers (see the module); declaring the same name again replaces it."""
    taken = {f.name for f in BUILT_IN} | {f.view for f in BUILT_IN}
    if family.name in taken or family.view in taken or family.view in {"summary", "content", "dlg", "joint"}:
        raise ValueError(f"trigger family {family.name!r} (view {family.view!r}) clashes with a built-in name")
    if family.host != "item" or family.build is None:
        raise ValueError(f"trigger family {family.name!r}: an added family hosts items and has a build function")
    _ADDED[family.name] = family


def unregister_trigger_family(name: str) -> None:
    _ADDED.pop(name, None)


def added_families() -> tuple[TriggerFamily, ...]:
    """The declared families beyond the built-in four, by name."""
    return tuple(_ADDED[name] for name in sorted(_ADDED))


def family_named(name: str) -> TriggerFamily | None:
    return _ADDED.get(name) or next((f for f in BUILT_IN if f.name == name), None)

"""The texts that get embedded, one row per (owner, view, ordinal) — DESIGN.md §3.

Dense node views: topic ``summary``; scene ``summary`` (title + summary); item ``content``.
Item trigger views: ``con`` (entity concepts), ``brg`` (bridge situations), ``joint``
(entities ‖ bridges ‖ rationales). Scene trigger views: ``dlg`` (the scene's dialogue),
``scn`` (the four attributes), ``hor`` (one row per non-empty horizon sentence).
A view with no text produces no row; the query side reads a missing view as NaN.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Literal

from tmem.domain import HORIZON_CHANNELS, SCENE_ATTRIBUTES, Memory, Turn

OwnerKind = Literal["topic", "scene", "item"]


@dataclass(frozen=True)
class ViewText:
    owner_kind: OwnerKind
    owner_id: str
    view: str
    ordinal: int
    text: str


def dialogue_text(turn_ids: tuple[str, ...], turns_by_id: Mapping[str, Turn]) -> str:
    """A scene's dialogue as ``Speaker: text`` lines, in turn order."""
    return "\n".join(f"{turns_by_id[t].speaker}: {turns_by_id[t].text}" for t in turn_ids if t in turns_by_id)


def memory_views(memory: Memory, turns_by_id: Mapping[str, Turn]) -> list[ViewText]:
    """Every embeddable view of a conversation's memory, in a deterministic order."""
    out: list[ViewText] = []
    for topic in memory.topics:
        out.append(ViewText("topic", topic.topic_id, "summary", 0, topic.summary))
    for scene in memory.scenes:
        out.append(ViewText("scene", scene.scene_id, "summary", 0, f"{scene.title}. {scene.summary}"))
        dialogue = dialogue_text(scene.turn_ids, turns_by_id)
        if dialogue:
            out.append(ViewText("scene", scene.scene_id, "dlg", 0, dialogue))
    for st in memory.scene_triggers:
        attrs = " ".join(getattr(st, a).strip() for a in SCENE_ATTRIBUTES if getattr(st, a).strip())
        if attrs:
            out.append(ViewText("scene", st.scene_id, "scn", 0, attrs))
        ordinal = 0
        for channel in HORIZON_CHANNELS:
            sentence = st.horizons.get(channel, "").strip()
            if sentence:
                out.append(ViewText("scene", st.scene_id, "hor", ordinal, sentence))
                ordinal += 1
    for item in memory.items:
        out.append(ViewText("item", item.item_id, "content", 0, item.content))
    for it in memory.item_triggers:
        entities = "; ".join(e.strip() for e in it.entities if e.strip())
        bridges = "; ".join(b.situation.strip() for b in it.bridges if b.situation.strip())
        rationales = "; ".join(b.rationale.strip() for b in it.bridges if b.rationale.strip())
        if entities:
            out.append(ViewText("item", it.item_id, "con", 0, entities))
        if bridges:
            out.append(ViewText("item", it.item_id, "brg", 0, bridges))
        joint = " | ".join(part for part in (entities, bridges, rationales) if part)
        if joint:
            out.append(ViewText("item", it.item_id, "joint", 0, joint))
    return out

"""One scene or one item of a published memory, whole (the MCP ``get_scene`` / ``get_item`` tools)."""

from __future__ import annotations

from datetime import datetime
from typing import Literal

from pydantic import BaseModel, Field

from tmem.domain import ConversationMemory, Turn
from tmem.query.schemas import TurnOut


class SceneRef(BaseModel):
    scene_id: str
    title: str
    start_time: datetime
    end_time: datetime


class SceneDetail(SceneRef):
    conversation_id: str
    summary: str
    narrative: str
    turns: list[TurnOut]
    topics: list[str] = Field(description="Titles of the topics the scene belongs to.")
    item_ids: list[str] = Field(description="Items drawn from this scene (get_item).")
    triggers: dict[str, str] = Field(description="Scene triggers: situation, object, event, emotion.")
    horizons: dict[str, str] = Field(description="Horizon triggers by channel (forward-looking projections).")


class BridgeOut(BaseModel):
    situation: str
    rationale: str


class ItemDetail(BaseModel):
    conversation_id: str
    item_id: str
    kind: Literal["atomic", "connected"]
    content: str
    event_time: datetime | None = Field(description="When it happened in the conversation (not build time).")
    keywords: list[str]
    topic: str | None = Field(description="Title of the topic it was extracted from.")
    source_scenes: list[SceneRef]
    entity_triggers: list[str] = Field(description="Concepts naming the item.")
    bridge_triggers: list[BridgeOut] = Field(description="Situations where knowing the item would matter.")


def _turn_out(turn: Turn) -> TurnOut:
    return TurnOut(turn_id=turn.turn_id, session_id=turn.session_id, speaker=turn.speaker, text=turn.text,
                   event_time=turn.event_time)


def scene_detail(memory: ConversationMemory, turns: tuple[Turn, ...], scene_id: str) -> SceneDetail | None:
    """The scene ``scene_id`` of ``memory`` (exact id), or None."""
    scene = next((s for s in memory.scenes if s.scene_id == scene_id), None)
    if scene is None:
        return None
    by_id = {t.turn_id: t for t in turns}
    triggers = next((t for t in memory.scene_triggers if t.scene_id == scene_id), None)
    return SceneDetail(
        conversation_id=memory.conversation_id, scene_id=scene.scene_id, title=scene.title,
        start_time=scene.start_time, end_time=scene.end_time, summary=scene.summary, narrative=scene.narrative,
        turns=[_turn_out(by_id[t]) for t in scene.turn_ids if t in by_id],
        topics=[t.title for t in memory.topics if scene_id in t.scene_ids],
        item_ids=[i.item_id for i in memory.items if scene_id in i.source_scene_ids],
        triggers={} if triggers is None else {"situation": triggers.situation, "object": triggers.object,
                                              "event": triggers.event, "emotion": triggers.emotion},
        horizons={} if triggers is None else {k: v for k, v in triggers.horizons.items() if v},
    )


def item_detail(memory: ConversationMemory, item_id: str) -> ItemDetail | None:
    """The item ``item_id`` of ``memory`` (exact id), or None."""
    item = next((i for i in memory.items if i.item_id == item_id), None)
    if item is None:
        return None
    scenes = {s.scene_id: s for s in memory.scenes}
    topic = next((t.title for t in memory.topics if t.topic_id == item.topic_id), None)
    triggers = next((t for t in memory.item_triggers if t.item_id == item_id), None)
    return ItemDetail(
        conversation_id=memory.conversation_id, item_id=item.item_id, kind=item.kind, content=item.content,
        event_time=item.event_time, keywords=list(item.keywords), topic=topic,
        source_scenes=[SceneRef(scene_id=s.scene_id, title=s.title, start_time=s.start_time, end_time=s.end_time)
                       for sid in item.source_scene_ids if (s := scenes.get(sid)) is not None],
        entity_triggers=list(triggers.entities) if triggers is not None else [],
        bridge_triggers=[BridgeOut(situation=b.situation, rationale=b.rationale) for b in triggers.bridges]
        if triggers is not None else [],
    )

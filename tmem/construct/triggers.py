"""Stage 4: triggers (paper §3.2.3). Item triggers (entity Q I + bridge Q II) and scene triggers
(scene Q IV + horizon Q III), several hosts per call.

Each batch is checked: every host of the batch answered exactly once, no unknown ref, no blank
cue (re-asked once with the reason, then :class:`ValidationFailure`).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

from tmem.construct.common import (
    DEFAULT_REASKS,
    Rejected,
    ask_checked,
    batched,
    check_refs,
    clean,
    local_refs,
    unique_phrases,
)
from tmem.domain import HORIZON_CHANNELS, BridgeTrigger, Item, ItemTriggers, Scene, SceneTriggers, Turn
from tmem.prompts import item_triggers as item_prompt
from tmem.prompts import scene_triggers as scene_prompt
from tmem.prompts.common import iso_date
from tmem.providers.base import ChatModel
from tmem.providers.scope import scoped

ITEM_BATCH = 6
SCENE_BATCH = 4


@scoped  # its LLM calls are attributed to the conversation (tmem forget)
def item_triggers(
    conversation_id: str,
    items: Sequence[Item],
    chat: ChatModel,
    *,
    batch: int = ITEM_BATCH,
    reasks: int = DEFAULT_REASKS,
) -> list[ItemTriggers]:
    """Entity and bridge triggers of every item, in item order; ``batch`` items per call."""
    _same_conversation(conversation_id, [(i.item_id, i.conversation_id) for i in items])
    found: list[ItemTriggers] = []
    for group in batched(items, batch):
        refs = local_refs("I", group)
        payload = item_prompt.ItemTriggerInput(
            conversation_id=conversation_id,
            items=[
                item_prompt.ItemView(
                    ref=ref, content=item.content, date=iso_date(item.event_time) if item.event_time else None
                )
                for ref, item in refs.items()
            ],
        )

        def check(answer: item_prompt.ItemTriggerResponse, refs: dict[str, Item] = refs) -> list[ItemTriggers]:
            check_refs("item", [clean(a.ref) for a in answer.items], list(refs))
            by_ref = {clean(a.ref): a for a in answer.items}
            return [_item_triggers(conversation_id, item, by_ref[ref]) for ref, item in refs.items()]

        found.extend(ask_checked(chat, item_prompt.build, payload, check, reasks=reasks))
    return found


def _item_triggers(conversation_id: str, item: Item, answer: item_prompt.ItemTriggerAnswer) -> ItemTriggers:
    entities = unique_phrases(answer.entities)
    bridges = tuple(
        BridgeTrigger(situation=clean(b.situation), rationale=clean(b.rationale))
        for b in answer.bridges
        if clean(b.situation) and clean(b.rationale)
    )
    if not entities or not bridges:
        raise Rejected(f"item {answer.ref!r} needs at least one entity and one bridge with its rationale.")
    return ItemTriggers(conversation_id=conversation_id, item_id=item.item_id, entities=entities, bridges=bridges)


@scoped  # its LLM calls are attributed to the conversation (tmem forget)
def scene_triggers(
    conversation_id: str,
    scenes: Sequence[Scene],
    turns_by_id: Mapping[str, Turn],
    chat: ChatModel,
    *,
    batch: int = SCENE_BATCH,
    reasks: int = DEFAULT_REASKS,
) -> list[SceneTriggers]:
    """Scene and horizon triggers of every scene from its narrative, in scene order; ``batch`` per call.

    ``turns_by_id`` gives each scene's speakers, whose arcs the horizons project.
    """
    _same_conversation(conversation_id, [(s.scene_id, s.conversation_id) for s in scenes])
    found: list[SceneTriggers] = []
    for group in batched(scenes, batch):
        refs = local_refs("S", group)
        payload = scene_prompt.SceneTriggerInput(
            conversation_id=conversation_id,
            scenes=[
                scene_prompt.SceneNarrative(
                    ref=ref,
                    date=iso_date(scene.start_time),
                    speakers=_speakers(scene, turns_by_id),
                    title=scene.title,
                    narrative=scene.narrative,
                )
                for ref, scene in refs.items()
            ],
        )

        def check(answer: scene_prompt.SceneTriggerResponse, refs: dict[str, Scene] = refs) -> list[SceneTriggers]:
            check_refs("scene", [clean(a.ref) for a in answer.scenes], list(refs))
            by_ref = {clean(a.ref): a for a in answer.scenes}
            return [_scene_triggers(conversation_id, scene, by_ref[ref]) for ref, scene in refs.items()]

        found.extend(ask_checked(chat, scene_prompt.build, payload, check, reasks=reasks))
    return found


def _scene_triggers(conversation_id: str, scene: Scene, answer: scene_prompt.SceneTriggerAnswer) -> SceneTriggers:
    attributes = {
        "situation": clean(answer.situation),
        "object": clean(answer.object),
        "event": clean(answer.event),
        "emotion": clean(answer.emotion),
    }
    blank = [name for name, text in attributes.items() if not text]
    if blank:
        raise Rejected(f"scene {answer.ref!r} has blank attributes {blank}; each needs one sentence.")
    horizons: dict[str, str] = {channel: clean(getattr(answer, channel)) for channel in HORIZON_CHANNELS}
    return SceneTriggers(conversation_id=conversation_id, scene_id=scene.scene_id, horizons=horizons, **attributes)


def _speakers(scene: Scene, turns_by_id: Mapping[str, Turn]) -> list[str]:
    missing = [tid for tid in scene.turn_ids if tid not in turns_by_id]
    if missing:
        raise ValueError(f"scene {scene.scene_id} has turns {missing[:5]} that are not in turns_by_id")
    return list(dict.fromkeys(turns_by_id[tid].speaker for tid in scene.turn_ids))


def _same_conversation(conversation_id: str, hosts: Sequence[tuple[str, str]]) -> None:
    foreign = [host for host, owner in hosts if owner != conversation_id]
    if foreign:
        raise ValueError(f"{foreign[:5]} do not belong to conversation {conversation_id!r}")

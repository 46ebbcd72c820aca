"""Stage 4: triggers (paper §3.2.3). Item triggers (entity Q I + bridge Q II) and scene triggers
(scene Q IV + horizon Q III), several hosts per call.

Each batch is checked: every host of the batch answered exactly once, no unknown ref, no blank
cue (re-asked once with the reason, then :class:`ValidationFailure`). Entity and bridge lists
longer than their stated limits are cut to them (noted ``clipped``, :mod:`tmem.construct.outcome`).
A batch whose answer is cut at its completion budget is asked again in halves, down to one host.
The ``*_outcome`` functions isolate failures: a batch whose answer stays invalid is split to find
its host(s) at fault, and a single host's failure is quarantined (an ``item`` or ``scene`` unit)
while the others keep their triggers; the plain functions raise instead.
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
from tmem.construct.outcome import BuildNote, StageLog, StageOutcome, ask_in_halves, clip
from tmem.domain import HORIZON_CHANNELS, BridgeTrigger, Item, ItemTriggers, Scene, SceneTriggers, Turn
from tmem.errors import LLMOutputError
from tmem.ports import ChatModel, scoped
from tmem.prompts import item_triggers as item_prompt
from tmem.prompts import scene_triggers as scene_prompt
from tmem.prompts.common import iso_date, iso_when

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
    return item_triggers_outcome(conversation_id, items, chat, batch=batch, reasks=reasks, isolate=False).value


@scoped  # its LLM calls are attributed to the conversation (tmem forget)
def item_triggers_outcome(
    conversation_id: str,
    items: Sequence[Item],
    chat: ChatModel,
    *,
    batch: int = ITEM_BATCH,
    reasks: int = DEFAULT_REASKS,
    isolate: bool = True,
) -> StageOutcome[list[ItemTriggers]]:
    """As :func:`item_triggers`, with notes; an item whose answer stays invalid is quarantined (``isolate``)."""
    _same_conversation(conversation_id, [(i.item_id, i.conversation_id) for i in items])
    log = StageLog(isolate=isolate)

    def ask(group: Sequence[Item]) -> list[ItemTriggers]:
        found, notes = _ask_item_batch(conversation_id, group, chat, reasks)
        log.extend(notes)
        return found

    def failed(group: Sequence[Item], exc: LLMOutputError) -> None:
        for item in group:
            log.quarantine("item", item.item_id, exc)

    found: list[ItemTriggers] = []
    for group in batched(items, batch):
        for answered in ask_in_halves(group, ask, failed, log, what="items", split_failures=isolate):
            found.extend(answered)
    return log.outcome(found)


def _ask_item_batch(
    conversation_id: str, group: Sequence[Item], chat: ChatModel, reasks: int
) -> tuple[list[ItemTriggers], list[BuildNote]]:
    refs = local_refs("I", group)
    payload = item_prompt.ItemTriggerInput(
        conversation_id=conversation_id,
        items=[
            item_prompt.ItemView(ref=ref, content=item.content, date=iso_when(item.time))
            for ref, item in refs.items()
        ],
    )
    input_ref = item_prompt.build(payload).input_ref

    def check(answer: item_prompt.ItemTriggerResponse) -> tuple[list[ItemTriggers], list[BuildNote]]:
        check_refs("item", [clean(a.ref) for a in answer.items], list(refs))
        by_ref = {clean(a.ref): a for a in answer.items}
        notes = StageLog(isolate=False)  # this answer's own: a rejected answer leaves no note
        found = [_item_triggers(conversation_id, item, by_ref[ref], notes, input_ref) for ref, item in refs.items()]
        return found, notes.notes

    return ask_checked(chat, item_prompt.build, payload, check, reasks=reasks)


def _item_triggers(
    conversation_id: str, item: Item, answer: item_prompt.ItemTriggerAnswer, log: StageLog, input_ref: str
) -> ItemTriggers:
    entities = unique_phrases(answer.entities)
    bridges = tuple(
        BridgeTrigger(situation=clean(b.situation), rationale=clean(b.rationale))
        for b in answer.bridges
        if clean(b.situation) and clean(b.rationale)
    )
    if not entities or not bridges:
        raise Rejected(f"item {answer.ref!r} needs at least one entity and one bridge with its rationale.")
    op = item_prompt.OPERATION
    return ItemTriggers(
        conversation_id=conversation_id,
        item_id=item.item_id,
        entities=tuple(clip(entities, item_prompt.MAX_ENTITIES, log, op, input_ref, f"entities of {answer.ref}")),
        bridges=tuple(clip(bridges, item_prompt.MAX_BRIDGES, log, op, input_ref, f"bridges of {answer.ref}")),
    )


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
    return scene_triggers_outcome(
        conversation_id, scenes, turns_by_id, chat, batch=batch, reasks=reasks, isolate=False
    ).value


@scoped  # its LLM calls are attributed to the conversation (tmem forget)
def scene_triggers_outcome(
    conversation_id: str,
    scenes: Sequence[Scene],
    turns_by_id: Mapping[str, Turn],
    chat: ChatModel,
    *,
    batch: int = SCENE_BATCH,
    reasks: int = DEFAULT_REASKS,
    isolate: bool = True,
) -> StageOutcome[list[SceneTriggers]]:
    """As :func:`scene_triggers`, with notes; a scene whose answer stays invalid is quarantined (``isolate``)."""
    _same_conversation(conversation_id, [(s.scene_id, s.conversation_id) for s in scenes])
    log = StageLog(isolate=isolate)

    def ask(group: Sequence[Scene]) -> list[SceneTriggers]:
        return _ask_scene_batch(conversation_id, group, turns_by_id, chat, reasks)

    def failed(group: Sequence[Scene], exc: LLMOutputError) -> None:
        for scene in group:
            log.quarantine("scene", scene.scene_id, exc)

    found: list[SceneTriggers] = []
    for group in batched(scenes, batch):
        for answered in ask_in_halves(group, ask, failed, log, what="scenes", split_failures=isolate):
            found.extend(answered)
    return log.outcome(found)


def _ask_scene_batch(
    conversation_id: str, group: Sequence[Scene], turns_by_id: Mapping[str, Turn], chat: ChatModel, reasks: int
) -> list[SceneTriggers]:
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

    def check(answer: scene_prompt.SceneTriggerResponse) -> list[SceneTriggers]:
        check_refs("scene", [clean(a.ref) for a in answer.scenes], list(refs))
        by_ref = {clean(a.ref): a for a in answer.scenes}
        return [_scene_triggers(conversation_id, scene, by_ref[ref]) for ref, scene in refs.items()]

    return ask_checked(chat, scene_prompt.build, payload, check, reasks=reasks)


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

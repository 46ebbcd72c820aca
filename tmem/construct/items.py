"""Stage 3: atomic and connected items per topic (paper §3.2.2, Algorithm 3 stage 3).

One ``item_extract`` call per topic over all its scenes' dated dialogue. A topic with more than
``max_scenes`` scenes is read in consecutive chunks of ``max_scenes`` (one call each) so the
prompt stays bounded; connected items then link scenes within a chunk.

Checks (re-asked once with the reason, then :class:`ValidationFailure`): every source ref is a
scene of the topic; an atomic item has exactly one source, a connected item two or more.

Event time: the model's ``YYYY-MM-DD`` when it is a real date. Otherwise (null or unparseable)
the item falls back to its source scenes' time (the latest source scene's start) and its id is
listed in :attr:`ExtractedItems.dated_from_scene`, so the fallback is never mistaken for a
date the dialogue gave.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass

from tmem.construct.common import (
    DEFAULT_REASKS,
    Rejected,
    ask_checked,
    batched,
    clean,
    local_refs,
    parse_model_date,
    unique_phrases,
)
from tmem.domain import Item, Scene, Topic, Turn
from tmem.ids import content_id
from tmem.prompts import item_extract
from tmem.prompts.common import dialogue_blocks
from tmem.providers.base import ChatModel
from tmem.providers.scope import scoped

MAX_SCENES_PER_CALL = 12
MAX_ITEM_KEYWORDS = 8


@dataclass(frozen=True)
class ExtractedItems:
    items: tuple[Item, ...]
    dated_from_scene: frozenset[str]  # ids of items whose event_time is their source scene's time


def item_id(conversation_id: str, content: str, source_scene_ids: Sequence[str], model_name: str) -> str:
    return content_id("itm", conversation_id, content, sorted(source_scene_ids), item_extract.VERSION, model_name)


@scoped  # its LLM calls are attributed to the conversation (tmem forget)
def extract_items(
    conversation_id: str,
    topic: Topic,
    scenes_of_topic: Sequence[Scene],
    turns_by_id: Mapping[str, Turn],
    chat: ChatModel,
    *,
    max_scenes: int = MAX_SCENES_PER_CALL,
    reasks: int = DEFAULT_REASKS,
) -> list[Item]:
    """The topic's items, in answer order, without duplicates."""
    return list(
        extract_items_detailed(
            conversation_id, topic, scenes_of_topic, turns_by_id, chat, max_scenes=max_scenes, reasks=reasks
        ).items
    )


@scoped  # its LLM calls are attributed to the conversation (tmem forget)
def extract_items_detailed(
    conversation_id: str,
    topic: Topic,
    scenes_of_topic: Sequence[Scene],
    turns_by_id: Mapping[str, Turn],
    chat: ChatModel,
    *,
    max_scenes: int = MAX_SCENES_PER_CALL,
    reasks: int = DEFAULT_REASKS,
) -> ExtractedItems:
    """As :func:`extract_items`, also telling which event times fell back to the scene's time."""
    if topic.conversation_id != conversation_id:
        raise ValueError(f"topic {topic.topic_id} does not belong to conversation {conversation_id!r}")
    foreign = [s.scene_id for s in scenes_of_topic if s.scene_id not in topic.scene_ids]
    if foreign:
        raise ValueError(f"scenes {foreign} are not scenes of topic {topic.topic_id}")
    ordered = sorted(scenes_of_topic, key=lambda s: s.seq)
    items: dict[str, Item] = {}
    from_scene: set[str] = set()
    for chunk in batched(ordered, max_scenes):
        for item, fallback in _extract_chunk(conversation_id, topic, chunk, turns_by_id, chat, reasks):
            if item.item_id not in items:
                items[item.item_id] = item
                if fallback:
                    from_scene.add(item.item_id)
    return ExtractedItems(tuple(items.values()), frozenset(from_scene))


def _extract_chunk(
    conversation_id: str,
    topic: Topic,
    scenes: Sequence[Scene],
    turns_by_id: Mapping[str, Turn],
    chat: ChatModel,
    reasks: int,
) -> list[tuple[Item, bool]]:
    refs = local_refs("S", scenes)
    payload = item_extract.ExtractInput(
        conversation_id=conversation_id,
        topic_id=topic.topic_id,
        topic=topic.title,
        scenes=[
            item_extract.TopicScene(ref=ref, title=scene.title, dialogue=dialogue_blocks(_turns(scene, turns_by_id)))
            for ref, scene in refs.items()
        ],
    )

    def check(answer: item_extract.ExtractResponse) -> list[tuple[Item, bool]]:
        return [_item(conversation_id, topic, refs, raw, chat.model_name) for raw in answer.items]

    return ask_checked(chat, item_extract.build, payload, check, reasks=reasks)


def _item(
    conversation_id: str, topic: Topic, refs: Mapping[str, Scene], raw: item_extract.ExtractedItem, model_name: str
) -> tuple[Item, bool]:
    content = clean(raw.content)
    if not content:
        raise Rejected("an item has blank content.")
    source_refs = list(dict.fromkeys(clean(ref) for ref in raw.sources))
    unknown = [ref for ref in source_refs if ref not in refs]
    if unknown:
        raise Rejected(f"item {content[:60]!r} cites {unknown}, which are not scenes of this topic {list(refs)}.")
    if raw.kind == "atomic" and len(source_refs) != 1:
        raise Rejected(f"atomic item {content[:60]!r} must have exactly one source scene, has {source_refs}.")
    if raw.kind == "connected" and len(source_refs) < 2:
        raise Rejected(f"connected item {content[:60]!r} must have two or more source scenes, has {source_refs}.")
    sources = [refs[ref] for ref in source_refs]
    latest = max(sources, key=lambda s: s.start_time)
    event_time = parse_model_date(raw.date, like=latest.start_time)
    source_ids = tuple(s.scene_id for s in sources)
    item = Item(
        conversation_id=conversation_id,
        item_id=item_id(conversation_id, content, source_ids, model_name),
        topic_id=topic.topic_id,
        kind=raw.kind,
        content=content,
        source_scene_ids=source_ids,
        event_time=event_time or latest.start_time,
        keywords=unique_phrases(raw.keywords, limit=MAX_ITEM_KEYWORDS),
    )
    return item, event_time is None


def _turns(scene: Scene, turns_by_id: Mapping[str, Turn]) -> list[Turn]:
    missing = [tid for tid in scene.turn_ids if tid not in turns_by_id]
    if missing:
        raise ValueError(f"scene {scene.scene_id} has turns {missing[:5]} that are not in turns_by_id")
    return [turns_by_id[tid] for tid in scene.turn_ids]


def dedupe_items(batches: Iterable[Sequence[Item]]) -> list[Item]:
    """Items of several topics, first occurrence of each id kept (the same fact from two topics
    that share a scene, worded identically, gets one row)."""
    kept: dict[str, Item] = {}
    for items in batches:
        for item in items:
            kept.setdefault(item.item_id, item)
    return list(kept.values())

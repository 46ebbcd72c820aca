"""Stage 3: atomic and connected items per topic (paper §3.2.2, Algorithm 3 stage 3).

One ``item_extract`` call per topic over all its scenes' dated dialogue. A topic with more than
``max_scenes`` scenes is read in consecutive chunks of ``max_scenes`` (one call each) so the
prompt stays bounded; connected items then link scenes within a chunk. A chunk whose answer is
cut at its completion budget (a dense topic: 40+ items) is asked again in halves of its scenes,
down to one scene (noted ``split``).

An answer is repaired without a call where it can be (:mod:`tmem.construct.outcome`): a cited ref
that is not a scene of the chunk is dropped (``dropped_ref``; an item left without a source is
dropped); an atomic item with two or more sources becomes connected and a connected item with one
becomes atomic (``reclassified``); keywords beyond ``MAX_ITEM_KEYWORDS`` are cut (``clipped``). An
item with blank content, or an answer none of whose items cites a scene of the chunk (it is about
something else: a misread ref format, an obeyed injection), is re-asked once with the reason, then
:class:`ValidationFailure`.

A chunk whose answer stays invalid (after the repair, the re-ask and the splits) is quarantined as
a ``topic_chunk`` unit by :func:`extract_items_outcome`; the plain functions raise instead.

Event time, in order of preference:

1. the model's ``when`` (a day, a month, a year or a span of days, :func:`parse_model_when`),
   with the dialogue's words for it (``when_phrase``): ``time_source = "stated"``;
2. else the day of the turn that says the fact (``said_in``, a turn of the item's source
   scenes): ``"said"``, so a fact told on the last day of a scene spanning weeks is dated by
   that day, not the scene's start;
3. else the latest source scene's start: ``"scene"``, shown as approximate; its id is listed in
   :attr:`ExtractedItems.dated_from_scene`, so the fallback is never mistaken for a date the
   dialogue gave.

A scene may belong to several topics: each request names a scene's other topics
(``other_topics``), whose facts are extracted with them.
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
    parse_model_when,
    unique_phrases,
)
from tmem.construct.outcome import BuildNote, StageLog, StageOutcome, ask_in_halves, clip
from tmem.domain import Item, Scene, TimeGranularity, TimeSource, Topic, Turn
from tmem.errors import LLMOutputError
from tmem.ids import content_id
from tmem.ports import ChatModel, scoped
from tmem.prompts import item_extract
from tmem.prompts.common import dialogue_blocks

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
    other_topics: Mapping[str, Sequence[str]] | None = None,
) -> list[Item]:
    """The topic's items, in answer order, without duplicates. ``other_topics``: scene id → titles of
    the other topics the scene belongs to (their facts are extracted with them)."""
    return list(
        extract_items_detailed(
            conversation_id, topic, scenes_of_topic, turns_by_id, chat, max_scenes=max_scenes, reasks=reasks,
            other_topics=other_topics,
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
    other_topics: Mapping[str, Sequence[str]] | None = None,
) -> ExtractedItems:
    """As :func:`extract_items`, also telling which event times fell back to the scene's time."""
    return extract_items_outcome(
        conversation_id, topic, scenes_of_topic, turns_by_id, chat, max_scenes=max_scenes, reasks=reasks,
        isolate=False, other_topics=other_topics,
    ).value


@scoped  # its LLM calls are attributed to the conversation (tmem forget)
def extract_items_outcome(
    conversation_id: str,
    topic: Topic,
    scenes_of_topic: Sequence[Scene],
    turns_by_id: Mapping[str, Turn],
    chat: ChatModel,
    *,
    max_scenes: int = MAX_SCENES_PER_CALL,
    reasks: int = DEFAULT_REASKS,
    isolate: bool = True,
    other_topics: Mapping[str, Sequence[str]] | None = None,
) -> StageOutcome[ExtractedItems]:
    """The topic's items with the notes of their extraction; a chunk whose answer stays invalid is
    quarantined (``isolate``) or raised."""
    if topic.conversation_id != conversation_id:
        raise ValueError(f"topic {topic.topic_id} does not belong to conversation {conversation_id!r}")
    foreign = [s.scene_id for s in scenes_of_topic if s.scene_id not in topic.scene_ids]
    if foreign:
        raise ValueError(f"scenes {foreign} are not scenes of topic {topic.topic_id}")
    ordered = sorted(scenes_of_topic, key=lambda s: s.seq)
    log = StageLog(isolate=isolate)
    items: dict[str, Item] = {}
    from_scene: set[str] = set()

    def ask(chunk: Sequence[Scene]) -> list[tuple[Item, bool]]:
        found, notes = _extract_chunk(conversation_id, topic, chunk, turns_by_id, chat, reasks, other_topics or {})
        log.extend(notes)
        return found

    def failed(chunk: Sequence[Scene], exc: LLMOutputError) -> None:
        log.quarantine("topic_chunk", topic.topic_id, exc)

    for chunk in batched(ordered, max_scenes):
        for found in ask_in_halves(chunk, ask, failed, log, what="scenes"):
            for item, fallback in found:
                if item.item_id not in items:
                    items[item.item_id] = item
                    if fallback:
                        from_scene.add(item.item_id)
    return log.outcome(ExtractedItems(tuple(items.values()), frozenset(from_scene)))


def _extract_chunk(
    conversation_id: str,
    topic: Topic,
    scenes: Sequence[Scene],
    turns_by_id: Mapping[str, Turn],
    chat: ChatModel,
    reasks: int,
    other_topics: Mapping[str, Sequence[str]],
) -> tuple[list[tuple[Item, bool]], list[BuildNote]]:
    refs = local_refs("S", scenes)
    payload = item_extract.ExtractInput(
        conversation_id=conversation_id,
        topic_id=topic.topic_id,
        topic=topic.title,
        scenes=[
            item_extract.TopicScene(
                ref=ref, title=scene.title, other_topics=list(other_topics.get(scene.scene_id, ())) or None,
                dialogue=dialogue_blocks(_turns(scene, turns_by_id)),
            )
            for ref, scene in refs.items()
        ],
    )
    input_ref = item_extract.build(payload).input_ref

    def check(answer: item_extract.ExtractResponse) -> tuple[list[tuple[Item, bool]], list[BuildNote]]:
        notes = StageLog(isolate=False)  # this answer's own: a rejected answer leaves no note
        found = [_item(conversation_id, topic, refs, raw, chat.model_name, notes, input_ref, turns_by_id)
                 for raw in answer.items]
        kept = [f for f in found if f is not None]
        if answer.items and not kept:  # an answer about nothing in the input: not a slip, ask again
            cited = sorted({clean(ref) for raw in answer.items for ref in raw.sources})
            raise Rejected(f"no item cites a scene of this topic: the items cite {cited}; the scenes are {list(refs)}.")
        return kept, notes.notes

    return ask_checked(chat, item_extract.build, payload, check, reasks=reasks)


def _item(
    conversation_id: str,
    topic: Topic,
    refs: Mapping[str, Scene],
    raw: item_extract.ExtractedItem,
    model_name: str,
    log: StageLog,
    input_ref: str,
    turns_by_id: Mapping[str, Turn],
) -> tuple[Item, bool] | None:
    content = clean(raw.content)
    if not content:
        raise Rejected("an item has blank content.")
    op = item_extract.OPERATION
    cited = list(dict.fromkeys(clean(ref) for ref in raw.sources))
    source_refs = [ref for ref in cited if ref in refs]
    unknown = [ref for ref in cited if ref not in refs]
    if unknown:
        fate = "dropped them" if source_refs else "dropped the item, which has no other source"
        log.note(op, input_ref, "dropped_ref", f"item {content[:60]!r} cites {unknown}, not scenes of the "
                 f"input {list(refs)}: {fate}")
    if not source_refs:
        return None
    kind = raw.kind
    if kind == "atomic" and len(source_refs) > 1:
        kind = "connected"
    elif kind == "connected" and len(source_refs) < 2:
        kind = "atomic"
    if kind != raw.kind:
        log.note(op, input_ref, "reclassified",
                 f"{raw.kind} item {content[:60]!r} has sources {source_refs}: made {kind}")
    sources = [refs[ref] for ref in source_refs]
    latest = max(sources, key=lambda s: s.start_time)
    source_ids = tuple(s.scene_id for s in sources)
    stated = parse_model_when(raw.when, like=latest.start_time)
    said = clean(raw.said_in or "")
    said_turn = turns_by_id.get(said) if any(said in s.turn_ids for s in sources) else None
    source: TimeSource
    granularity: TimeGranularity
    if stated is not None:
        start, end, granularity, source = stated.start, stated.end, stated.granularity, "stated"
    elif said_turn is not None:
        day = said_turn.event_time.replace(hour=0, minute=0, second=0, microsecond=0)
        start, end, granularity, source = day, None, "day", "said"
    else:
        start, end, granularity, source = latest.start_time, None, "day", "scene"
    keywords = clip(unique_phrases(raw.keywords), MAX_ITEM_KEYWORDS, log, op, input_ref,
                    f"keywords of item {content[:60]!r}")
    item = Item(
        conversation_id=conversation_id,
        item_id=item_id(conversation_id, content, source_ids, model_name),
        topic_id=topic.topic_id,
        kind=kind,
        content=content,
        source_scene_ids=source_ids,
        event_time=start,
        event_end=end,
        time_granularity=granularity,
        time_phrase=clean(raw.when_phrase) if stated is not None else "",
        time_source=source,
        keywords=tuple(keywords),
    )
    return item, source == "scene"


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

"""Stage 2: admit scenes to topics, one scene at a time in arrival order (paper Algorithm 4).

For each scene, the pool (in creation order) is matched in batches of at most ``batch`` labels,
one ``topic_match`` call per batch; the scene joins every topic that admits it. The matching
answer also carries the keywords each admitted topic gains (the topic update: the title stays
as created, keywords are merged and capped at ``max_keywords``). When no topic admits the scene,
a new topic is opened: from the proposal of the last matching call (asked only when no earlier
batch admitted), else with one ``topic_create`` call. A topic has at least 10 keywords.

One departure from Algorithm 4, measured on real-model builds: the last matching call may also
propose a topic when earlier batches (named to it in ``already_admitted``) or this one admitted the
scene, for a second matter of the scene that no topic covers; the scene then joins the topics that
admitted it and founds the new one. Under the strict rule a scene about two matters could only
fold its second matter into a topic of the first, and topics drifted into catch-alls (four of four
answerers of a whole-conversation build reported it).

Calls per scene: ceil(|pool| / batch) matching calls, plus one creation call for the first
scene of an empty pool or when the last batch's proposal is missing or too thin. A conversation's
matching thus grows with scenes x topics (a 600-turn LoCoMo conversation built by a capable model:
252 of its 448 calls). ``shortlist`` (settings.topic_shortlist) bounds it to one call per scene:
when the pool holds more than ``batch`` topics, the ``batch`` most like the scene by BM25 (scene
title, summary and narrative against topic title and keywords) are listed with their keywords and
the next ``shortlist - batch`` by title only, both admissible; the rest are not shown. Replayed
over four recorded real-model builds of full matching (``bench/topic_shortlist.py``), of the 172
topics admitted to scenes whose pool exceeded 10 topics, 170 were in the BM25 top 10, 2 in the next
30 and none left out, for 208 matching calls instead of 453.

More than ``MAX_NEW_KEYWORDS`` new keywords for one admission are cut to that many (noted
``clipped`` by :func:`admit_topics_outcome`). Topic admission is the spine of a conversation's
build: an answer that stays invalid fails the conversation (nothing is quarantined here).
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass

from tmem.construct.common import DEFAULT_REASKS, Rejected, ask_checked, batched, clean, local_refs, unique_phrases
from tmem.construct.outcome import BuildNote, StageLog, StageOutcome, clip
from tmem.domain import Scene, Topic
from tmem.ids import content_id
from tmem.ports import ChatModel, scoped
from tmem.prompts import topic_create, topic_match
from tmem.prompts.common import iso_date
from tmem.retrieval.scoring import bm25_scores, build_bm25, tokenize

MAX_KEYWORDS = 40


@dataclass(frozen=True)
class TopicPool:
    """The topics of one conversation in creation order, each with its scene ids in admission order."""

    conversation_id: str
    topics: tuple[Topic, ...]

    def get(self, topic_id: str) -> Topic:
        for topic in self.topics:
            if topic.topic_id == topic_id:
                return topic
        raise KeyError(topic_id)

    def topics_of(self, scene_id: str) -> tuple[str, ...]:
        return tuple(t.topic_id for t in self.topics if scene_id in t.scene_ids)


def topic_id(conversation_id: str, founding_scene_id: str) -> str:
    """Fixed at creation: conversation, founding scene (its id carries the model) and prompt versions."""
    return content_id("tpc", conversation_id, founding_scene_id, topic_create.VERSION, topic_match.VERSION)


@scoped  # its LLM calls are attributed to the conversation (tmem forget)
def admit_topics(
    conversation_id: str,
    scenes: Sequence[Scene],
    chat: ChatModel,
    *,
    existing: Iterable[Topic] = (),
    batch: int = 10,
    max_keywords: int = MAX_KEYWORDS,
    reasks: int = DEFAULT_REASKS,
    shortlist: int = 0,
) -> TopicPool:
    """Admit ``scenes`` in arrival order (by ``seq``) to the pool that starts as ``existing``.

    Scenes already in a topic of ``existing`` are skipped, so an incremental run over old and
    new scenes only pays for the new ones.
    """
    return admit_topics_outcome(
        conversation_id, scenes, chat, existing=existing, batch=batch, max_keywords=max_keywords, reasks=reasks,
        shortlist=shortlist,
    ).value


@scoped  # its LLM calls are attributed to the conversation (tmem forget)
def admit_topics_outcome(
    conversation_id: str,
    scenes: Sequence[Scene],
    chat: ChatModel,
    *,
    existing: Iterable[Topic] = (),
    batch: int = 10,
    max_keywords: int = MAX_KEYWORDS,
    reasks: int = DEFAULT_REASKS,
    shortlist: int = 0,
) -> StageOutcome[TopicPool]:
    """As :func:`admit_topics`, with the notes of the answers (clipped keyword lists)."""
    log = StageLog(isolate=False)
    pool = list(existing)
    for scene in sorted(scenes, key=lambda s: s.seq):
        if scene.conversation_id != conversation_id:
            raise ValueError(f"scene {scene.scene_id} does not belong to conversation {conversation_id!r}")
        if any(scene.scene_id in t.scene_ids for t in pool):
            continue
        pool = admit_scene(
            conversation_id, pool, scene, chat, batch=batch, max_keywords=max_keywords, reasks=reasks, log=log,
            shortlist=shortlist,
        )
    return log.outcome(TopicPool(conversation_id, tuple(pool)))


def admit_scene(
    conversation_id: str,
    pool: Sequence[Topic],
    scene: Scene,
    chat: ChatModel,
    *,
    batch: int = 10,
    max_keywords: int = MAX_KEYWORDS,
    reasks: int = DEFAULT_REASKS,
    log: StageLog | None = None,
    shortlist: int = 0,
) -> list[Topic]:
    """One step of Algorithm 4: the pool after ``scene`` joined its topics or opened a new one
    (notes, if any, go to ``log``); with ``shortlist`` > ``batch`` and a pool larger than ``batch``,
    one call over the shortlist instead of the batches (module docstring)."""
    if shortlist and shortlist <= batch:
        raise ValueError(f"topic shortlist {shortlist} must exceed the batch {batch} (or be 0)")
    view = topic_create.SceneView(
        date=iso_date(scene.start_time), title=scene.title, summary=scene.summary, narrative=scene.narrative
    )
    gained: dict[str, tuple[str, ...]] = {}  # admitted topic id -> its new keywords
    proposal: topic_create.TopicDraft | None = None
    if shortlist and len(pool) > batch:
        listed, by_title = shortlist_topics(view, pool, batch, shortlist)
        requests: list[tuple[Sequence[Topic], Sequence[Topic]]] = [(listed, by_title)]
    else:
        requests = [(labels, ()) for labels in batched(list(pool), batch)]
    titles = {t.topic_id: t.title for t in pool}
    for number, (labels, others) in enumerate(requests, start=1):
        last = number == len(requests)
        earlier = [titles[tid] for tid in gained] if last else []
        admitted, offered, notes = _match(conversation_id, scene, view, labels, last, chat, reasks, earlier, others)
        if log is not None:
            log.extend(notes)
        gained.update(admitted)
        if last and offered is not None:
            proposal = _usable(offered.title, offered.keywords, max_keywords)
    pool = [
        _fold(topic, scene.scene_id, gained[topic.topic_id], max_keywords) if topic.topic_id in gained else topic
        for topic in pool
    ]
    if gained and proposal is None:
        return pool
    if proposal is None:
        proposal = _create(conversation_id, scene, view, chat, max_keywords, reasks)
    founded = Topic(
        conversation_id=conversation_id,
        topic_id=topic_id(conversation_id, scene.scene_id),
        seq=len(pool),
        title=proposal.title,
        keywords=tuple(proposal.keywords),
        scene_ids=(scene.scene_id,),
    )
    return [*pool, founded]


def shortlist_topics(
    view: topic_create.SceneView, pool: Sequence[Topic], batch: int, shortlist: int
) -> tuple[list[Topic], list[Topic]]:
    """The ``batch`` topics of ``pool`` most like the scene, then the next ``shortlist - batch``
    (BM25 of the scene's title, summary and narrative over each topic's title and keywords; ties,
    and topics sharing no word, in creation order), each part in creation order."""
    scores = bm25_scores(
        build_bm25([tokenize(" ".join([t.title, *t.keywords])) for t in pool]),
        len(pool),
        tokenize(" ".join([view.title, view.summary, view.narrative])),
    )
    ranked = sorted(range(len(pool)), key=lambda i: (-float(scores[i]), i))
    listed, by_title = sorted(ranked[:batch]), sorted(ranked[batch:shortlist])
    return [pool[i] for i in listed], [pool[i] for i in by_title]


def _match(
    conversation_id: str,
    scene: Scene,
    view: topic_create.SceneView,
    labels: Sequence[Topic],
    may_open_new: bool,
    chat: ChatModel,
    reasks: int,
    already_admitted: Sequence[str] = (),
    others: Sequence[Topic] = (),
) -> tuple[dict[str, tuple[str, ...]], topic_match.TopicProposal | None, list[BuildNote]]:
    refs = local_refs("T", [*labels, *others])  # one ref series over both lists: either may be admitted
    offered = list(refs.items())
    payload = topic_match.MatchInput(
        conversation_id=conversation_id,
        scene_ref=f"#{scene.seq} {scene.scene_id}",
        scene=view,
        topics=[topic_match.TopicLabel(ref=r, title=t.title, keywords=list(t.keywords)) for r, t in offered[: len(labels)]],
        may_open_new=may_open_new,
        already_admitted=list(already_admitted) or None,
        other_topics=[topic_match.TopicTitle(ref=r, title=t.title) for r, t in offered[len(labels) :]] or None,
    )

    input_ref = topic_match.build(payload).input_ref

    def check(
        answer: topic_match.MatchResponse,
    ) -> tuple[dict[str, tuple[str, ...]], topic_match.TopicProposal | None, list[BuildNote]]:
        notes = StageLog(isolate=False)  # this answer's own: a rejected answer leaves no note
        admitted: dict[str, tuple[str, ...]] = {}
        for admission in answer.admitted:
            ref = clean(admission.ref)
            if ref not in refs:
                raise Rejected(f"topic ref {ref!r} is not among the listed topics {list(refs)}.")
            topic = refs[ref]
            new = clip(unique_phrases(admission.new_keywords), topic_match.MAX_NEW_KEYWORDS, notes,
                       topic_match.OPERATION, input_ref, f"new keywords for {ref}")
            admitted[topic.topic_id] = admitted.get(topic.topic_id, ()) + tuple(new)
        return admitted, answer.new_topic, notes.notes

    return ask_checked(chat, topic_match.build, payload, check, reasks=reasks)


def _usable(title: str, keywords: Iterable[str], max_keywords: int) -> topic_create.TopicDraft | None:
    """The draft with cleaned title and keywords, or ``None`` when it is too thin to found a topic."""
    kept = unique_phrases(keywords, limit=max_keywords)
    if not clean(title) or len(kept) < topic_create.MIN_KEYWORDS:
        return None
    return topic_create.TopicDraft(title=clean(title), keywords=list(kept))


def _create(
    conversation_id: str,
    scene: Scene,
    view: topic_create.SceneView,
    chat: ChatModel,
    max_keywords: int,
    reasks: int,
) -> topic_create.TopicDraft:
    payload = topic_create.CreateInput(
        conversation_id=conversation_id, scene_ref=f"#{scene.seq} {scene.scene_id}", scene=view
    )

    def check(answer: topic_create.TopicDraft) -> topic_create.TopicDraft:
        draft = _usable(answer.title, answer.keywords, max_keywords)
        if draft is None:
            raise Rejected(
                f"a topic needs a title and at least {topic_create.MIN_KEYWORDS} distinct keywords; "
                f"got {len(unique_phrases(answer.keywords))}."
            )
        return draft

    return ask_checked(chat, topic_create.build, payload, check, reasks=reasks)


def _fold(topic: Topic, scene_id: str, new_keywords: tuple[str, ...], max_keywords: int) -> Topic:
    """The topic update: same id and title, the scene appended, new keywords merged (capped)."""
    keywords = unique_phrases([*topic.keywords, *new_keywords], limit=max_keywords)
    return topic.model_copy(update={"scene_ids": (*topic.scene_ids, scene_id), "keywords": keywords})

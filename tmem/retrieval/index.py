"""The in-memory index of ONE conversation, prepared once and scored with numpy per query.

A snapshot loader fills :class:`VectorBundle` from the vector rows of a conversation
(columns ``owner_id, view, ordinal, vector``) and calls :func:`build_index` with the domain
objects; the cascade (:mod:`tmem.retrieval.cascade`) then never touches a database.

Row order is fixed at build time (topics and scenes by ``seq``, items by their first source
scene then id), and every tie in the cascade goes to the lower position, so a query over the
same memory always returns the same answer.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from datetime import datetime
from typing import Any, TypeVar

import bm25s
import numpy as np
import numpy.typing as npt

from tmem.domain import (
    HORIZON_CHANNELS,
    Item,
    ItemKind,
    ItemTime,
    ItemTriggers,
    Persona,
    Scene,
    SceneTriggers,
    Topic,
    Turn,
)
from tmem.errors import ScopeError, StoreError, TmemError
from tmem.retrieval.lexical import PrebuiltBM25, corpus_tokens, order_for_index
from tmem.retrieval.scoring import build_bm25, l2_normalise
from tmem.views.catalog import VIEWS, ViewKey, family_views, view_keys
from tmem.views.texts import window_start

F32 = npt.NDArray[np.float32]
I64 = npt.NDArray[np.int64]

MULTI_VIEWS: frozenset[ViewKey] = frozenset((v.owner, v.name) for v in VIEWS if v.several)

class IndexConsistencyError(StoreError):
    """The objects or vectors handed to :func:`build_index` contradict each other."""


class QueryVectorError(TmemError):
    """A query vector does not fit the index (wrong dimension or not finite)."""


A = TypeVar("A", bound=npt.NDArray[Any])


def _frozen(a: A) -> A:
    """Arrays of the index are shared by concurrent queries: make them read-only."""
    a.setflags(write=False)
    return a


# --------------------------------------------------------------------------- vectors


@dataclass(frozen=True, slots=True)
class ViewRows:
    """The rows of one view: ``vectors[i]`` belongs to ``owner_ids[i]`` (``ordinal[i]``-th of it)."""

    owner_ids: tuple[str, ...]
    ordinals: npt.NDArray[np.int64]
    vectors: F32


@dataclass(frozen=True, slots=True)
class VectorBundle:
    """Per-view embedding rows of one conversation, as stored in LanceDB (``tmem.store.lance``).

    Keyed by ``(owner_kind, view)`` — see :data:`VIEW_KEYS`. Every view but ``("scene", "hor")``
    holds at most one row per owner (ordinal 0); ``hor`` rows are the scene's non-empty horizon
    sentences in :data:`tmem.domain.HORIZON_CHANNELS` order, ordinal 0, 1, … A missing row is a
    missing view (NaN in the index).
    """

    dim: int
    views: Mapping[ViewKey, ViewRows] = field(default_factory=dict)

    @classmethod
    def empty(cls) -> VectorBundle:
        """No vectors at all: the index then answers lexically only."""
        return cls(dim=0, views={})

    @classmethod
    def from_columns(
        cls,
        owner_kinds: Sequence[str],
        owner_ids: Sequence[str],
        views: Sequence[str],
        ordinals: npt.ArrayLike,
        vectors: npt.ArrayLike,
    ) -> VectorBundle:
        """Group column data (one entry per vector row, as read from LanceDB) by view.

        ``vectors`` is ``(n, dim)``. Raises :class:`IndexConsistencyError` for columns of
        different lengths or an unknown ``(owner_kind, view)`` pair.
        """
        n = len(owner_ids)
        if n == 0:
            return cls.empty()
        vec = np.asarray(vectors, dtype=np.float32)
        ords = np.asarray(ordinals, dtype=np.int64).reshape(-1)
        if vec.ndim != 2 or vec.shape[0] != n or len(views) != n or len(owner_kinds) != n or ords.shape[0] != n:
            raise IndexConsistencyError(
                f"vector columns disagree: {n} owner ids, {len(owner_kinds)} owner kinds, {len(views)} views, "
                f"{ords.shape[0]} ordinals, vectors of shape {vec.shape}"
            )
        keys = np.asarray([f"{k}/{v}" for k, v in zip(owner_kinds, views, strict=True)], dtype=object)
        known = view_keys()
        unknown = set(keys.tolist()) - {f"{k}/{v}" for k, v in known}
        if unknown:
            raise IndexConsistencyError(
                f"unknown vector view(s) {sorted(unknown)}; expected one of {[f'{k}/{v}' for k, v in known]}"
            )
        owners = np.asarray(owner_ids, dtype=object)
        grouped: dict[ViewKey, ViewRows] = {}
        for key in known:
            rows = np.flatnonzero(keys == f"{key[0]}/{key[1]}")
            if rows.size:
                grouped[key] = ViewRows(tuple(owners[rows].tolist()), ords[rows], vec[rows])
        return cls(dim=int(vec.shape[1]), views=grouped)


# --------------------------------------------------------------------------- the index


@dataclass(frozen=True, slots=True, eq=False)
class TopicTable:
    ids: tuple[str, ...]
    titles: tuple[str, ...]
    vectors: F32  # (nT, dim), NaN rows when missing
    scene_indptr: I64  # CSR topic → scene positions: scenes of topic t are scene_indices[indptr[t]:indptr[t+1]]
    scene_indices: I64


@dataclass(frozen=True, slots=True, eq=False)
class SceneTable:
    ids: tuple[str, ...]
    titles: tuple[str, ...]
    summaries: tuple[str, ...]
    narratives: tuple[str, ...]
    turn_ids: tuple[tuple[str, ...], ...]
    turns: tuple[tuple[Turn, ...], ...]  # the raw turns, in scene order, for context rendering
    start_times: tuple[datetime, ...]
    end_times: tuple[datetime, ...]
    vectors: F32  # title+summary
    dlg: F32  # (nD, dim) dialogue windows
    dlg_owner: I64  # (nD,) scene position of each dialogue window
    dlg_span: I64  # (nD, 2) [first, end) turn positions of each window within its scene
    scn: F32
    hor: F32  # (nH, dim) flat horizon sentences
    hor_owner: I64  # (nH,) scene position of each horizon row
    hor_labels: tuple[str, ...]  # "channel: sentence" per horizon row (for traces)
    item_indptr: I64  # CSR scene → item positions (items citing the scene as a source)
    item_indices: I64


@dataclass(frozen=True, slots=True, eq=False)
class ItemTable:
    ids: tuple[str, ...]
    kinds: tuple[ItemKind, ...]
    contents: tuple[str, ...]
    keywords: tuple[tuple[str, ...], ...]
    event_times: tuple[datetime | None, ...]
    times: tuple[ItemTime, ...]  # the full time of each item (granularity, span end, phrase, source)
    source_scene_ids: tuple[tuple[str, ...], ...]
    vectors: F32  # content
    con: F32
    brg: F32
    joint: F32
    families: Mapping[str, F32] = field(default_factory=dict)  # view -> rows, of the declared trigger families


@dataclass(frozen=True, slots=True, eq=False)
class ConversationIndex:
    """Everything a query over one conversation needs, as arrays prepared once.

    The BM25 corpus is shared by all node types: documents ``[0, nT)`` are topics,
    ``[nT, nT+nS)`` scenes and ``[nT+nS, nT+nS+nI)`` items, so one BM25 call scores all three.
    """

    conversation_id: str
    dim: int  # 0 when the memory has no vectors (lexical-only)
    topics: TopicTable
    scenes: SceneTable
    items: ItemTable
    personas: tuple[Persona, ...]
    bm25: bm25s.BM25 | None
    scene_pos: Mapping[str, int]
    item_pos: Mapping[str, int]

    @property
    def n_topics(self) -> int:
        return len(self.topics.ids)

    @property
    def n_scenes(self) -> int:
        return len(self.scenes.ids)

    @property
    def n_items(self) -> int:
        return len(self.items.ids)

    @property
    def n_docs(self) -> int:
        return self.n_topics + self.n_scenes + self.n_items


def _single_view(bundle: VectorBundle, view: ViewKey, pos: Mapping[str, int], dim: int) -> F32:
    out = np.full((len(pos), dim), np.nan, dtype=np.float32)
    rows = bundle.views.get(view)
    if rows is None:
        return _frozen(out)
    seen: set[str] = set()
    for owner, ordinal, vec in zip(rows.owner_ids, rows.ordinals.tolist(), rows.vectors, strict=True):
        if owner not in pos:
            raise IndexConsistencyError(f"view {view!r}: vector for unknown owner {owner!r}")
        if owner in seen or ordinal != 0:
            raise IndexConsistencyError(f"view {view!r}: owner {owner!r} has more than one vector (ordinal {ordinal})")
        seen.add(owner)
        out[pos[owner]] = vec
    return _frozen(l2_normalise(out))


def _horizon_label(triggers: SceneTriggers | None, ordinal: int) -> str:
    """``"channel: sentence"`` of a hor row: the ``ordinal``-th non-empty horizon sentence in
    :data:`HORIZON_CHANNELS` order (the construction side's numbering)."""
    if triggers is None:
        return f"horizon #{ordinal}"
    filled = [(ch, triggers.horizons.get(ch, "").strip()) for ch in HORIZON_CHANNELS]
    filled = [(ch, text) for ch, text in filled if text]
    if not 0 <= ordinal < len(filled):
        return f"horizon #{ordinal}"
    channel, text = filled[ordinal]
    return f"{channel}: {text}"


def _multi_view(bundle: VectorBundle, view: ViewKey, scene_pos: Mapping[str, int], dim: int) -> tuple[F32, I64, list[int]]:
    """A view with several rows per scene (horizons, dialogue chunks): vectors, owner positions, ordinals."""
    rows = bundle.views.get(view)
    if rows is None:
        return _frozen(np.zeros((0, dim), np.float32)), _frozen(np.zeros(0, np.int64)), []
    owners: list[int] = []
    for owner in rows.owner_ids:
        if owner not in scene_pos:
            raise IndexConsistencyError(f"view {view!r}: vector for unknown scene {owner!r}")
        owners.append(scene_pos[owner])
    vec = _frozen(l2_normalise(rows.vectors))
    return vec, _frozen(np.asarray(owners, dtype=np.int64)), rows.ordinals.tolist()


def _window_spans(owners: I64, ordinals: Sequence[int], scene_sizes: Sequence[int]) -> I64:
    """``[first, end)`` turn positions of each dialogue window: from its first turn (its ordinal,
    :func:`tmem.views.texts.window_start`) to the next window's first turn of the same scene (the
    scene's end for the last one). Pieces of one cut turn share that turn's span."""
    starts = np.asarray([window_start(o) for o in ordinals], dtype=np.int64)
    spans = np.zeros((len(starts), 2), dtype=np.int64)
    for scene in np.unique(owners).tolist():
        rows = np.flatnonzero(owners == scene)
        firsts = sorted(set(starts[rows].tolist()))
        ends = {f: (firsts[k + 1] if k + 1 < len(firsts) else scene_sizes[scene]) for k, f in enumerate(firsts)}
        for r in rows.tolist():
            spans[r] = (starts[r], ends[int(starts[r])])
    return _frozen(spans)


def _horizon_rows(
    bundle: VectorBundle, scene_pos: Mapping[str, int], triggers: Mapping[str, SceneTriggers], dim: int
) -> tuple[F32, I64, tuple[str, ...]]:
    vec, owners, ordinals = _multi_view(bundle, ("scene", "hor"), scene_pos, dim)
    ids = list(scene_pos)
    labels = tuple(_horizon_label(triggers.get(ids[o]), ordinal) for o, ordinal in zip(owners.tolist(), ordinals, strict=True))
    return vec, owners, labels


def _csr(groups: Sequence[Sequence[int]]) -> tuple[I64, I64]:
    indptr = np.zeros(len(groups) + 1, dtype=np.int64)
    indptr[1:] = np.cumsum([len(g) for g in groups])
    flat = np.asarray([i for g in groups for i in g], dtype=np.int64)
    return _frozen(indptr), _frozen(flat)


def _check_scope(conversation_id: str, kind: str, owners: Sequence[str]) -> None:
    stray = sorted(set(owners) - {conversation_id})
    if stray:
        raise IndexConsistencyError(f"{kind} of conversation(s) {stray} handed to the index of {conversation_id!r}")


def build_index(
    conversation_id: str,
    scenes: Sequence[Scene],
    topics: Sequence[Topic],
    items: Sequence[Item],
    item_triggers: Sequence[ItemTriggers],
    scene_triggers: Sequence[SceneTriggers],
    personas: Sequence[Persona],
    turns: Sequence[Turn],
    vectors: VectorBundle,
    bm25: PrebuiltBM25 | None = None,
) -> ConversationIndex:
    """Assemble the query-side index of one conversation (arrays, CSR links, BM25 corpus).
    ``bm25``: the index's BM25 prebuilt at publish (:mod:`tmem.retrieval.lexical`), else built here.

    Raises :class:`IndexConsistencyError` when an object belongs to another conversation, a
    link names an unknown scene/turn, or a vector names an unknown owner or repeats one.
    """
    if not conversation_id:
        raise ScopeError("build_index needs a conversation id")
    _check_scope(conversation_id, "scenes", [s.conversation_id for s in scenes])
    _check_scope(conversation_id, "topics", [t.conversation_id for t in topics])
    _check_scope(conversation_id, "items", [it.conversation_id for it in items])
    _check_scope(conversation_id, "item triggers", [t.conversation_id for t in item_triggers])
    _check_scope(conversation_id, "scene triggers", [t.conversation_id for t in scene_triggers])
    _check_scope(conversation_id, "personas", [p.conversation_id for p in personas])
    _check_scope(conversation_id, "turns", [t.conversation_id for t in turns])

    for kind, ids in (
        ("scene", [s.scene_id for s in scenes]),
        ("topic", [t.topic_id for t in topics]),
        ("item", [it.item_id for it in items]),
    ):
        if len(set(ids)) != len(ids):
            raise IndexConsistencyError(f"duplicate {kind} ids in conversation {conversation_id!r}")
    scenes, topics, items = order_for_index(scenes, topics, items)
    scene_pos = {s.scene_id: i for i, s in enumerate(scenes)}
    for item in items:
        unknown = [sid for sid in item.source_scene_ids if sid not in scene_pos]
        if unknown:
            raise IndexConsistencyError(f"item {item.item_id!r} cites unknown scene(s) {unknown}")
    item_pos = {it.item_id: i for i, it in enumerate(items)}
    topic_pos = {t.topic_id: i for i, t in enumerate(topics)}
    for trig in item_triggers:
        if trig.item_id not in item_pos:
            raise IndexConsistencyError(f"item triggers for unknown item {trig.item_id!r}")
    scene_trig = {t.scene_id: t for t in scene_triggers}
    unknown_scenes = set(scene_trig) - set(scene_pos)
    if unknown_scenes:
        raise IndexConsistencyError(f"scene triggers for unknown scene(s) {sorted(unknown_scenes)}")

    turn_by_id = {t.turn_id: t for t in turns}
    scene_turns: list[tuple[Turn, ...]] = []
    for s in scenes:
        missing = [tid for tid in s.turn_ids if tid not in turn_by_id]
        if missing:
            raise IndexConsistencyError(f"scene {s.scene_id!r} names unknown turn(s) {missing[:5]}")
        scene_turns.append(tuple(turn_by_id[tid] for tid in s.turn_ids))

    topic_groups: list[list[int]] = []
    for t in topics:
        unknown = [sid for sid in t.scene_ids if sid not in scene_pos]
        if unknown:
            raise IndexConsistencyError(f"topic {t.topic_id!r} names unknown scene(s) {unknown}")
        topic_groups.append(sorted({scene_pos[sid] for sid in t.scene_ids}))
    scene_groups: list[list[int]] = [[] for _ in scenes]
    for i, it in enumerate(items):
        for sid in dict.fromkeys(it.source_scene_ids):
            scene_groups[scene_pos[sid]].append(i)

    dim = vectors.dim
    topic_indptr, topic_indices = _csr(topic_groups)
    item_indptr, item_indices = _csr(scene_groups)
    hor, hor_owner, hor_labels = _horizon_rows(vectors, scene_pos, scene_trig, dim)
    dlg, dlg_owner, dlg_ordinals = _multi_view(vectors, ("scene", "dlg"), scene_pos, dim)
    dlg_span = _window_spans(dlg_owner, dlg_ordinals, [len(s.turn_ids) for s in scenes])
    return ConversationIndex(
        conversation_id=conversation_id,
        dim=dim,
        topics=TopicTable(
            ids=tuple(t.topic_id for t in topics),
            titles=tuple(t.title for t in topics),
            vectors=_single_view(vectors, ("topic", "summary"), topic_pos, dim),
            scene_indptr=topic_indptr,
            scene_indices=topic_indices,
        ),
        scenes=SceneTable(
            ids=tuple(s.scene_id for s in scenes),
            titles=tuple(s.title for s in scenes),
            summaries=tuple(s.summary for s in scenes),
            narratives=tuple(s.narrative for s in scenes),
            turn_ids=tuple(s.turn_ids for s in scenes),
            turns=tuple(scene_turns),
            start_times=tuple(s.start_time for s in scenes),
            end_times=tuple(s.end_time for s in scenes),
            vectors=_single_view(vectors, ("scene", "summary"), scene_pos, dim),
            dlg=dlg,
            dlg_owner=dlg_owner,
            dlg_span=dlg_span,
            scn=_single_view(vectors, ("scene", "scn"), scene_pos, dim),
            hor=hor,
            hor_owner=hor_owner,
            hor_labels=hor_labels,
            item_indptr=item_indptr,
            item_indices=item_indices,
        ),
        items=ItemTable(
            ids=tuple(it.item_id for it in items),
            kinds=tuple(it.kind for it in items),
            contents=tuple(it.content for it in items),
            keywords=tuple(it.keywords for it in items),
            event_times=tuple(it.event_time for it in items),
            times=tuple(it.time for it in items),
            source_scene_ids=tuple(it.source_scene_ids for it in items),
            vectors=_single_view(vectors, ("item", "content"), item_pos, dim),
            con=_single_view(vectors, ("item", "con"), item_pos, dim),
            brg=_single_view(vectors, ("item", "brg"), item_pos, dim),
            joint=_single_view(vectors, ("item", "joint"), item_pos, dim),
            families={view: _single_view(vectors, ("item", view), item_pos, dim) for view in family_views()},
        ),
        personas=tuple(sorted(personas, key=lambda p: p.speaker)),
        bm25=bm25.retriever if bm25 is not None else build_bm25(corpus_tokens(topics, scenes, items)),
        scene_pos=scene_pos,
        item_pos=item_pos,
    )

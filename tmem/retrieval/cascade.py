"""The read-time retrieval cascade (DESIGN.md §4; paper §3.4, Algorithms 1-2).

``search`` scores one conversation's :class:`~tmem.retrieval.index.ConversationIndex` with numpy
only: (1) topic prefilter → P_S; (2) SceneCue → A_S (ungated); (3) scene selection over
C2 = P_S ∪ A_S; (4) TrigRecall → A_I (ungated); (5) item selection over C3 = items of the
selected scenes ∪ A_I; (6) personas.

Without a query vector (``query_vector=None``) the dense, SceneCue and TrigRecall channels are
skipped and only BM25 runs ("lexical" mode). A document absent from every rank list of a stage
is never selected, so in lexical mode only lexically matching topics, scenes and items return.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from datetime import datetime
from typing import Literal

import numpy as np
import numpy.typing as npt

from tmem.domain import ItemKind, ItemTime, Persona, Turn
from tmem.errors import ScopeError
from tmem.retrieval.config import RetrievalConfig
from tmem.retrieval.index import ConversationIndex, QueryVectorError
from tmem.retrieval.scoring import (
    bm25_scores,
    cosine_scores,
    nan_max,
    rank_positions,
    ranks_from_order,
    robust_z,
    segment_max,
    segment_mean,
    select,
    tokenize,
    top_k,
)
from tmem.retrieval.trace import Channel, StageTrace, Trace, attribute, stage_trace
from tmem.views.catalog import ITEM_TRIGGER_VIEWS

F32 = npt.NDArray[np.float32]
F64 = npt.NDArray[np.float64]
I64 = npt.NDArray[np.int64]
Mask = npt.NDArray[np.bool_]
_EMPTY = np.zeros(0, dtype=np.int64)
_ITEM_CHANNELS: tuple[Channel, ...] = ("lexical", "dense", "entity_bridge")


@dataclass(frozen=True, slots=True)
class ScoredScene:
    """A returned scene. ``windows``: its dialogue windows as ``[first, end)`` positions into
    ``turns``, best matching the query first (the context hands over the best ones when the
    whole scene does not fit); empty when the index has no windows (the whole scene is one)."""

    scene_id: str
    title: str
    turns: tuple[Turn, ...]
    start_time: datetime
    end_time: datetime
    score: float
    channels: tuple[Channel, ...]
    windows: tuple[tuple[int, int], ...] = ()
    reserved: bool = False  # held by the 'reserved' fusion rule: kept first when a budget trims


@dataclass(frozen=True, slots=True)
class ScoredItem:
    item_id: str
    kind: ItemKind
    content: str
    event_time: datetime | None
    source_scene_ids: tuple[str, ...]
    score: float
    channels: tuple[Channel, ...]
    time: ItemTime | None = None  # the full time (granularity, span end, phrase, source); None: a plain day
    reserved: bool = False  # held by the 'reserved' fusion rule: kept first when a budget trims


@dataclass(frozen=True, slots=True)
class SearchResult:
    """Scenes and items best first, then the ambient personas; ``trace`` when requested."""

    conversation_id: str
    query: str
    mode: Literal["hybrid", "lexical"]
    scenes: tuple[ScoredScene, ...]
    items: tuple[ScoredItem, ...]
    personas: tuple[Persona, ...]
    trace: Trace | None = None


@dataclass(slots=True)
class _Query:
    index: ConversationIndex
    config: RetrievalConfig
    query_text: str
    q: F32 | None
    bm25_topics: F32
    bm25_scenes: F32
    bm25_items: F32
    stages: list[StageTrace] | None  # None: no trace requested
    scene_cue: dict[str, F32] = field(default_factory=dict)  # SceneCue view scores over all scenes
    window_sims: F32 | None = None  # cos(q, dlg window) of every window, once computed


@dataclass(frozen=True, slots=True)
class _Selection:
    chosen: I64
    scores: F64
    channels: dict[int, tuple[Channel, ...]]
    reserved: frozenset[int] = frozenset()


def _query_vector(index: ConversationIndex, query_vector: npt.ArrayLike | None) -> F32 | None:
    if query_vector is None or index.dim == 0:
        return None
    q = np.asarray(query_vector, dtype=np.float32).reshape(-1)
    if q.shape[0] != index.dim:
        raise QueryVectorError(
            f"query vector has dimension {q.shape[0]}, the index of {index.conversation_id!r} has {index.dim}"
        )
    norm = float(np.linalg.norm(q))
    if not np.isfinite(norm) or norm == 0.0:
        raise QueryVectorError(f"query vector for {index.conversation_id!r} is zero or not finite")
    return q / np.float32(norm)


def _lists(*pairs: tuple[str, F64 | None]) -> dict[str, F64]:
    return {name: r for name, r in pairs if r is not None}


def _topic_prefilter(c: _Query) -> Mask:
    """Stage 1: RRF of BM25 and dense over topics → top kT → their scenes P_S."""
    idx, cfg = c.index, c.config
    if not cfg.topic_filter:
        return np.ones(idx.n_scenes, dtype=bool)
    dense = cosine_scores(idx.topics.vectors, c.q) if c.q is not None else None
    lists = _lists(
        ("lexical", rank_positions(c.bm25_topics, positive_only=True)),
        ("dense", rank_positions(dense) if dense is not None else None),
    )
    chosen, fused = select(np.vstack(list(lists.values())), cfg.k_topics, "rrf", cfg.k0)
    members = [idx.topics.scene_indices[idx.topics.scene_indptr[t] : idx.topics.scene_indptr[t + 1]] for t in chosen]
    pool = np.zeros(idx.n_scenes, dtype=bool)
    if members:
        pool[np.concatenate(members)] = True
    if c.stages is not None:
        scores = {"lexical": c.bm25_topics} | ({"dense": dense} if dense is not None else {})
        c.stages.append(stage_trace("topic_prefilter", idx.topics.ids, lists, scores, fused, chosen, "rrf"))
    return pool


def _best_horizon(idx: ConversationIndex, sims: F32, scene: int) -> str:
    rows = np.flatnonzero(idx.scenes.hor_owner == scene)
    rows = rows[np.isfinite(sims[rows])]
    return idx.scenes.hor_labels[int(rows[np.argmax(sims[rows])])] if rows.size else ""


def _window_sims(c: _Query) -> F32:
    if c.window_sims is None:
        assert c.q is not None
        c.window_sims = cosine_scores(c.index.scenes.dlg, c.q)
    return c.window_sims


def _dialogue_scores(c: _Query) -> F32:
    sims, owners, n = _window_sims(c), c.index.scenes.dlg_owner, c.index.n_scenes
    pool = c.config.dialogue_pool
    if pool == "mean":
        return segment_mean(sims, owners, n)
    if pool == "max_mean":
        return np.asarray((segment_max(sims, owners, n) + segment_mean(sims, owners, n)) / 2, dtype=np.float32)
    return segment_max(sims, owners, n)


def _scene_windows(c: _Query, scene: int) -> tuple[tuple[int, int], ...]:
    """The scene's dialogue windows best first: by cosine to the query (hybrid), else by how many
    query tokens their turns hold (lexical); ties in scene order."""
    sc = c.index.scenes
    rows = np.flatnonzero(sc.dlg_owner == scene)
    if rows.size == 0:
        return ()
    spans = [(int(sc.dlg_span[r, 0]), int(sc.dlg_span[r, 1])) for r in rows.tolist()]
    if c.q is not None:
        sims = _window_sims(c)[rows]
        keys = [-(float(v) if np.isfinite(v) else -2.0) for v in sims]
    else:
        wanted = set(tokenize(c.query_text))
        turns = sc.turns[scene]
        keys = [-len(wanted & {t for turn in turns[a:b] for t in tokenize(turn.text)}) for a, b in spans]
    order = sorted(range(len(spans)), key=lambda k: (keys[k], spans[k]))
    return tuple(dict.fromkeys(spans[k] for k in order))  # pieces of one cut turn share a span


def _scene_cue(c: _Query) -> tuple[I64, dict[Channel, F64]]:
    """Stage 2: RRF of cos(q, dlg), cos(q, scn), max cos(q, hor) over ALL scenes → top k_cue = A_S."""
    idx, cfg, q = c.index, c.config, c.q
    if q is None or cfg.k_cue == 0:
        return _EMPTY, {}
    views: dict[Channel, F32] = {"dialogue": _dialogue_scores(c)}
    if cfg.scene_trigger:
        views["scene_trigger"] = cosine_scores(idx.scenes.scn, q)
    hor_sims = cosine_scores(idx.scenes.hor, q) if cfg.horizon_trigger else None
    if hor_sims is not None:
        views["horizon"] = segment_max(hor_sims, idx.scenes.hor_owner, idx.n_scenes)
    ranks: dict[Channel, F64] = {ch: rank_positions(s) for ch, s in views.items()}
    chosen, fused = select(np.vstack(list(ranks.values())), cfg.k_cue, cfg.cue_fusion, cfg.k0)
    if c.stages is not None:
        details = {i: _best_horizon(idx, hor_sims, i) for i in chosen.tolist()} if hor_sims is not None else {}
        channels = {i: _cue_channels(ranks, i, cfg.k_cue) for i in chosen.tolist()}
        c.stages.append(
            stage_trace(
                "scene_cue",
                idx.scenes.ids,
                {str(ch): r for ch, r in ranks.items()},
                {str(ch): v for ch, v in views.items()},
                fused,
                chosen,
                cfg.cue_fusion,
                channels=channels,
                details=details,
            )
        )
    return chosen, ranks


def _cue_channels(ranks: dict[Channel, F64], i: int, limit: int) -> tuple[Channel, ...]:
    return attribute({ch: (float(r[i]), limit) for ch, r in ranks.items()})


def _select_scenes(c: _Query, prefilter: Mask, cue: I64, cue_ranks: dict[Channel, F64]) -> _Selection:
    """Stage 3: over C2 = P_S ∪ A_S, fuse BM25, dense (restricted to C2) and SceneCue → top kS."""
    idx, cfg = c.index, c.config
    n = idx.n_scenes
    pool = prefilter.copy()
    pool[cue] = True
    dense = cosine_scores(idx.scenes.vectors, c.q) if c.q is not None else None
    lists = _lists(
        ("lexical", rank_positions(c.bm25_scenes, pool, positive_only=True)),
        ("dense", rank_positions(dense, pool) if dense is not None else None),
        ("scene_cue", ranks_from_order(cue, n) if cue.size else None),
    )
    if cfg.cue_lists == "views" and cue.size:  # each SceneCue view a list of its own, over A_S
        in_cue_mask = np.zeros(n, dtype=bool)
        in_cue_mask[cue] = True
        del lists["scene_cue"]
        for ch, r in cue_ranks.items():
            lists[f"cue_{ch}"] = rank_positions(-r, in_cue_mask)
    assoc_row = list(lists).index("scene_cue") if "scene_cue" in lists else None
    chosen, fused = select(
        np.vstack(list(lists.values())),
        cfg.k_scenes,
        cfg.scene_fusion,
        cfg.k0,
        associative_row=assoc_row,
        reserve=cfg.reserved_scene_slots,
    )
    in_cue = set(cue.tolist())
    held = _held(cfg.scene_fusion, lists.get("scene_cue"), cfg.reserved_scene_slots, cfg.k_scenes, chosen)
    channels: dict[int, tuple[Channel, ...]] = {}
    for i in chosen.tolist():
        reach: dict[Channel, tuple[float, int]] = {
            ch: (float(lists[ch][i]), cfg.k_scenes) for ch in ("lexical", "dense") if ch in lists
        }
        if i in in_cue:
            reach.update({ch: (float(r[i]), cfg.k_cue) for ch, r in cue_ranks.items()})
        channels[i] = attribute(reach)
    if c.stages is not None:
        pools = {i: ("prefilter",) * bool(prefilter[i]) + ("scene_cue",) * (i in in_cue) for i in range(n)}
        scores = {"lexical": c.bm25_scenes} | ({"dense": dense} if dense is not None else {})
        c.stages.append(
            stage_trace(
                "scene_selection",
                idx.scenes.ids,
                lists,
                scores,
                fused,
                chosen,
                cfg.scene_fusion,
                pool=pool,
                channels=channels,
                pools=pools,
            )
        )
    return _Selection(chosen, fused, channels, held)


def _held(rule: str, assoc: F64 | None, reserve: int, k: int, chosen: I64) -> frozenset[int]:
    """Under 'reserved': the chosen documents held by their rank in the associative list."""
    if rule != "reserved" or assoc is None or reserve <= 0:
        return frozenset()
    held = top_k(-assoc, min(reserve, k), eligible=np.isfinite(assoc))
    return frozenset(set(held.tolist()) & set(chosen.tolist()))


def _trig_recall(c: _Query) -> I64:
    """Stage 4: per item NaN-aware max cos over con/brg/joint (and declared families' views); keep ≥ τ, at most R by score → A_I."""
    idx, cfg, q = c.index, c.config, c.q
    if q is None or not cfg.item_triggers or cfg.trigger_cap == 0:
        return _EMPTY
    views = {v: cosine_scores(getattr(idx.items, v), q) for v in ITEM_TRIGGER_VIEWS}
    views |= {v: cosine_scores(rows, q) for v, rows in idx.items.families.items()}  # declared trigger families
    best = nan_max(*views.values())
    passed = np.zeros(idx.n_items, dtype=bool)
    threshold: float | None
    if cfg.trigger_gate_rule == "robust_z":
        z, median, sigma = robust_z(best)
        np.greater_equal(z, cfg.trigger_gate_z, out=passed, where=~np.isnan(z))
        threshold = median + cfg.trigger_gate_z * sigma if np.isfinite(median) else None
        gate = (f"gate z≥{cfg.trigger_gate_z:g} (median {median:.3f}, σ {sigma:.3f} → cosine ≥ {threshold:.3f})"
                if threshold is not None else f"gate z≥{cfg.trigger_gate_z:g} (too few items to standardise: none pass)")
    else:
        np.greater_equal(best, cfg.trigger_gate, out=passed, where=~np.isnan(best))
        threshold = cfg.trigger_gate
        gate = f"gate τ={cfg.trigger_gate}"
    chosen = top_k(best, cfg.trigger_cap, eligible=passed)
    if c.stages is not None:
        shown = top_k(best, 2 * cfg.trigger_cap)  # the recalled items and the nearest misses
        stacked = np.vstack(list(views.values()))
        details = {
            i: list(views)[int(np.nanargmax(stacked[:, i]))] for i in shown.tolist() if np.isfinite(best[i])
        }
        c.stages.append(
            stage_trace(
                "trig_recall",
                idx.items.ids,
                {"entity_bridge": rank_positions(best, passed)},
                views | {"max": best},
                best.astype(np.float64),
                chosen,
                "nanmax",
                candidates=shown,
                details=details,
                note=f"{gate}, cap R={cfg.trigger_cap}",
                threshold=threshold,
            )
        )
    return chosen


def _select_items(c: _Query, scenes: I64 | None, trig: I64) -> _Selection:
    """Stage 5: over C3 = items of the selected scenes ∪ A_I (all items when the scene layer is
    off), fuse BM25, dense (restricted to C3) and the TrigRecall ranking → top kI."""
    idx, cfg = c.index, c.config
    n = idx.n_items
    if scenes is None:
        pool = np.ones(n, dtype=bool)
    else:
        pool = np.zeros(n, dtype=bool)
        ptr, members = idx.scenes.item_indptr, idx.scenes.item_indices
        for s in scenes.tolist():
            pool[members[ptr[s] : ptr[s + 1]]] = True
    scene_bound = pool.copy()
    pool[trig] = True
    dense = cosine_scores(idx.items.vectors, c.q) if c.q is not None else None
    lists = _lists(
        ("lexical", rank_positions(c.bm25_items, pool, positive_only=True)),
        ("dense", rank_positions(dense, pool) if dense is not None else None),
        ("entity_bridge", ranks_from_order(trig, n) if trig.size else None),
    )
    assoc_row = list(lists).index("entity_bridge") if "entity_bridge" in lists else None
    wide = cfg.k_items if cfg.item_dedupe_cosine is None else min(n, 3 * cfg.k_items)
    ranked, fused = select(
        np.vstack(list(lists.values())),
        wide,
        cfg.item_fusion,
        cfg.k0,
        associative_row=assoc_row,
        reserve=cfg.reserved_item_slots,
    )
    chosen, twins = _without_near_duplicates(c, ranked, cfg.k_items)
    held = _held(cfg.item_fusion, lists.get("entity_bridge"), cfg.reserved_item_slots, cfg.k_items, chosen)
    channels: dict[int, tuple[Channel, ...]] = {}
    for i in chosen.tolist():
        # every TrigRecall hit was reached by its triggers; lexical/dense reach within kI
        limits = {"lexical": cfg.k_items, "dense": cfg.k_items, "entity_bridge": n}
        channels[i] = attribute({ch: (float(lists[ch][i]), limits[ch]) for ch in _ITEM_CHANNELS if ch in lists})
    if c.stages is not None:
        in_trig = set(trig.tolist())
        pools = {
            i: ("selected_scene",) * bool(scene_bound[i]) + ("trigger",) * (i in in_trig)
            for i in np.flatnonzero(pool).tolist()
        }
        scores = {"lexical": c.bm25_items} | ({"dense": dense} if dense is not None else {})
        c.stages.append(
            stage_trace(
                "item_selection",
                idx.items.ids,
                lists,
                scores,
                fused,
                chosen,
                cfg.item_fusion,
                pool=pool,
                channels=channels,
                pools=pools,
                details={i: f"near-duplicate of {idx.items.ids[j]}" for i, j in twins.items()},
            )
        )
    return _Selection(chosen, fused, channels, held)


def _without_near_duplicates(c: _Query, ranked: I64, k: int) -> tuple[I64, dict[int, int]]:
    """The first ``k`` of ``ranked`` that are no near-duplicate of a better-ranked kept item, and the
    dropped ones → the item each duplicates. Cosine of content vectors ≥ ``item_dedupe_cosine``; an
    item without a vector (or lexical mode) is compared by token sets (Jaccard ≥ the same threshold)."""
    threshold = c.config.item_dedupe_cosine
    if threshold is None:
        return ranked[:k], {}
    vectors, contents = c.index.items.vectors, c.index.items.contents
    kept: list[int] = []
    twins: dict[int, int] = {}
    tokens: dict[int, set[str]] = {}
    for i in ranked.tolist():
        if len(kept) == k:
            break
        twin = None
        if kept and c.q is not None and np.isfinite(vectors[i]).all():
            sims = vectors[kept] @ vectors[i]
            best = int(np.nanargmax(sims)) if np.isfinite(sims).any() else -1
            twin = kept[best] if best >= 0 and sims[best] >= threshold else None
        elif kept:
            mine = tokens.setdefault(i, set(tokenize(contents[i])))
            for j in kept:
                other = tokens.setdefault(j, set(tokenize(contents[j])))
                if mine and other and len(mine & other) / len(mine | other) >= threshold:
                    twin = j
                    break
        if twin is None:
            kept.append(i)
        else:
            twins[i] = twin
    return np.asarray(kept, dtype=np.int64), twins


def select_personas(index: ConversationIndex, speaker: str | None) -> tuple[tuple[Persona, ...], bool]:
    """The speaker's persona (case-insensitive match) or, when no speaker is given or none matches,
    every speaker's; the flag tells whether the speaker matched."""
    if speaker is not None:
        wanted = speaker.strip().casefold()
        match = tuple(p for p in index.personas if p.speaker.strip().casefold() == wanted)
        if match:
            return match, True
    return index.personas, False


def search(
    index: ConversationIndex,
    query_text: str,
    query_vector: npt.ArrayLike | None,
    config: RetrievalConfig,
    speaker: str | None = None,
    trace: bool = False,
) -> SearchResult:
    """Run the cascade over one conversation's memory and return scenes, items and personas.

    ``query_vector`` is the query's embedding in the index's space (normalised here); ``None``
    runs lexical-only. Raises :class:`~tmem.errors.ScopeError` for an index without conversation
    id and :class:`~tmem.retrieval.index.QueryVectorError` for a vector of the wrong dimension.
    """
    if not index.conversation_id:
        raise ScopeError("search needs a conversation-scoped index")
    q = _query_vector(index, query_vector)
    tokens = tokenize(query_text)
    bm25 = bm25_scores(index.bm25, index.n_docs, tokens)
    n_t, n_s = index.n_topics, index.n_scenes
    c = _Query(
        index=index,
        config=config,
        query_text=query_text,
        q=q,
        bm25_topics=bm25[:n_t],
        bm25_scenes=bm25[n_t : n_t + n_s],
        bm25_items=bm25[n_t + n_s :],
        stages=[] if trace else None,
    )
    scenes = _Selection(_EMPTY, np.zeros(0), {})
    if config.scene_layer:
        prefilter = _topic_prefilter(c)
        cue, cue_ranks = _scene_cue(c)
        scenes = _select_scenes(c, prefilter, cue, cue_ranks)
    items = _Selection(_EMPTY, np.zeros(0), {})
    if config.item_channel:
        trig = _trig_recall(c)
        items = _select_items(c, scenes.chosen if config.scene_layer else None, trig)
    personas, matched = select_personas(index, speaker) if config.persona else ((), False)

    sc, it = index.scenes, index.items
    mode: Literal["hybrid", "lexical"] = "lexical" if q is None else "hybrid"
    return SearchResult(
        conversation_id=index.conversation_id,
        query=query_text,
        mode=mode,
        scenes=tuple(
            ScoredScene(
                scene_id=sc.ids[i],
                title=sc.titles[i],
                turns=sc.turns[i],
                start_time=sc.start_times[i],
                end_time=sc.end_times[i],
                score=float(scenes.scores[i]),
                channels=scenes.channels[i],
                windows=_scene_windows(c, i),
                reserved=i in scenes.reserved,
            )
            for i in scenes.chosen.tolist()
        ),
        items=tuple(
            ScoredItem(
                item_id=it.ids[i],
                kind=it.kinds[i],
                content=it.contents[i],
                event_time=it.event_times[i],
                source_scene_ids=it.source_scene_ids[i],
                score=float(items.scores[i]),
                channels=items.channels[i],
                time=it.times[i],
                reserved=i in items.reserved,
            )
            for i in items.chosen.tolist()
        ),
        personas=personas,
        trace=Trace(
            config=config.name,
            mode=mode,
            query_tokens=tuple(tokens),
            stages=tuple(c.stages),
            persona_speaker=speaker,
            persona_matched=matched,
        )
        if c.stages is not None
        else None,
    )

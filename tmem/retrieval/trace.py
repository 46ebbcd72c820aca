"""Why a memory was recalled: per-stage traces of the cascade and channel attribution.

Channel names (what reached a returned scene or item):

* ``lexical`` — BM25 over the weighted fields; ``dense`` — cosine to the node's own vector;
* ``dialogue``, ``scene_trigger``, ``horizon`` — the three SceneCue views (dlg, scn, hor);
* ``entity_bridge`` — TrigRecall over the item's entity/bridge/joint trigger views.

A channel *reached* a hit when the hit ranks within that channel's budget (kS/kI for the
descriptive lists of a selection stage, k_cue for the SceneCue views); a hit that no channel
reached on its own (it got in through fusion) is attributed to its best-ranked channel.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Literal

import numpy as np
import numpy.typing as npt

Channel = Literal["lexical", "dense", "dialogue", "scene_trigger", "horizon", "entity_bridge"]
StageName = Literal["topic_prefilter", "scene_cue", "scene_selection", "trig_recall", "item_selection"]

F32 = npt.NDArray[np.float32]
F64 = npt.NDArray[np.float64]
I64 = npt.NDArray[np.int64]


@dataclass(frozen=True, slots=True)
class CandidateTrace:
    """One candidate of a stage: its rank in each list (present lists only), its raw channel
    scores (BM25 / cosine), its fused score, and whether the stage kept it."""

    id: str
    ranks: Mapping[str, int]
    scores: Mapping[str, float]
    fused: float
    selected: bool
    channels: tuple[Channel, ...] = ()
    pools: tuple[str, ...] = ()  # how it entered the candidate pool (e.g. "prefilter", "scene_cue")
    detail: str = ""  # e.g. the best-matching horizon sentence or trigger view


@dataclass(frozen=True, slots=True)
class StageTrace:
    stage: StageName
    lists: tuple[str, ...]  # the rank lists fused at this stage
    fusion: str
    pool_size: int
    selected: tuple[str, ...]  # ids kept, best first
    candidates: tuple[CandidateTrace, ...]  # best fused first
    note: str = ""
    threshold: float | None = None  # TrigRecall: the cosine the gate required for this query (NaN-free)


@dataclass(frozen=True, slots=True)
class Trace:
    config: str
    mode: Literal["hybrid", "lexical"]
    query_tokens: tuple[str, ...]
    stages: tuple[StageTrace, ...]
    persona_speaker: str | None
    persona_matched: bool

    def stage(self, name: StageName) -> StageTrace | None:
        """The trace of one stage, or ``None`` when the stage did not run (switched off, no vector)."""
        return next((s for s in self.stages if s.stage == name), None)


def attribute(ranks: Mapping[Channel, tuple[float, int]]) -> tuple[Channel, ...]:
    """Channels that reached a hit: ``rank ≤ limit`` per channel (``ranks[c] = (rank, limit)``).

    When none did, the channel with the best ``rank / limit`` (finite ranks only); ``()`` when the
    hit is absent from every channel.
    """
    reached = tuple(c for c, (r, lim) in ranks.items() if r <= lim)
    if reached:
        return reached
    finite = [(r / max(lim, 1), c) for c, (r, lim) in ranks.items() if np.isfinite(r)]
    return (min(finite)[1],) if finite else ()


def stage_trace(
    stage: StageName,
    ids: Sequence[str],
    lists: Mapping[str, F64],
    scores: Mapping[str, F32],
    fused: F64,
    selected: I64,
    fusion: str,
    *,
    pool: npt.NDArray[np.bool_] | None = None,
    candidates: I64 | None = None,
    channels: Mapping[int, tuple[Channel, ...]] | None = None,
    pools: Mapping[int, tuple[str, ...]] | None = None,
    details: Mapping[int, str] | None = None,
    note: str = "",
    threshold: float | None = None,
) -> StageTrace:
    """Assemble a :class:`StageTrace` from a stage's rank lists (``inf`` = absent) and scores.

    ``candidates`` defaults to every document present in some list (within ``pool`` if given).
    """
    n = len(ids)
    if candidates is None:
        present = np.zeros(n, dtype=bool)
        for r in lists.values():
            present |= np.isfinite(r)
        if pool is not None:
            present &= pool
        candidates = np.flatnonzero(present)
    cand = np.asarray(candidates, dtype=np.int64)
    cand = cand[np.lexsort((cand, -fused[cand]))] if cand.size else cand
    chosen = set(selected.tolist())
    rows = tuple(
        CandidateTrace(
            id=ids[i],
            ranks={name: int(r[i]) for name, r in lists.items() if np.isfinite(r[i])},
            scores={name: round(float(s[i]), 6) for name, s in scores.items() if np.isfinite(s[i])},
            fused=round(float(fused[i]), 6),
            selected=i in chosen,
            channels=(channels or {}).get(i, ()),
            pools=(pools or {}).get(i, ()),
            detail=(details or {}).get(i, ""),
        )
        for i in cand.tolist()
    )
    return StageTrace(
        stage=stage,
        lists=tuple(lists),
        fusion=fusion,
        pool_size=int(pool.sum()) if pool is not None else n,
        selected=tuple(ids[i] for i in selected.tolist()),
        candidates=rows,
        note=note,
        threshold=threshold,
    )

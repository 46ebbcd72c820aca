"""Retrieval math: small pure functions over numpy arrays (DESIGN.md §3-§4, paper §3.4).

Conventions used throughout the cascade:

* A **rank list** over ``n`` documents is a float64 array of shape ``(n,)`` holding each
  document's 1-based rank, or ``inf`` when the document is absent from the list. With that
  encoding RRF needs no special case: ``1 / (k0 + inf) == 0`` ("absent contributes nothing").
* Ties are broken deterministically by document position (lower index first), everywhere.
* Missing vectors are NaN rows; a NaN similarity means "no evidence", never "score 0".
"""

from __future__ import annotations

import re
from collections.abc import Sequence
from functools import lru_cache
from typing import Literal

import bm25s
import numpy as np
import numpy.typing as npt
from bm25s.stopwords import STOPWORDS_EN_PLUS

from tmem.settings import RRF_K0

F32 = npt.NDArray[np.float32]
F64 = npt.NDArray[np.float64]
I64 = npt.NDArray[np.int64]
Bool = npt.NDArray[np.bool_]

FusionRule = Literal["rrf", "best_rank", "reserved"]
GateRule = Literal["cosine", "robust_z"]


BM25_K1 = 1.5
BM25_B = 0.75
"""Okapi BM25 parameters (bm25s defaults; Robertson & Zaragoza 2009 recommend k1∈[1.2, 2], b=0.75)."""

# --------------------------------------------------------------------------- tokenisation

_TOKEN = re.compile(r"(?u)\b\w\w+\b")  # scikit-learn / bm25s default: words of ≥ 2 characters
_STOPWORDS = frozenset(STOPWORDS_EN_PLUS)  # NLTK's English list as shipped by bm25s (179 words)


@lru_cache(maxsize=65536)
def s_stem(token: str) -> str:
    """Harman's "S" stemmer (Harman 1991, "How effective is suffixing?", JASIS 42(1)).

    Only plural endings are folded, first matching rule wins:
    ``-ies`` → ``-y`` (not ``-eies``/``-aies``); ``-es`` → ``-e`` (not ``-aes``/``-ees``/``-oes``);
    ``-s`` → ``""`` (not ``-us``/``-ss``). Tokens of ≤ 3 characters are kept as they are.
    Chosen over Porter/Snowball because no stemmer package is installed and a light stemmer is
    enough for short memory texts; it is applied identically to corpus and query.
    """
    if len(token) <= 3:
        return token
    if token.endswith("ies") and not token.endswith(("eies", "aies")):
        return token[:-3] + "y"
    if token.endswith("es") and not token.endswith(("aes", "ees", "oes")):
        return token[:-1]
    if token.endswith("s") and not token.endswith(("us", "ss")):
        return token[:-1]
    return token


def tokenize(text: str) -> list[str]:
    """Lower-case word tokens (≥ 2 word characters), English stopwords removed, S-stemmed."""
    return [s_stem(tok) for tok in _TOKEN.findall(text.lower()) if tok not in _STOPWORDS]


# --------------------------------------------------------------------------- BM25


def build_bm25(corpus_tokens: Sequence[Sequence[str]], k1: float = BM25_K1, b: float = BM25_B) -> bm25s.BM25 | None:
    """Index a tokenised corpus with bm25s (``method="lucene"``); ``None`` when it has no tokens.

    bm25s' Lucene variant scores ``Σ_{t∈q} IDF(t) · tf / (tf + k1·(1 − b + b·|d|/avgdl))`` with
    ``IDF(t) = ln(1 + (N − df + 0.5)/(df + 0.5))``: Okapi BM25 without the constant ``(k1+1)``
    numerator factor, so the ranking is Okapi's (Kamphuis et al. 2020, ECIR).
    """
    if not any(corpus_tokens):
        return None
    retriever = bm25s.BM25(k1=k1, b=b, method="lucene")
    retriever.index([list(doc) for doc in corpus_tokens], show_progress=False)
    return retriever


def bm25_scores(retriever: bm25s.BM25 | None, n_docs: int, query_tokens: Sequence[str]) -> F32:
    """BM25 score of every document (shape ``(n_docs,)``; 0 when no query term matches).

    Repeated query terms count once (the query is treated as a set of terms).
    """
    if retriever is None or not query_tokens:
        return np.zeros(n_docs, dtype=np.float32)
    ids = retriever.get_tokens_ids(list(dict.fromkeys(query_tokens)))
    if not ids:
        return np.zeros(n_docs, dtype=np.float32)
    return np.asarray(retriever.get_scores_from_ids(ids), dtype=np.float32)


# --------------------------------------------------------------------------- dense


def l2_normalise(matrix: npt.ArrayLike) -> F32:
    """Rows scaled to unit L2 norm, ``x / ‖x‖₂``; zero or non-finite rows become NaN (missing)."""
    m = np.array(matrix, dtype=np.float32, ndmin=2)
    with np.errstate(invalid="ignore", divide="ignore"):
        norms = np.linalg.norm(m, axis=1, keepdims=True)
        out = m / norms
    bad = ~np.isfinite(norms[:, 0]) | (norms[:, 0] == 0)
    out[bad] = np.nan
    return out


def cosine_scores(matrix: F32, query: F32) -> F32:
    """``cos(q, x_i) = x_i · q`` for L2-normalised rows ``x_i`` and query ``q``; NaN rows stay NaN."""
    if matrix.shape[0] == 0:
        return np.zeros(0, dtype=np.float32)
    return np.asarray(matrix @ query, dtype=np.float32)


def nan_max(*scores: F32) -> F32:
    """Element-wise NaN-aware max over views: ``max_v s_v`` ignoring NaN; all-NaN → NaN.

    This is the item trigger score of Algorithm 2 (lines 16-17): ``nanmax(cos_con, cos_brg, cos_joint)``.
    Uses ``np.fmax`` so an all-NaN column yields NaN without a RuntimeWarning.
    """
    if not scores:
        raise ValueError("nan_max needs at least one score array")
    out = np.asarray(scores[0], dtype=np.float32)
    for s in scores[1:]:
        out = np.fmax(out, s)
    return out


def segment_max(values: F32, owners: I64, n_owners: int) -> F32:
    """Per-owner max of ``values`` (``out[o] = max_{i: owners[i]=o} values[i]``); owners without
    rows (or only NaN rows) get NaN. Algorithm 2 line 8: ``max_s cos(q, e_hor_s)``."""
    out = np.full(n_owners, np.nan, dtype=np.float32)
    if values.size:
        np.fmax.at(out, owners, values)
    return out


def segment_mean(values: F32, owners: I64, n_owners: int) -> F32:
    """Per-owner mean of the finite ``values``; owners without finite rows get NaN."""
    total = np.zeros(n_owners, dtype=np.float64)
    count = np.zeros(n_owners, dtype=np.float64)
    ok = np.isfinite(values)
    np.add.at(total, owners[ok], values[ok])
    np.add.at(count, owners[ok], 1.0)
    with np.errstate(invalid="ignore", divide="ignore"):
        out = total / count
    out[count == 0] = np.nan
    return out.astype(np.float32)


MAD_TO_SIGMA = 1.4826
"""``σ ≈ 1.4826 · MAD`` for normally distributed scores (Rousseeuw & Croux 1993, "Alternatives to the
median absolute deviation", JASA 88)."""
MIN_GATE_SAMPLE = 8  # fewer scored items than this: too few to estimate a distribution
MIN_GATE_SPREAD = 1e-3  # floor of the robust σ (identical scores would divide by zero)


def robust_z(scores: F32) -> tuple[F32, float, float]:
    """Robust standard scores ``z_i = (s_i − median(s)) / (1.4826 · MAD(s))`` over the finite scores.

    Returns ``(z, median, sigma)``; NaN scores stay NaN. With fewer than :data:`MIN_GATE_SAMPLE`
    finite scores the distribution cannot be estimated and every z is NaN (nothing passes a gate).
    Used by TrigRecall's standardised gate: for one query, most items of a conversation are
    unrelated to it, so the median and MAD of its scores describe the encoder's similarity between
    unrelated texts, and a z threshold means the same on any encoder (a raw cosine threshold does
    not: MiniLM's best associative cosines sit at .3-.5, bge-m3's unrelated ones near .4).
    """
    s = np.asarray(scores, dtype=np.float64)
    finite = s[np.isfinite(s)]
    if finite.size < MIN_GATE_SAMPLE:
        return np.full(s.shape, np.nan, dtype=np.float32), float("nan"), float("nan")
    med = float(np.median(finite))
    sigma = max(MAD_TO_SIGMA * float(np.median(np.abs(finite - med))), MIN_GATE_SPREAD)
    return np.asarray((s - med) / sigma, dtype=np.float32), med, sigma


# --------------------------------------------------------------------------- ranks and fusion


def rank_positions(scores: npt.ArrayLike, eligible: Bool | None = None, *, positive_only: bool = False) -> F64:
    """1-based ordinal rank of each document by descending score; ``inf`` = absent.

    Absent: NaN score, outside ``eligible``, or (``positive_only``) score ≤ 0 — used for BM25,
    where a zero score means no query term matched. Ties go to the lower document index.
    """
    s = np.asarray(scores, dtype=np.float64)
    ok = ~np.isnan(s)
    if eligible is not None:
        ok &= eligible
    if positive_only:
        ok &= s > 0
    idx = np.flatnonzero(ok)
    order = idx[np.argsort(-s[idx], kind="stable")]
    ranks = np.full(s.shape[0], np.inf)
    ranks[order] = np.arange(1, order.size + 1, dtype=np.float64)
    return ranks


def ranks_from_order(order: Sequence[int] | npt.NDArray[np.integer], n: int) -> F64:
    """A rank list from documents given best first: ``rank(order[j]) = j + 1``, others absent."""
    ranks = np.full(n, np.inf)
    ranks[np.asarray(order, dtype=np.int64)] = np.arange(1, len(order) + 1, dtype=np.float64)
    return ranks


def rrf(ranks: F64, k0: int = RRF_K0) -> F64:
    """Reciprocal rank fusion, ``RRF(d) = Σ_m 1/(k0 + rank_m(d))`` (paper Eq. 2; Cormack et al. 2009).

    ``ranks`` has shape ``(M, n)`` (one rank list per row); absent (``inf``) contributes 0.
    """
    r = np.atleast_2d(np.asarray(ranks, dtype=np.float64))
    return np.asarray((1.0 / (k0 + r)).sum(axis=0), dtype=np.float64)


def best_rank(ranks: F64) -> F64:
    """Best-rank fusion key, ``best(d) = min_m rank_m(d)`` (``inf`` when absent from every list)."""
    r = np.atleast_2d(np.asarray(ranks, dtype=np.float64))
    return np.asarray(r.min(axis=0), dtype=np.float64)


def top_k(primary: npt.ArrayLike, k: int, secondary: npt.ArrayLike | None = None, eligible: Bool | None = None) -> I64:
    """Indices of the ``k`` best documents: by ``primary`` desc, then ``secondary`` desc, then index asc.

    NaN primaries and documents outside ``eligible`` are never returned.
    """
    p = np.asarray(primary, dtype=np.float64)
    ok = ~np.isnan(p)
    if eligible is not None:
        ok &= eligible
    idx = np.flatnonzero(ok)
    if k <= 0 or idx.size == 0:
        return np.zeros(0, dtype=np.int64)
    sec = np.zeros(idx.size) if secondary is None else np.asarray(secondary, dtype=np.float64)[idx]
    order = np.lexsort((idx, -sec, -p[idx]))  # last key is the primary sort key
    return idx[order[:k]].astype(np.int64)


def fuse(ranks: F64, rule: FusionRule, k0: int = RRF_K0) -> tuple[F64, F64]:
    """Fused ``(score, tie_break)`` per document for a fusion rule (both: higher is better).

    * ``rrf`` / ``reserved``: score = summed RRF; no tie-break beyond the index.
    * ``best_rank``: a document keeps its best rank over the lists, scored ``1/(k0 + min_m rank_m)``
      (the RRF term of its best list); ties are broken by summed RRF (DESIGN §4 step 3).
    Documents absent from every list score 0.
    """
    summed = rrf(ranks, k0)
    if rule == "best_rank":
        return 1.0 / (k0 + best_rank(ranks)), summed
    return summed, np.zeros_like(summed)


def select(
    ranks: F64,
    k: int,
    rule: FusionRule,
    k0: int = RRF_K0,
    *,
    associative_row: int | None = None,
    reserve: int = 0,
) -> tuple[I64, F64]:
    """Fuse rank lists (shape ``(M, n)``) and pick the top ``k`` documents, best first.

    Only documents present in at least one list are eligible. With ``rule="reserved"`` the best
    ``min(reserve, k)`` documents of the associative list (row ``associative_row``, e.g. SceneCue
    or TrigRecall hits) are kept whatever their fused score; the remaining slots go to the best
    summed-RRF documents. Returns the selected indices and the fused score of every document.
    """
    m = np.atleast_2d(np.asarray(ranks, dtype=np.float64))
    score, tie = fuse(m, rule, k0)
    eligible: Bool = np.asarray(np.isfinite(m).any(axis=0), dtype=bool)
    if rule != "reserved" or associative_row is None or reserve <= 0:
        return top_k(score, k, tie, eligible), score
    assoc = m[associative_row]
    held = top_k(-assoc, min(reserve, k), eligible=np.isfinite(assoc))
    rest_ok = eligible.copy()
    rest_ok[held] = False
    rest = top_k(score, k - held.size, tie, rest_ok)
    chosen = np.concatenate([held, rest])
    order = np.lexsort((chosen, -tie[chosen], -score[chosen]))
    return chosen[order].astype(np.int64), score

"""Retrieval math: BM25 oracle, cosine, NaN-aware max, ranks, RRF / best-rank fusion, top-k."""

from __future__ import annotations

import math
import warnings

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from tmem.retrieval.scoring import (
    BM25_B,
    BM25_K1,
    best_rank,
    bm25_scores,
    build_bm25,
    cosine_scores,
    fuse,
    l2_normalise,
    nan_max,
    rank_positions,
    ranks_from_order,
    rrf,
    s_stem,
    segment_max,
    select,
    tokenize,
    top_k,
)

# ----------------------------------------------------------------------------- BM25 oracle


def okapi_bm25(corpus: list[list[str]], query: list[str], k1: float = BM25_K1, b: float = BM25_B) -> list[float]:
    """Textbook Okapi BM25 (Robertson & Zaragoza 2009) with the Lucene idf, written out longhand:
    score(d, q) = Σ_{t ∈ set(q)} ln(1 + (N − df + 0.5)/(df + 0.5)) · tf·(k1+1) / (tf + k1·(1 − b + b·|d|/avgdl))."""
    n = len(corpus)
    avgdl = sum(len(d) for d in corpus) / n
    out = []
    for doc in corpus:
        score = 0.0
        for term in set(query):
            df = sum(1 for d in corpus if term in d)
            if df == 0:
                continue
            tf = doc.count(term)
            idf = math.log(1 + (n - df + 0.5) / (df + 0.5))
            score += idf * tf * (k1 + 1) / (tf + k1 * (1 - b + b * len(doc) / avgdl))
        out.append(score)
    return out


def test_bm25_matches_hand_computed_values():
    corpus = [["cat", "sat", "mat"], ["cat", "cat", "dog"], ["dog", "bird"]]
    ours = bm25_scores(build_bm25(corpus), 3, ["cat"])
    # Worked by hand: idf = ln 1.6; avgdl = 8/3; K = 1.5·(0.25 + 0.75·3/(8/3)) = 1.640625.
    okapi = [math.log(1.6) * 2.5 / (1 + 1.640625), math.log(1.6) * 5.0 / (2 + 1.640625), 0.0]
    assert okapi[0] == pytest.approx(0.444974, abs=1e-6)
    assert okapi[1] == pytest.approx(0.645499, abs=1e-6)
    # bm25s' Lucene variant drops the constant (k1+1) factor: same ranking, scores scaled by 1/(k1+1).
    np.testing.assert_allclose(ours * (BM25_K1 + 1), okapi, rtol=1e-5)


TOY = [
    "caroline went to the lgbtq support group on monday",
    "melanie painted a sunrise over the lake with her kids",
    "caroline is researching adoption agencies for a child",
    "melanie took the kids camping in the mountains and they roasted marshmallows",
    "the support group gave caroline courage to keep going",
    "pottery class with her kids: melanie made a bowl and a cup",
]


@pytest.mark.parametrize(
    "query",
    ["caroline support group", "melanie kids", "adoption", "camping mountains marshmallows", "bowl cup pottery kids"],
)
def test_bm25_ranking_agrees_with_okapi_oracle(query):
    corpus = [tokenize(t) for t in TOY]
    q = tokenize(query)
    ours = bm25_scores(build_bm25(corpus), len(corpus), q)
    reference = okapi_bm25(corpus, q)
    np.testing.assert_allclose(ours * (BM25_K1 + 1), reference, rtol=1e-5, atol=1e-6)
    assert list(np.argsort(-ours, kind="stable")) == list(np.argsort(-np.array(reference), kind="stable"))


def test_bm25_without_matching_terms_scores_zero_and_empty_corpus_is_none():
    corpus = [tokenize(t) for t in TOY]
    assert not bm25_scores(build_bm25(corpus), 6, tokenize("quantum chromodynamics")).any()
    assert not bm25_scores(build_bm25(corpus), 6, []).any()
    assert build_bm25([[], []]) is None
    assert bm25_scores(None, 2, ["x"]).tolist() == [0.0, 0.0]


def test_repeated_query_terms_count_once():
    corpus = [tokenize(t) for t in TOY]
    bm = build_bm25(corpus)
    np.testing.assert_array_equal(bm25_scores(bm, 6, ["caroline", "caroline"]), bm25_scores(bm, 6, ["caroline"]))


def test_tokenize_drops_stopwords_and_folds_plurals():
    assert tokenize("What did the Kids paint? Sunrises and parties!") == ["kid", "paint", "sunrise", "party"]
    assert [s_stem(w) for w in ("classes", "glass", "bus", "agencies", "hikes", "was")] == [
        "classe",
        "glass",
        "bus",
        "agency",
        "hike",
        "was",
    ]


# ----------------------------------------------------------------------------- dense and NaN


def test_cosine_against_normalised_rows_and_missing_rows():
    m = l2_normalise([[3.0, 4.0], [0.0, 0.0], [0.0, 2.0]])
    assert np.isnan(m[1]).all()  # a zero vector is a missing view, not a direction
    s = cosine_scores(m, np.array([0.0, 1.0], dtype=np.float32))
    assert s[0] == pytest.approx(0.8)
    assert np.isnan(s[1])
    assert s[2] == pytest.approx(1.0)


def test_nan_max_over_views():
    nan = np.nan
    a = np.array([0.2, nan, nan, 0.9], dtype=np.float32)
    b = np.array([0.5, 0.7, nan, nan], dtype=np.float32)
    c = np.array([nan, 0.1, nan, 0.3], dtype=np.float32)
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # all-NaN columns must not warn
        out = nan_max(a, b, c)
    assert out[0] == pytest.approx(0.5)
    assert out[1] == pytest.approx(0.7)
    assert np.isnan(out[2])
    assert out[3] == pytest.approx(0.9)
    # an all-NaN item is excluded from ranking and from top-k
    assert math.isinf(rank_positions(out)[2])
    assert 2 not in top_k(out, 4).tolist()


def test_segment_max_per_owner():
    values = np.array([0.1, 0.9, np.nan, 0.4], dtype=np.float32)
    owners = np.array([0, 0, 2, 3])
    out = segment_max(values, owners, 5)
    assert out[0] == pytest.approx(0.9)
    assert np.isnan(out[1]) and np.isnan(out[2]) and np.isnan(out[4])
    assert out[3] == pytest.approx(0.4)


# ----------------------------------------------------------------------------- ranks


def test_rank_positions_are_one_based_with_index_tie_break():
    s = np.array([0.5, 0.9, 0.5, np.nan, 0.0])
    r = rank_positions(s)
    assert r.tolist()[:3] == [2.0, 1.0, 3.0]
    assert math.isinf(r[3]) and r[4] == 4.0
    positive = rank_positions(s, positive_only=True)
    assert math.isinf(positive[4])
    masked = rank_positions(s, np.array([True, False, True, True, True]))
    assert masked.tolist()[:3] == [1.0, math.inf, 2.0]


def test_top_k_deterministic_ties_and_secondary():
    p = np.array([1.0, 2.0, 2.0, 0.5, np.nan])
    assert top_k(p, 3).tolist() == [1, 2, 0]
    assert top_k(p, 3, secondary=np.array([0, 0, 1, 0, 0])).tolist() == [2, 1, 0]
    assert top_k(p, 10).tolist() == [1, 2, 0, 3]
    assert top_k(p, 2, eligible=np.array([True, False, False, True, True])).tolist() == [0, 3]
    assert top_k(p, 0).tolist() == []


def test_rrf_formula_and_absent_documents():
    ranks = np.vstack([ranks_from_order([2, 0], 4), ranks_from_order([0], 4)])
    scores = rrf(ranks, 60)
    assert scores[0] == pytest.approx(1 / 62 + 1 / 61)
    assert scores[2] == pytest.approx(1 / 61)
    assert scores[1] == 0.0 and scores[3] == 0.0  # absent from every list: nothing
    assert best_rank(ranks).tolist() == [1.0, math.inf, 1.0, math.inf]


def test_fusion_rules_differ_on_an_associative_hit():
    # docs 0, 1 lead both descriptive lists; doc 2 is first only in the associative list.
    lexical = ranks_from_order([0, 1, 3], 4)
    dense = ranks_from_order([0, 1, 3], 4)
    assoc = ranks_from_order([2], 4)
    ranks = np.vstack([lexical, dense, assoc])
    assert select(ranks, 2, "rrf")[0].tolist() == [0, 1]  # summed RRF buries the associative hit
    assert select(ranks, 2, "best_rank")[0].tolist() == [0, 2]  # rank 1 kept; tie → summed RRF
    chosen, _ = select(ranks, 2, "reserved", associative_row=2, reserve=1)
    assert sorted(chosen.tolist()) == [0, 2]
    assert select(ranks, 3, "reserved", associative_row=2, reserve=0)[0].tolist() == [0, 1, 3]
    score, tie = fuse(ranks, "best_rank")
    assert score[2] == pytest.approx(1 / 61) and tie[0] > tie[2]


def test_k0_effect_on_a_concrete_pair():
    # A: ranks (1, 10); B: ranks (5, 5). A small k0 rewards the single top rank, k0=60 consistency.
    ranks = np.array([[1.0, 5.0], [10.0, 5.0]])
    assert rrf(ranks, 1)[0] > rrf(ranks, 1)[1]
    assert rrf(ranks, 60)[0] < rrf(ranks, 60)[1]


# ----------------------------------------------------------------------------- RRF properties


@st.composite
def rank_lists(draw: st.DrawFn, max_docs: int = 12, max_lists: int = 4) -> np.ndarray:
    n = draw(st.integers(1, max_docs))
    m = draw(st.integers(1, max_lists))
    rows = []
    for _ in range(m):
        order = draw(st.permutations(range(n)))
        keep = draw(st.integers(0, n))
        rows.append(ranks_from_order(list(order)[:keep], n))
    return np.vstack(rows)


@settings(max_examples=150, deadline=None)
@given(rank_lists(), st.integers(1, 200))
def test_rrf_scores_decrease_with_rank_in_a_single_list(ranks, k0):
    row = ranks[:1]
    scores = rrf(row, k0)
    present = np.flatnonzero(np.isfinite(row[0]))
    ordered = present[np.argsort(row[0][present])]
    assert np.all(np.diff(scores[ordered]) < 0)
    assert np.all(scores[np.isinf(row[0])] == 0)


@settings(max_examples=150, deadline=None)
@given(rank_lists(), st.randoms(use_true_random=False), st.integers(1, 200))
def test_rrf_is_invariant_to_list_order(ranks, rnd, k0):
    perm = list(range(ranks.shape[0]))
    rnd.shuffle(perm)
    np.testing.assert_allclose(rrf(ranks[perm], k0), rrf(ranks, k0))
    np.testing.assert_array_equal(best_rank(ranks[perm]), best_rank(ranks))
    for rule in ("rrf", "best_rank"):
        assert select(ranks[perm], 3, rule, k0)[0].tolist() == select(ranks, 3, rule, k0)[0].tolist()


@settings(max_examples=150, deadline=None)
@given(st.integers(2, 12), st.integers(1, 4), st.data(), st.integers(1, 200))
def test_document_first_in_every_list_is_first_overall(n, m, data, k0):
    winner = data.draw(st.integers(0, n - 1))
    rows = []
    for _ in range(m):
        rest = data.draw(st.permutations([d for d in range(n) if d != winner]))
        rows.append(ranks_from_order([winner, *rest], n))
    ranks = np.vstack(rows)
    for rule in ("rrf", "best_rank", "reserved"):
        assert select(ranks, 1, rule, k0)[0].tolist() == [winner]


@settings(max_examples=100, deadline=None)
@given(st.integers(1, 500), st.integers(2, 500), st.integers(1, 200), st.integers(1, 200))
def test_larger_k0_flattens_the_rank_contribution_ratio(r, extra, k_small, k_extra):
    s = r + extra  # a worse rank
    k_large = k_small + k_extra

    def ratio(k0: int) -> float:
        return (1 / (k0 + r)) / (1 / (k0 + s))

    assert ratio(k_large) < ratio(k_small)

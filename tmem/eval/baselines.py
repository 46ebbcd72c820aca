"""Baseline retrievers over a conversation's raw history, evaluated exactly as tmem is.

* ``flat``: one unit per raw turn; BM25 over ``speaker: text`` and dense cosine (the same
  MiniLM embedder as tmem) fused by summed RRF (k0 = 60).
* ``session``: one unit per session; BM25 over the session's whole text; dense score = the best
  cosine of any of its turns. (MiniLM reads at most 256 word pieces, a LoCoMo session ~600, so a
  whole-session vector would only see its opening; the max over turns sees all of it.)

Both use tmem's retrieval math (:mod:`tmem.retrieval.scoring`): same tokenizer, BM25 variant and
RRF, so the baselines differ from tmem only in what they index. Units render as tmem renders a
scene's turns (``[8 May 2023] Speaker: text``), so token budgets compare like with like.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Literal

import numpy as np
import numpy.typing as npt

from tmem.domain import Turn
from tmem.eval.examples import QAExample
from tmem.eval.retrieval_metrics import Context, RetrievedUnit, VectorMemo, pack_budget
from tmem.retrieval.context import format_date
from tmem.retrieval.scoring import (
    RRF_K0,
    bm25_scores,
    build_bm25,
    cosine_scores,
    rank_positions,
    segment_max,
    select,
    tokenize,
)

if TYPE_CHECKING:
    import bm25s

Granularity = Literal["turn", "session"]
BASELINES: tuple[str, ...] = ("flat", "session")
TurnSource = Callable[[str], Sequence[Turn]]


def turn_line(turn: Turn) -> str:
    """A turn as tmem's QA context shows it (:func:`tmem.retrieval.context.render_scene`)."""
    return f"[{format_date(turn.event_time)}] {turn.speaker}: {turn.text}"


def index_text(turn: Turn) -> str:
    """What the baselines index for a turn: its speaker and text (no date)."""
    return f"{turn.speaker}: {turn.text}"


def turn_units(turns: Sequence[Turn]) -> list[RetrievedUnit]:
    return [RetrievedUnit("turn", t.turn_id, (t.turn_id,), turn_line(t)) for t in turns]


def session_units(turns: Sequence[Turn]) -> tuple[list[RetrievedUnit], list[list[int]]]:
    """One unit per session (in conversation order) and the positions of each session's turns."""
    members: dict[str, list[int]] = {}
    for i, t in enumerate(turns):
        members.setdefault(t.session_id, []).append(i)
    units = []
    for sid, rows in members.items():
        first, last = turns[rows[0]], turns[rows[-1]]
        start, end = format_date(first.event_time), format_date(last.event_time)
        header = f"### {sid} ({start if start == end else f'{start} – {end}'})"
        units.append(
            RetrievedUnit("session", sid, tuple(turns[i].turn_id for i in rows), "\n".join([header, *(turn_line(turns[i]) for i in rows)]))
        )
    return units, list(members.values())


@dataclass(frozen=True)
class _Corpus:
    units: list[RetrievedUnit]
    bm25: bm25s.BM25 | None
    turn_vectors: npt.NDArray[np.float32]  # (n_turns, dim) L2-normalised
    turn_owner: npt.NDArray[np.int64]  # (n_turns,) unit position of each turn


class BaselineRetriever:
    """``flat`` (turns) or ``session`` retrieval over one conversation's raw turns: BM25 + dense, RRF."""

    def __init__(self, name: str, granularity: Granularity, turns_of: TurnSource, vectors: VectorMemo, *, k0: int = RRF_K0) -> None:
        self._name = name
        self.granularity = granularity
        self.turns_of = turns_of
        self.vectors = vectors
        self.k0 = k0
        self._corpora: dict[str, _Corpus] = {}

    @property
    def name(self) -> str:
        return self._name

    def corpus(self, conversation_id: str) -> _Corpus:
        corpus = self._corpora.get(conversation_id)
        if corpus is None:
            turns = list(self.turns_of(conversation_id))
            if self.granularity == "turn":
                units = turn_units(turns)
                owner = np.arange(len(turns), dtype=np.int64)
                docs = [tokenize(index_text(t)) for t in turns]
            else:
                units, members = session_units(turns)
                owner = np.zeros(len(turns), dtype=np.int64)
                for u, rows in enumerate(members):
                    owner[rows] = u
                docs = [[tok for i in rows for tok in tokenize(index_text(turns[i]))] for rows in members]
            matrix = self.vectors.matrix([index_text(t) for t in turns])
            corpus = _Corpus(units, build_bm25(docs), matrix, owner)
            self._corpora[conversation_id] = corpus
        return corpus

    def order(self, example: QAExample, k: int) -> list[int]:
        """Unit positions of the top ``k``, best first: summed RRF of the BM25 and dense rankings."""
        corpus = self.corpus(example.conversation_id)
        n = len(corpus.units)
        lexical = bm25_scores(corpus.bm25, n, tokenize(example.question))
        sims = cosine_scores(corpus.turn_vectors, self.vectors.vector(example.question))
        dense = sims if self.granularity == "turn" else segment_max(sims, corpus.turn_owner, n)
        ranks = np.vstack([rank_positions(lexical, positive_only=True), rank_positions(dense)])
        chosen, _ = select(ranks, k, "rrf", self.k0)
        return [int(i) for i in chosen]

    def ranked(self, example: QAExample, k: int) -> list[RetrievedUnit]:
        units = self.corpus(example.conversation_id).units
        return [units[i] for i in self.order(example, k)]

    def within_budget(self, example: QAExample, budget: int) -> Context:
        units = self.corpus(example.conversation_id).units
        return pack_budget(self.ranked(example, len(units)), budget)


def baseline(name: str, turns_of: TurnSource, vectors: VectorMemo) -> BaselineRetriever:
    """The named baseline (``flat`` or ``session``)."""
    if name == "flat":
        return BaselineRetriever("flat", "turn", turns_of, vectors)
    if name == "session":
        return BaselineRetriever("session", "session", turns_of, vectors)
    raise ValueError(f"unknown baseline {name!r}; expected one of {', '.join(BASELINES)}")

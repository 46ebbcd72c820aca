"""LLM-free retrieval metrics: evidence-turn recall at k units and at a context-token budget.

A *system* (:class:`Retriever`) returns ranked **units** — tmem scenes and items, raw turns,
whole sessions — each carrying the turn ids it puts before the answer model and its rendered
text. For a question with evidence turns ``E``:

* ``recall@k  = |E ∩ T_k| / |E|`` where ``T_k`` is the union of the turns of the top-k units
  (LoCoMo evidence recall; for LoCoMo-Plus ``E`` is the cue's turns: cue recall);
* ``hit@k``  = ``E ∩ T_k ≠ ∅`` (e.g. "is the cue retrieved at all"), ``complete@k`` = ``E ⊆ T_k``.

Because a scene carries many turns, systems are also compared at an equal **context budget**:
the units a system would hand to the answer model within ``B`` estimated tokens
(:func:`tmem.retrieval.context.estimate_tokens`), with the tokens actually used reported beside
the recall. Questions without usable evidence are left out (and counted by the caller).
"""

from __future__ import annotations

import math
from collections.abc import Callable, Collection, Iterable, Sequence
from dataclasses import asdict, dataclass
from typing import TYPE_CHECKING, Literal, Protocol

import numpy as np
import numpy.typing as npt

from tmem.eval.examples import QAExample
from tmem.ports import Embedder
from tmem.retrieval.context import CHARS_PER_TOKEN, estimate_tokens

if TYPE_CHECKING:
    import polars as pl

UnitKind = Literal["scene", "item", "turn", "session"]
DEFAULT_KS: tuple[int, ...] = (5, 10, 20)
DEFAULT_BUDGETS: tuple[int, ...] = (500, 1000, 2000, 4000)
OVERALL = "all"
UNIT_SEPARATOR = "\n\n"


@dataclass(frozen=True, slots=True)
class RetrievedUnit:
    """One retrieved unit: the turns it covers and the text the answer model would read."""

    kind: UnitKind
    unit_id: str
    turn_ids: tuple[str, ...]
    text: str

    @property
    def tokens(self) -> int:
        return estimate_tokens(self.text)


@dataclass(frozen=True, slots=True)
class Context:
    """What a system hands the answer model: the turns covered, its units and estimated tokens."""

    turn_ids: frozenset[str]
    units: int
    tokens: int


class Retriever(Protocol):
    """A system under evaluation. ``ranked`` returns its top-k units best first; ``within_budget``
    the context it would give within ``budget`` estimated tokens."""

    @property
    def name(self) -> str: ...

    def ranked(self, example: QAExample, k: int) -> Sequence[RetrievedUnit]: ...

    def within_budget(self, example: QAExample, budget: int) -> Context: ...


def covered_turns(units: Iterable[RetrievedUnit]) -> frozenset[str]:
    return frozenset(t for u in units for t in u.turn_ids)


def context_of(units: Sequence[RetrievedUnit]) -> Context:
    """The context made of ``units`` in order (tokens of their texts joined as the QA context joins them)."""
    return Context(covered_turns(units), len(units), estimate_tokens(UNIT_SEPARATOR.join(u.text for u in units)))


def pack_budget(units: Sequence[RetrievedUnit], budget: int) -> Context:
    """The longest prefix of ranked ``units`` whose joined text fits ``budget`` tokens — lowest
    ranked dropped first, as :func:`tmem.retrieval.context.format_context` does."""
    if budget < 0:
        raise ValueError(f"token budget must be ≥ 0, got {budget}")
    kept = 0
    used = 0  # characters of the joined prefix
    for unit in units:
        extra = len(unit.text) + (len(UNIT_SEPARATOR) if kept else 0)
        if math.ceil((used + extra) / CHARS_PER_TOKEN) > budget:  # = estimate_tokens of the joined text
            break
        used += extra
        kept += 1
    return context_of(units[:kept])


def evidence_recall(evidence: Collection[str], retrieved: Collection[str]) -> float:
    """``|E ∩ R| / |E|``; a question without evidence has no recall (ValueError)."""
    if not evidence:
        raise ValueError("evidence recall is undefined without evidence turns")
    wanted = set(evidence)
    return len(wanted & set(retrieved)) / len(wanted)


# --------------------------------------------------------------------------- shared embedding memo


class VectorMemo:
    """Embeds each distinct text once per run (questions, turns) and hands back its row."""

    def __init__(self, embedder: Embedder, batch: int = 256) -> None:
        self.embedder = embedder
        self.batch = batch
        self._rows: dict[str, npt.NDArray[np.float32]] = {}

    @property
    def dim(self) -> int:
        return self.embedder.dim

    def prefetch(self, texts: Iterable[str]) -> None:
        missing = list(dict.fromkeys(t for t in texts if t not in self._rows))
        for start in range(0, len(missing), self.batch):
            chunk = missing[start : start + self.batch]
            for text, row in zip(chunk, self.embedder.embed(chunk), strict=True):
                self._rows[text] = np.asarray(row, dtype=np.float32)

    def vector(self, text: str) -> npt.NDArray[np.float32]:
        self.prefetch([text])
        return self._rows[text]

    def matrix(self, texts: Sequence[str]) -> npt.NDArray[np.float32]:
        self.prefetch(texts)
        if not texts:
            return np.zeros((0, self.dim), dtype=np.float32)
        return np.vstack([self._rows[t] for t in texts])


# --------------------------------------------------------------------------- evaluation


@dataclass(frozen=True, slots=True)
class RecallRow:
    """One question × system × cut-off (``cut`` = k units, or a token budget)."""

    system: str
    dataset: str
    qid: str
    conversation_id: str
    category: str
    mode: Literal["k", "budget"]
    cut: int
    evidence: int
    found: int
    recall: float
    hit: bool
    complete: bool
    units: int
    tokens: int


def _row(system: str, example: QAExample, group: str, mode: Literal["k", "budget"], cut: int, ctx: Context) -> RecallRow:
    wanted = set(example.evidence)
    found = len(wanted & ctx.turn_ids)
    return RecallRow(
        system=system, dataset=example.dataset, qid=example.qid, conversation_id=example.conversation_id,
        category=group, mode=mode, cut=cut, evidence=len(wanted), found=found, recall=found / len(wanted),
        hit=found > 0, complete=found == len(wanted), units=ctx.units, tokens=ctx.tokens,
    )


def evaluate_retrieval(
    examples: Sequence[QAExample],
    systems: Sequence[Retriever],
    *,
    ks: Sequence[int] = DEFAULT_KS,
    budgets: Sequence[int] = DEFAULT_BUDGETS,
    group_of: Callable[[QAExample], str] = lambda e: e.category,
    on_system: Callable[[str, float], None] | None = None,
) -> list[RecallRow]:
    """Recall rows of every system on every question with evidence, at each k and each budget.
    ``on_system(name, seconds)`` is called after each system (progress and timing)."""
    import time

    if any(k < 1 for k in ks) or any(b < 0 for b in budgets):
        raise ValueError(f"k must be ≥ 1 and budgets ≥ 0, got ks={list(ks)} budgets={list(budgets)}")
    scored = [e for e in examples if e.evidence]
    rows: list[RecallRow] = []
    for system in systems:
        started = time.perf_counter()
        for example in scored:
            group = group_of(example)
            for k in ks:
                rows.append(_row(system.name, example, group, "k", k, context_of(system.ranked(example, k))))
            for budget in budgets:
                rows.append(_row(system.name, example, group, "budget", budget, system.within_budget(example, budget)))
        if on_system is not None:
            on_system(system.name, time.perf_counter() - started)
    return rows


def rows_frame(rows: Sequence[RecallRow]) -> pl.DataFrame:
    """The per-question rows as a tidy polars frame (one row per question × system × cut)."""
    import polars as pl

    schema = {
        "system": pl.String, "dataset": pl.String, "qid": pl.String, "conversation_id": pl.String,
        "category": pl.String, "mode": pl.String, "cut": pl.Int64, "evidence": pl.Int64, "found": pl.Int64,
        "recall": pl.Float64, "hit": pl.Boolean, "complete": pl.Boolean, "units": pl.Int64, "tokens": pl.Int64,
    }
    return pl.DataFrame([asdict(r) for r in rows], schema=schema, orient="row")


def summarise(frame: pl.DataFrame) -> pl.DataFrame:
    """Mean recall / hit / complete rate / units / tokens per system × mode × cut × category, plus
    the overall row (``category == "all"``, the mean over questions, not over categories)."""
    import polars as pl

    aggs = [
        pl.len().alias("questions"),
        pl.col("recall").mean().alias("recall"),
        pl.col("hit").cast(pl.Float64).mean().alias("hit_rate"),
        pl.col("complete").cast(pl.Float64).mean().alias("complete_rate"),
        pl.col("units").cast(pl.Float64).mean().alias("mean_units"),
        pl.col("tokens").cast(pl.Float64).mean().alias("mean_tokens"),
    ]
    keys = ["system", "mode", "cut"]
    per_category = frame.group_by([*keys, "category"]).agg(aggs)
    overall = frame.group_by(keys).agg(aggs).with_columns(pl.lit(OVERALL).alias("category"))
    out = pl.concat([per_category, overall.select(per_category.columns)])
    order = {name: i for i, name in enumerate(dict.fromkeys(frame["system"].to_list()))}
    return (
        out.with_columns(
            pl.col("system").replace_strict(order, return_dtype=pl.Int64).alias("_system_order"),
            (pl.col("category") == OVERALL).alias("_overall"),
        )
        .sort(["_system_order", "mode", "cut", "_overall", "category"])
        .drop("_system_order", "_overall")
    )

"""Build cost per conversation, from the store's build records (the paper's Figure 5 cost axis).

The usage ledger counts calls and tokens per build run, not per conversation, so a run that
built several conversations is apportioned to them by their share of the run's turns (a build's
calls grow with its turns: ~44 calls per 100 turns, bench/results/construction.json). A
conversation's cost is the sum over every build run that included it; runs answered from the
response cache cost nothing, so a rebuild of unchanged memory adds nothing.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from tmem.errors import StoreError
from tmem.store.conversations import conversation_states
from tmem.store.duck import connect
from tmem.store.runs import list_runs

MAX_RUNS = 100_000


@dataclass(frozen=True)
class BuildCost:
    conversation_id: str
    turns: int
    runs: int  # build runs that included the conversation
    llm_calls: float  # apportioned calls that reached the endpoint (cache hits excluded)
    prompt_tokens: float
    completion_tokens: float

    @property
    def tokens(self) -> float:
        return self.prompt_tokens + self.completion_tokens


def build_costs(store: Path, conversation_ids: Sequence[str]) -> dict[str, Any]:
    """``{"conversations": {id: BuildCost fields}, "apportioned": "by turns"}``, or
    ``{"unavailable": reason}`` when the working database cannot be read (e.g. a build holds it)."""
    try:
        con = connect(Path(store), read_only=True)
    except StoreError as exc:
        return {"unavailable": str(exc)}
    try:
        states = {s.conversation_id: s for s in conversation_states(con)}
        runs = list_runs(con, limit=MAX_RUNS)
    finally:
        con.close()
    wanted = set(conversation_ids)
    totals: dict[str, list[float]] = {cid: [0, 0.0, 0.0, 0.0] for cid in wanted}
    for run in runs:
        ids = [str(c) for c in run.inputs.get("conversation_ids") or [] if str(c) in states]
        if not wanted.intersection(ids):
            continue
        all_turns = sum(states[c].turns for c in ids) or 1
        for cid in wanted.intersection(ids):
            share = states[cid].turns / all_turns
            acc = totals[cid]
            acc[0] += 1
            acc[1] += share * run.llm_calls
            acc[2] += share * run.prompt_tokens
            acc[3] += share * run.completion_tokens
    costs = {
        cid: BuildCost(cid, states[cid].turns if cid in states else 0, int(acc[0]), round(acc[1], 2),
                       round(acc[2], 1), round(acc[3], 1))
        for cid, acc in sorted(totals.items())
    }
    return {"apportioned": "by turns within each build run", "conversations": {c: asdict(v) for c, v in costs.items()}}


def mean_build_cost(costs: dict[str, Any] | None) -> dict[str, float | None]:
    """Mean build calls and tokens per conversation of a ``build_costs`` result (None if unknown)."""
    conversations = (costs or {}).get("conversations") or {}
    if not conversations:
        return {"build_calls_per_conversation": None, "build_tokens_per_conversation": None}
    n = len(conversations)
    calls = sum(float(c["llm_calls"]) for c in conversations.values()) / n
    tokens = sum(float(c["prompt_tokens"]) + float(c["completion_tokens"]) for c in conversations.values()) / n
    return {"build_calls_per_conversation": round(calls, 2), "build_tokens_per_conversation": round(tokens, 1)}

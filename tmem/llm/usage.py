"""The usage ledger: one row per chat call (what it cost, whose it was), summed per operation and run.

:class:`tmem.llm.response_cache.CachedChatModel` writes the rows; the storage behind them is the
:class:`tmem.ports.UsageLedger` protocol: in memory here (unit tests), DuckDB in
:mod:`tmem.store.llm_cache`.
"""

from __future__ import annotations

import threading
from collections.abc import Iterable
from dataclasses import replace

from tmem.ports import OperationUsage, UsageRecord


def summarize_usage(records: Iterable[UsageRecord], run_id: str) -> dict[str, OperationUsage]:
    """Totals per operation over the records of ``run_id``, keys sorted by operation."""
    totals: dict[str, OperationUsage] = {}
    for rec in records:
        if rec.run_id != run_id:
            continue
        cur = totals.get(rec.operation, OperationUsage(rec.operation))
        totals[rec.operation] = replace(
            cur,
            calls=cur.calls + 1,
            cache_hits=cur.cache_hits + int(rec.cache_hit),
            requests=cur.requests + rec.attempts,
            prompt_tokens=cur.prompt_tokens + rec.prompt_tokens,
            completion_tokens=cur.completion_tokens + rec.completion_tokens,
            latency_ms=cur.latency_ms + rec.latency_ms,
            batch_calls=cur.batch_calls + int(rec.batch),
            batch_prompt_tokens=cur.batch_prompt_tokens + rec.batch_prompt_tokens,
            batch_completion_tokens=cur.batch_completion_tokens + rec.batch_completion_tokens,
            repairs=cur.repairs + rec.repairs,
            checked_reasks=cur.checked_reasks + int(rec.checked_reask),
            truncations=cur.truncations + int(rec.truncated),
            output_errors=cur.output_errors + int(rec.output_error),
        )
    return dict(sorted(totals.items()))


def total_usage(summary: dict[str, OperationUsage]) -> OperationUsage:
    """All operations of a summary added up (operation ``"*"``)."""
    out = OperationUsage("*")
    for op in summary.values():
        out = OperationUsage(
            "*",
            out.calls + op.calls,
            out.cache_hits + op.cache_hits,
            out.requests + op.requests,
            out.prompt_tokens + op.prompt_tokens,
            out.completion_tokens + op.completion_tokens,
            out.latency_ms + op.latency_ms,
            out.batch_calls + op.batch_calls,
            out.batch_prompt_tokens + op.batch_prompt_tokens,
            out.batch_completion_tokens + op.batch_completion_tokens,
            out.repairs + op.repairs,
            out.checked_reasks + op.checked_reasks,
            out.truncations + op.truncations,
            out.output_errors + op.output_errors,
        )
    return out



class InMemoryUsageLedger:
    """A thread-safe list ledger, for unit tests."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._records: list[UsageRecord] = []

    @property
    def records(self) -> list[UsageRecord]:
        with self._lock:
            return list(self._records)

    def record(self, record: UsageRecord) -> None:
        with self._lock:
            self._records.append(record)

    def summary(self, run_id: str) -> dict[str, OperationUsage]:
        return summarize_usage(self.records, run_id)


"""The usage ledger: one row per chat call (what it cost, whose it was), summed per operation and run.

:class:`tmem.llm.response_cache.CachedChatModel` writes the rows; the storage behind them is the
:class:`tmem.ports.UsageLedger` protocol: in memory here (unit tests), DuckDB in
:mod:`tmem.store.llm_cache`.
"""

from __future__ import annotations

import threading
from collections.abc import Iterable
from dataclasses import fields
from typing import Any

from tmem.ports import OperationUsage, UsageRecord


def usage_of(record: UsageRecord) -> OperationUsage:
    """One ledger row as the totals of its operation (one call)."""
    return OperationUsage(
        record.operation,
        calls=1,
        cache_hits=int(record.cache_hit),
        requests=record.attempts,
        prompt_tokens=record.prompt_tokens,
        completion_tokens=record.completion_tokens,
        latency_ms=record.latency_ms,
        batch_calls=int(record.batch),
        batch_prompt_tokens=record.batch_prompt_tokens,
        batch_completion_tokens=record.batch_completion_tokens,
        repairs=record.repairs,
        checked_reasks=int(record.checked_reask),
        truncations=int(record.truncated),
        output_errors=int(record.output_error),
    )


_TOTALS = tuple(f.name for f in fields(OperationUsage) if f.name != "operation")


def add_usage(a: OperationUsage, b: OperationUsage, operation: str) -> OperationUsage:
    """The totals of ``a`` and ``b`` added up, under ``operation``."""
    sums: dict[str, Any] = {name: getattr(a, name) + getattr(b, name) for name in _TOTALS}
    return OperationUsage(operation, **sums)


def summarize_usage(records: Iterable[UsageRecord], run_id: str) -> dict[str, OperationUsage]:
    """Totals per operation over the records of ``run_id``, keys sorted by operation."""
    totals: dict[str, OperationUsage] = {}
    for rec in records:
        if rec.run_id == run_id:
            op = rec.operation
            totals[op] = add_usage(totals.get(op, OperationUsage(op)), usage_of(rec), op)
    return dict(sorted(totals.items()))


def total_usage(summary: dict[str, OperationUsage]) -> OperationUsage:
    """All operations of a summary added up (operation ``"*"``)."""
    out = OperationUsage("*")
    for op in summary.values():
        out = add_usage(out, op, "*")
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


"""DuckDB implementations of the LLM response cache and usage ledger (tables of ``m003_llm``).

Thread-safety: a ``DuckDBPyConnection`` must not be used from several threads at once, and
concurrent writers of one key conflict (DuckDB raises a constraint error rather than
waiting). Each object below therefore serialises its statements with its own lock and runs
each one on a fresh ``con.cursor()`` (a cheap, separate connection to the same database,
~4 µs), so it neither races with itself nor with the thread that owns ``con``. Statements
take milliseconds and LLM calls seconds, so the lock costs nothing measurable.
"""

from __future__ import annotations

import threading
from collections.abc import Iterator
from contextlib import contextmanager

import duckdb

from tmem.ports import CacheEntry, OperationUsage, UsageRecord

# Every column of the table as the migrations leave it (up to m008_construction_health and m010_forget);
# also what the publisher writes for a Dask worker's rows.
INSERT_USAGE_FULL = (
    "INSERT INTO llm_usage (run_id, operation, model, prompt_tokens, completion_tokens, latency_ms, cache_hit,"
    " attempts, recorded_at, usage_estimated, batch, batch_prompt_tokens, batch_completion_tokens, repairs,"
    " checked_reask, truncated, output_error, conversation_id, cache_key)"
    " VALUES (?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?)"
)


def usage_values(record: UsageRecord) -> list[object]:
    """The values of :data:`INSERT_USAGE_FULL` for ``record``."""
    return [
        record.run_id, record.operation, record.model, record.prompt_tokens, record.completion_tokens,
        record.latency_ms, record.cache_hit, record.attempts, record.recorded_at, record.usage_estimated,
        record.batch, record.batch_prompt_tokens, record.batch_completion_tokens, record.repairs,
        record.checked_reask, record.truncated, record.output_error, record.conversation_id, record.cache_key,
    ]


_SUMMARY = """
    SELECT operation, count(*), count(*) FILTER (WHERE cache_hit), sum(attempts),
           sum(prompt_tokens), sum(completion_tokens), sum(latency_ms),
           count(*) FILTER (WHERE batch), sum(batch_prompt_tokens), sum(batch_completion_tokens),
           sum(repairs), count(*) FILTER (WHERE checked_reask), count(*) FILTER (WHERE truncated),
           count(*) FILTER (WHERE output_error)
    FROM llm_usage WHERE run_id = ? GROUP BY operation ORDER BY operation
"""


class _Serialised:
    def __init__(self, con: duckdb.DuckDBPyConnection) -> None:
        self._con = con
        self._lock = threading.Lock()

    @contextmanager
    def _cursor(self) -> Iterator[duckdb.DuckDBPyConnection]:
        with self._lock:
            cur = self._con.cursor()
            try:
                yield cur
            finally:
                cur.close()


class DuckResponseCache(_Serialised):
    """:class:`~tmem.ports.ResponseCache` on table ``llm_cache``."""

    def get(self, cache_key: str) -> str | None:
        with self._cursor() as cur:
            row = cur.execute("SELECT response FROM llm_cache WHERE cache_key = ?", [cache_key]).fetchone()
        return str(row[0]) if row else None

    def put(self, entry: CacheEntry) -> None:
        with self._cursor() as cur:
            cur.execute(
                "INSERT OR REPLACE INTO llm_cache "
                "(cache_key, operation, model, prompt_version, response, prompt_tokens, completion_tokens, created_at) "
                "VALUES (?, ?, ?, ?, ?, ?, ?, ?)",
                [
                    entry.cache_key,
                    entry.operation,
                    entry.model,
                    entry.prompt_version,
                    entry.response_json,
                    entry.prompt_tokens,
                    entry.completion_tokens,
                    entry.created_at,
                ],
            )

    def count(self) -> int:
        with self._cursor() as cur:
            row = cur.execute("SELECT count(*) FROM llm_cache").fetchone()
        return int(row[0]) if row else 0


class DuckUsageLedger(_Serialised):
    """:class:`~tmem.ports.UsageLedger` on table ``llm_usage`` (of a migrated working database)."""

    def record(self, record: UsageRecord) -> None:
        with self._cursor() as cur:
            cur.execute(INSERT_USAGE_FULL, usage_values(record))

    def summary(self, run_id: str) -> dict[str, OperationUsage]:
        with self._cursor() as cur:
            rows = cur.execute(_SUMMARY, [run_id]).fetchall()
        out: dict[str, OperationUsage] = {}
        for op, calls, hits, reqs, pt, ct, lat, bc, bpt, bct, rep, reask, trunc, err in rows:
            n = [int(v or 0) for v in (calls, hits, reqs, pt, ct, bc, bpt, bct, rep, reask, trunc, err)]
            out[str(op)] = OperationUsage(
                str(op), calls=n[0], cache_hits=n[1], requests=n[2], prompt_tokens=n[3], completion_tokens=n[4],
                latency_ms=float(lat or 0.0), batch_calls=n[5], batch_prompt_tokens=n[6], batch_completion_tokens=n[7],
                repairs=n[8], checked_reasks=n[9], truncations=n[10], output_errors=n[11],
            )
        return out

"""DuckDB implementations of the LLM response cache and usage ledger (tables of ``m003_llm``).

Thread-safety: a ``DuckDBPyConnection`` must not be used from several threads at once, and
concurrent writers of one key conflict (DuckDB raises a constraint error rather than
waiting). Each object below runs each statement on a fresh ``con.cursor()`` (a cheap, separate
connection to the same database, ~12 µs), made under its own lock, so it races neither with itself
nor with the thread that owns ``con``. Its writes go through one writer thread
(:class:`~tmem.store.group_commit.GroupCommit`): the rows of concurrent calls share one
transaction, and each call returns once its row is committed. A cache lookup runs beside it.
"""

from __future__ import annotations

import threading
from collections.abc import Iterator
from contextlib import contextmanager

import duckdb
import pyarrow as pa

from tmem.ports import CacheEntry, OperationUsage, UsageRecord
from tmem.store.duck import insert_arrow
from tmem.store.group_commit import GroupCommit

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
    def __init__(self, con: duckdb.DuckDBPyConnection, *, lock: threading.Lock | None = None) -> None:
        self._con = con
        self._lock = lock or threading.Lock()  # shared with other readers of ``con`` when given

    @contextmanager
    def _cursor(self) -> Iterator[duckdb.DuckDBPyConnection]:
        with self._lock:
            cur = self._con.cursor()
            try:
                yield cur
            finally:
                cur.close()


_CACHE_TYPES: dict[str, pa.DataType] = {
    "cache_key": pa.string(), "operation": pa.string(), "model": pa.string(), "prompt_version": pa.string(),
    "response": pa.string(), "prompt_tokens": pa.int64(), "completion_tokens": pa.int64(),
    "created_at": pa.timestamp("us", tz="UTC"),
}  # the columns of llm_cache, in the order of _cache_values
_VALUES_ROWS = 16  # up to this many rows in one INSERT ... VALUES; beyond, one Arrow table


def _cache_values(e: CacheEntry) -> list[object]:
    return [e.cache_key, e.operation, e.model, e.prompt_version, e.response_json, e.prompt_tokens,
            e.completion_tokens, e.created_at]


def write_cache_rows(cur: duckdb.DuckDBPyConnection, entries: list[CacheEntry]) -> None:
    """Insert the round's answers; a key already stored (a damaged answer asked again) is replaced.

    ``INSERT OR REPLACE`` costs a primary-key conflict check that a plain ``INSERT`` does not (4.4
    against 2.1 ms of CPU per one-row transaction on a nightly's table), and nearly every key is new,
    so the keys present are looked up first and only their rows replaced."""
    latest = list({e.cache_key: e for e in entries}.values())  # one row per key in a statement: the last answer
    stored = {str(r[0]) for r in cur.execute("SELECT cache_key FROM llm_cache WHERE cache_key IN "
                                              "(SELECT unnest(?::VARCHAR[]))", [[e.cache_key for e in latest]]).fetchall()}
    names = ", ".join(_CACHE_TYPES)
    for verb, rows in (("INSERT", [e for e in latest if e.cache_key not in stored]),
                       ("INSERT OR REPLACE", [e for e in latest if e.cache_key in stored])):
        if not rows:
            continue
        if len(rows) <= _VALUES_ROWS:
            one = "(" + ", ".join("?" * len(_CACHE_TYPES)) + ")"
            cur.execute(f"{verb} INTO llm_cache ({names}) VALUES {', '.join([one] * len(rows))}",
                        [v for e in rows for v in _cache_values(e)])
            continue
        columns = zip(*(_cache_values(e) for e in rows), strict=True)
        table = pa.table({name: pa.array(list(values), kind)
                          for (name, kind), values in zip(_CACHE_TYPES.items(), columns, strict=True)})
        insert_arrow(cur, f"{verb} INTO llm_cache ({names}) SELECT {names} FROM {{staged}}", table)  # noqa: S608 -- constant names


class DuckResponseCache(_Serialised):
    """:class:`~tmem.ports.ResponseCache` on table ``llm_cache``; puts from many threads are
    committed together (:mod:`tmem.store.group_commit`), each returning once its row is committed.

    ``known_keys``: the table's keys are read once, and a key neither among them nor put since is
    answered as missing without a query (a build's new calls, about half its requests in a nightly,
    each cost a lookup of ~1 ms of CPU). Only for the working database's single writer, whose
    answers all go through this object: a key another writer stored meanwhile would be asked again."""

    def __init__(self, con: duckdb.DuckDBPyConnection, *, known_keys: bool = False,
                 lock: threading.Lock | None = None) -> None:
        super().__init__(con, lock=lock)
        self.writes: GroupCommit[CacheEntry] = GroupCommit(con, write_cache_rows, cursor_lock=self._lock,
                                                           name="llm-cache")
        self._known: set[str] | None = None
        if known_keys:
            with self._cursor() as cur:
                self._known = {str(r[0]) for r in cur.execute("SELECT cache_key FROM llm_cache").fetchall()}

    def get(self, cache_key: str) -> str | None:
        if self._known is not None and cache_key not in self._known:
            return None
        with self._lock:
            cur = self._con.cursor()
        try:  # a read needs no lock: DuckDB reads beside the writer's transaction
            row = cur.execute("SELECT response FROM llm_cache WHERE cache_key = ?", [cache_key]).fetchone()
        finally:
            cur.close()
        return str(row[0]) if row else None

    def put(self, entry: CacheEntry) -> None:
        self.writes.write(entry)
        if self._known is not None:
            self._known.add(entry.cache_key)  # set.add is atomic under the GIL

    def count(self) -> int:
        with self._cursor() as cur:
            row = cur.execute("SELECT count(*) FROM llm_cache").fetchone()
        return int(row[0]) if row else 0


class DuckUsageLedger(_Serialised):
    """:class:`~tmem.ports.UsageLedger` on table ``llm_usage`` (of a migrated working database).

    ``deferred``: :meth:`record` returns at once and its row is committed with others within
    ``linger_s`` (:meth:`flush` waits for them; :meth:`summary` flushes first). A build's ledger is
    deferred — its rows are statistics, one per call and per cache hit, and one transaction each
    cost a nightly of 200 conversations ~10 s of CPU — and flushed as each conversation finishes: a
    build killed mid-conversation loses at most that conversation's rows of the last ``linger_s``
    (its answers are in the response cache, whose writes are never deferred). Otherwise each
    ``record`` returns once its row is committed."""

    def __init__(self, con: duckdb.DuckDBPyConnection, *, deferred: bool = False, linger_s: float = 1.0) -> None:
        super().__init__(con)
        self.deferred = deferred
        self.writes: GroupCommit[UsageRecord] = GroupCommit(con, write_usage_rows, cursor_lock=self._lock,
                                                            name="llm-usage", linger_s=linger_s)

    def record(self, record: UsageRecord) -> None:
        """Store ``record``: committed on return, or (``deferred``) with the next round."""
        if self.deferred:
            self.writes.write_later(record)
        else:
            self.writes.write(record)

    def flush(self) -> None:
        """Every row recorded so far committed; raises a deferred row's error."""
        self.writes.flush()

    def summary(self, run_id: str) -> dict[str, OperationUsage]:
        self.flush()
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


_USAGE_TYPES: dict[str, pa.DataType] = {
    "run_id": pa.string(), "operation": pa.string(), "model": pa.string(), "prompt_tokens": pa.int64(),
    "completion_tokens": pa.int64(), "latency_ms": pa.float64(), "cache_hit": pa.bool_(), "attempts": pa.int64(),
    "recorded_at": pa.timestamp("us", tz="UTC"), "usage_estimated": pa.bool_(), "batch": pa.bool_(),
    "batch_prompt_tokens": pa.int64(), "batch_completion_tokens": pa.int64(), "repairs": pa.int64(),
    "checked_reask": pa.bool_(), "truncated": pa.bool_(), "output_error": pa.bool_(), "conversation_id": pa.string(),
    "cache_key": pa.string(),
}  # the columns of INSERT_USAGE_FULL, in its order


def write_usage_rows(cur: duckdb.DuckDBPyConnection, records: list[UsageRecord]) -> None:
    columns = list(zip(*(usage_values(r) for r in records), strict=True))
    table = pa.table({name: pa.array(list(values), kind)
                      for (name, kind), values in zip(_USAGE_TYPES.items(), columns, strict=True)})
    names = ", ".join(_USAGE_TYPES)
    insert_arrow(cur, f"INSERT INTO llm_usage ({names}) SELECT {names} FROM {{staged}}", table)  # noqa: S608 -- constant names

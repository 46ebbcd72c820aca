"""Group commit: rows that many threads write to one DuckDB table, committed together.

A build's LLM calls finish on dozens of threads, and each writes two rows to the working
database: its answer (``llm_cache``) and its ledger row (``llm_usage``). One transaction per row
costs ~5 ms of CPU in DuckDB (the commit, not the row: 30 rows in one transaction cost ~0.5 ms
each, 100 ~0.2 ms, inserted as one Arrow table), and with the statements serialised under one lock
the threads queue behind each other's commits — in a nightly of 1,000 conversations the lock was
where the build's threads waited most (``bench/nightly_scale.py``, py-spy).

:class:`GroupCommit` keeps each row's guarantee and pays the commit once per round: ``write(row)``
queues the row and returns only once a transaction holding it has committed (so an answer that a
caller has seen stored survives a kill -9, as before), or raises that row's own error. One writer
thread takes every row waiting, writes them with one call of ``write_rows`` in one transaction, and
answers their callers. If that transaction fails, the rows are written again one per transaction,
so only the rows that fail on their own fail their callers. No row waits on purpose: a round is
what queued while the previous one committed, one row when the build is quiet, dozens when busy.
The writer thread ends after ``idle_s`` with nothing to do and starts again on the next row.
"""

from __future__ import annotations

import threading
from collections import deque
from collections.abc import Callable
from concurrent.futures import Future
from typing import Generic, TypeVar

import duckdb

R = TypeVar("R")


class GroupCommit(Generic[R]):
    """Rows of one table from any thread, one transaction per round (see the module)."""

    def __init__(self, con: duckdb.DuckDBPyConnection, write_rows: Callable[[duckdb.DuckDBPyConnection, list[R]], None],
                 *, cursor_lock: threading.Lock, name: str, idle_s: float = 2.0) -> None:
        self._con = con
        self._write_rows = write_rows
        self._cursor_lock = cursor_lock  # held only while a cursor is made from the shared connection
        self._name = name
        self._idle_s = idle_s
        self._queue: deque[tuple[R, Future[None]]] = deque()
        self._ready = threading.Condition()
        self._worker: threading.Thread | None = None
        self.rounds = 0  # transactions that committed a round (tests, benchmarks)

    def write(self, row: R) -> None:
        """Store ``row``; returns once it is committed, raises its error otherwise."""
        done: Future[None] = Future()
        with self._ready:
            self._queue.append((row, done))
            if self._worker is None:
                self._worker = threading.Thread(target=self._work, name=f"tmem-{self._name}-writer", daemon=True)
                self._worker.start()
            self._ready.notify()
        done.result()

    def _take(self) -> list[tuple[R, Future[None]]]:
        with self._ready:
            if not self._queue:
                self._ready.wait(self._idle_s)
            if not self._queue:
                self._worker = None  # a writer that comes after this starts a new thread
                return []
            taken = list(self._queue)
            self._queue.clear()
            return taken

    def _work(self) -> None:
        while taken := self._take():
            try:
                self._commit([row for row, _ in taken])
            except BaseException:  # noqa: BLE001 -- not swallowed: each row is written again alone below
                for row, done in taken:
                    try:
                        self._commit([row])
                    except BaseException as exc:  # noqa: BLE001 -- handed to the row's caller, who raises it
                        done.set_exception(exc)
                    else:
                        done.set_result(None)
                continue
            self.rounds += 1
            for _, done in taken:
                done.set_result(None)

    def _commit(self, rows: list[R]) -> None:
        with self._cursor_lock:
            cur = self._con.cursor()
        try:
            cur.begin()
            try:
                self._write_rows(cur, rows)
                cur.commit()
            except BaseException:
                cur.rollback()
                raise
        finally:
            cur.close()

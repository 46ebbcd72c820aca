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

A row whose caller need not wait for it (a ledger row: statistics, not the resume guarantee) goes
in with ``write_later``: it returns at once, and the writer, holding only such rows, waits up to
``linger_s`` for more before it commits them, so they share one transaction instead of costing one
each (~2 ms of CPU per transaction in DuckDB, whatever its rows). ``flush()`` returns once every row
queued before it is committed, and raises the first error of a deferred row since the last flush.
"""

from __future__ import annotations

import logging
import threading
from collections import deque
from collections.abc import Callable
from concurrent.futures import Future
from typing import Generic, TypeVar, cast

import duckdb

R = TypeVar("R")
log = logging.getLogger(__name__)
_FLUSH = object()  # a queue entry that only marks how far a flush() waits


class GroupCommit(Generic[R]):
    """Rows of one table from any thread, one transaction per round (see the module)."""

    def __init__(self, con: duckdb.DuckDBPyConnection, write_rows: Callable[[duckdb.DuckDBPyConnection, list[R]], None],
                 *, cursor_lock: threading.Lock, name: str, idle_s: float = 2.0, linger_s: float = 1.0) -> None:
        self._con = con
        self._write_rows = write_rows
        self._cursor_lock = cursor_lock  # held only while a cursor is made from the shared connection
        self._name = name
        self._idle_s = idle_s
        self._linger_s = linger_s
        # (row, its caller's future; None: written with write_later) -- a _FLUSH row only marks a flush
        self._queue: deque[tuple[R | object, Future[None] | None]] = deque()
        self._waiting = 0  # queued entries with a caller waiting on them
        self._failure: BaseException | None = None  # the first error of a deferred row since the last flush
        self._ready = threading.Condition()
        self._worker: threading.Thread | None = None
        self.rounds = 0  # transactions that committed a round (tests, benchmarks)

    def write(self, row: R) -> None:
        """Store ``row``; returns once it is committed, raises its error otherwise."""
        self._enqueue(row, Future()).result()  # type: ignore[union-attr]

    def write_later(self, row: R) -> None:
        """Queue ``row`` and return: it is committed with the next round (see the module)."""
        self._enqueue(row, None)

    def flush(self) -> None:
        """Return once every row queued before this call is committed; raise the first error of a
        row written with :meth:`write_later` since the last flush."""
        self._enqueue(_FLUSH, Future()).result()  # type: ignore[union-attr]
        with self._ready:
            failure, self._failure = self._failure, None
        if failure is not None:
            raise failure

    def _enqueue(self, row: R | object, done: Future[None] | None) -> Future[None] | None:
        with self._ready:
            self._queue.append((row, done))
            self._waiting += done is not None
            if self._worker is None:
                self._worker = threading.Thread(target=self._work, name=f"tmem-{self._name}-writer", daemon=True)
                self._worker.start()
            self._ready.notify()
        return done

    def _take(self) -> list[tuple[R | object, Future[None] | None]]:
        with self._ready:
            if not self._queue:
                self._ready.wait(self._idle_s)
            if not self._queue:
                self._worker = None  # a writer that comes after this starts a new thread
                return []
            if not self._waiting:  # only deferred rows: let more join them, unless a caller comes to wait
                self._ready.wait_for(lambda: self._waiting > 0, self._linger_s)
            taken = list(self._queue)
            self._queue.clear()
            self._waiting = 0
            return taken

    def _work(self) -> None:
        while taken := self._take():
            try:
                self._commit([cast(R, row) for row, _ in taken if row is not _FLUSH])
            except BaseException:  # noqa: BLE001 -- not swallowed: each row is written again alone below
                for row, done in taken:
                    try:
                        if row is not _FLUSH:
                            self._commit([cast(R, row)])
                    except BaseException as exc:  # noqa: BLE001 -- handed to the row's caller, who raises it
                        if done is not None:
                            done.set_exception(exc)
                        else:
                            self._deferred_failed(exc)
                    else:
                        if done is not None:
                            done.set_result(None)
                continue
            self.rounds += any(row is not _FLUSH for row, _ in taken)
            for _, done in taken:
                if done is not None:
                    done.set_result(None)

    def _deferred_failed(self, exc: BaseException) -> None:
        log.error("tmem %s: a deferred row could not be stored (raised at the next flush): %s", self._name, exc)
        with self._ready:
            if self._failure is None:
                self._failure = exc

    def _commit(self, rows: list[R]) -> None:
        if not rows:
            return
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

"""Route construction calls of chosen operations through the OpenAI Batch API.

:class:`BatchingChatModel` is a metered chat adapter (what :class:`~tmem.llm.response_cache.CachedChatModel`
wraps, so cache hits never reach it). A call of a batched operation renders the same request
body the synchronous adapter would send, queues it, and blocks; the queue is submitted as one
batch after ``linger_s`` (or at once when it holds ``max_size`` requests); a poller thread per
batch follows it with doubling delays and hands every waiting caller its own line by custom id.
The answer then goes through the synchronous adapter's validation and repair (repairs are asked
synchronously); a failed line raises the typed error the synchronous path raises for that status.

Resumability: every submitted batch and the digests (content hashes of the request bodies) it
carries go to a :class:`~tmem.ports.BatchJournal` (DuckDB in :mod:`tmem.store.batch_journal`). A request whose
digest belongs to a batch still in flight — submitted by a process that died — attaches to that
batch instead of being sent again. Other operations pass straight to the synchronous adapter,
at most ``sync_limit`` at a time.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable
from concurrent.futures import Future
from dataclasses import dataclass, field, replace
from datetime import UTC, datetime
from typing import Any, Final, TypeVar

from pydantic import BaseModel

from tmem.errors import BatchEndpointError, BatchFormatError, LLMError, LLMRequestRejectedError, LLMTransportError
from tmem.ids import content_hash
from tmem.ports import (
    BatchableChatModel,
    BatchJournal,
    BatchState,
    BatchTransport,
    Completion,
    LineResult,
    RequestLine,
    TokenUsage,
    current_conversation,
)
from tmem.prompts.base import Prompt

R = TypeVar("R", bound=BaseModel)

log = logging.getLogger(__name__)

MAX_CUSTOM_ID: Final = 64


@dataclass(frozen=True)
class BatchConfig:
    operations: frozenset[str]
    linger_s: float = 10.0
    max_size: int = 1000
    poll_s: float = 10.0
    poll_max_s: float = 300.0
    sync_limit: int = 4


@dataclass
class _Batch:
    """A batch this process follows: submitted here, or re-attached from the journal."""

    batch_id: str
    waiters: dict[str, list[Future[LineResult]]] = field(default_factory=dict)  # custom id -> callers
    results: dict[str, LineResult] | None = None  # set once terminal
    # Collected answers nobody was waiting on (a re-attached batch of a dead run carries requests
    # this run has not reached yet): handed to the first later caller of each, then forgotten.
    unclaimed: dict[str, LineResult] = field(default_factory=dict)


@dataclass
class _Queued:
    custom_id: str
    operation: str
    digest: str
    body: dict[str, Any]
    future: Future[LineResult]
    conversation_id: str | None = None  # whose request it is (tmem.ports), for `tmem forget`


def custom_id_for(operation: str, digest: str) -> str:
    """``<operation>.<digest prefix>``: unique per request body, readable in the provider's console."""
    return f"{operation}.{digest}"[:MAX_CUSTOM_ID]


def line_error(result: LineResult, operation: str, input_ref: str) -> LLMError:
    """The typed error the synchronous path raises for the same failure."""
    reason = f"batch {result.batch_id or '(not submitted)'}: " + (
        f"HTTP {result.status_code}: {result.error}" if result.status_code is not None else result.error
    )
    status = result.status_code
    if status is None or status in (408, 429) or status >= 500:
        return LLMTransportError(operation, input_ref, reason)
    return LLMRequestRejectedError(operation, input_ref, f"endpoint rejected the request: {reason}", status)


def _missing(custom_id: str, state: BatchState) -> LineResult:
    """The result of a line absent from a terminal batch's files."""
    if state.status == "failed":  # the batch failed validation: nothing in it ran
        return LineResult(custom_id, 400, error=f"batch failed: {state.errors or 'no reason given'}")
    return LineResult(custom_id, None, error=f"batch ended {state.status} without an answer for this request")


def utc_now() -> datetime:
    return datetime.now(UTC)


class BatchingChatModel:
    """A metered chat adapter sending ``config.operations`` through the Batch API. Thread-safe."""

    def __init__(
        self,
        sync: BatchableChatModel,
        transport: BatchTransport,
        config: BatchConfig,
        *,
        journal: BatchJournal | None = None,
        clock: Callable[[], datetime] = utc_now,
    ) -> None:
        self._sync = sync
        self._transport = transport
        self._journal = journal
        self._config = config
        self._clock = clock
        self._slots = threading.BoundedSemaphore(config.sync_limit)
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._queue: list[_Queued] = []
        self._timer: threading.Timer | None = None
        self._batches: dict[str, _Batch] = {}
        self._threads: list[threading.Thread] = []

    @property
    def model_name(self) -> str:
        return self._sync.model_name

    def complete_metered(self, prompt: Prompt[R]) -> Completion[R]:
        if prompt.operation not in self._config.operations:
            with self._slots:
                return self._sync.complete_metered(prompt)
        body = self._sync.request_body(prompt)
        result = self._ticket(prompt.operation, content_hash(body), body).result()
        if not result.ok:
            raise line_error(result, prompt.operation, prompt.input_ref)
        usage = result.usage or TokenUsage()
        with self._slots:  # validation; a repair re-ask is a synchronous call
            done = self._sync.complete_metered(prompt, (result.content, usage, result.finish_reason))
        return replace(done, batch_usage=usage)

    def flush(self) -> None:
        """Submit the queued requests now (the linger timer does this on its own)."""
        with self._lock:
            lines = self._take_queue()
        if lines:
            self._submit_and_follow(lines)

    def close(self) -> None:
        """Stop following batches: waiting callers get a transport error; the journal keeps the batches
        in flight, so the next process re-attaches to them (what a killed build does implicitly)."""
        self._stop.set()
        with self._lock:
            if self._timer is not None:
                self._timer.cancel()
            queued, self._queue = self._queue, []
        for q in queued:
            q.future.set_result(LineResult(q.custom_id, None, error="batching closed before submission"))
        for thread in list(self._threads):
            thread.join(timeout=5)

    # -- queueing ----------------------------------------------------------------------------
    def _ticket(self, operation: str, digest: str, body: dict[str, Any]) -> Future[LineResult]:
        custom_id = custom_id_for(operation, digest)
        with self._lock:
            for q in self._queue:  # the same request already queued: share its answer
                if q.custom_id == custom_id:
                    return q.future
            found = self._attach(custom_id, digest)
            if found is not None:
                return found
            future: Future[LineResult] = Future()
            self._queue.append(_Queued(custom_id, operation, digest, body, future, current_conversation()))
            if len(self._queue) >= self._config.max_size:
                lines = self._take_queue()
                self._spawn(lambda: self._submit_and_follow(lines), "submit")
            elif self._timer is None:
                self._timer = threading.Timer(self._config.linger_s, self.flush)
                self._timer.daemon = True
                self._timer.start()
        return future

    def _attach(self, custom_id: str, digest: str) -> Future[LineResult] | None:
        """A future on a batch already carrying this request (this process's, or a dead one's). Under lock."""
        for batch in self._batches.values():
            if custom_id in batch.waiters:
                return self._wait_on(batch, custom_id)
            if custom_id in batch.unclaimed:  # already collected (the journal says so): never ask again
                claimed: Future[LineResult] = Future()
                claimed.set_result(replace(batch.unclaimed.pop(custom_id), batch_id=batch.batch_id))
                return claimed
        if self._journal is None:
            return None
        found = self._journal.in_flight(digest)
        if found is None:
            return None
        batch_id, journal_custom_id = found
        known = self._batches.get(batch_id)
        if known is None:
            log.info("re-attaching to batch %s (submitted by an earlier run)", batch_id)
            fresh = self._batches[batch_id] = _Batch(batch_id)
            self._spawn(lambda: self._follow(fresh), f"follow-{batch_id}")
            return self._wait_on(fresh, journal_custom_id)
        if known.results is not None and journal_custom_id not in known.results:
            return None
        return self._wait_on(known, journal_custom_id)

    def _wait_on(self, batch: _Batch, custom_id: str) -> Future[LineResult]:
        future: Future[LineResult] = Future()
        if batch.results is not None and custom_id in batch.results:
            future.set_result(replace(batch.results[custom_id], batch_id=batch.batch_id))
        else:
            batch.waiters.setdefault(custom_id, []).append(future)
        return future

    def _take_queue(self) -> list[_Queued]:
        """Under lock: the queued requests, and the queue reset."""
        lines, self._queue = self._queue, []
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None
        return lines

    def _spawn(self, target: Callable[[], None], name: str) -> None:
        thread = threading.Thread(target=target, name=f"tmem-batch-{name}", daemon=True)
        self._threads = [t for t in self._threads if t.is_alive()] + [thread]
        thread.start()

    # -- submitting and following -------------------------------------------------------------
    def _submit_and_follow(self, queued: list[_Queued]) -> None:
        lines = [RequestLine(q.custom_id, q.body) for q in queued]
        try:
            batch_id, file_id = self._transport.submit(lines, {"tmem_model": self.model_name})
            log.info("submitted batch %s with %d requests", batch_id, len(lines))
            if self._journal is not None:
                requests = [(q.digest, q.custom_id, q.operation, q.conversation_id) for q in queued]
                self._journal.submitted(batch_id, file_id, self.model_name, requests, self._clock())
        except BaseException as exc:  # every caller gets the failure (none waits forever); unexpected ones re-raise
            log.warning("batch submission of %d requests failed: %s", len(lines), exc)
            for q in queued:
                q.future.set_result(LineResult(q.custom_id, None, error=f"batch submission failed: {exc}"))
            if not isinstance(exc, BatchEndpointError):
                raise
            return
        batch = _Batch(batch_id)
        with self._lock:
            for q in queued:
                batch.waiters.setdefault(q.custom_id, []).append(q.future)
            self._batches[batch_id] = batch
        self._follow(batch)

    def _follow(self, batch: _Batch) -> None:
        delay = self._config.poll_s
        try:
            while True:
                if self._stop.wait(delay):
                    self._resolve(batch, None, "batching closed while the batch was in flight")
                    return
                state = self._transport.retrieve(batch.batch_id)
                if state.terminal:
                    break
                delay = min(delay * 2, self._config.poll_max_s)
            results: dict[str, LineResult] = {}
            for file_id in (state.error_file_id, state.output_file_id):
                if file_id:
                    results.update(self._transport.results(file_id))
        except BaseException as exc:  # the batch may still run: it stays in the journal for the next run
            self._resolve(batch, None, f"following batch {batch.batch_id} failed: {type(exc).__name__}: {exc}")
            if not isinstance(exc, (BatchEndpointError, BatchFormatError)):
                raise
            return
        if self._journal is not None:
            self._journal.finished(batch.batch_id, "collected" if state.status == "completed" else state.status,
                                   self._clock())
        try:
            self._discard_files(state)  # before waking the callers: their run may end right after
        finally:
            self._resolve(batch, (state, results), "")

    def _discard_files(self, state: BatchState) -> None:
        """Delete the batch's files at the provider (they hold conversation text and count against storage).
        A failed deletion costs nothing but storage: it is logged, and the build goes on."""
        for file_id in (state.input_file_id, state.output_file_id, state.error_file_id):
            if not file_id:
                continue
            try:
                self._transport.delete_file(file_id)
            except BatchEndpointError as exc:
                log.warning("batch %s: could not delete file %s at the provider: %s", state.batch_id, file_id, exc)

    def _resolve(self, batch: _Batch, outcome: tuple[BatchState, dict[str, LineResult]] | None, error: str) -> None:
        with self._lock:
            waiters, batch.waiters = batch.waiters, {}
            if outcome is None:
                self._batches.pop(batch.batch_id, None)  # a later request re-attaches through the journal
            else:
                batch.results = outcome[1]
                batch.unclaimed = {cid: r for cid, r in outcome[1].items() if cid not in waiters}
        for custom_id, futures in waiters.items():
            if outcome is None:
                result = LineResult(custom_id, None, error=error)
            else:
                result = outcome[1].get(custom_id) or _missing(custom_id, outcome[0])
            for future in futures:
                future.set_result(replace(result, batch_id=batch.batch_id))

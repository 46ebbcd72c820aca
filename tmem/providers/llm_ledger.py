"""Response cache, usage ledger and the caching/metering wrapper around a chat adapter.

The adapter (:class:`tmem.providers.chat.OpenAIChatModel`) reports what one call cost as a
:class:`Completion`; :class:`CachedChatModel` turns that into one ledger row per call and
stores the validated answer under the prompt's content key, so a rerun makes no requests. A call
that ends in invalid output (:class:`~tmem.errors.LLMOutputError`, a truncation included) writes a
ledger row too — its tokens were spent — flagged so that construction health (repairs, checked
re-asks, truncations, failed calls per operation and run) can be read from the ledger.
The storage behind both is a small protocol: in memory here (unit tests), DuckDB in
:mod:`tmem.store.llm_cache`.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable, Iterable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, replace
from datetime import UTC, datetime
from typing import Generic, Protocol, TypeVar

from pydantic import BaseModel, ValidationError

from tmem.errors import LLMOutputError, LLMTruncatedError
from tmem.prompts.base import Prompt
from tmem.providers.scope import current_conversation

R = TypeVar("R", bound=BaseModel)

log = logging.getLogger(__name__)


def utc_now() -> datetime:
    """The default clock of :class:`CachedChatModel` (pass your own for tests and replays)."""
    return datetime.now(UTC)


@dataclass(frozen=True)
class TokenUsage:
    """Tokens of one logical call, summed over every request it sent (retries and repairs)."""

    prompt_tokens: int = 0
    completion_tokens: int = 0
    estimated: bool = False  # True when the server sent no `usage` and chars/4 was used

    def __add__(self, other: TokenUsage) -> TokenUsage:
        return TokenUsage(
            self.prompt_tokens + other.prompt_tokens,
            self.completion_tokens + other.completion_tokens,
            self.estimated or other.estimated,
        )


@dataclass(frozen=True)
class Completion(Generic[R]):
    """A validated answer and what it cost."""

    value: R
    usage: TokenUsage
    requests: int  # HTTP requests sent, including retries, fallback and repair re-asks
    # The part of ``usage`` answered through the Batch API (billed at the batch price); None: no batch.
    batch_usage: TokenUsage | None = None
    repairs: int = 0  # of the requests, the adapter's repair re-asks (invalid JSON or schema)


class MeteredChatModel(Protocol):
    """A chat adapter that reports usage: what :class:`CachedChatModel` wraps."""

    @property
    def model_name(self) -> str: ...

    def complete_metered(self, prompt: Prompt[R]) -> Completion[R]: ...


@dataclass(frozen=True)
class CacheEntry:
    cache_key: str
    operation: str
    model: str
    prompt_version: str
    response_json: str  # the validated answer, as JSON text
    prompt_tokens: int
    completion_tokens: int
    created_at: datetime


@dataclass(frozen=True)
class UsageRecord:
    """One ledger row: one ``complete`` call (a cache hit is a call with zero requests)."""

    run_id: str
    operation: str
    model: str
    prompt_tokens: int
    completion_tokens: int
    latency_ms: float
    cache_hit: bool
    attempts: int  # HTTP requests sent; 0 on a cache hit
    recorded_at: datetime
    usage_estimated: bool = False
    batch: bool = False  # the call's first answer came through the Batch API
    batch_prompt_tokens: int = 0  # of prompt_tokens, those billed at the batch price
    batch_completion_tokens: int = 0
    repairs: int = 0  # the adapter's repair re-asks within this call
    checked_reask: bool = False  # the prompt carried a construction check's rejection (Prompt.checked_reask)
    truncated: bool = False  # the answer was cut at the completion budget (LLMTruncatedError)
    output_error: bool = False  # the call raised LLMOutputError (truncated, or invalid after the repairs)
    # Whose call it was (tmem.providers.scope) and the cache key it read or wrote: what `tmem forget`
    # finds a conversation's cached answers by. None: made outside a conversation's scope / uncached.
    conversation_id: str | None = None
    cache_key: str | None = None


@dataclass(frozen=True)
class OperationUsage:
    """Usage totals of one operation within one run."""

    operation: str
    calls: int = 0
    cache_hits: int = 0
    requests: int = 0
    prompt_tokens: int = 0
    completion_tokens: int = 0
    latency_ms: float = 0.0  # summed over calls
    batch_calls: int = 0  # calls answered through the Batch API
    batch_prompt_tokens: int = 0  # tokens billed at the batch price (included in the totals above)
    batch_completion_tokens: int = 0
    repairs: int = 0  # adapter repair re-asks (requests)
    checked_reasks: int = 0  # calls that were a construction stage's checked re-ask
    truncations: int = 0  # calls whose answer was cut at the completion budget
    output_errors: int = 0  # calls that raised LLMOutputError (truncations included)

    @property
    def mean_latency_ms(self) -> float:
        return self.latency_ms / self.calls if self.calls else 0.0


class ResponseCache(Protocol):
    """Validated answers by content key. ``put`` of an existing key replaces its answer."""

    def get(self, cache_key: str) -> str | None: ...

    def put(self, entry: CacheEntry) -> None: ...


class UsageLedger(Protocol):
    """Append-only usage rows, summarised per operation for a run."""

    def record(self, record: UsageRecord) -> None: ...

    def summary(self, run_id: str) -> dict[str, OperationUsage]: ...


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


class InMemoryResponseCache:
    """A thread-safe dict cache, for unit tests."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self.entries: dict[str, CacheEntry] = {}

    def get(self, cache_key: str) -> str | None:
        with self._lock:
            entry = self.entries.get(cache_key)
        return entry.response_json if entry else None

    def put(self, entry: CacheEntry) -> None:
        with self._lock:
            self.entries[entry.cache_key] = entry


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


class _KeyLocks:
    """One lock per key while in use: concurrent calls with the same cache key run once."""

    def __init__(self) -> None:
        self._guard = threading.Lock()
        self._locks: dict[str, tuple[threading.Lock, int]] = {}

    @contextmanager
    def hold(self, key: str) -> Iterator[None]:
        with self._guard:
            lock, users = self._locks.get(key, (threading.Lock(), 0))
            self._locks[key] = (lock, users + 1)
        try:
            with lock:
                yield
        finally:
            with self._guard:
                lock, users = self._locks[key]
                if users == 1:
                    del self._locks[key]
                else:
                    self._locks[key] = (lock, users - 1)


class CachedChatModel:
    """A :class:`~tmem.providers.base.ChatModel` that caches answers and records usage.

    Thread-safe: concurrent calls share the inner adapter; concurrent calls with the same
    cache key wait for each other, so a key costs one LLM call per process. A call that fails
    with invalid output raises the adapter's typed error after writing its ledger row (what it
    spent, flagged ``output_error``/``truncated``); transport failures and rejections write none.
    """

    def __init__(
        self,
        inner: MeteredChatModel,
        *,
        cache: ResponseCache | None,
        ledger: UsageLedger | None,
        run_id: str,
        clock: Callable[[], datetime] = utc_now,
    ) -> None:
        self._inner = inner
        self._cache = cache
        self._ledger = ledger
        self._clock = clock
        self._key_locks = _KeyLocks()
        self.run_id = run_id

    @property
    def model_name(self) -> str:
        return self._inner.model_name

    def with_run(self, run_id: str) -> CachedChatModel:
        """The same adapter, cache and ledger, recording under another run id."""
        return CachedChatModel(self._inner, cache=self._cache, ledger=self._ledger, run_id=run_id, clock=self._clock)

    def complete(self, prompt: Prompt[R]) -> R:
        start = time.perf_counter()
        if self._cache is None:
            done = self._metered(prompt, start)
            self._record(prompt, done.usage, done.requests, start, cache_hit=False, batch=done.batch_usage,
                         repairs=done.repairs)
            return done.value
        key = prompt.cache_key(self.model_name)
        with self._key_locks.hold(key):
            hit = self._cached(prompt, key)
            if hit is not None:
                self._record(prompt, TokenUsage(), 0, start, cache_hit=True, key=key)
                return hit
            done = self._metered(prompt, start)
            self._cache.put(
                CacheEntry(
                    cache_key=key,
                    operation=prompt.operation,
                    model=self.model_name,
                    prompt_version=prompt.version,
                    response_json=done.value.model_dump_json(),
                    prompt_tokens=done.usage.prompt_tokens,
                    completion_tokens=done.usage.completion_tokens,
                    created_at=self._clock(),
                )
            )
        self._record(prompt, done.usage, done.requests, start, cache_hit=False, batch=done.batch_usage,
                     repairs=done.repairs, key=key)
        return done.value

    def _metered(self, prompt: Prompt[R], start: float) -> Completion[R]:
        """The inner call; invalid output is recorded in the ledger, then raised unchanged."""
        try:
            return self._inner.complete_metered(prompt)
        except LLMOutputError as exc:
            spend = exc.spend
            usage = TokenUsage(spend.prompt_tokens, spend.completion_tokens, spend.estimated) if spend else TokenUsage()
            self._record(prompt, usage, spend.requests if spend else 0, start, cache_hit=False,
                         repairs=spend.repairs if spend else 0, truncated=isinstance(exc, LLMTruncatedError),
                         output_error=True)
            raise

    def _cached(self, prompt: Prompt[R], key: str) -> R | None:
        assert self._cache is not None
        raw = self._cache.get(key)
        if raw is None:
            return None
        try:
            return prompt.response_model.model_validate_json(raw)
        except ValidationError as exc:
            # The key covers the schema, so this is a damaged row: ask again and overwrite it.
            log.warning("cached answer for %s (%s) no longer validates, asking again: %s", prompt.operation, key[:12], exc)
            return None

    def _record(
        self, prompt: Prompt[R], usage: TokenUsage, requests: int, start: float, *, cache_hit: bool,
        batch: TokenUsage | None = None, repairs: int = 0, truncated: bool = False, output_error: bool = False,
        key: str | None = None,
    ) -> None:
        if self._ledger is None:
            return
        self._ledger.record(
            UsageRecord(
                run_id=self.run_id,
                operation=prompt.operation,
                model=self.model_name,
                prompt_tokens=usage.prompt_tokens,
                completion_tokens=usage.completion_tokens,
                latency_ms=(time.perf_counter() - start) * 1000.0,
                cache_hit=cache_hit,
                attempts=requests,
                recorded_at=self._clock(),
                usage_estimated=usage.estimated,
                batch=batch is not None,
                batch_prompt_tokens=batch.prompt_tokens if batch else 0,
                batch_completion_tokens=batch.completion_tokens if batch else 0,
                repairs=repairs,
                checked_reask=prompt.checked_reask,
                truncated=truncated,
                output_error=output_error,
                conversation_id=current_conversation(),
                cache_key=key,
            )
        )

"""The response cache and the caching, metering wrapper around a chat adapter.

The adapter (e.g. :class:`tmem.providers.openai_chat.OpenAIChatModel`) reports what one call cost
as a :class:`~tmem.ports.Completion`; :class:`CachedChatModel` turns that into one ledger row per
call (:mod:`tmem.llm.usage`) and stores the validated answer under the prompt's content key, so a
rerun makes no requests. A call that ends in invalid output (:class:`~tmem.errors.LLMOutputError`,
a truncation included) writes a ledger row too — its tokens were spent — flagged so that
construction health (repairs, checked re-asks, truncations, failed calls per operation and run)
can be read from the ledger. The storage behind both is a small protocol
(:class:`~tmem.ports.ResponseCache`, :class:`~tmem.ports.UsageLedger`): in memory here (unit
tests), DuckDB in :mod:`tmem.store.llm_cache`.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from datetime import UTC, datetime
from typing import TypeVar

from pydantic import BaseModel, ValidationError

from tmem.errors import LLMOutputError, LLMTruncatedError
from tmem.ports import (
    CacheEntry,
    Completion,
    MeteredChatModel,
    ResponseCache,
    TokenUsage,
    UsageLedger,
    UsageRecord,
    current_conversation,
)
from tmem.prompts.base import Prompt

R = TypeVar("R", bound=BaseModel)

log = logging.getLogger(__name__)


def utc_now() -> datetime:
    """The default clock of :class:`CachedChatModel` (pass your own for tests and replays)."""
    return datetime.now(UTC)


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
    """A :class:`~tmem.ports.ChatModel` that caches answers and records usage.

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

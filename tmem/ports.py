"""The interfaces of the core and the value types of the call layer.

The core (construction, retrieval, evaluation) speaks to models only through :class:`ChatModel`
and :class:`Embedder`, one method each (STYLE.md §2). The call layer (:mod:`tmem.llm`: response
cache, usage ledger, batching, journal, in-flight bound) wraps an adapter that reports what each
call cost (:class:`MeteredChatModel`); adapters live in :mod:`tmem.providers`, storage behind the
cache, ledger and journal in :mod:`tmem.store`. The values they hand each other are declared here,
once, so that none of those packages imports another for a type. The core also declares here whose
work a call is (:func:`conversation_scope`), which the call layer records with every call.
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from concurrent.futures import Future
from contextlib import contextmanager
from contextvars import ContextVar
from dataclasses import dataclass
from datetime import datetime
from typing import Any, Generic, ParamSpec, Protocol, TypeVar, runtime_checkable

import numpy as np
import numpy.typing as npt
from pydantic import BaseModel

from tmem.prompts.base import Prompt

R = TypeVar("R", bound=BaseModel)

# ---- the two capabilities -------------------------------------------------------------------


class ChatModel(Protocol):
    """Sends a prompt and returns its validated response model, or raises :class:`tmem.errors.LLMError`."""

    @property
    def model_name(self) -> str: ...

    def complete(self, prompt: Prompt[R]) -> R: ...


class Embedder(Protocol):
    """Embeds texts as L2-normalised float32 rows of shape (len(texts), dim)."""

    @property
    def model_name(self) -> str: ...

    @property
    def dim(self) -> int: ...

    @property
    def max_input_tokens(self) -> int | None:
        """The longest input the encoder reads, in its own tokens (longer inputs are cut); None: unknown."""
        ...

    def embed(self, texts: list[str]) -> npt.NDArray[np.float32]: ...


@runtime_checkable
class PipelinedEmbedder(Protocol):
    """What an :class:`Embedder` that takes a call while earlier ones run (the build's encoder pool) has
    besides. Methods only: ``isinstance`` on a protocol reads each of its members, and an embedder's
    ``dim`` waits for its model to load."""

    def submit(self, texts: list[str]) -> Future[npt.NDArray[np.float32]]:
        """Queue a call of ``texts`` (at least one) behind the calls before it; its rows when done."""
        ...

    def wait_taken(self, timeout: float | None = None) -> bool:
        """Wait until the embedder has started on every call queued so far (whether it had, within ``timeout``)."""
        ...


# ---- what an adapter reports ------------------------------------------------------------------


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
    """A chat adapter that reports usage: what :class:`tmem.llm.response_cache.CachedChatModel` wraps."""

    @property
    def model_name(self) -> str: ...

    def complete_metered(self, prompt: Prompt[R]) -> Completion[R]: ...


class BatchableChatModel(MeteredChatModel, Protocol):
    """A metered adapter whose requests can also travel through a batch endpoint
    (:class:`tmem.llm.batching.BatchingChatModel`): it renders a request body, and validates (and
    repairs) an answer that came back by another way (``first``: content, usage, finish reason)."""

    def request_body(self, prompt: Prompt[Any], extra: list[dict[str, str]] | None = None) -> dict[str, Any]: ...

    def complete_metered(
        self, prompt: Prompt[R], first: tuple[str, TokenUsage, str | None] | None = None
    ) -> Completion[R]: ...


# ---- response cache and usage ledger ------------------------------------------------------------


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
    # Whose call it was (tmem.ports) and the cache key it read or wrote: what `tmem forget`
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


# ---- embedding cache ------------------------------------------------------------------------------


class EmbeddingCache(Protocol):
    """Vectors by (model, text hash). Implementations are thread-safe."""

    def get_many(self, model: str, text_hashes: Sequence[str]) -> dict[str, npt.NDArray[np.float32]]:
        """The cached vectors among ``text_hashes`` (misses are absent from the result)."""
        ...

    def put_many(self, model: str, vectors: Mapping[str, npt.NDArray[np.float32]]) -> None:
        """Store vectors by text hash; an existing entry is kept."""
        ...


# ---- the work journal of a read-only worker (tmem.llm.journal, tmem.store.exchange) -----------------


@dataclass(frozen=True)
class EmbeddingEntry:
    model: str
    text_hash: str
    vector: npt.NDArray[np.float32]


@dataclass(frozen=True)
class ServiceAddress:
    """Where a build's encoder service listens (:mod:`tmem.llm.embed_service`): its machine, Unix
    socket and key (hex). The run's exchange file carries it to the build's workers."""

    host: str
    address: str
    authkey: str

    def here(self) -> bool:
        """Whether this process runs on the service's machine (a Unix socket reaches no further)."""
        import socket
        from pathlib import Path

        return self.host == socket.gethostname() and Path(self.address).exists()


@runtime_checkable
class Prefetcher(Protocol):
    """An embedder that can queue texts ahead of the call that needs their rows."""

    def prefetch(self, texts: list[str]) -> None: ...


@dataclass(frozen=True)
class JournalBatch:
    """What one worker recorded since its journal was last drained."""

    cache_entries: tuple[CacheEntry, ...] = ()
    usage: tuple[UsageRecord, ...] = ()
    embeddings: tuple[EmbeddingEntry, ...] = ()

    @property
    def empty(self) -> bool:
        return not (self.cache_entries or self.usage or self.embeddings)

    @staticmethod
    def merge(batches: Iterable[JournalBatch | None]) -> JournalBatch:
        found = [b for b in batches if b is not None]
        return JournalBatch(
            cache_entries=tuple(e for b in found for e in b.cache_entries),
            usage=tuple(u for b in found for u in b.usage),
            embeddings=tuple(e for b in found for e in b.embeddings),
        )


# ---- batch endpoint (tmem.llm.batching; the OpenAI Batch API in tmem.providers.openai_batch) ----------

TERMINAL_STATUSES = frozenset({"completed", "failed", "expired", "cancelled"})


@dataclass(frozen=True)
class RequestLine:
    custom_id: str
    body: dict[str, Any]


@dataclass(frozen=True)
class LineResult:
    """What the batch said about one request: an answer (status 200) or an error.

    ``status_code`` is None when no HTTP response exists for the line (the batch expired, was
    cancelled, or could not be followed): the caller treats that as a transport failure.
    """

    custom_id: str
    status_code: int | None
    content: str = ""
    usage: TokenUsage | None = None
    error: str = ""
    batch_id: str = ""  # set when handed to a caller
    finish_reason: str | None = None  # "length": the answer was cut at the request's max_tokens

    @property
    def ok(self) -> bool:
        return self.status_code == 200


@dataclass(frozen=True)
class BatchState:
    batch_id: str
    status: str
    input_file_id: str
    output_file_id: str | None
    error_file_id: str | None
    errors: str  # batch-level errors (a batch that failed validation), joined

    @property
    def terminal(self) -> bool:
        return self.status in TERMINAL_STATUSES


class BatchTransport(Protocol):
    """The Batch API endpoints (:class:`tmem.providers.openai_batch.BatchClient`)."""

    def submit(self, lines: list[RequestLine], metadata: dict[str, str]) -> tuple[str, str]: ...

    def retrieve(self, batch_id: str) -> BatchState: ...

    def results(self, file_id: str) -> dict[str, LineResult]:
        """Every line of a terminal batch's output or error file, by custom id."""
        ...

    def delete_file(self, file_id: str) -> None: ...


class BatchJournal(Protocol):
    """Submitted batches and their request digests, kept across processes."""

    def in_flight(self, digest: str) -> tuple[str, str] | None:
        """(batch id, custom id) of a batch not yet collected that carries ``digest``."""
        ...

    def submitted(
        self, batch_id: str, input_file_id: str, model: str, requests: list[tuple[str, str, str, str | None]],
        at: datetime,
    ) -> None:
        """Record a new batch and its requests as (digest, custom id, operation, conversation id or None)."""
        ...

    def finished(self, batch_id: str, status: str, at: datetime) -> None: ...


# ---- whose call it is ----------------------------------------------------------------------------
# Which conversation an LLM call or an embedding is made for, so that its cache and ledger rows
# can be found again when the conversation is forgotten (``tmem forget``, :mod:`tmem.store.forget`).
#
# Cache keys are content hashes of the messages, which do not name the conversation. So the
# construction stages run inside :func:`conversation_scope` (via :func:`scoped`), and the cached
# chat model records the scope with every ledger row (``llm_usage.conversation_id`` next to the
# row's ``cache_key``); the batching adapter records it with each journalled batch request. A
# context variable carries it: each thread (a Prefect task run, a Dask worker thread) sees the
# scope its own code entered, and nothing else.

P = ParamSpec("P")
T = TypeVar("T")

_SCOPE: ContextVar[str | None] = ContextVar("tmem_conversation_scope", default=None)


def current_conversation() -> str | None:
    """The conversation the current code works for, or ``None`` outside any scope."""
    return _SCOPE.get()


@contextmanager
def conversation_scope(conversation_id: str) -> Iterator[None]:
    """Attribute the LLM calls made inside the block to ``conversation_id``."""
    token = _SCOPE.set(conversation_id)
    try:
        yield
    finally:
        _SCOPE.reset(token)


def scoped(fn: Callable[P, T]) -> Callable[P, T]:
    """Run ``fn(conversation_id, ...)`` inside :func:`conversation_scope` of its ``conversation_id``
    argument (the first positional one, or the keyword)."""

    @functools.wraps(fn)
    def wrapper(*args: P.args, **kwargs: P.kwargs) -> T:
        conversation_id = args[0] if args else kwargs.get("conversation_id")
        if not isinstance(conversation_id, str):
            return fn(*args, **kwargs)
        with conversation_scope(conversation_id):
            return fn(*args, **kwargs)

    return wrapper

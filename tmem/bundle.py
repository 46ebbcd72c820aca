"""The clients a process builds once at the edge and passes down (STYLE.md §3).

The build-role chat model (cached, metered, concurrency-bounded), the embedder (cached) and the
vector store's location; a build's runtime (:mod:`tmem.build.runtime`), the query side and the
evaluation assemble theirs from these. Construction code receives the pieces it needs as
arguments; it never builds a client itself.
"""

from __future__ import annotations

import re
import threading
from pathlib import Path
from typing import TYPE_CHECKING, TypeVar

from pydantic import BaseModel

from tmem.prompts.base import Prompt
from tmem.providers.base import ChatModel, Embedder
from tmem.settings import Role, Settings

if TYPE_CHECKING:
    import duckdb

    from tmem.providers.chat import OpenAIChatModel
    from tmem.providers.llm_ledger import MeteredChatModel

R = TypeVar("R", bound=BaseModel)

LANCE_DIR = "lance"
VECTOR_TABLE = "vectors"


class BoundedChatModel:
    """Caps in-flight calls of the wrapped model at ``limit`` across all threads of a process.

    Prefect's tag concurrency limit (``llm``) bounds task runs on a server; this bound holds
    for every code path, including local ephemeral runs where no limit is configured.
    """

    def __init__(self, inner: ChatModel, limit: int) -> None:
        self._inner = inner
        self._slots = threading.BoundedSemaphore(limit)

    @property
    def model_name(self) -> str:
        return self._inner.model_name

    def complete(self, prompt: Prompt[R]) -> R:
        with self._slots:
            return self._inner.complete(prompt)


_URI_SCHEME = re.compile(r"^[A-Za-z][A-Za-z0-9+.-]*://")


def is_object_uri(location: str) -> bool:
    """True for a URI such as ``s3://bucket/lance`` (LanceDB opens it itself), False for a local path."""
    return bool(_URI_SCHEME.match(location))


def lance_uri(settings: Settings) -> str:
    """Where the vectors live: ``TMEM_LANCE_URI`` (a URI is used verbatim), else ``STORE/lance``."""
    if settings.lance_uri:
        return settings.lance_uri
    return str(Path(settings.store) / LANCE_DIR)


def pinned_lance_uri(location: str) -> str:
    """The location a snapshot manifest records: a URI unchanged, a local path made absolute."""
    return location if is_object_uri(location) else str(Path(location).resolve())


def chat_model_for(settings: Settings, role: Role, con: duckdb.DuckDBPyConnection | None, run_id: str) -> ChatModel:
    """The role's chat model: OpenAI-compatible adapter, cached and metered in ``con`` when given."""
    from tmem.providers.chat import ChatConfig, OpenAIChatModel
    from tmem.providers.llm_ledger import CachedChatModel
    from tmem.store.llm_cache import DuckResponseCache, DuckUsageLedger

    adapter = OpenAIChatModel(ChatConfig.from_settings(settings, role))
    batch_ops = settings.batch_operations if role == "build" else frozenset()
    inner: MeteredChatModel = adapter if not batch_ops else _batching(settings, adapter, con, batch_ops)
    if con is None:
        cached = CachedChatModel(inner, cache=None, ledger=None, run_id=run_id)
    else:
        cached = CachedChatModel(inner, cache=DuckResponseCache(con), ledger=DuckUsageLedger(con), run_id=run_id)
    if batch_ops:
        return cached  # the batching adapter bounds its synchronous calls; batched callers only wait
    return BoundedChatModel(cached, settings.llm_concurrency)


def _batching(
    settings: Settings, adapter: OpenAIChatModel, con: duckdb.DuckDBPyConnection | None, ops: frozenset[str]
) -> MeteredChatModel:
    """The build adapter with ``ops`` sent through the OpenAI Batch API (``TMEM_LLM_BATCH=on``)."""
    from tmem.providers.batch_api import BatchClient
    from tmem.providers.batching import BatchConfig, BatchingChatModel
    from tmem.store.batch_journal import DuckBatchJournal

    endpoint = settings.endpoint("build")
    client = BatchClient(endpoint.base_url, endpoint.api_key.get_secret_value(), timeout_s=settings.llm_timeout_s,
                         max_retries=settings.llm_max_retries)
    config = BatchConfig(
        operations=ops, linger_s=settings.llm_batch_linger_s, max_size=settings.llm_batch_max_size,
        poll_s=settings.llm_batch_poll_s, poll_max_s=settings.llm_batch_poll_max_s, sync_limit=settings.llm_concurrency,
    )
    return BatchingChatModel(adapter, client, config, journal=DuckBatchJournal(con) if con is not None else None)


def embedder_for(settings: Settings, con: duckdb.DuckDBPyConnection | None, *, threads: int = 0) -> Embedder:
    """The configured sentence-transformers embedder, cached by content hash in ``con`` when given;
    ``threads`` > 0 limits torch to that many threads during its calls (the query side's setting)."""
    from tmem.providers.embed import CachedEmbedder, SentenceTransformerEmbedder

    inner = SentenceTransformerEmbedder(
        settings.embedding_model, batch_size=settings.embedding_batch_size, device=settings.embedding_device,
        threads=threads,
    )
    if con is None:
        return inner
    from tmem.store.embed_cache import DuckEmbeddingCache

    return CachedEmbedder(inner, DuckEmbeddingCache(con))

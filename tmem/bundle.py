"""The dependency bundle: built once at the edge, passed down (STYLE.md §3).

A :class:`BuildBundle` holds what a build needs — settings, the build-role chat model
(cached, metered, concurrency-bounded), the embedder (cached), the working database and
the vector store. Construction code receives the pieces it needs as arguments; it never
builds a client itself.
"""

from __future__ import annotations

import re
import threading
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, TypeVar

from pydantic import BaseModel

from tmem.prompts.base import Prompt
from tmem.providers.base import ChatModel, Embedder
from tmem.providers.llm_ledger import OperationUsage
from tmem.settings import Role, Settings

if TYPE_CHECKING:
    import duckdb

    from tmem.providers.chat import OpenAIChatModel
    from tmem.providers.journal import WorkJournal
    from tmem.providers.llm_ledger import MeteredChatModel
    from tmem.store.lance import VectorStore

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


@dataclass(frozen=True)
class BuildBundle:
    settings: Settings
    run_id: str
    con: duckdb.DuckDBPyConnection  # the working DB; on a Dask worker, the run's read-only exchange file
    chat: ChatModel
    embedder: Embedder
    journal: WorkJournal | None = None  # set on a Dask worker: what it would have written to the store

    def usage(self) -> dict[str, OperationUsage]:
        """This run's LLM usage per operation, from the ledger."""
        from tmem.store.llm_cache import DuckUsageLedger

        return DuckUsageLedger(self.con).summary(self.run_id)

    def vectors(self) -> VectorStore:
        from tmem.store.lance import VectorStore

        return VectorStore(lance_uri(self.settings), dim=self.embedder.dim)


def open_build_bundle(settings: Settings, run_id: str) -> BuildBundle:
    from tmem.store.duck import connect

    con = connect(settings.store)
    return BuildBundle(
        settings=settings,
        run_id=run_id,
        con=con,
        chat=chat_model_for(settings, "build", con, run_id),
        embedder=embedder_for(settings, con),
    )


def open_worker_bundle(settings: Settings, run_id: str, exchange: Path) -> BuildBundle:
    """A bundle for a process that must not write the store (a Dask worker).

    Turns and cache hits come from the run's exchange file, opened read-only; new answers,
    ledger rows and embeddings go to the bundle's journal, which the publisher writes.
    """
    from tmem.providers.chat import ChatConfig, OpenAIChatModel
    from tmem.providers.embed import CachedEmbedder, SentenceTransformerEmbedder
    from tmem.providers.journal import (
        JournalingEmbeddingCache,
        JournalingResponseCache,
        JournalingUsageLedger,
        WorkJournal,
    )
    from tmem.providers.llm_ledger import CachedChatModel
    from tmem.store.embed_cache import DuckEmbeddingCache
    from tmem.store.exchange import check_worker_settings, open_exchange
    from tmem.store.llm_cache import DuckResponseCache

    con = open_exchange(exchange)
    try:
        check_worker_settings(con, exchange, settings)
    except BaseException:
        con.close()
        raise
    journal = WorkJournal()
    cached = CachedChatModel(
        OpenAIChatModel(ChatConfig.from_settings(settings, "build")),
        cache=JournalingResponseCache(DuckResponseCache(con), journal),
        ledger=JournalingUsageLedger(journal),
        run_id=run_id,
    )
    inner = SentenceTransformerEmbedder(
        settings.embedding_model, batch_size=settings.embedding_batch_size, device=settings.embedding_device
    )
    return BuildBundle(
        settings=settings,
        run_id=run_id,
        con=con,
        chat=BoundedChatModel(cached, settings.llm_concurrency),
        embedder=CachedEmbedder(inner, JournalingEmbeddingCache(DuckEmbeddingCache(con), journal)),
        journal=journal,
    )

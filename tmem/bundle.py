"""The dependency bundle: built once at the edge, passed down (STYLE.md §3).

A :class:`BuildBundle` holds what a build needs — settings, the build-role chat model
(cached, metered, concurrency-bounded), the embedder (cached), the working database and
the vector store. Construction code receives the pieces it needs as arguments; it never
builds a client itself.
"""

from __future__ import annotations

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


def lance_uri(settings: Settings) -> str:
    return str(Path(settings.store) / LANCE_DIR)


def chat_model_for(settings: Settings, role: Role, con: duckdb.DuckDBPyConnection | None, run_id: str) -> ChatModel:
    """The role's chat model: OpenAI-compatible adapter, cached and metered in ``con`` when given."""
    from tmem.providers.chat import ChatConfig, OpenAIChatModel
    from tmem.providers.llm_ledger import CachedChatModel
    from tmem.store.llm_cache import DuckResponseCache, DuckUsageLedger

    adapter = OpenAIChatModel(ChatConfig.from_settings(settings, role))
    if con is None:
        cached = CachedChatModel(adapter, cache=None, ledger=None, run_id=run_id)
    else:
        cached = CachedChatModel(adapter, cache=DuckResponseCache(con), ledger=DuckUsageLedger(con), run_id=run_id)
    return BoundedChatModel(cached, settings.llm_concurrency)


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
    con: duckdb.DuckDBPyConnection
    chat: ChatModel
    embedder: Embedder

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

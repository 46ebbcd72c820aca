"""The clients a process builds once at the edge and passes down (STYLE.md §3).

The role's chat model (the provider's adapter under the call layer: cached, metered, batched
when asked, concurrency-bounded) and the embedder (cached); a build's runtime
(:mod:`tmem.build.runtime`), the query side and the evaluation assemble theirs from these.
Construction code receives the pieces it needs as arguments; it never builds a client itself.
Which adapter serves a provider name is :mod:`tmem.providers.registry`'s to say.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from tmem.errors import ConfigError
from tmem.llm.bounded import BoundedChatModel
from tmem.llm.cached_embedder import CachedEmbedder
from tmem.llm.response_cache import CachedChatModel
from tmem.ports import (
    BatchableChatModel,
    ChatModel,
    Embedder,
    EmbeddingCache,
    MeteredChatModel,
    ResponseCache,
    UsageLedger,
)
from tmem.providers.registry import ChatProvider, chat_provider, embedder_factory
from tmem.settings import Role, Settings

if TYPE_CHECKING:
    import duckdb


def chat_model_for(settings: Settings, role: Role, con: duckdb.DuckDBPyConnection | None, run_id: str, *,
                   ledger: UsageLedger | None = None, cache: ResponseCache | None = None) -> ChatModel:
    """The role's chat model: the provider's adapter, cached and metered in ``con`` when given
    (``ledger`` / ``cache``: the usage ledger and response cache to use, default a
    :class:`DuckUsageLedger` and a :class:`DuckResponseCache` on ``con``)."""
    from tmem.store.llm_cache import DuckResponseCache, DuckUsageLedger

    provider = chat_provider(settings, role)
    adapter = provider.adapter(settings, role)
    batch_ops = settings.batch_operations if role == "build" else frozenset()
    inner: MeteredChatModel = adapter if not batch_ops else _batching(settings, provider, adapter, con, batch_ops)
    if con is None:
        cached = CachedChatModel(inner, cache=None, ledger=None, run_id=run_id)
    else:
        cached = CachedChatModel(inner, cache=cache or DuckResponseCache(con), ledger=ledger or DuckUsageLedger(con),
                                 run_id=run_id)
    if batch_ops:
        return cached  # the batching adapter bounds its synchronous calls; batched callers only wait
    return BoundedChatModel(cached, settings.llm_concurrency)


def _batching(
    settings: Settings, provider: ChatProvider, adapter: MeteredChatModel, con: duckdb.DuckDBPyConnection | None,
    ops: frozenset[str],
) -> MeteredChatModel:
    """The build adapter with ``ops`` sent through the provider's batch endpoint (``TMEM_LLM_BATCH=on``)."""
    from tmem.llm.batching import BatchConfig, BatchingChatModel
    from tmem.store.batch_journal import DuckBatchJournal

    if provider.batch_transport is None or not hasattr(adapter, "request_body"):
        raise ConfigError(f"TMEM_LLM_BATCH=on: provider {settings.llm_provider!r} has no batch endpoint")
    batchable: BatchableChatModel = adapter  # type: ignore[assignment]  # checked above: it renders requests
    config = BatchConfig(
        operations=ops, linger_s=settings.llm_batch_linger_s, max_size=settings.llm_batch_max_size,
        poll_s=settings.llm_batch_poll_s, poll_max_s=settings.llm_batch_poll_max_s, sync_limit=settings.llm_concurrency,
    )
    journal = DuckBatchJournal(con) if con is not None else None
    return BatchingChatModel(batchable, provider.batch_transport(settings), config, journal=journal)


def embedder_from_settings(settings: Settings, cache: EmbeddingCache | None = None, *, threads: int = 0) -> Embedder:
    """The configured embedder (``TMEM_EMBEDDING_*``), behind ``cache`` when one is given; ``threads``
    > 0 limits torch to that many threads during its calls (the query side's setting)."""
    inner = embedder_factory(settings)(settings, threads)
    return CachedEmbedder(inner, cache) if cache is not None else inner


def embedder_for(settings: Settings, con: duckdb.DuckDBPyConnection | None, *, threads: int = 0) -> Embedder:
    """:func:`embedder_from_settings`, cached by content hash in ``con`` when given."""
    if con is None:
        return embedder_from_settings(settings, threads=threads)
    from tmem.store.embed_cache import DuckEmbeddingCache

    return embedder_from_settings(settings, DuckEmbeddingCache(con), threads=threads)

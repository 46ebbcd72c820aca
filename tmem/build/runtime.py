"""The runtime of one build in one process, opened from its :class:`~tmem.build.spec.BuildSpec`.

A :class:`BuildRuntime` is what the stages use (STYLE.md §3): the settings, the build-role chat
model (cached, metered, bounded to ``TMEM_LLM_CONCURRENCY`` calls in flight in this process),
the embedder (one coalescing worker with the embedding cache in it), the stage-result cache, and the database behind the caches. Opening one
loads the model clients and the migrations, so a process opens it once per run:
:func:`runtime_for` memoises it on the values a task receives — the spec, the run id and, on a
Dask worker, the path of the run's exchange file.

Two kinds:

* the **publisher's** (no exchange): the working database ``work.duckdb`` — this process is the
  store's single writer;
* a **worker's** (``exchange`` given): turns and cache hits come from the run's exchange file,
  opened read-only (any number of processes may); what the worker would have written — new
  answers, ledger rows, embeddings — goes to a journal the publisher writes
  (:mod:`tmem.store.exchange`). Stage results go straight to the store's files.
"""

from __future__ import annotations

import logging
import os
import threading
from collections.abc import Iterator
from contextlib import contextmanager, nullcontext
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

from tmem.build.spec import BuildSpec, build_fingerprint
from tmem.bundle import chat_model_for
from tmem.errors import EmbeddingError
from tmem.llm.bounded import BoundedChatModel
from tmem.llm.embed_queue import CoalescingEmbedder
from tmem.ports import ChatModel, Embedder, OperationUsage, ResponseCache
from tmem.providers.registry import chat_provider, embedder_factory
from tmem.settings import Settings
from tmem.store.embed_cache import DuckEmbeddingCache
from tmem.store.lance_location import lance_uri
from tmem.store.stage_cache import StageCache

if TYPE_CHECKING:
    import duckdb

    from tmem.llm.embed_service import EmbeddingService
    from tmem.llm.journal import WorkJournal
    from tmem.ports import JournalBatch
    from tmem.providers.encoder_process import EncoderPool
    from tmem.store.lance import VectorStore
    from tmem.store.llm_cache import DuckUsageLedger


log = logging.getLogger(__name__)


@dataclass(frozen=True)
class BuildRuntime:
    spec: BuildSpec
    settings: Settings
    run_id: str
    con: duckdb.DuckDBPyConnection  # the working DB; on a Dask worker, the run's read-only exchange file
    chat: ChatModel
    embedder: Embedder
    stages: StageCache
    fingerprint: str
    journal: WorkJournal | None = None  # set on a Dask worker: what it would have written to the store
    embed_queue: CoalescingEmbedder | None = None  # the one worker every conversation's new texts go through
    ledger: DuckUsageLedger | None = None  # the publisher's (deferred) usage ledger, flushed per conversation
    # The publisher's, on Dask with dask_shared_encoder: its queue served to the workers on this machine.
    service: EmbeddingService | None = None
    # Set on a Dask worker: every read of ``con`` (turns, response and embedding cache) holds it, one at a
    # time. Concurrent reads on cursors of the worker's exchange connection deadlocked a nightly of 1,000
    # conversations (an Arrow export of the embedding cache waiting for the GIL while another thread,
    # holding it, waited inside DuckDB to prepare a turns query); the reads take milliseconds.
    reads: threading.Lock | None = None

    @contextmanager
    def reading(self) -> Iterator[duckdb.DuckDBPyConnection]:
        """A cursor of ``con`` for one read (under :attr:`reads` when set), closed after."""
        with self.reads or nullcontext():
            cur = self.con.cursor()
            try:
                yield cur
            finally:
                cur.close()

    @property
    def store(self) -> Path:
        return self.spec.store_path

    def usage(self) -> dict[str, OperationUsage]:
        """This run's LLM usage per operation, from the ledger (its deferred rows committed first)."""
        from tmem.store.llm_cache import DuckUsageLedger

        return (self.ledger or DuckUsageLedger(self.con)).summary(self.run_id)

    def flush_ledger(self) -> None:
        """Commit the usage rows recorded so far (a conversation's, as it finishes)."""
        if self.ledger is not None:
            self.ledger.flush()

    def vectors(self) -> VectorStore:
        from tmem.store.lance import VectorStore

        return VectorStore(lance_uri(self.settings), dim=self.embedder.dim)


def open_publisher_runtime(spec: BuildSpec, run_id: str) -> BuildRuntime:
    """The runtime over the working database (this process becomes the store's writer)."""
    from tmem.store.duck import connect
    from tmem.store.llm_cache import DuckResponseCache, DuckUsageLedger

    settings = spec.load_settings()
    con = connect(settings.store)
    ledger = DuckUsageLedger(con, deferred=True)
    # this process is the store's one writer: a key it never stored is not looked up
    chat = chat_model_for(settings, "build", con, run_id, ledger=ledger, cache=DuckResponseCache(con, known_keys=True))
    # On Dask the publisher's queue serves the workers on this machine (dask_shared_encoder); its encoder
    # starts ahead for a local cluster's workers, else (workers elsewhere, or encoders of their own) on use.
    serve = settings.task_runner == "dask" and settings.dask_shared_encoder
    start = settings.task_runner == "threads" or (serve and not settings.dask_address)
    queue = CoalescingEmbedder(_embedder(settings, worker=False, start=start), cache=DuckEmbeddingCache(con))
    service = None
    if serve:
        from tmem.llm.embed_service import EmbeddingService

        service = EmbeddingService(queue)
    return BuildRuntime(
        spec=spec, settings=settings, run_id=run_id, con=con, chat=chat,
        embedder=queue, stages=StageCache.of_store(settings.store),
        fingerprint=build_fingerprint(settings, chat.model_name), embed_queue=queue, ledger=ledger, service=service,
    )


def _embedder(settings: Settings, *, worker: bool, cores: int | None = None, start: bool = True) -> Embedder:
    """This process's build encoder, laid out by :func:`encoder_layout`: a pool of encoder
    children (the built-in sentence-transformers provider), else the provider's embedder here.
    ``start``: the children start loading the model now, in the background, while the first
    conversations wait for their LLM answers (else on the first call)."""
    processes, threads = encoder_layout(settings, worker=worker, cores=cores)
    if processes:
        from tmem.providers.encoder_process import EncoderSpec, shared_pool

        pool = shared_pool(EncoderSpec(settings.embedding_model, settings.embedding_batch_size,
                                       settings.embedding_device, threads, settings.embedding_batch_tokens), processes)
        if start:
            threading.Thread(target=_start_pool, args=(pool,), name="tmem-encoder-start", daemon=True).start()
        return pool
    return embedder_factory(settings)(settings, threads)


def _start_pool(pool: EncoderPool) -> None:
    try:
        pool.start()
    except EmbeddingError as exc:
        # not lost: a child that cannot start raises the same error at the build's first embedding call
        log.debug("the encoder pool did not start ahead of the build: %s", exc)


MAX_AUTO_ENCODERS = 4  # beyond it a child gets more threads, not a model copy of its own (~0.4 GB each)


def encoder_layout(settings: Settings, *, worker: bool, cores: int | None = None) -> tuple[int, int]:
    """``(processes, torch threads)`` of this process's build encoder; 0 processes: in this process.

    ``TMEM_EMBEDDING_PROCESSES=auto`` gives the process's share of the cores to single-threaded
    encoder children, one per core up to :data:`MAX_AUTO_ENCODERS` (then more threads each): on 2
    cores two children embed more per second than one two-threaded model and lose less of it beside
    the build's own work (:mod:`tmem.providers.encoder_process`). A worker of the local Dask cluster
    shares the machine with ``dask_workers - 1`` others, so its share is ``cores // dask_workers``; a
    worker of an external cluster (``dask_address``) cannot know its neighbours and embeds in its own
    process at torch's default, as does an embedder of another provider."""
    share = (cores or os.cpu_count() or 1) // (settings.dask_workers if worker else 1)
    share = max(1, share)
    wanted = settings.embedding_processes
    if settings.embedding_provider != "sentence-transformers" or wanted == 0 or (
            wanted == "auto" and worker and settings.dask_address):
        return 0, embedding_threads(settings, worker=worker, cores=cores)
    processes = min(share, MAX_AUTO_ENCODERS) if wanted == "auto" else int(wanted)
    return processes, settings.embedding_threads or max(1, share // processes)


def embedding_threads(settings: Settings, *, worker: bool, cores: int | None = None) -> int:
    """Torch threads of a build embedder running in the build's own process (0: torch's default,
    every core).

    ``TMEM_EMBEDDING_THREADS`` when set. A worker of the local Dask cluster shares the machine with
    ``dask_workers - 1`` others embedding at the same time: each left at torch's default runs as
    many threads as there are cores, and on 2 cores two workers x 2 threads took 1.3x as long as
    two x 1 for the same texts (``bench/embed_build.py``), so it gets its share of the cores. A
    worker of an external cluster (``dask_address``) cannot know its neighbours: torch's default."""
    if settings.embedding_threads:
        return settings.embedding_threads
    if not worker or settings.dask_address:
        return 0
    return max(1, (cores or os.cpu_count() or 1) // settings.dask_workers)


def worker_response_cache(con: duckdb.DuckDBPyConnection, reads: threading.Lock, journal: WorkJournal) -> ResponseCache:
    """A worker's LLM response cache: the exchange's rows, read-only, and its own new answers journaled.

    Nothing writes the exchange file while the run lasts, so its keys are read once and a key not among
    them (a new call: ~half of a nightly's requests) is a miss without a query of the exchange; the
    publisher's cache does the same as the working database's single writer."""
    from tmem.llm.journal import JournalingResponseCache
    from tmem.store.llm_cache import DuckResponseCache

    return JournalingResponseCache(DuckResponseCache(con, lock=reads, known_keys=True), journal)


def open_worker_runtime(spec: BuildSpec, run_id: str, exchange: Path) -> BuildRuntime:
    """The runtime of a process that must not write the working database (a Dask worker)."""
    from tmem.llm.journal import JournalingEmbeddingCache, JournalingUsageLedger, WorkJournal
    from tmem.llm.response_cache import CachedChatModel
    from tmem.store.exchange import check_worker_settings, open_exchange, served_encoder

    settings = spec.load_settings()
    con = open_exchange(exchange)
    try:
        check_worker_settings(con, exchange, settings)
    except BaseException:
        con.close()
        raise
    journal = WorkJournal()
    reads = threading.Lock()  # one read of the exchange at a time (BuildRuntime.reads)
    cached = CachedChatModel(
        chat_provider(settings, "build").adapter(settings, "build"),
        cache=worker_response_cache(con, reads, journal),
        ledger=JournalingUsageLedger(journal),
        run_id=run_id,
    )
    served = served_encoder(con)
    embedder: Embedder
    queue = None
    if served is not None and served.here():
        # the publisher's encoder, on this machine: its queue looks texts up and stores them itself
        from tmem.llm.embed_service import RemoteEmbedder

        try:
            embedder = RemoteEmbedder(served, settings.embedding_model)
        except BaseException:
            con.close()
            raise
    else:
        embedder = queue = CoalescingEmbedder(
            _embedder(settings, worker=True), cache=JournalingEmbeddingCache(DuckEmbeddingCache(con, lock=reads), journal))
    return BuildRuntime(
        spec=spec, settings=settings, run_id=run_id, con=con, chat=BoundedChatModel(cached, settings.llm_concurrency),
        embedder=embedder,
        stages=StageCache.of_store(settings.store), fingerprint=build_fingerprint(settings, cached.model_name),
        journal=journal, embed_queue=queue, reads=reads,
    )


# ---- one runtime per (spec, run, exchange) in this process ----------------------------------

_lock = threading.Lock()
_runtimes: dict[tuple[str, str, str | None], BuildRuntime] = {}


def _key(spec: BuildSpec, run_id: str, exchange: str | None) -> tuple[str, str, str | None]:
    return spec.model_dump_json(), run_id, exchange


def runtime_for(spec: BuildSpec, run_id: str, exchange: str | None = None) -> BuildRuntime:
    """The runtime of this spec and run in this process, opened on first use: the publisher's, or
    with ``exchange`` (the run's exchange file) a worker's."""
    key = _key(spec, run_id, exchange)
    with _lock:
        found = _runtimes.get(key)
        if found is None:
            found = (open_worker_runtime(spec, run_id, Path(exchange)) if exchange is not None
                     else open_publisher_runtime(spec, run_id))
            _runtimes[key] = found
        return found


def drain_journal(spec: BuildSpec, run_id: str, exchange: str | None) -> JournalBatch | None:
    """What this process's runtime journaled since the last drain (None: it writes the store itself)."""
    with _lock:
        found = _runtimes.get(_key(spec, run_id, exchange))
    if found is None or found.journal is None:
        return None
    return found.journal.drain()


def release(spec: BuildSpec, run_id: str, exchange: str | None = None) -> JournalBatch | None:
    """Close the runtime of a finished run; returns what its journal still held (a worker's)."""
    with _lock:
        found = _runtimes.pop(_key(spec, run_id, exchange), None)
    if found is None:
        return None
    left = found.journal.drain() if found.journal is not None else None
    if found.service is not None:
        found.service.close()
    if found.embed_queue is not None:
        found.embed_queue.close()
    try:
        found.flush_ledger()
    finally:
        found.con.close()
    return left

"""Scale-out pieces without a cluster (issue 7, point 5): the worker journal, the exchange file,
the publisher's one-transaction write, the task-runner setting and object-store Lance URIs."""

from __future__ import annotations

import threading
from datetime import UTC, datetime
from pathlib import Path
from typing import Any, ClassVar

import duckdb
import numpy as np
import pytest

from tests.flow_helpers import ingest_slice
from tests.paths import REPO
from tmem.errors import ConfigError, StoreError
from tmem.llm.cached_embedder import InMemoryEmbeddingCache
from tmem.llm.journal import JournalingEmbeddingCache, JournalingResponseCache, JournalingUsageLedger, WorkJournal
from tmem.llm.response_cache import InMemoryResponseCache
from tmem.ports import CacheEntry, EmbeddingEntry, JournalBatch, ServiceAddress, UsageRecord
from tmem.settings import load_settings
from tmem.store.conversations import load_turns
from tmem.store.duck import connect
from tmem.store.exchange import (
    check_worker_settings,
    exchange_path,
    export_exchange,
    open_exchange,
    served_encoder,
    write_journal,
)
from tmem.store.lance import VectorRow, VectorStore
from tmem.store.lance_location import is_object_uri, lance_uri, pinned_lance_uri

NOW = datetime(2024, 1, 2, 3, 4, tzinfo=UTC)


def entry(key: str, model: str = "m1", answer: str = '{"a": 1}') -> CacheEntry:
    return CacheEntry(key, "persona", model, "v1", answer, 10, 2, NOW)


def usage(op: str = "persona", run_id: str = "r1") -> UsageRecord:
    return UsageRecord(run_id, op, "m1", 10, 2, 5.0, False, 1, NOW)


def vec(*values: float) -> np.ndarray:
    return np.asarray(values, dtype=np.float32)


def test_a_build_crosses_processes_with_its_vectors_as_one_buffer() -> None:
    """A worker's ConversationBuild returns to the flow through pickle (Dask's protocol 5, each array an
    out-of-band buffer): its ~200 vector rows travel as one matrix, and come back equal, row by row."""
    import pickle

    from tests.factories import sample_memory
    from tmem.build.conversation import ConversationBuild
    from tmem.construct import BuildNote

    matrix = np.random.default_rng(7).standard_normal((200, 16)).astype(np.float32)
    rows = [VectorRow("conv-a", "item", f"i{n}", "content", n % 3, f"text {n}", matrix[n]) for n in range(200)]
    build = ConversationBuild(sample_memory(), rows, 41, notes=(BuildNote("items", "topic-1", "clipped", "a long list"),), seconds=1.5)
    buffers: list[pickle.PickleBuffer] = []
    data = pickle.dumps(build, protocol=5, buffer_callback=buffers.append)
    assert len(buffers) == 1 and buffers[0].raw().nbytes == matrix.nbytes  # was one buffer per row: 200
    back = pickle.loads(data, buffers=buffers)
    assert (back.memory, back.watermark_turn_seq, back.notes, back.seconds) == (build.memory, 41, build.notes, 1.5)
    assert [(r.row_id, r.text) for r in back.vectors] == [(r.row_id, r.text) for r in rows]
    assert all(np.array_equal(a.vector, b.vector) for a, b in zip(back.vectors, rows, strict=True))
    empty = pickle.loads(pickle.dumps(ConversationBuild(sample_memory(), [], 0)))
    assert empty.vectors == [] and empty.memory == build.memory


# ---- the worker journal -------------------------------------------------------------------


def test_journaling_cache_reads_the_base_and_records_new_answers_without_writing_it() -> None:
    base = InMemoryResponseCache()
    base.put(entry("old"))
    journal = WorkJournal()
    cache = JournalingResponseCache(base, journal)

    assert cache.get("old") == '{"a": 1}' and cache.get("new") is None
    cache.put(entry("new", answer='{"a": 2}'))
    assert cache.get("new") == '{"a": 2}'  # hit in this worker, although the base never changes
    assert set(base.entries) == {"old"}
    first = journal.drain()
    assert [e.cache_key for e in first.cache_entries] == ["new"]
    assert journal.drain().empty  # handed out once
    assert cache.get("new") == '{"a": 2}'  # still remembered after the drain


def test_journaling_ledger_and_embedding_cache_record_each_write_once() -> None:
    journal = WorkJournal()
    ledger = JournalingUsageLedger(journal)
    ledger.record(usage())
    ledger.record(usage(run_id="other"))
    assert ledger.summary("r1")["persona"].calls == 1

    base = InMemoryEmbeddingCache()
    base.put_many("e", {"h0": vec(1, 0)})
    cache = JournalingEmbeddingCache(base, journal)
    cache.put_many("e", {"h1": vec(0, 1)})
    cache.put_many("e", {"h1": vec(9, 9), "h2": vec(1, 1)})  # h1 exists: kept, not journaled again
    found = cache.get_many("e", ["h0", "h1", "h2", "missing"])
    assert sorted(found) == ["h0", "h1", "h2"] and found["h1"].tolist() == [0, 1]
    assert len(base) == 1
    batch = journal.drain()
    assert [u.run_id for u in batch.usage] == ["r1", "other"]
    assert [(e.model, e.text_hash) for e in batch.embeddings] == [("e", "h1"), ("e", "h2")]


# ---- exchange file and the publisher's write ----------------------------------------------


@pytest.fixture
def store(tmp_path: Path) -> Path:
    root = tmp_path / "store"
    ingest_slice(root, tmp_path / "slice.json", {"conv-30": 1, "conv-26": 1})
    con = connect(root)
    try:
        write_journal(con, JournalBatch(
            cache_entries=(entry("k1", "gpt-4o-mini"), entry("k2", "other-model")),
            embeddings=(EmbeddingEntry("all-MiniLM-L6-v2", "h1", vec(1, 2)), EmbeddingEntry("other", "h2", vec(3, 4))),
        ))
    finally:
        con.close()
    return root


def test_exchange_holds_the_runs_turns_and_the_build_models_cache_rows_read_only(store: Path) -> None:
    settings = load_settings(store=store)
    con = connect(store)
    try:
        want = load_turns(con, "conv-30")
        info = export_exchange(con, exchange_path(store, "run/1"), ["conv-30"], settings)
    finally:
        con.close()
    assert info.path == store / "exchange" / "run_1.duckdb" and info.path.is_file()
    assert (info.turns, info.llm_cache_rows, info.embedding_rows) == (len(want), 1, 1)

    ex = open_exchange(info.path)
    try:
        assert load_turns(ex, "conv-30") == want and load_turns(ex, "conv-26") == ()
        assert ex.execute("SELECT cache_key FROM llm_cache").fetchall() == [("k1",)]
        with pytest.raises(duckdb.Error, match="read-only"):
            ex.execute("DELETE FROM llm_cache")
        check_worker_settings(ex, info.path, settings)  # same settings: fine
        with pytest.raises(ConfigError, match=r"TMEM_LLM_BUILD_MODEL='gpt-4.1'.*TMEM_SEGMENT_WINDOW='8'"):
            check_worker_settings(ex, info.path, load_settings(store=store, llm_model="gpt-4.1", segment_window=8))
    finally:
        ex.close()
    with pytest.raises(StoreError, match="no build exchange"):
        open_exchange(exchange_path(store, "never-exported"))


def test_the_exchange_names_the_publishers_encoder_and_may_leave_the_embedding_cache_out(store: Path) -> None:
    settings = load_settings(store=store)
    served = ServiceAddress("publisher-host", "/tmp/tmem-encoder-x/encoder.sock", "ab" * 32)
    con = connect(store)
    try:
        plain = export_exchange(con, exchange_path(store, "run-plain"), ["conv-30"], settings)
        local = export_exchange(con, exchange_path(store, "run-local"), ["conv-30"], settings,
                                encoder=served, embeddings=False)
    finally:
        con.close()
    assert (plain.embedding_rows, local.embedding_rows) == (1, 0)
    assert (plain.turns, plain.llm_cache_rows) == (local.turns, local.llm_cache_rows)
    for info, encoder in ((plain, None), (local, served)):
        ex = open_exchange(info.path)
        try:
            assert served_encoder(ex) == encoder
            assert ex.execute("SELECT count(*) FROM embedding_cache").fetchone() == (info.embedding_rows,)
        finally:
            ex.close()


def test_a_workers_response_cache_answers_a_new_key_without_reading_the_exchange(store: Path) -> None:
    """The exchange file is fixed for the run, so a worker reads its keys once: a new call's key is a miss
    at once (no query, none of the exchange's read lock), a stored one is read, and the worker's own answers
    come from its journal."""
    import threading

    from tmem.build.runtime import worker_response_cache

    con = connect(store)
    try:
        info = export_exchange(con, exchange_path(store, "run-keys"), ["conv-30"], load_settings(store=store))
    finally:
        con.close()
    ex = open_exchange(info.path)
    journal = WorkJournal()
    cache = worker_response_cache(ex, threading.Lock(), journal)
    assert cache.get("k1") == '{"a": 1}' and cache.get("k2") is None  # k2 is another model's: not exported
    cache.put(entry("k9", answer='{"a": 9}'))
    ex.close()  # from here a query of the exchange would raise
    assert cache.get("never-asked") is None and cache.get("k9") == '{"a": 9}'
    assert [e.cache_key for e in journal.drain().cache_entries] == ["k9"]
    with pytest.raises(duckdb.Error):
        cache.get("k1")  # a stored key is still read from the exchange


def test_write_journal_is_one_transaction(store: Path) -> None:
    con = connect(store)
    try:
        write_journal(con, JournalBatch(
            cache_entries=(entry("k3", answer='{"a": 1}'), entry("k3", answer='{"a": 3}')),  # two workers, one key
            usage=(usage(), usage()),
            embeddings=(EmbeddingEntry("all-MiniLM-L6-v2", "h1", vec(9, 9)), EmbeddingEntry("e", "h3", vec(5, 6))),
        ))
        assert con.execute("SELECT response FROM llm_cache WHERE cache_key = 'k3'").fetchall() == [('{"a": 3}',)]
        assert con.execute("SELECT count(*) FROM llm_usage WHERE run_id = 'r1'").fetchone() == (2,)
        assert con.execute(
            "SELECT vector FROM embedding_cache WHERE text_hash = 'h1'").fetchone() == ([1.0, 2.0],)  # existing kept
        before = con.execute("SELECT count(*) FROM llm_cache").fetchone()

        broken = UsageRecord("r2", None, "m1", 1, 1, 1.0, False, 1, NOW)  # type: ignore[arg-type]
        with pytest.raises(StoreError, match="nothing was written"):
            write_journal(con, JournalBatch(cache_entries=(entry("k4"),), usage=(broken,)))
        assert con.execute("SELECT count(*) FROM llm_cache").fetchone() == before
        assert con.execute("SELECT count(*) FROM llm_usage WHERE run_id = 'r2'").fetchone() == (0,)
    finally:
        con.close()


def test_a_large_journal_replaces_stored_keys_and_inserts_the_rest(store: Path) -> None:
    """A nightly's journal holds thousands of rows (written as one Arrow table): a key already stored
    takes the new answer, the last answer of a key given twice wins, every ledger row lands."""
    con = connect(store)
    try:
        fresh = tuple(entry(f"n{n}", answer=f'{{"n": {n}}}') for n in range(40))
        write_journal(con, JournalBatch(
            cache_entries=(entry("k1", answer='{"again": 1}'), *fresh, entry("n7", answer='{"n": "last"}')),
            usage=tuple(usage() for _ in range(30)),
        ))
        assert con.execute("SELECT response FROM llm_cache WHERE cache_key = 'k1'").fetchall() == [('{"again": 1}',)]
        assert con.execute("SELECT response FROM llm_cache WHERE cache_key = 'n7'").fetchall() == [('{"n": "last"}',)]
        assert con.execute("SELECT count(*) FROM llm_cache WHERE cache_key LIKE 'n%'").fetchone() == (40,)
        assert con.execute("SELECT count(*) FROM llm_usage WHERE run_id = 'r1'").fetchone() == (30,)
    finally:
        con.close()


# ---- settings: task runner, Lance location ------------------------------------------------


def _profiling(dask_worker: Any) -> bool:
    return "profile" in dask_worker.periodic_callbacks


def _duplicate_here() -> Any:
    from tmem.tasks.scaleout import ConfiguredTaskRunner

    return ConfiguredTaskRunner().duplicate()


def test_on_a_dask_worker_the_flows_runner_is_duplicated_idle(monkeypatch: pytest.MonkeyPatch) -> None:
    """Prefect duplicates the flow's task runner for each task run a worker starts; there it is never used,
    so it costs neither a read of the settings nor an API client."""
    from distributed import Client, LocalCluster
    from prefect.task_runners import ThreadPoolTaskRunner

    from tmem.tasks import scaleout

    reads: list[str] = []
    real = scaleout.load_settings
    monkeypatch.setattr(scaleout, "load_settings", lambda: reads.append("read") or real())
    monkeypatch.setenv("TMEM_TASK_RUNNER", "dask")
    with LocalCluster(n_workers=1, threads_per_worker=1, processes=False, dashboard_address=None) as cluster, \
            Client(cluster) as client:
        on_worker = client.submit(_duplicate_here, pure=False).result()
    assert isinstance(on_worker, ThreadPoolTaskRunner) and reads == []
    monkeypatch.setenv("TMEM_TASK_RUNNER", "threads")
    assert isinstance(_duplicate_here(), ThreadPoolTaskRunner) and reads == ["read"]  # the flow's process reads them


def _build_modules_loaded() -> list[str]:
    import sys

    from tmem.tasks.dask_runner import WORKER_PRELOAD

    return [name for name in WORKER_PRELOAD if name not in sys.modules]


def test_a_local_clusters_workers_run_without_dasks_own_profiler() -> None:
    from distributed import Client, LocalCluster

    from tmem.tasks.scaleout import task_runner_for

    runner: Any = task_runner_for(load_settings(task_runner="dask", dask_workers=1, dask_threads_per_worker=1))
    with LocalCluster(**runner.cluster_kwargs) as cluster, Client(cluster) as client:
        assert list(client.run(_profiling).values()) == [False]
        # the build's modules are imported as the worker starts, before any task run arrives
        assert list(client.run(_build_modules_loaded).values()) == [[]]
    with LocalCluster(n_workers=1, threads_per_worker=1, processes=True, dashboard_address=None) as cluster, \
            Client(cluster) as client:
        assert list(client.run(_profiling).values()) == [True]  # Dask's default, which the runner turns off


WORKER_IMPORTS = """
import sys
import prefect, distributed, prefect_dask  # a worker has these before its first task
import tmem.flows.build_memory  # unpickling the flow run's context, around every task run, imports the flow
import tmem.tasks.build, tmem.build.runtime, tmem.llm.journal, tmem.llm.response_cache, tmem.llm.embed_service
import tmem.store.exchange, tmem.store.llm_cache, tmem.providers.registry
print(sorted(m for m in ("lancedb", "torch", "sentence_transformers", "transformers") if m in sys.modules))
"""


def test_a_worker_building_conversations_imports_no_vector_store_or_model_library() -> None:
    """What a Dask worker imports to build conversations through the publisher's encoder: the build flow's
    module (Prefect's context around each task run carries the flow), the task, its runtime and the caches;
    no LanceDB (~1-1.5 s of every worker's start, before its first LLM call) and no model library. A fresh
    interpreter, so that nothing this test process loaded counts."""
    import subprocess
    import sys

    found = subprocess.run([sys.executable, "-c", WORKER_IMPORTS], cwd=REPO, capture_output=True, text=True,
                           timeout=120, check=True)
    assert found.stdout.strip() == "[]", found.stdout + found.stderr


def test_task_runner_follows_the_settings(monkeypatch: pytest.MonkeyPatch) -> None:
    from prefect.task_runners import ThreadPoolTaskRunner
    from prefect_dask import DaskTaskRunner

    from tmem.tasks.dask_runner import BuildDaskTaskRunner
    from tmem.tasks.scaleout import ConfiguredTaskRunner, task_runner_for

    threads = task_runner_for(load_settings())
    assert isinstance(threads, ThreadPoolTaskRunner) and threads._max_workers == 16
    assert task_runner_for(load_settings(build_concurrency=3))._max_workers == 3
    remote = task_runner_for(load_settings(task_runner="dask", dask_address="tcp://10.0.0.5:8786"))
    assert isinstance(remote, BuildDaskTaskRunner) and remote.address == "tcp://10.0.0.5:8786"
    local = task_runner_for(load_settings(task_runner="dask", dask_workers=3), api_url="http://127.0.0.1:4200/api")
    assert isinstance(local, DaskTaskRunner) and local.address is None
    assert local.cluster_kwargs["n_workers"] == 3 and local.cluster_kwargs["processes"] is True
    assert local.cluster_kwargs["env"] == {"PREFECT_API_URL": "http://127.0.0.1:4200/api"}  # workers report there
    with pytest.raises(ConfigError, match="TMEM_LLM_BATCH=on is not supported"):  # workers keep no batch journal
        task_runner_for(load_settings(task_runner="dask", llm_batch="on"))
    assert isinstance(task_runner_for(load_settings(llm_batch="on")), ThreadPoolTaskRunner)

    # What Prefect enters when a flow run starts: the settings of that moment.
    assert isinstance(ConfiguredTaskRunner().duplicate(), ThreadPoolTaskRunner)
    monkeypatch.delenv("PREFECT_API_URL", raising=False)
    monkeypatch.setenv("TMEM_TASK_RUNNER", "dask")
    monkeypatch.setenv("TMEM_DASK_ADDRESS", "tcp://10.0.0.5:8786")
    from prefect.settings import PREFECT_API_URL, temporary_settings

    # Without an API URL (another test's Prefect harness may have set one for the session):
    with temporary_settings(restore_defaults={PREFECT_API_URL}), pytest.raises(ConfigError, match="PREFECT_API_URL"):
        ConfiguredTaskRunner().duplicate()  # remote workers cannot reach a temporary server
    monkeypatch.setenv("TMEM_TASK_RUNNER", "ray")
    with pytest.raises(ValueError, match="task_runner"):
        ConfiguredTaskRunner().duplicate()


@pytest.mark.parametrize("uri", ["s3://bucket/tmem/lance", "gs://bucket/lance", "az://container/lance",
                                 "memory://tmem/lance"])
def test_object_store_lance_uris_are_used_verbatim(tmp_path: Path, uri: str) -> None:
    settings = load_settings(store=tmp_path, lance_uri=uri)
    assert lance_uri(settings) == uri and is_object_uri(uri)
    assert pinned_lance_uri(uri) == uri  # what a snapshot manifest records


def test_local_lance_paths_are_pinned_absolute(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.chdir(tmp_path)
    assert lance_uri(load_settings(store=Path("s"))) == str(Path("s") / "lance")
    assert pinned_lance_uri("s/lance") == str(tmp_path / "s" / "lance") and not is_object_uri("s/lance")


def test_vector_store_on_an_in_memory_lance_uri(tmp_path: Path) -> None:
    store = VectorStore("memory://tmem-test/lance", dim=2)
    rows = [VectorRow("c1", "item", "i1", "content", 0, "hello", vec(1, 0))]
    version = store.replace_conversations("vectors", {"c1": rows})
    loaded = store.load_conversation("vectors", "c1", version=version)
    assert loaded.to_polars()["text"].to_list() == ["hello"]
    assert not (tmp_path / "memory:").exists() and not Path("memory:").exists()  # nothing on disk


def test_a_local_dask_worker_embeds_with_its_share_of_the_cores() -> None:
    from tmem.build.runtime import embedding_threads

    two = load_settings(dask_workers=2)
    assert embedding_threads(two, worker=True, cores=2) == 1  # not 2 workers x 2 torch threads on 2 cores
    assert embedding_threads(load_settings(dask_workers=2), worker=True, cores=8) == 4
    assert embedding_threads(load_settings(dask_workers=4), worker=True, cores=2) == 1
    assert embedding_threads(two, worker=False, cores=2) == 0  # the publisher alone: torch's default
    assert embedding_threads(load_settings(dask_workers=2, dask_address="tcp://10.0.0.5:8786"), worker=True, cores=2) == 0
    assert embedding_threads(load_settings(dask_workers=2, embedding_threads=2), worker=True, cores=2) == 2


def _worker_runtime(store: Path, monkeypatch: pytest.MonkeyPatch, run_id: str, embedder: Any,
                    encoder: ServiceAddress | None = None, **settings: Any) -> Any:
    """A Dask worker's runtime over an exchange of conv-30 (naming ``encoder``, the publisher's service), its
    own embedder made by ``embedder(settings, threads)`` (registered as a toy provider for this test)."""
    from tmem.build.runtime import open_worker_runtime
    from tmem.build.spec import BuildSpec
    from tmem.providers import registry

    monkeypatch.setattr(registry, "EMBEDDING_PROVIDERS", dict(registry.EMBEDDING_PROVIDERS))
    registry.register_embedding_provider(f"toy-{run_id}", embedder)
    resolved = load_settings(store=store, embedding_provider=f"toy-{run_id}", llm_base_url="http://127.0.0.1:9/v1",
                             llm_api_key="sk-test", **settings)
    con = connect(store)
    try:
        info = export_exchange(con, exchange_path(store, run_id), ["conv-30"], resolved, encoder=encoder)
    finally:
        con.close()
    return open_worker_runtime(BuildSpec.resolve(store, resolved), run_id, info.path)


def test_a_worker_on_the_publishers_machine_embeds_through_its_service(store: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    from tests.query_store import HashEmbedder
    from tmem.llm.embed_queue import CoalescingEmbedder
    from tmem.llm.embed_service import EmbeddingService, RemoteEmbedder

    own: list[int] = []

    def toy(settings: object, threads: int) -> HashEmbedder:
        own.append(threads)
        return HashEmbedder()

    publisher = CoalescingEmbedder(HashEmbedder(), linger_s=0.0)
    service = EmbeddingService(publisher)
    try:
        # the model name the worker checks is the embedding_model both sides are set to
        model = load_settings(store=store).embedding_model
        monkeypatch.setattr(HashEmbedder, "model_name", property(lambda self: model))
        rt = _worker_runtime(store, monkeypatch, "run-served", toy, encoder=service.address)
        try:
            assert isinstance(rt.embedder, RemoteEmbedder) and rt.embed_queue is None and own == []  # no model here
            assert rt.embedder.embed(["a view"]).shape == (1, HashEmbedder().dim) and publisher.usage.texts == 1
            rt.embedder.prefetch(["a scene summary", "a dialogue window"])
            assert publisher.usage.prefetched == 2  # the worker's scene views go ahead on the publisher's queue
        finally:
            rt.con.close()
        elsewhere = ServiceAddress("another-host.example", service.address.address, service.address.authkey)
        rt = _worker_runtime(store, monkeypatch, "run-elsewhere", toy, encoder=elsewhere)
        try:
            assert isinstance(rt.embedder, CoalescingEmbedder) and rt.embed_queue is rt.embedder and len(own) == 1
        finally:
            rt.con.close()
    finally:
        service.close()
        publisher.close()


def test_the_worker_runtime_hands_its_thread_share_to_the_embedder(store: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    from tests.query_store import HashEmbedder

    asked: list[int] = []

    def toy(settings: object, threads: int) -> HashEmbedder:
        asked.append(threads)
        return HashEmbedder()

    rt = _worker_runtime(store, monkeypatch, "run-threads", toy, dask_workers=64)
    try:
        assert asked == [1]  # 64 workers on this machine's cores: one thread each
    finally:
        rt.con.close()


def test_a_worker_reads_its_exchange_one_read_at_a_time(store: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Turns, response-cache and embedding-cache reads of a worker share one lock: concurrent reads on
    cursors of the exchange connection deadlocked a worker of a 1,000-conversation Dask nightly."""
    import threading
    from concurrent.futures import ThreadPoolExecutor

    from tests.query_store import HashEmbedder

    rt = _worker_runtime(store, monkeypatch, "run-reads", lambda settings, threads: HashEmbedder())
    try:
        assert isinstance(rt.reads, type(threading.Lock()))

        def turns() -> int:
            with rt.reading() as cur:
                return len(load_turns(cur, "conv-30"))

        assert rt.embed_queue is not None and rt.embed_queue.cache is not None
        reads = {
            "turns": turns,
            "embedding cache": lambda: rt.embed_queue.cache.get_many("m1", ["k"]),  # type: ignore[union-attr]
            # a key the exchange holds: a key it does not is a miss without a read (worker_response_cache)
            "response cache": lambda: rt.chat._inner._cache.get("k1"),  # type: ignore[attr-defined]
        }
        with ThreadPoolExecutor(len(reads)) as pool:
            with rt.reads:
                waiting = {name: pool.submit(read) for name, read in reads.items()}
                threading.Event().wait(0.3)
                assert [name for name, f in waiting.items() if f.done()] == []  # each waits for the lock
            results = {name: f.result(timeout=10) for name, f in waiting.items()}
        assert results["turns"] > 0 and results["embedding cache"] == {} and results["response cache"] == '{"a": 1}'
    finally:
        rt.con.close()


def test_units_submitted_together_serialise_the_prefect_settings_once(monkeypatch: pytest.MonkeyPatch) -> None:
    """What a Dask task runner sends with every submission (``serialize_context``): under
    ``settings_serialized_once`` the settings are serialised for the first unit only, and every unit
    gets exactly what it got before; outside it, each call serialises again."""
    import pickle

    from prefect.context import SettingsContext, serialize_context
    from prefect.settings import Settings

    from tmem.tasks.build import settings_serialized_once

    calls: list[bool] = []
    serialize = SettingsContext.serialize

    def counted(self: SettingsContext, include_secrets: bool = True) -> dict[str, Any]:
        calls.append(include_secrets)
        return serialize(self, include_secrets=include_secrets)

    monkeypatch.setattr(SettingsContext, "serialize", counted)
    outer = SettingsContext.get()
    before = serialize_context()["settings_context"]
    with settings_serialized_once():
        sent = [serialize_context()["settings_context"] for _ in range(3)]
        inner = SettingsContext.get()
        assert outer is not None and inner is not None and inner is not outer
        assert inner.settings is outer.settings and inner.profile == outer.profile
    assert SettingsContext.get() is outer
    assert len(calls) == 2  # one outside, one for the three units
    # a worker's task run makes its settings context from what it was sent (pickled by Dask): the
    # same profile and settings as from the dump, the settings model taken as it is, not validated again
    assert all(s["profile"] == before["profile"] and s["settings"] is outer.settings for s in sent)
    hydrated = SettingsContext(**pickle.loads(pickle.dumps(sent[0])))
    assert hydrated.settings == SettingsContext(**before).settings == outer.settings
    assert hydrated.profile == outer.profile
    built: list[int] = []
    init = Settings.__init__

    def counted_init(self: Settings, *args: Any, **kwargs: Any) -> None:
        built.append(1)
        init(self, *args, **kwargs)

    monkeypatch.setattr(Settings, "__init__", counted_init)
    SettingsContext(**pickle.loads(pickle.dumps(sent[0])))
    assert built == []  # no settings source read again
    SettingsContext(**before)
    assert built  # what a dump costs: the settings made again from their sources
    serialize_context()
    assert len(calls) == 3  # the flow's own context serialises as before once the units are sent


class _RecordingCluster:
    """A local in-process cluster that records the thread it was made in (or fails to start)."""

    made_in: ClassVar[list[str]] = []
    fail: ClassVar[BaseException | None] = None

    def __new__(cls, **kwargs: Any) -> Any:
        from distributed import LocalCluster

        cls.made_in.append(threading.current_thread().name)
        if cls.fail is not None:
            raise cls.fail
        return LocalCluster(n_workers=1, threads_per_worker=1, processes=False, dashboard_address=None)


def test_the_build_runner_starts_its_cluster_ahead_in_a_thread_and_hands_over_its_client() -> None:
    from tmem.tasks.dask_runner import BuildDaskTaskRunner

    _RecordingCluster.made_in, _RecordingCluster.fail = [], None
    with BuildDaskTaskRunner(cluster_class=_RecordingCluster) as runner:
        runner.start_ahead()
        runner.start_ahead()  # once on its way, a no-op
        client = runner.client  # waits for the thread
        assert _RecordingCluster.made_in == ["tmem-dask-start"]
        assert runner.client is client and client.submit(sum, [1, 2], pure=False).result() == 3
    assert client.status == "closed"  # the runner's exit closed what the thread made

    _RecordingCluster.made_in, _RecordingCluster.fail = [], RuntimeError("no room for a cluster")
    with BuildDaskTaskRunner(cluster_class=_RecordingCluster) as runner:
        runner.start_ahead()
        with pytest.raises(RuntimeError, match="no room for a cluster"):  # the start's own failure, to the user
            runner.client  # noqa: B018
    assert _RecordingCluster.made_in == ["tmem-dask-start"]  # not tried again behind the error
    _RecordingCluster.fail = None


class _TwoThreadCluster:
    """A local in-process cluster of one worker with two threads."""

    def __new__(cls, **kwargs: Any) -> Any:
        from distributed import LocalCluster

        return LocalCluster(n_workers=1, threads_per_worker=2, processes=False, dashboard_address=None)


_BOTH_THREADS = threading.Barrier(2)  # the first two task runs wait for each other: one on each worker thread


def _client_of_this_task_run(n: int) -> tuple[int, int]:
    from prefect.client.orchestration import get_client
    from prefect.context import FlowRunContext, TaskRunContext

    if n < 2:
        _BOTH_THREADS.wait(timeout=60)
    flow_ctx, task_ctx = FlowRunContext.get(), TaskRunContext.get()
    assert flow_ctx is not None and task_ctx is not None
    assert flow_ctx.client is get_client(sync_client=True)  # the hydrated flow run context uses it too
    return id(get_client(sync_client=True)), threading.get_ident()


@pytest.mark.usefixtures("prefect_harness")
def test_dask_task_runs_on_a_worker_share_its_api_client_across_threads_and_are_not_hashed() -> None:
    """prefect-dask's task engine made two API clients (each a new TLS context) per task run on a worker;
    under the build's runner the task runs of a worker use one client, on every worker thread, as
    Prefect's own client context, and Dask gets each run without hashing its arguments (a UUID key)."""
    import uuid

    from prefect import flow, task

    from tmem.tasks.dask_runner import BuildDaskClient, BuildDaskTaskRunner

    which = task(_client_of_this_task_run, name="which-client")
    keys: list[str] = []
    _BOTH_THREADS.reset()

    @flow(task_runner=BuildDaskTaskRunner(cluster_class=_TwoThreadCluster))
    def four_runs() -> list[tuple[int, int]]:
        from prefect.context import FlowRunContext

        ctx = FlowRunContext.get()
        assert ctx is not None and isinstance(ctx.task_runner.client, BuildDaskClient)
        futures = [which.submit(n) for n in range(4)]
        keys.extend(f.wrapped_future.key for f in futures)
        return [f.result() for f in futures]

    used = four_runs()
    assert len({thread for _, thread in used}) == 2  # both worker threads ran task runs
    assert len({client for client, _ in used}) == 1  # old code: a new client per run; then one per thread
    for key in keys:
        assert key.startswith("_client_of_this_task_run-") and uuid.UUID(key[-36:])  # not a content hash


def test_a_worker_process_api_client_is_kept_for_one_api_on_every_thread_and_another_made_for_another() -> None:
    from prefect.context import SettingsContext, serialize_context
    from prefect.settings import PREFECT_API_URL, PREFECT_CLIENT_SERVER_VERSION_CHECK_ENABLED, temporary_settings

    from tmem.tasks.build import settings_serialized_once
    from tmem.tasks.dask_runner import process_api_client

    def sent_to(url: str, model: bool = False) -> dict[str, Any]:
        with temporary_settings({PREFECT_API_URL: url, PREFECT_CLIENT_SERVER_VERSION_CHECK_ENABLED: False}):
            if model:  # as a build sends its task runs: the settings model itself
                with settings_serialized_once():
                    return serialize_context()
            return serialize_context()

    def in_thread(contexts: list[dict[str, Any]]) -> list[Any]:
        made: list[Any] = []
        worker = threading.Thread(target=lambda: made.extend(process_api_client(c) for c in contexts))
        worker.start()
        worker.join()
        return made

    one, two = sent_to("http://127.0.0.1:4201/api"), sent_to("http://127.0.0.1:4202/api")
    first, again, other = in_thread([one, one, two])
    assert again is first and other is not first
    assert str(first.client.api_url).startswith("http://127.0.0.1:4201") and str(other.client.api_url).startswith("http://127.0.0.1:4202")
    assert not first.client._closed and not other.client._closed  # another thread may still be using the first
    assert in_thread([one, two]) == [first, other]  # another thread: the same clients
    first.client.__exit__(None, None, None)
    remade = in_thread([one])[0]
    assert remade is not first and not remade.client._closed  # a closed client is not handed out again
    assert SettingsContext.get() is not None
    # sent the settings model (a build's task runs): compared by the API it names, not rebuilt per run
    a, b, c = sent_to("http://127.0.0.1:4203/api", True), sent_to("http://127.0.0.1:4203/api", True), sent_to("http://127.0.0.1:4204/api", True)
    assert not isinstance(a["settings_context"]["settings"], dict)
    first, again, other = in_thread([a, b, c])
    assert again is first and other is not first and in_thread([b])[0] is first
    assert str(other.client.api_url).startswith("http://127.0.0.1:4204")

"""build-memory on Prefect's Dask task runner (issue 7, point 5).

A 2-worker ``LocalCluster`` of processes builds the same memory as the thread-pool runner
("same memory" as in tests/test_flow_incremental.py: :mod:`tmem.store.memory_image`), at the
same LLM cost, and no worker process opens ``work.duckdb``: workers read the run's exchange file
read-only and their cache and ledger writes reach the store through the flow process.
"""

from __future__ import annotations

import os
import shutil
from collections.abc import Iterator
from contextlib import ExitStack
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import duckdb
import pytest

from tests.flow_helpers import ingest_slice, published, set_llm_env, wait_for
from tmem.devtools.scripted_llm import ScriptedLLM
from tmem.store.memory_image import diff_images, memory_image

pytestmark = [pytest.mark.prefect, pytest.mark.slow]

SESSIONS = {"conv-30": 1, "conv-26": 1}  # two small conversations: one per worker


@dataclass
class Runs:
    threads_store: Path
    dask_store: Path
    batch_stores: dict[str, Path]  # both conversations in one task run (TMEM_BUILD_BATCH=2), on Dask and threads
    summaries: dict[str, dict[str, Any]]
    requests: dict[str, int]
    connects: dict[str, list[tuple[int, str, bool]]]  # worker address -> its duckdb.connect calls


def _store_rows(store: Path, sql: str, params: list[Any] | None = None) -> list[tuple[Any, ...]]:
    con = duckdb.connect(str(store / "work.duckdb"), read_only=True)
    try:
        return con.execute(sql, params or []).fetchall()
    finally:
        con.close()


@pytest.fixture(scope="module")
def runs(prefect_harness: None, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Runs]:
    from distributed import Client, LocalCluster

    from tests.dask_helpers import RecordDuckDBConnects, recorded_connects
    from tmem.flows.build_memory import build_memory

    root = tmp_path_factory.mktemp("dask")
    server = ScriptedLLM().start()
    stack = ExitStack()
    try:
        with pytest.MonkeyPatch.context() as mp:
            for name in [n for n in os.environ if n.startswith(("TMEM_", "OPENAI_"))]:
                mp.delenv(name)
            set_llm_env(mp, server)  # before the cluster starts: worker processes read TMEM_* from their environment
            cluster = LocalCluster(n_workers=2, threads_per_worker=1, processes=True, dashboard_address=None)
            client = Client(cluster)
            stack.callback(cluster.close)
            stack.callback(client.close)
            client.register_plugin(RecordDuckDBConnects())
            runs = Runs(root / "threads", root / "dask", {n: root / n for n in ("dask-batch", "threads-batch")},
                        {}, {}, {})
            for store in (runs.threads_store, runs.dask_store, *runs.batch_stores.values()):
                ingest_slice(store, root / f"{store.name}.json", SESSIONS)

            def run(name: str, store: Path) -> None:
                before = len(server.requests)
                out: dict[str, Any] = build_memory(store=str(store), label=name)
                assert out["status"] == "completed", out["failures"]
                runs.summaries[name] = out
                runs.requests[name] = len(server.requests) - before

            run("threads", runs.threads_store)
            mp.setenv("TMEM_TASK_RUNNER", "dask")
            mp.setenv("TMEM_DASK_ADDRESS", cluster.scheduler_address)
            run("dask", runs.dask_store)
            # Forget Prefect's task-result cache: the rebuild must get every answer from the LLM
            # response cache, which workers can only read through the exchange file.
            shutil.rmtree(runs.dask_store / "prefect")
            run("dask-rebuild", runs.dask_store)
            runs.connects = client.run(recorded_connects)
            mp.setenv("TMEM_BUILD_BATCH", "2")
            run("dask-batch", runs.batch_stores["dask-batch"])
            mp.setenv("TMEM_TASK_RUNNER", "threads")
            run("threads-batch", runs.batch_stores["threads-batch"])
        yield runs
    finally:
        stack.close()
        server.stop()


def test_dask_build_publishes_the_same_memory_at_the_same_cost_as_the_thread_pool(runs: Runs) -> None:
    threads, dask = runs.summaries["threads"], runs.summaries["dask"]
    assert dask["conversations_built"] == threads["conversations_built"] == sorted(SESSIONS)
    for cid in SESSIONS:
        image = memory_image(published(runs.dask_store), cid)
        assert diff_images(image, memory_image(published(runs.threads_store), cid)) == [], cid
        assert image.rows["scenes"] and image.rows["items"] and image.rows["item_triggers"]
    for key in ("llm_calls", "llm_cache_hits", "prompt_tokens", "completion_tokens", "cost_usd"):
        assert dask[key] == threads[key], key
    assert runs.requests["dask"] == runs.requests["threads"] > 0


def test_worker_writes_reach_the_store_through_the_publisher(runs: Runs) -> None:
    keys = "SELECT cache_key FROM llm_cache ORDER BY cache_key"
    assert _store_rows(runs.dask_store, keys) == _store_rows(runs.threads_store, keys) != []
    vectors = "SELECT model, text_hash FROM embedding_cache ORDER BY ALL"
    assert _store_rows(runs.dask_store, vectors) == _store_rows(runs.threads_store, vectors) != []
    ledger = "SELECT operation, count(*), sum(prompt_tokens) FROM llm_usage WHERE run_id = ? GROUP BY ALL ORDER BY ALL"
    assert (_store_rows(runs.dask_store, ledger, [runs.summaries["dask"]["run_id"]])
            == _store_rows(runs.threads_store, ledger, [runs.summaries["threads"]["run_id"]]))
    assert not any((runs.dask_store / "exchange").iterdir())  # the run's exchange file is gone


def test_the_workers_embed_through_the_publishers_encoder(runs: Runs) -> None:
    """Workers on the flow's machine send their texts to the publisher's one queue (tmem/llm/embed_service.py):
    its figures in the build report count every text the thread pool's queue embedded for the same build."""
    threads, dask = runs.summaries["threads"]["embedding"], runs.summaries["dask"]["embedding"]
    assert dask["texts"] == threads["texts"] > 0 and dask["model_calls"] > 0
    assert dask["prefetched"] > 0  # the workers' scene views went ahead on it too


def test_a_dask_rebuild_is_answered_by_the_cache_the_workers_read_from_the_exchange(runs: Runs) -> None:
    rebuild = runs.summaries["dask-rebuild"]
    assert runs.requests["dask-rebuild"] == 0
    # llm_calls counts the calls that reached the model; every one of the first build's is now a hit.
    assert rebuild["llm_calls"] == 0
    assert rebuild["llm_cache_hits"] == runs.summaries["dask"]["llm_calls"] > 0
    for cid in SESSIONS:
        assert diff_images(memory_image(published(runs.dask_store), cid),
                           memory_image(published(runs.threads_store), cid)) == [], cid


def test_no_worker_process_opened_the_working_database(runs: Runs) -> None:
    calls = [c for found in runs.connects.values() for c in found]
    pids = {pid for pid, _, _ in calls}
    assert os.getpid() not in pids and len(runs.connects) == 2
    assert [c for c in calls if Path(c[1]).name == "work.duckdb"] == []
    exchange = [c for c in calls if Path(c[1]).parent.name == "exchange"]
    assert exchange and all(read_only for _, _, read_only in exchange)
    assert len({pid for pid, _, _ in exchange}) == 2  # both workers built a conversation


@pytest.mark.parametrize("name", ["dask-batch", "threads-batch"])
def test_a_batch_of_conversations_in_one_task_run_builds_what_one_task_each_builds(runs: Runs, name: str) -> None:
    """Both conversations in one ``conversations/<id>+1`` task run: the same memory, calls and tokens,
    and (on Dask) the worker's cache and ledger writes reach the store with the batch's result."""
    threads, batch, store = runs.summaries["threads"], runs.summaries[name], runs.batch_stores[name]
    assert batch["conversations_built"] == sorted(SESSIONS)
    for cid in SESSIONS:
        assert diff_images(memory_image(published(store), cid),
                           memory_image(published(runs.threads_store), cid)) == [], cid
    for key in ("llm_calls", "llm_cache_hits", "prompt_tokens", "completion_tokens", "cost_usd"):
        assert batch[key] == threads[key], key
    assert runs.requests[name] == runs.requests["threads"] > 0
    keys = "SELECT cache_key FROM llm_cache ORDER BY cache_key"
    assert _store_rows(store, keys) == _store_rows(runs.threads_store, keys) != []
    ledger = "SELECT operation, count(*), sum(prompt_tokens) FROM llm_usage WHERE run_id = ? GROUP BY ALL ORDER BY ALL"
    assert (_store_rows(store, ledger, [batch["run_id"]])
            == _store_rows(runs.threads_store, ledger, [threads["run_id"]]))


@pytest.mark.parametrize("name", ["dask-batch", "threads-batch"])
def test_a_batched_build_runs_one_task_run_whose_log_names_each_conversation(runs: Runs, name: str) -> None:
    from uuid import UUID

    from prefect.client.orchestration import get_client
    from prefect.client.schemas.filters import FlowRunFilter, FlowRunFilterId, LogFilter, LogFilterTaskRunId

    first = sorted(SESSIONS)[0]

    def probe() -> Any:
        with get_client(sync_client=True) as client:
            found = [r for r in client.read_task_runs(flow_run_filter=FlowRunFilter(
                id=FlowRunFilterId(any_=[UUID(runs.summaries[name]["run_id"])]))) if r.name.startswith("conv")]
            logs = [entry.message for r in found for entry in client.read_logs(
                log_filter=LogFilter(task_run_id=LogFilterTaskRunId(any_=[r.id])))]
            if not all(any(m.startswith(f"{cid}: embed:") for m in logs) for cid in SESSIONS):
                return None  # logs reach the API in batches
            return [(r.name, r.state_name) for r in found], logs

    names, logs = wait_for(probe, what="the batch's task run and its log")
    assert names == [(f"conversations/{first}+1", "Completed")]
    for cid in SESSIONS:  # every stage line of the batch's log is headed by its conversation
        assert any(m.startswith(f"{cid}: segment: ") for m in logs), (cid, logs)
    assert not [m for m in logs if m.startswith(("segment: ", "embed: "))], logs

"""Scale-out of ``build-memory``: the task runner chosen by settings, and the publisher's side of it.

``TMEM_TASK_RUNNER=threads`` (default) runs the conversation tasks in threads of the flow
process. ``TMEM_TASK_RUNNER=dask`` sends them to a Dask cluster — ``TMEM_DASK_ADDRESS``, else a
temporary ``LocalCluster`` of ``TMEM_DASK_WORKERS`` processes x ``TMEM_DASK_THREADS_PER_WORKER``
threads. A worker runs a conversation's stages in its own process (:mod:`tmem.build.conversation`).
The runner is chosen from the settings of the process when the run starts (Prefect enters a
flow's task runner before the flow's body runs); everything a worker builds with comes from the
spec its tasks receive.

``work.duckdb`` keeps one writer, the flow process. Before submitting, it exports what workers
read (turns, cache rows) to the run's exchange file (:mod:`tmem.store.exchange`) and hands its
path to every conversation task; workers journal what they would have written and send it back
with each conversation's result; at the end the flow sweeps every worker for what is left (e.g.
the calls of a failed conversation) and writes it all in one transaction before publishing.
"""

from __future__ import annotations

import sys
from collections.abc import Iterable
from dataclasses import replace
from typing import TYPE_CHECKING, Any

from prefect.context import FlowRunContext
from prefect.futures import PrefectFuture
from prefect.task_runners import TaskRunner, ThreadPoolTaskRunner

from tmem.build.batch import DASK_UNITS_PER_SLOT, UNITS_PER_SLOT, batch_size, batches
from tmem.build.conversation import ConversationBuild
from tmem.build.runtime import BuildRuntime, release
from tmem.build.spec import BuildSpec
from tmem.errors import ConfigError
from tmem.ports import JournalBatch
from tmem.settings import Settings, load_settings
from tmem.store.exchange import exchange_path, export_exchange, write_journal

if TYPE_CHECKING:
    from distributed import Client


def task_runner_for(settings: Settings, api_url: str | None = None) -> TaskRunner[Any]:
    """The task runner ``settings`` ask for (a new, unstarted instance).

    ``api_url`` is the Prefect API of the flow run; a local cluster's workers get it in their
    environment, so they report to the flow's API even when that is Prefect's ephemeral server.
    """
    if settings.task_runner == "threads":
        return ThreadPoolTaskRunner(max_workers=settings.build_concurrency)
    if settings.batch_operations:
        # A worker has no batch journal (it never writes the store): a killed build would pay twice.
        raise ConfigError("TMEM_LLM_BATCH=on is not supported with TMEM_TASK_RUNNER=dask yet: use threads for batch builds")
    try:
        from tmem.tasks.dask_runner import WORKER_PRELOAD, BuildDaskTaskRunner
    except ImportError as exc:
        raise ConfigError(f"TMEM_TASK_RUNNER=dask needs prefect-dask: pip install 'tmem[dask]' ({exc})") from exc
    if settings.dask_address:
        return BuildDaskTaskRunner(address=settings.dask_address)
    cluster: dict[str, Any] = {
        "n_workers": settings.dask_workers, "threads_per_worker": settings.dask_threads_per_worker,
        "processes": True, "dashboard_address": None,
        # Without a dashboard nobody reads Dask's statistical profiler, which walks every thread's stack
        # each 10 ms (~7 % of a worker's CPU in a profiled 200-conversation nightly) and, on CPython 3.11
        # before its fix of gh-106883, can deadlock the worker: a garbage collection inside
        # sys._current_frames() (holding the interpreter's thread-list lock) ran distributed's GC callback,
        # which released the GIL to a thread waiting for that lock to start a thread. Seen here: a worker
        # of a 1,000-conversation nightly, every thread waiting for the GIL (py-spy dump --native).
        # (a dotted key: the nanny merges this over the whole config one level deep, the worker sets it)
        "config": {"distributed.worker.profile.enabled": False},
        # each worker imports the build's modules as it starts, not inside its first task run (tmem.tasks.dask_runner)
        "preload": list(WORKER_PRELOAD),
    }
    if api_url:
        cluster["env"] = {"PREFECT_API_URL": api_url}
    return BuildDaskTaskRunner(cluster_kwargs=cluster)


class ConfiguredTaskRunner(TaskRunner[PrefectFuture[Any]]):
    """A placeholder resolved when a flow run starts: Prefect enters ``flow.task_runner.duplicate()``
    for every run, so each run (CLI, deployment, subflow of nightly-rebuild) reads the settings then.

    Prefect also duplicates it on a Dask worker for every task run it starts there, to rebuild the
    flow run's context around the task (``prefect.context.hydrated_context``). No task of tmem submits
    tasks of its own, so there the runner is never used: an idle thread pool, without reading the
    settings or opening an API client (~0.1 s of a worker's CPU per task run, py-spy)."""

    def duplicate(self) -> Any:
        if _on_dask_worker():
            return ThreadPoolTaskRunner(max_workers=1)
        settings = load_settings()
        if settings.task_runner == "threads":
            return task_runner_for(settings)
        from prefect.client.orchestration import get_client
        from prefect.settings import PREFECT_API_URL

        if settings.dask_address and not PREFECT_API_URL.value():
            raise ConfigError(
                "TMEM_DASK_ADDRESS: workers of an existing Dask cluster report to the Prefect API, but this flow "
                "runs on Prefect's temporary local server; start `prefect server start` and set PREFECT_API_URL"
            )
        return task_runner_for(settings, api_url=str(get_client(sync_client=True).api_url).rstrip("/"))

    def submit(self, task: Any, parameters: dict[str, Any], wait_for: Iterable[PrefectFuture[Any]] | None = None,
               dependencies: dict[str, Any] | None = None) -> PrefectFuture[Any]:
        raise RuntimeError("ConfiguredTaskRunner is resolved by duplicate() when a flow run starts; it runs nothing")


def _on_dask_worker() -> bool:
    """Whether this thread runs a task of a Dask worker."""
    if "distributed" not in sys.modules:
        return False
    from distributed import get_worker

    try:
        get_worker()
    except ValueError:  # "No worker found": not in a worker's task
        return False
    return True


def start_workers() -> None:
    """On Dask, start the flow run's cluster now, in the background, while the flow opens the store (the
    first use of the client waits for it: :class:`tmem.tasks.dask_runner.BuildDaskTaskRunner`); on the
    thread pool nothing."""
    ctx = FlowRunContext.get()
    if ctx is None or "prefect_dask" not in sys.modules:
        return
    from tmem.tasks.dask_runner import BuildDaskTaskRunner

    if isinstance(ctx.task_runner, BuildDaskTaskRunner):
        ctx.task_runner.start_ahead()


def dask_client() -> Client | None:
    """The current flow run's Dask client, or None when its tasks run in threads here."""
    ctx = FlowRunContext.get()
    if ctx is None or "prefect_dask" not in sys.modules:
        return None
    from prefect_dask import DaskTaskRunner

    runner = ctx.task_runner
    return runner.client if isinstance(runner, DaskTaskRunner) else None


def conversation_units(conversation_ids: list[str], settings: Settings) -> list[list[str]]:
    """The build's task-run units: runs of conversations sized over the slots that build them
    (``build_concurrency`` threads here, about four units each; or the Dask cluster's worker threads,
    about two each, a task run costing more there; :func:`tmem.build.batch.batch_size`,
    ``TMEM_BUILD_BATCH``), one conversation each while the build is small."""
    client = dask_client()
    slots, per_slot = ((settings.build_concurrency, UNITS_PER_SLOT) if client is None else
                       (sum(client.nthreads().values()) or settings.dask_workers * settings.dask_threads_per_worker,
                        DASK_UNITS_PER_SLOT))
    return batches(conversation_ids, batch_size(len(conversation_ids), slots, settings.build_batch, per_slot))


def open_exchange_for_workers(rt: BuildRuntime, conversation_ids: list[str]) -> str | None:
    """On Dask, export the run's exchange file before any conversation is submitted; its path (the
    workers' tasks receive it), or None when the tasks run in threads here. It names the publisher's
    encoder service when there is one; a local cluster's workers all embed through it, so the
    embedding cache stays out of the file."""
    if dask_client() is None:
        return None
    served = rt.service.address if rt.service is not None else None
    every_worker_here = served is not None and not rt.settings.dask_address
    return str(export_exchange(rt.con, exchange_path(rt.store, rt.run_id), conversation_ids, rt.settings,
                               encoder=served, embeddings=not every_worker_here).path)


def finish_worker_run(spec: BuildSpec, run_id: str, exchange: str) -> JournalBatch | None:
    """Run on each Dask worker when the flow ends: the journal's remainder (e.g. from a failed
    conversation), then the runtime is closed (its read-only exchange connection)."""
    return release(spec, run_id, exchange)


def store_worker_journals(rt: BuildRuntime, builds: dict[str, ConversationBuild],
                          exchange: str | None) -> dict[str, ConversationBuild]:
    """Write what workers journaled — returned with their results, plus what every worker still
    holds — in one transaction. Returns the builds without their journals (nothing to publish)."""
    batches: list[JournalBatch | None] = [build.journal for build in builds.values()]
    client = dask_client()
    if client is not None and exchange is not None:
        batches.extend(client.run(finish_worker_run, rt.spec, rt.run_id, exchange).values())
    write_journal(rt.con, JournalBatch.merge(batches))
    return {cid: replace(build, journal=None) for cid, build in builds.items()}


def remove_exchange(spec: BuildSpec, run_id: str) -> None:
    exchange_path(spec.store_path, run_id).unlink(missing_ok=True)

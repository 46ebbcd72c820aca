"""The construction DAG (DESIGN.md §2) as a Prefect flow:

    (Dask: the cluster starts) ─▶ posted turns (spool) ─▶ the conversations to build (all, given, or changed)
        ─▶ export for Dask workers
        ─▶ one ``conversation/<id>`` task run per conversation, in parallel: its stages run in process
           (segment ─▶ topics ─▶ items ─▶ item triggers / scene triggers / personas ─▶ embedded views),
           each stage and retry in the task run's log (a build of many more conversations than it
           builds at once sends them in batches, ``conversations/<id>+<more>``, each line of the log
           naming its conversation)
        ─▶ as each conversation finishes: its quarantined units and notes recorded, its build id and vector
           table made for the publish, progress artifact updated
        ─▶ workers' cache and ledger writes stored ─▶ publish one snapshot ─▶ build report artifact

A conversation that fails keeps its previous memory and is reported with the typed error that
stopped it (a spine that kept answering invalid output quarantines it whole). A unit whose answer
stays invalid after repairs, re-asks and splits (one topic chunk's items, one item's or scene's
triggers, one speaker's persona) is left out and quarantined as that unit; its conversation
publishes with the rest, and the next build runs that unit again.
"""

from __future__ import annotations

import uuid
from datetime import UTC, datetime
from typing import Any

from prefect import flow
from prefect.artifacts import create_markdown_artifact
from prefect.futures import as_completed
from prefect.runtime import flow_run
from prefect.utilities.annotations import quote

from tmem.build.bookkeeping import BuildRun
from tmem.build.conversation import ConversationBuild
from tmem.build.publish import ready_to_publish
from tmem.build.runtime import release, runtime_for
from tmem.build.spec import BuildSpec
from tmem.tasks.build import submit_conversations, unit_outcomes
from tmem.tasks.maintenance import drain_posted_turns
from tmem.tasks.publish import publish
from tmem.tasks.runtime import BuildProgress
from tmem.tasks.scaleout import (
    ConfiguredTaskRunner,
    conversation_units,
    open_exchange_for_workers,
    remove_exchange,
    start_workers,
    store_worker_journals,
)


@flow(name="build-memory", flow_run_name="build-memory/{label}", task_runner=ConfiguredTaskRunner())
def build_memory(
    store: BuildSpec | str = "./tmem-store",
    conversation_ids: list[str] | None = None,
    only_changed: bool = False,
    label: str = "all",
    prices: dict[str, dict[str, float]] | None = None,
) -> dict[str, Any]:
    """Build (or rebuild) the memory of the given conversations (default: all) and publish a snapshot.

    ``store`` is the build's :class:`~tmem.build.spec.BuildSpec`, or a store directory whose spec is
    resolved from this process's ``TMEM_*`` settings now. First the turns posted to ``tmem serve`` /
    ``tmem mcp`` and waiting in the spool are ingested. ``only_changed`` keeps the conversations with
    turns newer than their last build, plus any whose last build was recorded but never published (a
    build killed mid-publish). A conversation is rebuilt over all its turns; its stage units whose
    inputs did not change come from the stage cache and its requests from the LLM response cache,
    so only new work costs tokens. ``prices`` overrides the model price table of the cost estimate
    (USD per 1M tokens).
    """
    start_workers()  # TMEM_TASK_RUNNER=dask: the cluster starts while the store opens
    spec = store if isinstance(store, BuildSpec) else BuildSpec.resolve(store)
    run_id = str(flow_run.get_id() or uuid.uuid4())
    rt = runtime_for(spec, run_id)  # this process holds the working database until the run ends
    try:
        run = BuildRun.open(rt)
        spooled = drain_posted_turns(spec.store, datetime.now(UTC), spec, run_id)  # posted turns join this build
        ids = run.start(conversation_ids, only_changed, label)
        exchange = open_exchange_for_workers(rt, ids)  # TMEM_TASK_RUNNER=dask: what workers read, exported once
        progress = BuildProgress(label, len(ids))
        units = submit_conversations(spec, run_id, conversation_units(ids, rt.settings), exchange)
        for future in as_completed(list(units)):
            for cid, outcome in unit_outcomes(future, units[future]).items():
                if isinstance(outcome, ConversationBuild):
                    run.built(cid, ready_to_publish(rt, outcome))  # its build id and vector table made now
                else:
                    run.failed(cid, outcome)
                progress.conversation_done(cid, ok=isinstance(outcome, ConversationBuild))
        builds = store_worker_journals(rt, run.builds, exchange)  # workers' cache and ledger writes, one transaction
        whole: Any = quote(builds)  # handed over as is: Prefect does not walk a thousand memories for futures
        snapshot_id = publish(spec, run_id, whole) if builds else None
        result = run.finish(snapshot_id, prices)
        create_markdown_artifact(markdown=result.report, key="tmem-build-report",
                                 description=f"tmem build {run_id}: {result.status}")
        return result.summary | {"spool": spooled}
    finally:
        remove_exchange(spec, run_id)
        release(spec, run_id)

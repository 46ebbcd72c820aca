"""Prefect tasks of the operations flows: ingest posted turns, find changed conversations, ingest a
chunk of archives, prune snapshots and clean Lance versions. Each wraps one library function."""

from __future__ import annotations

from datetime import datetime, timedelta
from pathlib import Path
from typing import Any

from prefect import task

from tmem.build.runtime import runtime_for
from tmem.build.spec import BuildSpec
from tmem.ingest import ingest_parsed, read_archives
from tmem.ingest.spool import drain_spool
from tmem.store.conversations import conversation_states
from tmem.store.duck import connect
from tmem.store.lance_location import is_object_uri, lance_uri
from tmem.store.snapshot.published import prune_snapshots, unpublished_conversations


@task(name="drain-spool", task_run_name="drain-spool", tags=["stage:ingest"])
def drain_posted_turns(store: str, now: datetime, spec: BuildSpec | None = None,
                       run_id: str | None = None) -> dict[str, Any]:
    """Ingest the turns posted to ``tmem serve`` / ``tmem mcp`` that wait in the spool, through the
    build run's connection when ``spec`` and ``run_id`` name one (this process then holds the working
    database)."""
    con = runtime_for(spec, run_id).con.cursor() if spec is not None and run_id is not None else None
    try:
        return drain_spool(Path(store), now=now, con=con).as_dict()
    finally:
        if con is not None:
            con.close()


@task(name="find-changed", task_run_name="find-changed")
def find_changed_conversations(store: str) -> list[str]:
    """Conversations with turns newer than their last build, or built but never published."""
    con = connect(Path(store))
    try:
        unpublished = set(unpublished_conversations(con, Path(store)))
        return [s.conversation_id for s in conversation_states(con) if s.changed or s.conversation_id in unpublished]
    finally:
        con.close()


@task(name="ingest-archives", task_run_name="ingest/{label}", tags=["stage:ingest"])
def ingest_files(store: str, files: list[str], label: str, now: datetime) -> dict[str, Any]:
    """Validate and ingest ``files`` in one transaction (idempotent: a re-run adds nothing).

    Returns the ingest report plus ``conversation_ids``, the conversations the files hold.
    """
    archives = read_archives([Path(f) for f in files])
    report = ingest_parsed(archives, Path(store), now=now)
    ids = sorted({c.conversation_id for a in archives for c in a.conversations})
    return report.as_dict() | {"conversation_ids": ids}


@task(name="prune-snapshots", task_run_name="prune-snapshots/keep-{keep}")
def prune_old_snapshots(store: str, keep: int) -> list[str]:
    return prune_snapshots(Path(store), keep=keep)


@task(name="optimize-vectors", task_run_name="optimize-vectors")
def optimize_vector_tables(spec: BuildSpec, now: datetime, margin_s: float) -> list[dict[str, Any]]:
    """Compact Lance tables and delete versions no retained snapshot pins (run after pruning)."""
    uri = lance_uri(spec.load_settings())
    if not is_object_uri(uri) and not Path(uri).exists():
        return []
    # Imported here: LanceDB (~1 s) stays out of the modules a Dask worker imports with the build flow's.
    from tmem.store.maintenance import optimize_vectors

    done = optimize_vectors(spec.store_path, uri, now=now, margin=timedelta(seconds=margin_s))
    return [
        {"table": m.table, "pinned": list(m.pinned), "versions_before": len(m.versions_before),
         "versions_after": len(m.versions_after), "removed": len(m.removed),
         "keep_newer_than_s": round(m.keep_newer_than_s, 1)}
        for m in done
    ]

"""``tmem forget``: erase one conversation from every place the store keeps it, resumably.

The steps, in order (each one idempotent; the job row in ``forget_jobs`` says which is next):

1. ``work``     — the working database: its rows in every table, the cache rows only it used, its
                  traces in ``build_runs`` (:mod:`tmem.store.forget_work`); one transaction.
2. ``files``    — Prefect task results and cache records, Dask exchange leftovers
                  (:mod:`tmem.store.forget_files`).
3. ``vectors``  — LanceDB: its rows, and the fragments that held them rewritten
                  (:mod:`tmem.store.lance_forget`).
4. ``snapshot`` — the current snapshot republished without it (:mod:`tmem.store.snapshot.forget`).
5. ``prune``    — every other snapshot deleted (they pin Lance versions step 6 deletes).
6. ``vector-versions`` — every Lance version but the latest deleted, with the files only they used.
7. ``rewrite``  — the working database copied into a fresh file, so no freed block keeps a byte.

Steps 3-6 run only when the conversation was published (a snapshot lists it) or has vector rows.
The job is recorded, with a tombstone (:mod:`tmem.store.tombstones`), before anything is
removed; a forget killed at any point is finished by the next ``tmem forget`` (of the same id,
or ``--resume``), and builds refuse to start while a job is pending. The id itself is kept in
the job row until step 7 begins (it is needed to finish) and is in no file after step 7.

Scope is the exact string: every match is ``=`` on the id, never a pattern.
"""

from __future__ import annotations

import json
import time
from collections.abc import Callable, Sequence
from datetime import datetime
from pathlib import Path
from typing import Any

import duckdb

from tmem.errors import ForgetError, StoreError
from tmem.store.duck import connect, work_db_path
from tmem.store.forget_files import forget_files
from tmem.store.forget_work import Unowned, delete_from_work, holds_conversation, plan_work, rewrite_work_db
from tmem.store.lance_forget import drop_old_versions, forget_vectors, latest_versions, vector_rows
from tmem.store.snapshot.forget import remove_other_snapshots, republish_without, snapshots_holding
from tmem.store.snapshot.formats import require_current
from tmem.store.snapshot.image_vectors import lance_source
from tmem.store.snapshot.published import MANIFEST, current_snapshot, list_snapshots
from tmem.store.tombstones import id_digest

STEPS = ("work", "files", "vectors", "snapshot", "prune", "vector-versions", "rewrite")
VECTOR_STEPS = frozenset({"vectors", "snapshot", "prune", "vector-versions"})
Progress = Callable[[str, int, int], None]  # (step, number, of)


def pending_forget(con: duckdb.DuckDBPyConnection) -> datetime | None:
    """When the unfinished forget started, or None (builds refuse to run while one is pending)."""
    found = con.execute("SELECT count(*) FROM information_schema.tables WHERE table_name = 'forget_jobs'").fetchone()
    if not found or not found[0]:
        return None
    row = con.execute("SELECT min(started_at) FROM forget_jobs").fetchone()
    return row[0] if row and row[0] is not None else None


class _Job:
    """The ``forget_jobs`` row of one forget: its next step and what the done steps removed."""

    def __init__(self, con: duckdb.DuckDBPyConnection, digest: str, subject: str | None, step: str,
                 options: dict[str, Any]) -> None:
        self.con, self.digest, self.subject, self.step, self.options = con, digest, subject, step, options

    @classmethod
    def load(cls, con: duckdb.DuckDBPyConnection) -> list[_Job]:
        rows = con.execute("SELECT id_digest, subject, step, options FROM forget_jobs ORDER BY started_at").fetchall()
        return [cls(con, str(d), s, str(step), json.loads(o)) for d, s, step, o in rows]

    def advance(self, done: str, result: Any) -> None:
        """Record ``done`` finished with ``result`` and move to the step after it."""
        self.options.setdefault("done", {})[done] = result
        later = [s for s in STEPS[STEPS.index(done) + 1 :] if self.options.get("vectors") or s not in VECTOR_STEPS]
        self.step = later[0] if later else "rewrite"
        self._save()

    def clear_subject(self) -> None:
        """Forget the id in the job row (the final rewrite then copies no trace of it)."""
        self.subject, self.step = None, "rewrite"
        self._save()

    def _save(self) -> None:
        self.con.execute("UPDATE forget_jobs SET step = ?, options = ?, subject = ? WHERE id_digest = ?",
                         [self.step, json.dumps(self.options, sort_keys=True), self.subject, self.digest])


def _begin(con: duckdb.DuckDBPyConnection, conversation_id: str, options: dict[str, Any], now: datetime) -> _Job:
    digest = id_digest(conversation_id)
    con.execute("BEGIN TRANSACTION")
    try:
        con.execute("INSERT INTO forget_jobs (id_digest, subject, step, started_at, options) VALUES (?, ?, 'work', ?, ?)",
                    [digest, conversation_id, now, json.dumps(options, sort_keys=True)])
        # every column named: DuckDB's INSERT OR REPLACE keeps the columns a statement leaves out
        con.execute("INSERT OR REPLACE INTO forget_tombstones (id_digest, forgotten_at, finished_at, readmitted_at) "
                    "VALUES (?, ?, NULL, NULL)", [digest, now])
    except BaseException:
        con.execute("ROLLBACK")
        raise
    con.execute("COMMIT")
    return _Job(con, digest, conversation_id, "work", options)


def _holdings(con: duckdb.DuckDBPyConnection, store: Path, lance_uri: str, conversation_id: str,
              result_dirs: Sequence[Path]) -> dict[str, Any]:
    """Where the conversation is now (nothing is changed): what a dry run reports."""
    current = current_snapshot(store)
    return {
        "work": plan_work(con, conversation_id).as_dict(),
        "files": forget_files(store, conversation_id, result_dirs=result_dirs, dry_run=True).as_dict(),
        "vector_rows": vector_rows(lance_uri, conversation_id),
        "snapshots_holding": snapshots_holding(store, conversation_id),
        "snapshots_on_disk": list_snapshots(store),
        "current_snapshot": None if current is None else current.snapshot_id,
        "work_db_bytes": work_db_path(store).stat().st_size,
        "in_work_db": holds_conversation(con, conversation_id),
    }


def _held(h: dict[str, Any]) -> bool:
    files = h["files"]
    return bool(h["in_work_db"] or h["vector_rows"] or h["snapshots_holding"]
                or files["prefect_partition_files"] or files["prefect_legacy_results"])


def _checked(conversation_id: object) -> str:
    if not isinstance(conversation_id, str) or not conversation_id:
        raise ForgetError(f"forget needs a conversation id, got {conversation_id!r}")
    return conversation_id


def forget_conversation(
    store: Path, conversation_id: str, *, now: datetime, lance_uri: str, dry_run: bool = False,
    unowned: Unowned = "refuse", result_dirs: Sequence[Path] = (), progress: Progress | None = None,
) -> dict[str, Any]:
    """Forget ``conversation_id`` (see the module doc) and return the report; with ``dry_run``,
    report what would be removed and change nothing (beyond applying schema migrations).

    :class:`ForgetError` (nothing removed): an empty or unknown id, cache rows without an owner while
    ``unowned="refuse"``, or an unfinished forget of another id. :class:`StoreError`: a build holds the
    store. A pending forget of the same id is resumed."""
    cid = _checked(conversation_id)
    store = Path(store)
    con = connect(store)
    closed = False
    try:
        jobs = _Job.load(con)
        digest = id_digest(cid)
        other = [j for j in jobs if j.digest != digest]
        if other:
            raise ForgetError(f"conversation {cid!r}: another forget is unfinished (a killed `tmem forget`); "
                              "run `tmem forget --resume` first; nothing was removed")
        if jobs:
            if dry_run:
                return {"conversation_id": cid, "dry_run": True, "pending_step": jobs[0].step}
            closed = True
            return _run(jobs[0], store, lance_uri, now, result_dirs, progress, resumed=True)
        held = _holdings(con, store, lance_uri, cid, result_dirs)
        if dry_run:
            return {"conversation_id": cid, "dry_run": True, "tombstone": digest, "would_remove": held}
        if not _held(held):
            stone = con.execute("SELECT forgotten_at FROM forget_tombstones WHERE id_digest = ? AND finished_at IS NOT NULL",
                                [digest]).fetchone()
            if stone is not None:
                return {"conversation_id": cid, "already_forgotten": True, "forgotten_at": stone[0].isoformat()}
            raise ForgetError(f"conversation {cid!r}: not in store {store} (no turns, memory, snapshot, vectors or "
                              "task results of exactly that id); nothing was removed")
        unowned_rows = held["work"]["unowned_llm_cache"] + held["work"]["unowned_embedding_cache"]
        if unowned == "refuse" and unowned_rows:
            raise ForgetError(
                f"conversation {cid!r}: {held['work']['unowned_llm_cache']} cached LLM answers and "
                f"{held['work']['unowned_embedding_cache']} cached embeddings have no recorded owner (written before "
                "tmem recorded owners, or outside a conversation's build), so they may hold this conversation's text; "
                "pass --unowned delete (remove them all; other conversations re-ask them when rebuilt) or --unowned "
                "keep (leave them); a full `tmem build` first records the owners of every row still in use; "
                "nothing was removed")
        _require_current_snapshot(store, cid)
        options = {"unowned": unowned, "vectors": bool(held["vector_rows"] or held["snapshots_holding"]),
                   "result_dirs": [str(p) for p in result_dirs]}
        job = _begin(con, cid, options, now)
        closed = True
        return _run(job, store, lance_uri, now, result_dirs, progress, resumed=False)
    finally:
        if not closed:
            con.close()


def _require_current_snapshot(store: Path, conversation_id: str) -> None:
    """A forget republishes the current snapshot, which must be of the current format: refused
    before anything is removed otherwise."""
    current = current_snapshot(store)
    if current is None:
        return
    try:
        require_current(current.path / MANIFEST, current.image_format, store=store)
    except StoreError as exc:
        raise ForgetError(f"conversation {conversation_id!r}: {exc}; nothing was removed") from exc


def resume_forgets(store: Path, *, now: datetime, lance_uri: str, result_dirs: Sequence[Path] = (),
                   progress: Progress | None = None) -> list[dict[str, Any]]:
    """Finish every unfinished forget (oldest first); returns their reports."""
    reports: list[dict[str, Any]] = []
    while True:
        con = connect(Path(store))
        jobs = _Job.load(con)
        if not jobs:
            con.close()
            return reports
        reports.append(_run(jobs[0], Path(store), lance_uri, now, result_dirs, progress, resumed=True))


def _run(job: _Job, store: Path, lance_uri: str, now: datetime, result_dirs: Sequence[Path],
         progress: Progress | None, *, resumed: bool) -> dict[str, Any]:
    """Run the job's remaining steps; closes its connection (the last step replaces the file)."""
    try:
        dirs = [*result_dirs, *(Path(p) for p in job.options.get("result_dirs", []) if Path(p) not in result_dirs)]
        plan = [s for s in STEPS[STEPS.index(job.step):] if job.options.get("vectors") or s not in VECTOR_STEPS]
        timings: dict[str, float] = dict(job.options.get("seconds", {}))
        for step in plan:
            if progress is not None:
                progress(step, STEPS.index(step) + 1, len(STEPS))
            started = time.perf_counter()
            if step == "rewrite":
                job.clear_subject()  # nothing left needs the id: the copy below must not hold it
                before, after = rewrite_work_db(job.con, store, lambda schema: _finish(job, schema, now))
                timings[step] = round(time.perf_counter() - started, 3)
                job.options.setdefault("done", {})["rewrite"] = {"work_db_bytes_before": before,
                                                                 "work_db_bytes_after": after}
                break
            assert job.subject is not None
            job.options["seconds"] = timings | {step: 0.0}
            result = _STEP_RUNNERS[step](job, job.subject, store, lance_uri, now, dirs)
            timings[step] = round(time.perf_counter() - started, 3)
            job.options["seconds"] = timings
            if step == "work":
                continue  # recorded inside its own transaction
            job.advance(step, result)
        return {"tombstone": job.digest, "resumed": resumed, "steps": job.options.get("done", {}),
                "seconds": timings, "unowned": job.options.get("unowned")}
    finally:
        job.con.close()


def _finish(job: _Job, schema: str, now: datetime) -> None:
    """In the fresh copy of the working database: the job is done, its tombstone finished."""
    job.con.execute(f"DELETE FROM {schema}.forget_jobs WHERE id_digest = ?", [job.digest])  # noqa: S608 -- fixed schema
    job.con.execute(f"UPDATE {schema}.forget_tombstones SET finished_at = ? WHERE id_digest = ?",  # noqa: S608
                    [now, job.digest])


def _step_work(job: _Job, cid: str, store: Path, uri: str, now: datetime, dirs: Sequence[Path]) -> Any:
    # The job moves on inside the deleting transaction: killed, the rows and the step go together.
    delete_from_work(job.con, cid, unowned=job.options["unowned"], then=lambda plan: job.advance("work", plan.as_dict()))


def _step_files(job: _Job, cid: str, store: Path, uri: str, now: datetime, dirs: Sequence[Path]) -> Any:
    return forget_files(store, cid, result_dirs=dirs).as_dict()


def _step_vectors(job: _Job, cid: str, store: Path, uri: str, now: datetime, dirs: Sequence[Path]) -> Any:
    current = current_snapshot(store)
    done = forget_vectors(uri, cid, current.lance_versions if current is not None else {})
    return {t.table: {"rows_removed": t.rows_removed, "fragments_rewritten": t.fragments_rewritten,
                      "other_rows_rewritten": t.rows_rewritten, "restored_from": t.restored_from, "version": t.version}
            for t in done}


def _step_snapshot(job: _Job, cid: str, store: Path, uri: str, now: datetime, dirs: Sequence[Path]) -> Any:
    current = current_snapshot(store)
    if current is None:
        return {"republished": None}
    latest = latest_versions(uri)
    versions = {t: latest[t] for t in current.lance_versions if t in latest}
    if cid not in current.conversations and versions == current.lance_versions:
        return {"republished": None, "current": current.snapshot_id}  # done before a kill
    source = lance_source(uri, versions)
    keys = source.keys() if source is not None else None
    absent = f"{source.table}|{source.dim}|none" if source is not None else ""
    info, images, image_bytes = republish_without(store, current, cid, lance_uri=uri, lance_versions=versions,
                                                  now=now, vector_keys=keys, vector_key_absent=absent)
    return {"republished": info.snapshot_id, "from": current.snapshot_id, "images_copied": images,
            "image_bytes_copied": image_bytes}


def _step_prune(job: _Job, cid: str, store: Path, uri: str, now: datetime, dirs: Sequence[Path]) -> Any:
    current = current_snapshot(store)
    return {"removed": remove_other_snapshots(store, None if current is None else current.snapshot_id)}


def _step_versions(job: _Job, cid: str, store: Path, uri: str, now: datetime, dirs: Sequence[Path]) -> Any:
    """Drop old Lance versions. When LanceDB's cleanup compacted and so moved the latest version, the
    current snapshot (which holds no row of the conversation any more) is republished pinning it."""
    out: dict[str, Any] = {}
    for _ in range(3):
        for table, (before, after, _, _) in drop_old_versions(uri).items():
            out[table] = {"versions_before": out.get(table, {}).get("versions_before", before), "versions_after": after}
        current = current_snapshot(store)
        latest = latest_versions(uri)
        if current is None or all(latest.get(t, v) == v for t, v in current.lance_versions.items()):
            return out
        out["republished_after_cleanup"] = _step_snapshot(job, cid, store, uri, now, dirs)
        _step_prune(job, cid, store, uri, now, dirs)
    raise StoreError(f"{store}: the latest Lance versions keep moving during cleanup; run `tmem forget --resume` again")


_STEP_RUNNERS: dict[str, Callable[[_Job, str, Path, str, datetime, Sequence[Path]], Any]] = {
    "work": _step_work, "files": _step_files, "vectors": _step_vectors, "snapshot": _step_snapshot,
    "prune": _step_prune, "vector-versions": _step_versions,
}

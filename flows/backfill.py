"""Backfill: load archives in chunks, each chunk its own flow run (it retries and shows separately).

    archive paths / glob ─▶ sorted files ─▶ chunks of ``chunk_size`` files
        ─▶ for each chunk, a ``backfill-chunk/<n>-of-<total>`` subflow:
               ingest the chunk (one transaction) ─▶ build-memory of its changed conversations
        ─▶ summary artifact

Resumable: re-running the same backfill re-reads every chunk, but ingest is idempotent (it adds
only turns it does not have) and a chunk whose conversations are all built and published is
skipped without a build; a chunk cut short mid-build rebuilds from the caches (Prefect task cache
and LLM response cache), so finished work costs no LLM call. Chunks run one after the other (the
store has a single writer); a failed chunk does not stop the others, and makes the run fail.
"""

from __future__ import annotations

import glob as globbing
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

from prefect import flow
from prefect.artifacts import create_markdown_artifact

from tmem.build.spec import BuildSpec
from tmem.errors import IngestError, TmemError
from tmem.flows.build_memory import build_memory
from tmem.tasks.maintenance import find_changed_conversations, ingest_files


class BackfillFailed(TmemError):
    """Some chunks failed; the others were ingested and published."""


def archive_files(paths: list[str] | None, pattern: str | None) -> list[str]:
    """The archive files named by ``paths`` and matched by ``pattern`` (recursive ``**``), sorted, unique."""
    found: set[str] = set()
    for raw in paths or []:
        path = Path(raw)
        if not path.is_file():
            raise IngestError(raw, "file", "no such archive file")
        found.add(str(path.resolve()))
    if pattern:
        matched = [p for p in globbing.glob(pattern, recursive=True) if Path(p).is_file()]
        if not matched:
            raise IngestError(pattern, "glob", "the pattern matches no file")
        found.update(str(Path(p).resolve()) for p in matched)
    if not found:
        raise IngestError(str(paths or pattern), "arguments", "give archive paths or a glob")
    return sorted(found)


def chunked(files: list[str], size: int) -> list[list[str]]:
    if size < 1:
        raise ValueError(f"chunk_size must be >= 1, got {size}")
    return [files[i : i + size] for i in range(0, len(files), size)]


@flow(name="backfill-chunk", flow_run_name="backfill-chunk/{number}-of-{total}", retries=1, retry_delay_seconds=30)
def backfill_chunk(store: str, files: list[str], number: int, total: int) -> dict[str, Any]:
    """Ingest one chunk of archive files, then build and publish its changed conversations."""
    label = f"chunk-{number}-of-{total}"
    report = ingest_files(store, files, label, datetime.now(UTC))
    mine = set(report["conversation_ids"])
    changed = [cid for cid in find_changed_conversations(store) if cid in mine]
    out: dict[str, Any] = {"number": number, "files": files, "new_turns": report["new_turns"],
                           "conversations": report["conversation_ids"], "built": [], "llm_calls": 0,
                           "snapshot_id": None, "run_id": None, "skipped": not changed}
    if not changed:  # ingested and published by an earlier run
        return out
    build = build_memory(store=BuildSpec.resolve(store), conversation_ids=changed, only_changed=True, label=label)
    if build["failures"]:
        failed = ", ".join(f["conversation_id"] for f in build["failures"])
        raise BackfillFailed(f"chunk {number}/{total}: conversations failed to build: {failed}")
    return out | {"built": build["conversations_built"], "llm_calls": build["llm_calls"],
                  "snapshot_id": build["snapshot_id"], "run_id": build["run_id"]}


def render_report(chunks: list[dict[str, Any]]) -> str:
    lines = ["# tmem backfill", "",
             f"{sum(c['status'] == 'completed' for c in chunks)} of {len(chunks)} chunks completed, "
             f"{sum(bool(c.get('skipped')) for c in chunks)} of them already done before this run.", "",
             "| chunk | files | status | new turns | built | LLM calls | note |", "|---:|---:|---|---:|---:|---:|---|"]
    for c in chunks:
        note = "already ingested and built" if c.get("skipped") else c.get("error", "")
        lines.append(f"| {c['number']} | {len(c['files'])} | {c['status']} | {c.get('new_turns', '')} | "
                     f"{len(c.get('built', []))} | {c.get('llm_calls', '')} | {note.replace('|', '/')[:200]} |")
    return "\n".join(lines) + "\n"


@flow(name="backfill", flow_run_name="backfill/{label}")
def backfill(
    store: str = "./tmem-store",
    paths: list[str] | None = None,
    glob: str | None = None,
    chunk_size: int = 5,
    chunk_retries: int = 1,
    label: str = "archives",
) -> list[dict[str, Any]]:
    """Ingest and build archives (``paths`` and/or files matching ``glob``) ``chunk_size`` files at a time."""
    chunks = chunked(archive_files(paths, glob), chunk_size)
    results: list[dict[str, Any]] = []
    for number, files in enumerate(chunks, start=1):
        run = backfill_chunk.with_options(retries=chunk_retries)
        state = run(store, files, number, len(chunks), return_state=True)
        if state.is_completed():
            results.append(state.result() | {"status": "completed"})
        else:
            error = state.result(raise_on_failure=False)
            results.append({"number": number, "files": files, "status": state.type.value.lower(),
                            "error": f"{type(error).__name__}: {error}"})
    create_markdown_artifact(markdown=render_report(results), key="tmem-backfill-report",
                             description=f"backfill {label}: {len(chunks)} chunks")
    failed = [r["number"] for r in results if r["status"] != "completed"]
    if failed:
        raise BackfillFailed(f"chunks {failed} of {len(chunks)} failed; re-run the backfill to resume them")
    return results

"""The nightly flow: rebuild what changed, publish, then tidy the store.

    ingest posted turns (spool) ─▶ find changed conversations (watermarks) ─▶ build-memory (only_changed; publishes a snapshot)
        ─▶ prune old snapshots (keep N) ─▶ Lance optimize + cleanup (never a pinned version)
        ─▶ summary artifact

Nothing changed: no build and no new snapshot, but maintenance still runs. A failed conversation
keeps its last good memory (the build publishes the others) and makes this run fail, so the
schedule's history shows it; maintenance runs either way.
"""

from __future__ import annotations

from datetime import UTC, datetime
from typing import Any

from prefect import flow
from prefect.artifacts import create_markdown_artifact

from tmem.build.spec import BuildSpec
from tmem.errors import TmemError
from tmem.flows.build_memory import build_memory
from tmem.pricing import format_usd
from tmem.tasks.maintenance import (
    drain_posted_turns,
    find_changed_conversations,
    optimize_vector_tables,
    prune_old_snapshots,
)


class NightlyBuildFailed(TmemError):
    """Some conversations failed to build; the others were published."""


def render_report(result: dict[str, Any]) -> str:
    build = result["build"]
    lines = [
        f"# tmem nightly rebuild · {result['started_at']}",
        "",
        f"**Changed conversations:** {len(result['changed'])}"
        + (f" ({', '.join(result['changed'][:20])}{' …' if len(result['changed']) > 20 else ''})"
           if result["changed"] else ""),
        "",
    ]
    if build is None:
        lines.append("Nothing to build; no new snapshot.")
    else:
        lines += [
            f"**Build:** `{build['run_id']}` {build['status']} · built {len(build['conversations_built'])} · "
            f"failed {len(build['failures'])} · snapshot `{build['snapshot_id'] or 'not published'}`",
            "",
            f"LLM calls {build['llm_calls']} (cache hits {build['llm_cache_hits']}), tokens "
            f"{build['prompt_tokens']} in / {build['completion_tokens']} out, est. cost "
            f"{format_usd(build.get('cost_usd'))} — see the "
            "`tmem-build-report` artifact of the build-memory run.",
        ]
        for failure in build["failures"]:
            lines.append(f"- FAILED {failure['conversation_id']}: {failure['error_type']}: {failure['message'][:200]}")
        for unit in build.get("quarantined_units", []):  # published without these units
            lines.append(f"- MISSING {unit['conversation_id']} {unit['operation']} {unit['unit_kind']} "
                         f"{unit['unit_id']}: {unit['error_type']}: {unit['reason'][:200]}")
    lines += ["", "## Maintenance", "", f"Snapshots pruned: {len(result['pruned'])}", "",
              "| Lance table | pinned versions | versions before | after | removed | kept window (s) |",
              "|---|---|---:|---:|---:|---:|"]
    lines += [f"| {m['table']} | {m['pinned']} | {m['versions_before']} | {m['versions_after']} | {m['removed']} | "
              f"{m['keep_newer_than_s']} |" for m in result["vectors"]]
    return "\n".join(lines) + "\n"


@flow(name="nightly-rebuild", flow_run_name="nightly-rebuild/{label}")
def nightly_rebuild(
    store: str = "./tmem-store",
    keep_snapshots: int = 3,
    lance_margin_s: float = 300.0,
    prices: dict[str, dict[str, float]] | None = None,
    label: str = "nightly",
) -> dict[str, Any]:
    """Rebuild and publish the conversations that changed, then prune snapshots and Lance versions.

    ``keep_snapshots``: published snapshots kept (the current one always). ``lance_margin_s``:
    extra age kept beyond the oldest pinned Lance version (covers clock skew).
    """
    if keep_snapshots < 1:
        raise ValueError("keep_snapshots must be >= 1")
    started = datetime.now(UTC)
    spec = BuildSpec.resolve(store)  # this run's settings, resolved once: the build's parameter in the UI
    drain_posted_turns(store, started)  # turns posted since the last run count as changes
    changed = find_changed_conversations(store)
    build = None
    if changed:
        build = build_memory(store=spec, conversation_ids=changed, only_changed=True, label=label, prices=prices)
    pruned = prune_old_snapshots(store, keep_snapshots)
    vectors = optimize_vector_tables(spec, datetime.now(UTC), lance_margin_s)
    result: dict[str, Any] = {"started_at": started.isoformat(timespec="seconds"), "changed": changed, "build": build,
                              "pruned": pruned, "vectors": vectors}
    create_markdown_artifact(markdown=render_report(result), key="tmem-nightly-report",
                             description=f"nightly rebuild: {len(changed)} changed")
    if build is not None and build["failures"]:
        failed = [f["conversation_id"] for f in build["failures"]]
        raise NightlyBuildFailed(f"{len(failed)} conversation(s) failed to build: {', '.join(failed)}")
    return result

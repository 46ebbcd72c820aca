"""``tmem forget --conversation ID [--store DIR] [--json] [--dry-run] [--unowned delete|keep]`` and
``tmem forget --resume``: erase a conversation from every place the store keeps it
(:mod:`tmem.store.forget`).

Exit status: 0 forgotten (or already forgotten, or a dry run); 2 refused with nothing removed
(unknown id, unattributable cache rows without ``--unowned``, another forget unfinished, a build
holding the store). A forget that is killed is finished by running the command again.
"""

from __future__ import annotations

import argparse
from pathlib import Path
from typing import Any

from tmem.cli.base import CliContext, Command, add_json_option, add_store_option, resolve_store


def configure(parser: argparse.ArgumentParser) -> None:
    target = parser.add_mutually_exclusive_group(required=True)
    target.add_argument("--conversation", metavar="ID", help="the conversation to forget (its exact id)")
    target.add_argument("--resume", action="store_true", help="finish forgets a killed `tmem forget` left unfinished")
    add_store_option(parser)
    add_json_option(parser)
    parser.add_argument("--dry-run", action="store_true", help="list what would be removed; change nothing")
    parser.add_argument(
        "--unowned", choices=("delete", "keep"), default=None,
        help="cache rows with no recorded owner (written before owners were recorded) may hold this "
             "conversation's text: delete them all, or keep them (refused while any exist, unless given)",
    )


def _result_dirs() -> list[Path]:
    """Prefect's local result storage, scanned too (importing Prefect costs ~2 s: only when it exists)."""
    from tmem.tasks.runtime import prefect_local_result_dirs

    return [d for d in prefect_local_result_dirs() if d.is_dir()]


def _say(ctx: CliContext) -> Any:
    def progress(step: str, number: int, total: int) -> None:
        print(f"forget: step {number}/{total} {step}", file=ctx.stderr, flush=True)

    return progress


def run(args: argparse.Namespace, ctx: CliContext) -> int:
    from tmem.store.forget import forget_conversation, resume_forgets
    from tmem.store.lance_location import lance_uri

    store = resolve_store(args, ctx)
    settings = ctx.settings()
    uri = lance_uri(settings.model_copy(update={"store": store}))
    if args.resume:
        reports = resume_forgets(store, now=ctx.clock(), lance_uri=uri, result_dirs=_result_dirs(), progress=_say(ctx))
        if args.json:
            ctx.print_json({"resumed": reports})
        else:
            ctx.print(f"finished {len(reports)} unfinished forget{'s' if len(reports) != 1 else ''} in {store}")
        return 0
    report = forget_conversation(
        store, args.conversation, now=ctx.clock(), lance_uri=uri, dry_run=args.dry_run,
        unowned=args.unowned or "refuse", result_dirs=_result_dirs(), progress=None if args.dry_run else _say(ctx),
    )
    if args.json:
        ctx.print_json(report)
        return 0
    if args.dry_run:
        ctx.print(_dry_run_text(report))
    elif report.get("already_forgotten"):
        ctx.print(f"conversation {args.conversation!r} was already forgotten ({report['forgotten_at']}); nothing to do")
    else:
        ctx.print(_done_text(args.conversation, report))
    return 0


def _dry_run_text(report: dict[str, Any]) -> str:
    if "pending_step" in report:
        return f"a forget of {report['conversation_id']!r} is unfinished (next step: {report['pending_step']})"
    held = report["would_remove"]
    work, files = held["work"], held["files"]
    lines = [f"would forget {report['conversation_id']!r} (dry run, nothing changed):",
             f"  working database: {sum(work['rows'].values())} rows in {len(work['rows'])} tables "
             f"({', '.join(f'{t} {n}' for t, n in sorted(work['rows'].items()))}); "
             f"{work['llm_cache']} cached LLM answers, {work['embedding_cache']} cached embeddings "
             f"({work['llm_cache_shared_kept']} + {work['embedding_cache_shared_kept']} shared with other conversations: kept); "
             f"{work['build_runs_scrubbed']} build runs scrubbed; the file ({held['work_db_bytes']} bytes) rewritten",
             f"  unowned cache rows: {work['unowned_llm_cache']} LLM answers, {work['unowned_embedding_cache']} embeddings",
             f"  vector rows: {held['vector_rows'] or 'none'}",
             f"  snapshots holding it: {held['snapshots_holding'] or 'none'}; on disk: {len(held['snapshots_on_disk'])}"
             + (f" (all removed but a republished {held['current_snapshot']})" if held["snapshots_holding"] else ""),
             f"  files: {files['prefect_partition_files']} task results in its directory, "
             f"{files['prefect_legacy_results']} older task results, {files['prefect_cache_records']} cache records, "
             f"{files['exchange_files']} exchange files ({files['bytes']} bytes)"]
    if work["in_flight_batches"]:
        lines.append(f"  not reachable: Batch API input files at the provider of in-flight batches {work['in_flight_batches']}")
    return "\n".join(lines)


def _done_text(conversation_id: str, report: dict[str, Any]) -> str:
    steps = report["steps"]
    work = steps.get("work", {})
    snap = steps.get("snapshot", {})
    lines = [f"forgot {conversation_id!r}{' (resumed)' if report['resumed'] else ''}: tombstone {report['tombstone'][:16]}…",
             f"  working database: {sum(work.get('rows', {}).values())} rows, {work.get('llm_cache', 0)} cached answers, "
             f"{work.get('embedding_cache', 0)} cached embeddings removed; file rewritten",
             f"  snapshots: republished {snap.get('republished')}, removed {len(steps.get('prune', {}).get('removed', []))}",
             f"  seconds: {sum(report['seconds'].values()):.2f}"]
    if work.get("in_flight_batches"):
        lines.append(f"  not reachable: Batch API input files at the provider of in-flight batches {work['in_flight_batches']}")
    return "\n".join(lines)


COMMAND = Command(
    name="forget",
    help="erase a conversation from every place the store keeps it (tombstoned against re-ingest)",
    description=(
        "Remove one conversation (its exact id) from the working database, the LLM and embedding caches, "
        "Prefect task results, LanceDB (rows and old versions) and the snapshots (the current one is "
        "republished without it, older ones removed), then rewrite the working database file. A killed "
        "forget is finished by running it again; builds refuse to run meanwhile. A later ingest of the "
        "conversation is refused unless `tmem ingest --allow-forgotten`."
    ),
    configure=configure,
    run=run,
)

"""``tmem ingest [PATH...] [--store DIR] [--format F] [--json]``: add archives to the store.

Then the turns posted by live assistants and waiting in the store's spool are ingested too
(:func:`tmem.ingest.spool.drain_spool`); with no PATH, only they are.
"""

from __future__ import annotations

import argparse
import time
from pathlib import Path

from tmem.cli.base import CliContext, Command, add_json_option, add_store_option, resolve_store
from tmem.errors import StoreError

FORMAT_CHOICES = ("auto", "locomo", "jsonl")


def configure(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("paths", nargs="*", type=Path, metavar="PATH",
                        help="archive files (.json LoCoMo, .jsonl generic); none: only the posted turns waiting in the spool")
    add_store_option(parser)
    parser.add_argument(
        "--format",
        choices=FORMAT_CHOICES,
        default="auto",
        help="archive format; auto: by extension (.json LoCoMo, .jsonl generic), else by content",
    )
    parser.add_argument(
        "--allow-forgotten",
        action="store_true",
        help="ingest conversations that `tmem forget` erased (refused otherwise, naming the file and record)",
    )
    add_json_option(parser)


def run(args: argparse.Namespace, ctx: CliContext) -> int:
    from tmem.ingest.load import ingest_archives  # imported here: keeps `tmem --help` light
    from tmem.ingest.spool import drain_spool

    store = resolve_store(args, ctx)
    if not args.paths and not store.is_dir():
        raise StoreError(f"{store}: no tmem store here; give archive files to ingest")
    started = time.perf_counter()
    report = None
    if args.paths:
        report = ingest_archives(
            list(args.paths),
            store,
            now=ctx.clock(),
            source_format=None if args.format == "auto" else args.format,
            allow_forgotten=args.allow_forgotten,
        )
    spooled = drain_spool(store, now=ctx.clock())
    seconds = round(time.perf_counter() - started, 3)
    if args.json:
        ctx.print_json((report.as_dict() if report is not None else {}) | {"spool": spooled.as_dict(),
                                                                           "store": str(store), "seconds": seconds})
        return 0
    if spooled.files or report is None:
        ctx.print(f"posted turns: {spooled.files} waiting file{'s' if spooled.files != 1 else ''} ingested, "
                  f"{spooled.new_turns} new turns, {len(spooled.rejected)} refused")
    for refused in spooled.rejected:
        ctx.print(f"  refused, moved to {refused['file']}: {refused['error']}")
    if report is None:
        return 0
    files = len(report.files)
    ctx.print(
        f"read {files} file{'s' if files != 1 else ''}: {report.conversations} conversations, {report.sessions} sessions, "
        f"{report.turns} turns, {report.qa} QA items"
    )
    ctx.print(
        f"added to {store}: {report.new_conversations} new conversations ({report.updated_conversations} updated), "
        f"{report.new_sessions} sessions, {report.new_turns} turns, {report.new_qa} QA items in {seconds:.2f} s"
    )
    return 0


COMMAND = Command(
    name="ingest",
    help="validate archives and add their new turns to the store",
    description=(
        "Read LoCoMo JSON or tmem JSON Lines archives, validate all of them, then add what is new in one "
        "transaction. A malformed archive or a conflicting change writes nothing and exits 2. "
        "Re-ingesting the same archive adds nothing. Then ingest the turns posted to `tmem serve` / "
        "`tmem mcp` that wait in the store's spool (one transaction per post)."
    ),
    configure=configure,
    run=run,
)

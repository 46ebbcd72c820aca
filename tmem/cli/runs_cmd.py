"""``tmem runs [--store DIR] [--json] [--limit N]``: recent builds from the working database, newest first.

A build that died (killed, crashed) stays ``running`` until the next build marks it
``interrupted``. While a build is running its process holds the working database, so this
command reports that the store is busy instead of listing.
"""

from __future__ import annotations

import argparse
from typing import Any

from tmem.cli.base import CliContext, Command, add_json_option, add_store_option, resolve_store

COLUMNS = ("run", "started (UTC)", "secs", "status", "convs", "calls", "hits", "tokens", "snapshot")


def run_rows(store: Any, limit: int) -> list[dict[str, Any]]:
    from tmem.store.duck import connect  # imported here: keeps `tmem --help` light
    from tmem.store.runs import list_runs

    con = connect(store, read_only=True)
    try:
        runs = list_runs(con, limit=limit)
    finally:
        con.close()
    return [
        {
            "run_id": r.run_id,
            "started_at": r.started_at.isoformat(),
            "finished_at": r.finished_at.isoformat() if r.finished_at else None,
            "seconds": None if r.seconds is None else round(r.seconds, 1),
            "status": r.status,
            "label": r.inputs.get("label"),
            "conversations": r.inputs.get("conversation_ids", []),
            "only_changed": r.inputs.get("only_changed"),
            "llm_calls": r.llm_calls,
            "llm_cache_hits": r.llm_cache_hits,
            "prompt_tokens": r.prompt_tokens,
            "completion_tokens": r.completion_tokens,
            "failures": r.failures,
            "snapshot_id": r.snapshot_id,
        }
        for r in runs
    ]


def render_table(rows: list[dict[str, Any]]) -> list[str]:
    cells = [
        (
            r["run_id"][:8],
            r["started_at"][:19].replace("T", " "),
            "" if r["seconds"] is None else f"{r['seconds']:.1f}",
            r["status"] + _failure_note(r["failures"]),
            str(len(r["conversations"])),
            str(r["llm_calls"]),
            str(r["llm_cache_hits"]),
            str(r["prompt_tokens"] + r["completion_tokens"]),
            r["snapshot_id"] or "-",
        )
        for r in rows
    ]
    widths = [max(len(h), *(len(c[i]) for c in cells)) for i, h in enumerate(COLUMNS)]
    line = "  ".join(f"{{:<{w}}}" for w in widths)
    return [line.format(*COLUMNS).rstrip(), *(line.format(*c).rstrip() for c in cells)]


def _failure_note(failures: list[dict[str, Any]]) -> str:
    if not failures:
        return ""
    quarantined = sum(1 for f in failures if f.get("quarantined"))
    return f" ({len(failures)} failed" + (f", {quarantined} quarantined)" if quarantined else ")")


def run(args: argparse.Namespace, ctx: CliContext) -> int:
    rows = run_rows(resolve_store(args, ctx), args.limit)
    if args.json:
        ctx.print_json(rows)
    elif not rows:
        ctx.print("no builds recorded yet")
    else:
        for text in render_table(rows):
            ctx.print(text)
    return 0


def _positive(text: str) -> int:
    value = int(text)
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be >= 1, got {value}")
    return value


def configure(parser: argparse.ArgumentParser) -> None:
    add_store_option(parser)
    add_json_option(parser)
    parser.add_argument("--limit", type=_positive, default=20, metavar="N", help="show the newest N builds (default 20)")


COMMAND = Command(
    name="runs",
    help="recent builds: status, conversations, LLM calls, tokens, snapshot",
    configure=configure,
    run=run,
)

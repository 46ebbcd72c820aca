"""``tmem quarantine [--all] [--conversation ID] [--store DIR] [--json]``: quarantined conversations and units.

A conversation is quarantined when an operation of its spine (segmentation, topic admission) kept
answering invalid output after the bounded repair; a unit (one topic chunk's items, one item's or
scene's triggers, one speaker's persona) when its own answer did, and the conversation published
without it (see :mod:`tmem.store.quarantine`). Listed newest first: conversation, unit, run,
operation, input (reference, digest, excerpt), reason and the raw output. ``--all`` also lists
records cleared by a later successful build or superseded by a later quarantine.
"""

from __future__ import annotations

import argparse
from typing import Any

from tmem.cli.base import CliContext, Command, add_json_option, add_store_option, resolve_store

RAW_PREVIEW = 240


def configure(parser: argparse.ArgumentParser) -> None:
    add_store_option(parser)
    add_json_option(parser)
    parser.add_argument("--all", action="store_true", help="include cleared and superseded records")
    parser.add_argument("--conversation", default=None, metavar="ID", help="only this conversation")


def quarantine_rows(store: Any, *, include_inactive: bool, conversation_id: str | None) -> list[dict[str, Any]]:
    from tmem.store.duck import connect  # imported here: keeps `tmem --help` light
    from tmem.store.quarantine import list_quarantine

    con = connect(store, read_only=True)
    try:
        records = list_quarantine(con, include_inactive=include_inactive, conversation_id=conversation_id)
    finally:
        con.close()
    return [
        {
            "conversation_id": r.conversation_id, "unit_kind": r.unit_kind, "unit_id": r.unit_id,
            "run_id": r.run_id, "state": r.state, "error_type": r.error_type,
            "operation": r.operation, "input_ref": r.input_ref, "input_digest": r.input_digest,
            "input_excerpt": r.input_excerpt, "reason": r.reason, "raw_output": r.raw_output,
            "quarantined_at": r.quarantined_at.isoformat(),
            "cleared_at": r.cleared_at.isoformat() if r.cleared_at else None, "cleared_by_run": r.cleared_by_run,
        }
        for r in records
    ]


def _one_line(text: str | None, limit: int) -> str:
    flat = " ".join((text or "").split())
    return flat if len(flat) <= limit else flat[:limit] + "..."


def run(args: argparse.Namespace, ctx: CliContext) -> int:
    rows = quarantine_rows(resolve_store(args, ctx), include_inactive=args.all, conversation_id=args.conversation)
    if args.json:
        ctx.print_json(rows)
        return 0
    if not rows:
        ctx.print("nothing is quarantined" if not args.all else "no quarantine records")
        return 0
    for r in rows:
        unit = "whole conversation" if r["unit_kind"] == "conversation" else f"{r['unit_kind']} {r['unit_id']}"
        ctx.print(f"{r['conversation_id']}  {unit}  [{r['state']}]  run {r['run_id'][:8]}  {r['quarantined_at'][:19]}")
        ctx.print(f"  operation   {r['operation']} ({r['error_type']})")
        ctx.print(f"  input       {r['input_ref']}  digest {(r['input_digest'] or '-')[:16]}")
        ctx.print(f"  reason      {_one_line(r['reason'], RAW_PREVIEW)}")
        ctx.print(f"  raw output  {_one_line(r['raw_output'], RAW_PREVIEW)}")
        if r["cleared_by_run"]:
            ctx.print(f"  cleared by  run {r['cleared_by_run'][:8]} at {(r['cleared_at'] or '')[:19]}")
    return 0


COMMAND = Command(
    name="quarantine",
    help="conversations and units whose LLM output stayed invalid after repair: operation, input, raw output, reason",
    configure=configure,
    run=run,
)

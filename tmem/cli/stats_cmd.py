"""``tmem stats [--store DIR] [--json]``: what the store holds."""

from __future__ import annotations

import argparse
from pathlib import Path

from tmem.cli.base import CliContext, Command, add_json_option, add_store_option, resolve_store


def collect_stats(store: Path) -> dict[str, object]:
    """Stats of a store as one JSON-ready dict. New sections are new keys (rendered generically)."""
    from tmem.store.duck import connect, table_counts  # imported here: keeps `tmem --help` light
    from tmem.store.ingest_writer import conversation_overview
    from tmem.store.runs import memory_counts
    from tmem.store.snapshot.published import current_snapshot

    con = connect(store, read_only=True)
    try:
        snapshot = current_snapshot(store)
        return {
            "store": str(store),
            **memory_counts(con),
            "snapshot_id": snapshot.snapshot_id if snapshot else None,
            "tables": table_counts(con),
            "per_conversation": conversation_overview(con),
        }
    finally:
        con.close()


def render_text(stats: dict[str, object]) -> list[str]:
    """Scalars as ``key: value``, dicts as aligned ``name  value`` rows, lists of dicts one row each."""
    lines: list[str] = []
    for key, value in stats.items():
        if isinstance(value, dict):
            lines.append(f"{key}:")
            width = max((len(str(k)) for k in value), default=0)
            lines.extend(f"  {k!s:<{width}}  {v}" for k, v in value.items())
        elif isinstance(value, list):
            lines.append(f"{key}: {len(value)}")
            for row in value:
                if isinstance(row, dict):
                    lines.append("  " + "  ".join(f"{k}={_scalar(v)}" for k, v in row.items()))
                else:
                    lines.append(f"  {row}")
        else:
            lines.append(f"{key}: {value}")
    return lines


def _scalar(value: object) -> str:
    if isinstance(value, list | tuple):
        return ",".join(str(v) for v in value)
    return str(value)


def run(args: argparse.Namespace, ctx: CliContext) -> int:
    stats = collect_stats(resolve_store(args, ctx))
    if args.json:
        ctx.print_json(stats)
    else:
        for line in render_text(stats):
            ctx.print(line)
    return 0


def configure(parser: argparse.ArgumentParser) -> None:
    add_store_option(parser)
    add_json_option(parser)


COMMAND = Command(
    name="stats",
    help="row counts per table and per-conversation ingest watermarks",
    configure=configure,
    run=run,
)

"""``tmem build [--conversation ID ...] [--changed] [--store DIR] [--json]``: run the construction flow locally."""

from __future__ import annotations

import argparse

from tmem.cli.base import CliContext, Command, add_json_option, add_store_option, resolve_store


def configure(parser: argparse.ArgumentParser) -> None:
    add_store_option(parser)
    add_json_option(parser)
    parser.add_argument("--conversation", action="append", default=None, metavar="ID",
                        help="build only this conversation (repeatable; default: all)")
    parser.add_argument("--changed", action="store_true",
                        help="only conversations with turns newer than their last build")


def run(args: argparse.Namespace, ctx: CliContext) -> int:
    from tmem.settings import apply_process_defaults

    apply_process_defaults()
    from flows.build_memory import build_memory  # Prefect is imported only when a build runs

    store = resolve_store(args, ctx)
    label = ",".join(args.conversation) if args.conversation else ("changed" if args.changed else "all")
    summary = build_memory(store=str(store), conversation_ids=args.conversation, only_changed=args.changed,
                           label=label[:60])
    if args.json:
        ctx.print_json(summary)
    else:
        ctx.print(f"run {summary['run_id']}: {summary['status']} in {summary['seconds']} s; "
                  f"snapshot {summary['snapshot_id']}")
        for key in ("conversations", "scenes", "topics", "items", "atomic_items", "connected_items",
                    "entity_triggers", "bridge_triggers", "scene_triggers", "horizon_triggers", "personas",
                    "llm_calls", "llm_cache_hits", "prompt_tokens", "completion_tokens"):
            ctx.print(f"  {key:<18} {summary[key]}")
        for failure in summary["failures"]:
            ctx.print(f"  FAILED {failure['conversation_id']}: {failure['message']}")
    return 0 if summary["status"] == "completed" else 1


COMMAND = Command(
    name="build",
    help="build memory with the Prefect flow (local, ephemeral Prefect) and publish a snapshot",
    configure=configure,
    run=run,
)

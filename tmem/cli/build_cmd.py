"""``tmem build [--conversation ID ...] [--changed] [--store DIR] [--json]``: run the construction flow locally.

Progress goes to stderr, one line per finished conversation (Prefect's own logs go there too);
the result goes to stdout. Exit status:

* 0 — every conversation built whole and published;
* 4 — every conversation published, but some units were quarantined and left out (one topic
  chunk's items, one item's or scene's triggers, one speaker's persona);
* 3 — some conversations quarantined whole (their previous memory kept), the others published
  (with or without quarantined units);
* 1 — any other failure (e.g. the endpoint kept failing).

``tmem quarantine`` lists what is quarantined, the build report names it.
"""

from __future__ import annotations

import argparse
import logging
import time
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any, TextIO

from tmem.cli.base import CliContext, Command, add_json_option, add_store_option, resolve_store


def configure(parser: argparse.ArgumentParser) -> None:
    add_store_option(parser)
    add_json_option(parser)
    parser.add_argument("--conversation", action="append", default=None, metavar="ID",
                        help="build only this conversation (repeatable; default: all)")
    parser.add_argument("--changed", action="store_true",
                        help="only conversations with turns newer than their last build")


class ProgressLines(logging.Handler):
    """Renders the build flow's progress records as ``[####------] 4/10 conv-41 built (12.3 s)``."""

    WIDTH = 20

    def __init__(self, stream: TextIO) -> None:
        super().__init__(logging.INFO)
        self.stream = stream
        self.started = time.monotonic()

    def emit(self, record: logging.LogRecord) -> None:
        done, total = getattr(record, "done", None), getattr(record, "total", None)
        if not isinstance(done, int) or not isinstance(total, int) or total < 1:
            return
        filled = round(self.WIDTH * done / total)
        status = "built" if getattr(record, "ok", False) else "FAILED"
        self.stream.write(f"[{'#' * filled}{'-' * (self.WIDTH - filled)}] {done}/{total} "
                          f"{getattr(record, 'conversation_id', '?')} {status} "
                          f"({time.monotonic() - self.started:.1f} s)\n")
        self.stream.flush()


@contextmanager
def progress_to(stream: TextIO) -> Iterator[None]:
    """Show the build's per-conversation progress on ``stream`` while the block runs."""
    log = logging.getLogger("tmem.build.progress")
    handler = ProgressLines(stream)
    saved = (log.level, log.propagate)
    log.addHandler(handler)
    log.setLevel(logging.INFO)
    log.propagate = False  # not again through Prefect's console handler
    try:
        yield
    finally:
        log.removeHandler(handler)
        log.setLevel(saved[0])
        log.propagate = saved[1]


def run(args: argparse.Namespace, ctx: CliContext) -> int:
    from tmem.settings import apply_process_defaults

    apply_process_defaults()
    from tmem.build.spec import BuildSpec
    from tmem.flows.build_memory import build_memory  # Prefect is imported only when a build runs
    from tmem.providers.llama_cpp import LocalModelError, provider_endpoint
    from tmem.providers.registry import resolve_provider

    store = resolve_store(args, ctx)
    label = ",".join(args.conversation) if args.conversation else ("changed" if args.changed else "all")
    settings = ctx.settings().model_copy(update={"store": store})
    if settings.llm_batch == "on" and resolve_provider(settings, "build") == "local":
        print("error: TMEM_LLM_BATCH=on needs an OpenAI-compatible endpoint with the Batch API "
              "(set TMEM_LLM_BASE_URL); the embedded local model has none", file=ctx.stderr)
        return 2
    try:
        with provider_endpoint(settings, "build") as embedded, progress_to(ctx.stderr):
            if embedded is not None:
                print(f"LLM: the embedded model {embedded.model} at {embedded.base_url} (TMEM_LLM_PROVIDER="
                      f"{settings.llm_provider}); a tiny model that proves the pipeline, not the quality.",
                      file=ctx.stderr)
            # The build's spec: the settings read now (the embedded model's endpoint included), no secret.
            spec = BuildSpec.resolve(store, ctx.settings_loader())
            summary = build_memory(store=spec, conversation_ids=args.conversation, only_changed=args.changed,
                                   label=label[:60])
    except LocalModelError as exc:
        print(f"error: {exc}", file=ctx.stderr)
        return 2
    if args.json:
        ctx.print_json(summary)
    else:
        ctx.print(f"run {summary['run_id']}: {summary['status']} in {summary['seconds']} s; "
                  f"snapshot {summary['snapshot_id']}")
        for key in ("conversations", "scenes", "topics", "items", "atomic_items", "connected_items",
                    "entity_triggers", "bridge_triggers", "scene_triggers", "horizon_triggers", "personas",
                    "llm_calls", "llm_cache_hits", "prompt_tokens", "completion_tokens"):
            ctx.print(f"  {key:<18} {summary[key]}")
        from tmem.pricing import format_usd

        ctx.print(f"  {'est. cost':<18} {format_usd(summary.get('cost_usd'))} ({summary.get('model')})")
        spooled = summary.get("spool") or {}
        if spooled.get("files"):
            ctx.print(f"  {'posted turns':<18} {spooled['new_turns']} new from {spooled['files']} waiting posts"
                      f"{', ' + str(len(spooled['rejected'])) + ' refused' if spooled['rejected'] else ''}")
        for refused in spooled.get("rejected", ()):
            ctx.print(f"  REFUSED post, moved to {refused['file']}: {refused['error']}")
        for failure in summary["failures"]:
            tag = "QUARANTINED" if failure.get("quarantined") else "FAILED"
            ctx.print(f"  {tag} {failure['conversation_id']}: {failure['message']}")
        for unit in summary.get("quarantined_units", []):
            ctx.print(f"  MISSING {unit['conversation_id']} {unit['operation']} {unit['unit_kind']} {unit['unit_id']}: "
                      f"{unit['reason'][:200]}")
        if summary["quarantined"] or summary.get("quarantined_units"):
            ctx.print("  (quarantined: invalid LLM output after the bounded repair; see `tmem quarantine`)")
    return exit_status(summary)


EXIT_QUARANTINED = 3
EXIT_UNITS_QUARANTINED = 4


def exit_status(summary: dict[str, Any]) -> int:
    """0 completed whole; 4 completed with some units quarantined; 3 every other conversation published
    and the failures are all quarantines; else 1."""
    if summary["status"] == "completed":
        return EXIT_UNITS_QUARANTINED if summary.get("quarantined_units") else 0
    if summary["status"] == "partial" and all(f.get("quarantined") for f in summary["failures"]):
        return EXIT_QUARANTINED
    return 1


COMMAND = Command(
    name="build",
    help="build memory with the Prefect flow (local, ephemeral Prefect) and publish a snapshot",
    configure=configure,
    run=run,
)

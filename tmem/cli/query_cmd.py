"""``tmem query "..." --conversation ID [--json] [--trace] [--preset NAME] [--speaker S] [--no-embed]``.

Prints the recalled scenes and items, each with the channels that reached it (lexical, dense,
dialogue, scene_trigger, horizon, entity_bridge), then the personas. ``--no-embed`` runs the
lexical channels only and never imports the embedding model (nor LanceDB).
"""

from __future__ import annotations

import argparse
import time
from datetime import datetime
from typing import TYPE_CHECKING

from tmem.cli.base import CliContext, Command, add_json_option, add_store_option, resolve_store

if TYPE_CHECKING:
    from tmem.query.memory import Memory
    from tmem.retrieval.cascade import SearchResult
    from tmem.retrieval.context import ContextReport
    from tmem.retrieval.trace import Trace

EXIT_BAD_INPUT = 2
TRACE_ROWS = 10  # candidates shown per stage in text mode (--json has them all)


def add_query_options(parser: argparse.ArgumentParser) -> None:
    """Options shared by ``query`` and ``answer``."""
    parser.add_argument("--conversation", required=True, metavar="ID", help="conversation (tenant) id; required")
    parser.add_argument("--speaker", default=None, metavar="S", help="speaker asking (selects the persona)")
    parser.add_argument("--preset", default="default", metavar="NAME", help="retrieval preset (default, paper, ...)")
    parser.add_argument("--no-embed", action="store_true", help="lexical only: do not embed the query")
    add_store_option(parser)
    add_json_option(parser)


def open_memory(args: argparse.Namespace, ctx: CliContext) -> Memory:
    from tmem.query.memory import Memory  # imported here: keeps `tmem --help` light

    return Memory.open(resolve_store(args, ctx), ctx.settings())


def bad_preset(ctx: CliContext, exc: Exception) -> int:
    from tmem.retrieval.config import preset_names

    print(f"error: {exc}", file=ctx.stderr)
    print(f"known presets: {', '.join(preset_names())} (combine with '+')", file=ctx.stderr)
    return EXIT_BAD_INPUT


def _day(moment: datetime | None) -> str:
    from tmem.retrieval.context import format_date

    return format_date(moment)


def render_result(result: SearchResult, lines: list[str]) -> None:
    """Scenes and items best first, each with its reaching channels; then the personas."""
    lines.append(f"Scenes ({len(result.scenes)})")
    for n, scene in enumerate(result.scenes, 1):
        start, end = _day(scene.start_time), _day(scene.end_time)
        span = start if start == end else f"{start} – {end}"
        lines.append(f"  {n}. {scene.title} ({span})  via {', '.join(scene.channels) or '-'}  score {scene.score:.4f}")
        lines.append(f"     {scene.scene_id} · {len(scene.turns)} turns")
    lines.append(f"Items ({len(result.items)})")
    for n, item in enumerate(result.items, 1):
        lines.append(f"  {n}. [{_day(item.event_time)}] {item.content}")
        lines.append(f"     via {', '.join(item.channels) or '-'} · {item.kind} · {item.item_id} · score {item.score:.4f}")
    if result.personas:
        lines.append("Personas: " + ", ".join(p.speaker for p in result.personas))


def render_trace(trace: Trace, lines: list[str]) -> None:
    lines.append(f"Trace · preset {trace.config} · {trace.mode} · query tokens: {' '.join(trace.query_tokens) or '-'}")
    for stage in trace.stages:
        lines.append(
            f"  {stage.stage}: fusion {stage.fusion} over {', '.join(stage.lists) or '-'}; pool {stage.pool_size}; "
            f"kept {len(stage.selected)}" + (f" ({stage.note})" if stage.note else "")
        )
        for cand in stage.candidates[:TRACE_ROWS]:
            ranks = " ".join(f"{name}#{rank}" for name, rank in cand.ranks.items())
            extra = f"  via {','.join(cand.channels)}" if cand.channels else ""
            pools = f"  from {','.join(cand.pools)}" if cand.pools else ""
            detail = f"  «{cand.detail}»" if cand.detail else ""
            mark = "*" if cand.selected else " "
            lines.append(f"    {mark} {cand.id}  fused {cand.fused:.4f}  {ranks}{extra}{pools}{detail}")
        if len(stage.candidates) > TRACE_ROWS:
            lines.append(f"    … {len(stage.candidates) - TRACE_ROWS} more (see --json)")
    persona = trace.persona_speaker or "-"
    lines.append(f"  persona: speaker {persona} ({'matched' if trace.persona_matched else 'all speakers'})")


def render_report(report: ContextReport) -> str:
    return (
        f"context {report.tokens_used}/{report.budget} tokens (+{report.persona_tokens} persona); "
        f"scenes {report.scenes_kept} kept, {report.scenes_dropped} dropped; "
        f"items {report.items_kept} kept, {report.items_dropped} dropped"
    )


def run(args: argparse.Namespace, ctx: CliContext) -> int:
    from tmem.query.schemas import context_report_out, search_out
    from tmem.retrieval.config import UnknownPresetError

    started = time.perf_counter()
    memory = open_memory(args, ctx)
    pinned = memory.snapshot()
    try:
        qc = pinned.context(
            args.query, conversation_id=args.conversation, speaker=args.speaker, preset=args.preset,
            trace=args.trace, embed=not args.no_embed,
        )
    except UnknownPresetError as exc:
        return bad_preset(ctx, exc)
    took = (time.perf_counter() - started) * 1000
    result = qc.result
    if args.json:
        out = search_out(result, snapshot_id=pinned.snapshot_id, preset=args.preset, took_ms=took).model_dump(mode="json")
        out["context_report"] = context_report_out(qc.context.report).model_dump()
        if args.context:
            out["context"] = qc.context.text
        ctx.print_json(out)
        return 0
    lines = [
        f"conversation {result.conversation_id} · snapshot {pinned.snapshot_id} · {result.mode} · "
        f"preset {args.preset} · {took:.1f} ms"
    ]
    render_result(result, lines)
    lines.append(render_report(qc.context.report))
    if result.trace is not None:
        render_trace(result.trace, lines)
    if args.context:
        lines += ["", qc.context.text]
    for line in lines:
        ctx.print(line)
    return 0


def configure(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("query", metavar="QUERY", help="what to recall")
    add_query_options(parser)
    parser.add_argument("--trace", action="store_true", help="show each stage's candidates, ranks and fused scores")
    parser.add_argument("--context", action="store_true", help="also print the QA context text")


COMMAND = Command(
    name="query",
    help="recall scenes and items of one conversation for a query",
    description=(
        "Run the topic → scene → item cascade over the published memory of one conversation and print "
        "what was recalled, with the channel that reached each scene and item. Exits 2 for an unknown "
        "conversation or preset."
    ),
    configure=configure,
    run=run,
)

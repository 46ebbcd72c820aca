"""``tmem answer "..." --conversation ID [--speaker S] [--preset NAME] [--date ISO] [--json]``.

Recalls memory for the question, renders the context under the token budget and asks the
answer-role model (``TMEM_LLM_ANSWER_*``, else ``TMEM_LLM_*``) for a short answer. Prints the
answer, the context report and what was recalled, with the channels that reached it.
"""

from __future__ import annotations

import argparse
import time
from datetime import datetime

from tmem.cli.base import CliContext, Command, resolve_store
from tmem.cli.query_cmd import EXIT_BAD_INPUT, add_query_options, bad_preset, render_report, render_result


def _question_date(text: str) -> datetime:
    try:
        return datetime.fromisoformat(text)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(f"not an ISO date or date-time: {text!r}") from exc


def run(args: argparse.Namespace, ctx: CliContext) -> int:
    from tmem.query.schemas import answer_out
    from tmem.retrieval.config import UnknownPresetError

    if not args.question.strip():
        print("error: the question is empty", file=ctx.stderr)
        return EXIT_BAD_INPUT
    from tmem.providers.llama_cpp import LocalModelError, provider_endpoint
    from tmem.query.memory import Memory

    started = time.perf_counter()
    store = resolve_store(args, ctx)
    try:
        with provider_endpoint(ctx.settings().model_copy(update={"store": store}), "answer") as embedded:
            if embedded is not None:
                print(f"LLM: the embedded model {embedded.model}; a tiny model that proves the pipeline, not the "
                      "quality.", file=ctx.stderr)
            # Settings are read again inside the block: the embedded model's endpoint is in the environment.
            settings = ctx.settings() if embedded is None else ctx.settings_loader()
            answer = Memory.open(store, settings).snapshot().answer(
                args.question, conversation_id=args.conversation, speaker=args.speaker, preset=args.preset,
                question_date=args.date, embed=not args.no_embed,
            )
    except UnknownPresetError as exc:
        return bad_preset(ctx, exc)
    except LocalModelError as exc:
        print(f"error: {exc}", file=ctx.stderr)
        return EXIT_BAD_INPUT
    took = (time.perf_counter() - started) * 1000
    if args.json:
        out = answer_out(answer, preset=args.preset, took_ms=took, include_context=args.context)
        ctx.print_json(out.model_dump(mode="json"))
        return 0
    lines = [
        answer.answer,
        "",
        f"conversation {answer.conversation_id} · snapshot {answer.snapshot_id} · model {answer.model} · "
        f"{answer.result.mode} · preset {args.preset} · {took:.0f} ms",
        render_report(answer.context.report),
    ]
    render_result(answer.result, lines)
    if args.context:
        lines += ["", answer.context.text]
    for line in lines:
        ctx.print(line)
    return 0


def configure(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("question", metavar="QUESTION", help="the question to answer")
    add_query_options(parser)
    parser.add_argument("--date", type=_question_date, default=None, metavar="ISO",
                        help="when the question is asked (resolves relative dates), e.g. 2023-10-02")
    parser.add_argument("--context", action="store_true", help="also print the context sent to the model")


COMMAND = Command(
    name="answer",
    help="answer a question about one conversation from its memory",
    description=(
        "Recall memory for the question, then ask the answer-role model for a short answer grounded in "
        "that context. Exits 2 for an unknown conversation or preset, 1 when the model fails."
    ),
    configure=configure,
    run=run,
)

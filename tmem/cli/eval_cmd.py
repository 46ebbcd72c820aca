"""``tmem eval locomo|locomo-plus|ablate|sweep|report|retrieval ...``: the evaluation harness.

    tmem eval locomo --data locomo10.json --out DIR [--build] [--judge-runs 3] [--preset NAME]
    tmem eval locomo-plus --data locomo10.json --plus locomo_plus.json --out DIR [--build] [--one-build conv-30 --cues 16]
    tmem eval ablate --dataset locomo|locomo-plus --data ... --out DIR [--only no-horizon,...]
    tmem eval sweep --param kS --values 1,3,5,10 --dataset locomo --data ... --out DIR
    tmem eval report DIR
    tmem eval retrieval --dataset locomo --data locomo10.json      (LLM-free recall; no answer model)

Answers use the answer-role model (``TMEM_LLM_ANSWER_*``, else ``TMEM_LLM_*``), grades the
judge-role model (``TMEM_LLM_JUDGE_*``). ``--answer-prompt FILE`` / ``--judge-prompt FILE`` send a
protocol text (e.g. ``../shared/datasets/protocol/memos__ANSWER_PROMPT_MEMOS.txt``) verbatim.
Every output is saved under ``--out``; running the same command again resumes, and ``tmem eval
report DIR`` re-scores from the saved outputs without any LLM call.
"""

from __future__ import annotations

import argparse
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from tmem.cli.base import CliContext, Command, add_json_option, add_store_option, resolve_store

EXIT_BAD_INPUT = 2
DATASETS = ("locomo", "locomo-plus")


def _ints(text: str) -> tuple[int, ...]:
    try:
        values = tuple(int(v) for v in text.split(",") if v.strip())
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected comma-separated integers, got {text!r}") from None
    if not values:
        raise argparse.ArgumentTypeError("expected at least one integer")
    return values


def _names(text: str) -> tuple[str, ...]:
    return tuple(v.strip() for v in text.split(",") if v.strip())


def _run_options(parser: argparse.ArgumentParser, *, dataset: bool) -> None:
    add_store_option(parser)
    add_json_option(parser)
    if dataset:
        parser.add_argument("--dataset", choices=DATASETS, default="locomo", help="benchmark (default: locomo)")
    parser.add_argument("--data", type=Path, required=True, metavar="LOCOMO_JSON",
                        help="locomo10.json or a slice of it (for locomo-plus: the host conversations)")
    parser.add_argument("--plus", type=Path, default=None, metavar="PLUS_JSON", help="locomo_plus.json (locomo-plus)")
    parser.add_argument("--out", type=Path, default=None, metavar="DIR",
                        help="results root (default: ./tmem-eval/<dataset>-<command>); re-running resumes it")
    parser.add_argument("--preset", default="default", help="retrieval preset of the baseline (default: default)")
    parser.add_argument("--conversations", type=_names, default=(), metavar="ID[,ID]", help="only these conversations")
    parser.add_argument("--categories", type=_ints, default=(1, 2, 3, 4), metavar="C[,C]",
                        help="LoCoMo categories (default 1,2,3,4; 5 = adversarial)")
    parser.add_argument("--limit", type=int, default=None, metavar="N",
                        help="only the first N questions (locomo-plus: items)")
    parser.add_argument("--build", action="store_true",
                        help="ingest and build (or reuse) the needed conversations first (Prefect flow); "
                             "default: require a published snapshot holding them")
    parser.add_argument("--judge-runs", type=int, default=1, metavar="N", help="judge calls per answer, averaged")
    parser.add_argument("--answer-prompt", type=Path, default=None, metavar="FILE", help="protocol answer prompt text")
    parser.add_argument("--answer-prompt-role", choices=("user", "system"), default="user",
                        help="send the answer prompt file as this message role (Mem0/MemOS: system)")
    parser.add_argument("--answer-positional", type=_names, default=(), metavar="NAME[,NAME]",
                        help="what fills the answer file's positional {} fields, in order (e.g. question)")
    parser.add_argument("--judge-prompt", type=Path, default=None, metavar="FILE", help="protocol judge prompt text")
    parser.add_argument("--judge-system-prompt", type=Path, default=None, metavar="FILE",
                        help="protocol judge system message (MemOS)")
    parser.add_argument("--judge-positional", type=_names, default=(), metavar="NAME[,NAME]",
                        help="what fills the judge file's positional {} fields, in order")
    parser.add_argument("--prompt-style", choices=("auto", "format", "jinja", "dollar"), default="auto",
                        help="placeholder style of the prompt files (default: detect)")
    parser.add_argument("--budget-tokens", type=int, default=None, metavar="N", help="context token budget")
    parser.add_argument("--workers", type=int, default=4, metavar="N", help="questions in flight (default 4)")
    parser.add_argument("--no-embed", action="store_true", help="lexical recall only (no query embedder)")
    parser.add_argument("--llm-cache", type=Path, default=None, metavar="DIR",
                        help="answer/judge response cache (default: <out>/llm-cache)")
    parser.add_argument("--one-build", default=None, metavar="HOST",
                        help="locomo-plus: stitch the cues hosted by this LoCoMo conversation into it as short "
                             "sessions of their own, one memory for all (cue recall and the judge in one build)")
    parser.add_argument("--cues", type=int, default=16, metavar="N", help="with --one-build: how many cues (default 16)")


def configure(parser: argparse.ArgumentParser) -> None:
    sub = parser.add_subparsers(dest="eval_command", metavar="SUBCOMMAND", required=True)
    locomo = sub.add_parser("locomo", help="LoCoMo QA: answer, judge, F1 (one configuration)")
    _run_options(locomo, dataset=False)
    locomo.set_defaults(eval_run=_run_single, dataset="locomo")
    plus = sub.add_parser("locomo-plus", help="LoCoMo-Plus cognitive items: reply, memory-awareness judge")
    _run_options(plus, dataset=False)
    plus.set_defaults(eval_run=_run_single, dataset="locomo-plus")
    ablate = sub.add_parser("ablate", help="the baseline and the eight ablations of the paper's Table 4")
    _run_options(ablate, dataset=True)
    ablate.add_argument("--only", type=_names, default=None, metavar="NAME[,NAME]",
                        help="only these ablations (e.g. no-horizon,no-scene-trigger)")
    ablate.set_defaults(eval_run=_run_ablate)
    sweep = sub.add_parser("sweep", help="one budget of the paper's Figure 4 (kT, kS, kI, R) over values")
    _run_options(sweep, dataset=True)
    sweep.add_argument("--param", required=True, help="kT, kS, kI or R")
    sweep.add_argument("--values", default=None, metavar="V[,V]", help="values (default: the paper's)")
    sweep.set_defaults(eval_run=_run_sweep)
    report = sub.add_parser("report", help="re-score saved outputs (no LLM call) and write the report")
    report.add_argument("run_dir", type=Path, metavar="DIR", help="a results root or one run folder")
    report.add_argument("--title", default=None)
    add_json_option(report)
    report.set_defaults(eval_run=_run_report)
    _add_retrieval(sub)


def run(args: argparse.Namespace, ctx: CliContext) -> int:
    from tmem.eval.ablations import EvalConfigError
    from tmem.eval.prompt_files import PromptFileError
    from tmem.eval.run_folder import RunFolderError
    from tmem.retrieval.config import UnknownPresetError

    try:
        code: int = args.eval_run(args, ctx)
    except (EvalConfigError, PromptFileError, RunFolderError, UnknownPresetError, ValueError) as exc:
        print(f"error: {exc}", file=ctx.stderr)
        return EXIT_BAD_INPUT
    return code


# --------------------------------------------------------------------------- running


def _options(args: argparse.Namespace) -> Any:
    from tmem.eval.judge import JudgeSetup
    from tmem.eval.prompt_files import load_prompt_file
    from tmem.eval.runner import AnswerSetup, RunOptions
    from tmem.settings import load_settings

    style = args.prompt_style
    answer = AnswerSetup(
        template=load_prompt_file(args.answer_prompt, style) if args.answer_prompt else None,
        role=args.answer_prompt_role, positional=tuple(args.answer_positional),
        # the product's setting (TMEM_ANSWER_REASONING) applies to tmem's own answer prompt here too
        reasoning=load_settings().answer_reasoning == "on" and not args.answer_prompt,
    )
    judge = JudgeSetup(
        template=load_prompt_file(args.judge_prompt, style) if args.judge_prompt else None,
        system=load_prompt_file(args.judge_system_prompt, style, plain_ok=True) if args.judge_system_prompt else None,
        positional=tuple(args.judge_positional),
    )
    if judge.system is not None and judge.template is None:
        raise ValueError("--judge-system-prompt needs --judge-prompt")
    if args.judge_runs < 1 or args.workers < 1:
        raise ValueError("--judge-runs and --workers must be ≥ 1")
    return RunOptions(judge_runs=args.judge_runs, answer=answer, judge=judge, budget_tokens=args.budget_tokens,
                      workers=args.workers, embed=not args.no_embed)


def build_with_flow(store: Path, conversation_ids: list[str]) -> Mapping[str, Any]:
    """The builder of ``tmem eval --build``: the Prefect build flow, only for changed conversations."""
    from tmem.eval.session import BuildFailedError
    from tmem.settings import apply_process_defaults

    apply_process_defaults()
    from tmem.flows.build_memory import build_memory  # Prefect is imported only when a build runs

    label = ",".join(conversation_ids)
    summary: dict[str, Any] = build_memory(store=str(store), conversation_ids=conversation_ids, only_changed=True,
                                           label=label if len(label) <= 60 else f"{len(conversation_ids)} conversations")
    if summary["status"] != "completed":
        failed = "; ".join(f"{f['conversation_id']}: {f['message']}" for f in summary.get("failures", []))
        raise BuildFailedError(f"build {summary['run_id']} {summary['status']}: {failed}")
    return summary


def _execute(args: argparse.Namespace, ctx: CliContext, configs: list[Any], kind: str) -> int:
    from tmem.eval.session import EvalPlan, run_plan

    if args.dataset == "locomo-plus" and args.plus is None:
        raise ValueError("locomo-plus needs --plus locomo_plus.json")
    store = resolve_store(args, ctx)
    settings = ctx.settings().model_copy(update={"store": store})
    out = args.out or Path("tmem-eval") / f"{args.dataset}-{kind}"
    plan = EvalPlan(
        dataset=args.dataset, locomo=args.data, plus=args.plus, out=out, configs=configs,
        categories=tuple(args.categories), conversations=tuple(args.conversations), limit=args.limit,
        build=args.build, options=_options(args), llm_cache=args.llm_cache,
        one_build_host=args.one_build, one_build_cues=args.cues,
    )
    outcome = run_plan(plan, settings, now=ctx.clock(), builder=build_with_flow if args.build else None,
                       progress=None if args.json else ctx.print)
    failures = sum(t.failures for t in outcome.tallies)
    if args.json:
        ctx.print_json({
            "out": str(out), "report": str(outcome.report.markdown), "results_csv": str(outcome.report.results_csv),
            "questions": outcome.examples, "failures": failures,
            "tallies": [t.__dict__ for t in outcome.tallies], "results": outcome.report.table.to_dicts(),
        })
    else:
        _print_overall(ctx, outcome.report.table)
        if failures:
            ctx.print(f"{failures} call(s) failed (see errors.jsonl); run the same command again to retry them")
    return 0 if failures == 0 else 1


def _run_mode(mode: str) -> Any:
    def run_mode(args: argparse.Namespace, ctx: CliContext) -> int:
        from tmem.eval.ablations import eval_configs

        kind, configs = eval_configs(mode, args.preset, param=getattr(args, "param", None),
                                     values=getattr(args, "values", None), only=getattr(args, "only", None))
        return _execute(args, ctx, configs, kind)

    return run_mode


_run_single, _run_ablate, _run_sweep = _run_mode("single"), _run_mode("ablate"), _run_mode("sweep")


def _run_report(args: argparse.Namespace, ctx: CliContext) -> int:
    from tmem.eval.report import build_report

    files = build_report(args.run_dir, title=args.title)
    if args.json:
        ctx.print_json({"report": str(files.markdown), "results_csv": str(files.results_csv),
                        "charts": [str(p) for p in files.charts], "results": files.table.to_dicts()})
    else:
        _print_overall(ctx, files.table)
        ctx.print(f"report: {files.markdown}")
    return 0


def _print_overall(ctx: CliContext, table: Any) -> None:
    from tmem.eval.results import OVERALL

    def fmt(value: Any) -> str:
        return "–" if value is None else (f"{value:.1f}" if isinstance(value, float) else str(value))

    ctx.print(f"{'config':<22} {'n':>5} {'acc %':>6} {'F1 off':>6} {'F1 mem0':>7} {'F1 memos':>8} {'in tok':>7}")
    for r in table.filter(table["category"] == OVERALL).iter_rows(named=True):
        ctx.print(f"{r['label'][:22]:<22} {r['n']:>5} {fmt(r['accuracy_pct']):>6} {fmt(r['f1_official_pct']):>6} "
                  f"{fmt(r['f1_mem0_pct']):>7} {fmt(r['f1_memos_pct']):>8} {fmt(r['mean_input_tokens']):>7}")


def _add_retrieval(sub: Any) -> None:
    """``retrieval`` is part A's command (``tmem.cli.eval_retrieval``), imported only when the parser
    is built; without it the subcommand exists and says so."""
    try:
        from tmem.cli import eval_retrieval
    except ModuleNotFoundError as exc:
        if exc.name != "tmem.cli.eval_retrieval":
            raise
        missing = sub.add_parser("retrieval", help="LLM-free evidence/cue recall (not installed)")
        missing.add_argument("ignored", nargs="*")
        missing.set_defaults(eval_run=_retrieval_missing)
        return
    retrieval = sub.add_parser("retrieval", help="LLM-free evidence/cue recall (no answer model)",
                               description=eval_retrieval.__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    eval_retrieval.configure(retrieval)
    retrieval.set_defaults(eval_run=eval_retrieval.run)


def _retrieval_missing(args: argparse.Namespace, ctx: CliContext) -> int:
    print("error: `tmem eval retrieval` is not available in this installation "
          "(module tmem.cli.eval_retrieval is missing)", file=ctx.stderr)
    return EXIT_BAD_INPUT


COMMAND = Command(
    name="eval",
    help="evaluate on LoCoMo / LoCoMo-Plus: QA accuracy, F1, ablations, sweeps, cost, retrieval recall",
    description=__doc__.split("\n\n")[0] if __doc__ else "",
    configure=configure,
    run=run,
)

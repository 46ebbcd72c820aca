"""``tmem eval retrieval``: LLM-free evidence recall of tmem and the flat/session baselines.

    tmem eval retrieval --dataset locomo --data locomo10.json --store S
        [--systems tmem,tmem-scenes,flat,session] [--preset default,paper] [--k 5,10,20]
        [--dataset locomo-plus --plus locomo_plus.json --one-build conv-30 --cues 16]
        [--budgets 500,1000,2000,4000] [--categories 1,2,3,4] [--conversations ID,..] [--limit N]
        [--out DIR] [--json]

Prints evidence recall@k per category and system (LoCoMo-Plus: cue recall and the share of items
whose cue is retrieved at all, per relation type), then recall at equal context budgets; writes
``rows.csv`` (one row per question × system × cut), ``summary.csv`` and ``summary.json`` under
``--out``. No LLM is called; the question embedder is the store's configured one.
"""

from __future__ import annotations

import argparse
import dataclasses
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

from tmem.cli.base import CliContext, add_json_option, add_store_option, resolve_store
from tmem.errors import ScopeError

if TYPE_CHECKING:
    import polars as pl

    from tmem.domain import Turn
    from tmem.eval.examples import DefectReport, QAExample
    from tmem.eval.retrieval_metrics import Retriever
    from tmem.ports import Embedder

SYSTEMS = ("tmem", "tmem-scenes", "flat", "session")
DEFAULT_SYSTEMS = "tmem,flat,session"
LOCOMO_ORDER = ("multi-hop", "temporal", "open-domain", "single-hop", "adversarial")


def _ints(text: str) -> list[int]:
    try:
        values = [int(v) for v in text.split(",") if v.strip()]
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected comma-separated integers, got {text!r}") from None
    if not values:
        raise argparse.ArgumentTypeError("expected at least one integer")
    return values


def _names(text: str) -> list[str]:
    return [v.strip() for v in text.split(",") if v.strip()]


def configure(parser: argparse.ArgumentParser) -> None:
    add_store_option(parser)
    add_json_option(parser)
    parser.add_argument("--dataset", required=True, choices=("locomo", "locomo-plus"))
    parser.add_argument("--data", type=Path, required=True, metavar="LOCOMO_JSON",
                        help="locomo10.json (for locomo-plus: the host conversations)")
    parser.add_argument("--plus", type=Path, default=None, metavar="PLUS_JSON",
                        help="locomo_plus.json (required with --dataset locomo-plus)")
    parser.add_argument("--systems", type=_names, default=_names(DEFAULT_SYSTEMS),
                        help=f"comma-separated, of {', '.join(SYSTEMS)} (default {DEFAULT_SYSTEMS})")
    parser.add_argument("--preset", type=_names, default=["default"], metavar="NAME[,NAME]",
                        help="tmem retrieval preset(s), e.g. default,paper (default: default)")
    parser.add_argument("--k", type=_ints, default=[5, 10, 20], metavar="K[,K]", help="cut-offs in units (default 5,10,20)")
    parser.add_argument("--budgets", type=_ints, default=[500, 1000, 2000, 4000], metavar="T[,T]",
                        help="context-token budgets (default 500,1000,2000,4000)")
    parser.add_argument("--budget-k", type=int, default=None, metavar="K",
                        help="tmem scenes and items retrieved before a budget is applied (default: largest --k)")
    parser.add_argument("--categories", type=_ints, default=[1, 2, 3, 4], help="LoCoMo categories (default 1,2,3,4)")
    parser.add_argument("--audited-evidence", action="store_true",
                        help="LoCoMo: use the audit's corrected evidence for flagged questions")
    parser.add_argument("--conversations", type=_names, default=None, metavar="ID[,ID]",
                        help="only questions about these conversations")
    parser.add_argument("--limit", type=int, default=None, metavar="N", help="only the first N questions")
    parser.add_argument("--out", type=Path, default=None, metavar="DIR", help="write rows.csv, summary.csv, summary.json here")
    parser.add_argument("--one-build", default=None, metavar="HOST",
                        help="locomo-plus: the cues stitched into this LoCoMo conversation (tmem eval stitch-cues / "
                             "tmem eval locomo-plus --one-build): cue recall of that one memory")
    parser.add_argument("--cues", type=int, default=16, metavar="N", help="with --one-build: how many cues (default 16)")


def load_examples(args: argparse.Namespace) -> tuple[list[QAExample], DefectReport]:
    from tmem.eval.datasets import load_locomo_plus_qa, load_locomo_qa

    if args.dataset == "locomo":
        examples, defects = load_locomo_qa(args.data, args.categories, audited_evidence=args.audited_evidence)
    else:
        if args.plus is None:
            raise ScopeError("--dataset locomo-plus needs --plus PATH (locomo_plus.json)")
        if args.one_build is not None:
            from tmem.eval.cue_stitch import stitch_cues

            stitch = stitch_cues(args.data, args.plus, args.one_build, cues=args.cues)
            examples, defects = list(stitch.cue_examples), stitch.defects
        else:
            examples, defects = load_locomo_plus_qa(args.data, args.plus)
    if args.conversations is not None:
        wanted = set(args.conversations)
        examples = [e for e in examples if e.conversation_id in wanted]
    if args.limit is not None:
        examples = examples[: max(args.limit, 0)]
    return examples, defects


def store_turns(store: Path, conversation_ids: Sequence[str]) -> dict[str, tuple[Turn, ...]]:
    """The conversations' raw turns from the working database (read-only; unknown ids raise ScopeError)."""
    from tmem.store.conversations import conversation_states, load_turns
    from tmem.store.duck import connect

    con = connect(store, read_only=True)
    try:
        conversation_states(con, list(conversation_ids))
        return {cid: load_turns(con, cid) for cid in conversation_ids}
    finally:
        con.close()


def check_evidence(examples: list[QAExample], turns: dict[str, tuple[Turn, ...]]) -> tuple[list[QAExample], int]:
    """Evidence ids the store does not hold are dropped (an archive that differs from the data file)."""
    out: list[QAExample] = []
    dropped = 0
    for e in examples:
        held = {t.turn_id for t in turns[e.conversation_id]}
        kept = tuple(t for t in e.evidence if t in held)
        dropped += len(e.evidence) - len(kept)
        out.append(dataclasses.replace(e, evidence=kept) if len(kept) != len(e.evidence) else e)
    return out, dropped


def build_systems(args: argparse.Namespace, ctx: CliContext, store: Path, turns: dict[str, tuple[Turn, ...]],
                  conversation_ids: Sequence[str], vectors: Any) -> list[Retriever]:
    from tmem.eval.baselines import baseline
    from tmem.eval.tmem_system import TmemRetriever, TmemSearcher
    from tmem.query.memory import Memory

    unknown = [s for s in args.systems if s not in SYSTEMS]
    if unknown or not args.systems:
        raise ScopeError(f"unknown system(s) {unknown}; choose from {', '.join(SYSTEMS)}")
    systems: list[Retriever] = []
    if {"tmem", "tmem-scenes"} & set(args.systems):
        memory = Memory.open(store, ctx.settings(), embedder=vectors.embedder)
        snapshot = memory.snapshot()
        missing = [c for c in conversation_ids if not snapshot.has_conversation(c)]
        if missing:
            raise ScopeError(f"snapshot {snapshot.snapshot_id} has no memory for {', '.join(missing[:5])}"
                             f"{' …' if len(missing) > 5 else ''}; build them or pass --conversations")
        budget_k = args.budget_k or max(args.k)
        for preset in args.preset:
            searcher = TmemSearcher(memory, preset, vectors, budget_k=budget_k)
            for name in ("tmem", "tmem-scenes"):
                if name in args.systems:
                    systems.append(TmemRetriever(searcher, scenes_only=name == "tmem-scenes"))
    for name in ("flat", "session"):
        if name in args.systems:
            systems.append(baseline(name, turns.__getitem__, vectors))
    return systems


def run(args: argparse.Namespace, ctx: CliContext, *, embedder: Embedder | None = None) -> int:
    """Run the evaluation (``embedder`` replaces the configured one, e.g. a test double)."""
    from tmem.settings import apply_process_defaults

    apply_process_defaults()
    from tmem.bundle import embedder_for
    from tmem.eval.retrieval_metrics import VectorMemo, evaluate_retrieval, rows_frame, summarise

    started = time.perf_counter()
    store = resolve_store(args, ctx)
    examples, defects = load_examples(args)
    conversation_ids = list(dict.fromkeys(e.conversation_id for e in examples))
    turns = store_turns(store, conversation_ids)
    examples, not_in_store = check_evidence(examples, turns)
    scored = [e for e in examples if e.evidence]

    vectors = VectorMemo(embedder if embedder is not None else embedder_for(ctx.settings(), None))
    systems = build_systems(args, ctx, store, turns, conversation_ids, vectors)
    embed_started = time.perf_counter()
    vectors.prefetch(e.question for e in scored)
    timings: dict[str, float] = {"embed_questions": time.perf_counter() - embed_started}

    def on_system(name: str, seconds: float) -> None:
        timings[name] = seconds
        print(f"  {name}: {len(scored)} questions in {seconds:.1f} s", file=ctx.stderr)

    group_of: Callable[[QAExample], str] = (
        (lambda e: e.extra.get("relation_type", e.category)) if args.dataset == "locomo-plus" else (lambda e: e.category)
    )
    rows = evaluate_retrieval(scored, systems, ks=args.k, budgets=args.budgets, group_of=group_of, on_system=on_system)
    frame = rows_frame(rows)
    summary = summarise(frame)
    timings["total"] = time.perf_counter() - started
    meta: dict[str, Any] = {
        "dataset": args.dataset, "store": str(store), "systems": [s.name for s in systems], "k": args.k,
        "budgets": args.budgets, "questions": len(examples), "scored": len(scored),
        "excluded_no_evidence": len(examples) - len(scored), "evidence_not_in_store": not_in_store,
        "defects": defects.as_dict(), "seconds": {k: round(v, 2) for k, v in timings.items()},
    }
    if args.out is not None:
        write_outputs(args.out, frame, summary, meta)
    if args.json:
        ctx.print_json({**meta, "summary": summary.to_dicts()})
    else:
        for line in render_tables(summary, meta):
            ctx.print(line)
    return 0


def write_outputs(out: Path, frame: pl.DataFrame, summary: pl.DataFrame, meta: dict[str, Any]) -> None:
    import json

    out.mkdir(parents=True, exist_ok=True)
    frame.write_csv(out / "rows.csv")
    summary.write_csv(out / "summary.csv")
    (out / "summary.json").write_text(
        json.dumps({**meta, "summary": summary.to_dicts()}, indent=1, ensure_ascii=False), encoding="utf-8"
    )


def _categories(summary: pl.DataFrame) -> list[str]:
    present = set(summary["category"].to_list()) - {"all"}
    ordered = [c for c in LOCOMO_ORDER if c in present] + sorted(present - set(LOCOMO_ORDER))
    return [*ordered, "all"]


def render_tables(summary: pl.DataFrame, meta: dict[str, Any]) -> list[str]:
    """Recall@k tables (rows: categories; columns: systems), then recall at each budget."""
    systems: list[str] = meta["systems"]
    width = max(12, *(len(s) + 1 for s in systems))
    label = 32
    cell = {(r["system"], r["mode"], r["cut"], r["category"]): r for r in summary.to_dicts()}
    what = "cue" if meta["dataset"] == "locomo-plus" else "evidence"
    lines = [f"{meta['dataset']}: {meta['scored']} of {meta['questions']} questions with usable evidence; "
             f"{meta['seconds']['total']:.0f} s"]
    for k in meta["k"]:
        lines += ["", f"{what} recall@{k}".ljust(label) + "".join(s.rjust(width) for s in systems)]
        for cat in _categories(summary):
            row = [cell.get((s, "k", k, cat)) for s in systems]
            n = next((r["questions"] for r in row if r), 0)
            lines.append(f"{cat} ({n})".ljust(label) + "".join((f"{r['recall']:.3f}" if r else "-").rjust(width) for r in row))
        if meta["dataset"] == "locomo-plus":
            row = [cell.get((s, "k", k, "all")) for s in systems]
            lines.append("cue retrieved (any turn)".ljust(label) + "".join((f"{r['hit_rate']:.3f}" if r else "-").rjust(width) for r in row))
        row = [cell.get((s, "k", k, "all")) for s in systems]
        lines.append("mean context tokens".ljust(label) + "".join((f"{r['mean_tokens']:.0f}" if r else "-").rjust(width) for r in row))
    lines += ["", f"{what} recall at a context budget (mean tokens used)", "budget".ljust(label) + "".join(s.rjust(width + 7) for s in systems)]
    for budget in meta["budgets"]:
        row = [cell.get((s, "budget", budget, "all")) for s in systems]
        lines.append(str(budget).ljust(label) + "".join(
            (f"{r['recall']:.3f} ({r['mean_tokens']:.0f})" if r else "-").rjust(width + 7) for r in row))
    return lines

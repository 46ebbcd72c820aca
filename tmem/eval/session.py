"""One evaluation end to end: load the questions, (optionally) build their memory, run every
configuration into its own folder under a results root, and write the report.

Used by ``tmem eval`` and ``flows/evaluate.py``. Building needs Prefect, which the library never
imports: the caller passes a ``builder(store, conversation_ids)`` (the CLI and the flow wrap
``tmem.flows.build_memory.build_memory``). Without ``--build`` the store must already hold a published
snapshot with every conversation the questions name.

Results root layout::

    plan.json  defects.json  report.md  results.csv  results.json  questions.csv  charts/*.png
    llm-cache/work.duckdb      answer/judge response cache and usage ledger (shared by configs)
    stitched/plus-0007.jsonl   LoCoMo-Plus conversations (locomo-plus only; with --one-build HOST,
                               stitched/archive.json: every cue in one host, see tmem.eval.cue_stitch)
    <config>/                  one run folder per configuration (see tmem.eval.run_folder)
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from datetime import datetime
from pathlib import Path
from typing import Any

from tmem.errors import TmemError
from tmem.eval.ablations import EvalConfig
from tmem.eval.costs import build_costs
from tmem.eval.examples import Dataset, DefectReport, QAExample
from tmem.eval.report import ReportFiles, build_report
from tmem.eval.results import PLAN
from tmem.eval.run_folder import BUILD_COSTS, RunFolder
from tmem.eval.runner import QARunner, RunOptions, RunTally, embed_questions
from tmem.ports import ChatModel, Embedder
from tmem.settings import Settings

Builder = Callable[[Path, list[str]], Mapping[str, Any]]
LLM_CACHE = "llm-cache"
STITCHED = "stitched"


class BuildFailedError(TmemError):
    """The memory of some conversations could not be built; the evaluation does not start."""


@dataclass(frozen=True)
class EvalPlan:
    dataset: Dataset
    locomo: Path  # locomo10.json (or a slice of it)
    out: Path  # results root
    configs: Sequence[EvalConfig]
    plus: Path | None = None  # locomo_plus.json (dataset "locomo-plus")
    categories: tuple[int, ...] = (1, 2, 3, 4)
    conversations: tuple[str, ...] = ()  # only these (default: all)
    limit: int | None = None  # at most this many questions (LoCoMo-Plus: items)
    build: bool = False
    options: RunOptions = field(default_factory=RunOptions)
    llm_cache: Path | None = None  # default: <out>/llm-cache
    one_build_host: str | None = None  # locomo-plus: stitch the cues into this LoCoMo conversation, one build
    one_build_cues: int = 16


@dataclass(frozen=True)
class EvalOutcome:
    examples: int
    tallies: tuple[RunTally, ...]
    report: ReportFiles
    defects: DefectReport
    built: Mapping[str, Any] | None


def load_examples(plan: EvalPlan) -> tuple[list[QAExample], DefectReport, list[Path]]:
    """The plan's questions, its data-defect report and the archives holding their conversations."""
    if plan.dataset == "locomo-plus" and plan.one_build_host is not None:
        from tmem.eval.cue_stitch import stitch_cues, write_cue_stitch

        if plan.plus is None:
            raise ValueError("a locomo-plus evaluation needs the LoCoMo-Plus file (--plus)")
        stitch = stitch_cues(plan.locomo, plan.plus, plan.one_build_host, cues=plan.one_build_cues)
        archive, _ = write_cue_stitch(stitch, plan.out / STITCHED)
        examples = list(stitch.cue_examples)[: plan.limit] if plan.limit is not None else list(stitch.cue_examples)
        return examples, stitch.defects, [archive]
    if plan.dataset == "locomo-plus":
        from tmem.eval.datasets import stitch_locomo_plus

        if plan.plus is None:
            raise ValueError("a locomo-plus evaluation needs the LoCoMo-Plus file (--plus)")
        paths, examples, defects = stitch_locomo_plus(plan.locomo, plan.plus, plan.out / STITCHED, limit=plan.limit)
        if plan.conversations:
            wanted = set(plan.conversations)
            keep = {e.conversation_id for e in examples if e.conversation_id in wanted}
            examples = [e for e in examples if e.conversation_id in keep]
            paths = [p for p in paths if p.stem in keep]
        return examples, defects, paths
    from tmem.eval.datasets import load_locomo_qa

    examples, defects = load_locomo_qa(plan.locomo, plan.categories)
    if plan.conversations:
        examples = [e for e in examples if e.conversation_id in set(plan.conversations)]
    if plan.limit is not None:
        examples = examples[: plan.limit]
    return examples, defects, [plan.locomo]


def _ensure_built(
    plan: EvalPlan, settings: Settings, examples: Sequence[QAExample], archives: list[Path], now: datetime,
    builder: Builder | None,
) -> Mapping[str, Any] | None:
    if not plan.build:
        return None
    if builder is None:
        raise ValueError("--build needs a builder (the Prefect build flow)")
    from tmem.ingest.load import ingest_archives

    ingest_archives(archives, settings.store, now=now)  # adds only what is new
    ids = sorted({e.conversation_id for e in examples})
    return builder(settings.store, ids)


def open_chat_models(settings: Settings, cache_dir: Path, run_id: str) -> tuple[ChatModel, ChatModel, Any]:
    """(answer model, judge model, the cache connection to close): cached and metered in ``cache_dir``."""
    from tmem.bundle import chat_model_for
    from tmem.store.duck import connect

    con = connect(cache_dir)
    return chat_model_for(settings, "answer", con, run_id), chat_model_for(settings, "judge", con, run_id), con


SAME_JUDGE_WARNING = (
    "warning: the answer and judge roles use the same model ({model} at {url}): a judge grading its own "
    "answers is not independent; set TMEM_LLM_JUDGE_MODEL (or TMEM_LLM_JUDGE_BASE_URL) to another model"
)


def same_model_warning(settings: Settings) -> str | None:
    """The warning to print when answers would be judged by the model that wrote them."""
    answer, judge = settings.endpoint("answer"), settings.endpoint("judge")
    if (answer.model, answer.base_url.rstrip("/")) != (judge.model, judge.base_url.rstrip("/")):
        return None
    return SAME_JUDGE_WARNING.format(model=answer.model, url=answer.base_url)


def run_plan(
    plan: EvalPlan,
    settings: Settings,
    *,
    now: datetime,
    builder: Builder | None = None,
    answer_chat: ChatModel | None = None,
    judge_chat: ChatModel | None = None,
    embedder: Embedder | None = None,
    progress: Callable[[str], None] | None = None,
) -> EvalOutcome:
    """Run ``plan`` (resuming whatever its folders already hold) and write the report."""
    from tmem.query.memory import Memory

    if not plan.configs:
        raise ValueError("an evaluation needs at least one configuration")
    say = progress or (lambda line: None)
    plan.out.mkdir(parents=True, exist_ok=True)
    examples, defects, archives = load_examples(plan)
    if not examples:
        raise ValueError(f"no questions selected from {plan.locomo} (check --conversation / --category / --limit)")
    root = RunFolder(plan.out)
    root.write_json("defects.json", defects.as_dict())
    root.write_json(PLAN, {"dataset": plan.dataset, "configs": [c.name for c in plan.configs]})
    say(f"{len(examples)} questions over {len({e.conversation_id for e in examples})} conversations")
    warning = same_model_warning(settings) if answer_chat is None or judge_chat is None else None
    if warning is not None:
        say(warning)
        root.write_json("warnings.json", {"same_answer_and_judge_model": warning})
    built = _ensure_built(plan, settings, examples, archives, now, builder)
    con = None
    if answer_chat is None or judge_chat is None:
        answer_default, judge_default, con = open_chat_models(
            settings, plan.llm_cache or plan.out / LLM_CACHE, f"eval:{plan.out.name}"
        )
        answer_chat, judge_chat = answer_chat or answer_default, judge_chat or judge_default
    try:
        base = Memory.open(settings.store, settings, embedder=embedder, chat=answer_chat)
        QARunner(base, answer_chat, judge_chat, plan.options).require_built(examples)
        vectors = embed_questions(base, examples) if plan.options.embed else {}
        costs = build_costs(settings.store, sorted({e.conversation_id for e in examples}))
        tallies: list[RunTally] = []
        shared_embedder = (embedder or base.embedder()) if plan.options.embed else embedder
        for config in plan.configs:
            memory = Memory.open(settings.store, config.settings(settings), embedder=shared_embedder, chat=answer_chat)
            runner = QARunner(memory, answer_chat, judge_chat, plan.options, vectors=vectors, progress=say)
            folder = RunFolder(plan.out / config.name)
            folder.open(runner.manifest(plan.dataset, config))
            folder.write_json(BUILD_COSTS, costs)
            tallies.append(runner.run(examples, folder, config))
    finally:
        if con is not None:
            con.close()
    report = build_report(plan.out)
    say(f"report: {report.markdown}")
    return EvalOutcome(len(examples), tuple(tallies), report, defects, built)

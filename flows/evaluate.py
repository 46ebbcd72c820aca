"""The evaluation as a Prefect flow: build (or reuse) the memory, run the QA runner over every
configuration, and publish the report as a markdown artifact.

``evaluate`` composes three steps, readable top to bottom:

1. ``build-memory`` (subflow, only with ``build=True``): ingest what the questions need and
   build the conversations that changed — cached, so a rebuild of built memory costs no call;
2. ``run-evaluation`` (task): :func:`tmem.eval.session.run_plan` — resumable, every output saved
   under ``out``;
3. the report (``report.md``) as the artifact ``tmem-eval-report``.

Its modes are ``tmem eval``'s (one dispatch: :func:`tmem.eval.ablations.eval_configs`). Run it as
the ``evaluate`` deployment (``prefect deployment run evaluate/evaluate --param mode=ablate``), or
call it from Python; ``tmem eval`` runs the same evaluation without Prefect.
"""

from __future__ import annotations

from datetime import UTC, datetime
from pathlib import Path
from typing import Any

from prefect import flow, task
from prefect.artifacts import create_markdown_artifact
from prefect.cache_policies import NO_CACHE

from tmem.eval.ablations import eval_configs
from tmem.eval.judge import JudgeSetup
from tmem.eval.prompt_files import load_prompt_file
from tmem.eval.runner import AnswerSetup, RunOptions
from tmem.eval.session import BuildFailedError, EvalPlan, load_examples, run_plan
from tmem.flows.build_memory import build_memory
from tmem.settings import load_settings

ARTIFACT_KEY = "tmem-eval-report"


@task(name="ingest-questions", task_run_name="ingest/{dataset}", cache_policy=NO_CACHE)
def ingest_questions(plan: EvalPlan, store: str, dataset: str) -> list[str]:
    """Ingest the archives the questions need (only what is new); returns their conversation ids."""
    from tmem.ingest.load import ingest_archives

    examples, _, archives = load_examples(plan)
    ingest_archives(archives, Path(store), now=datetime.now(UTC))
    return sorted({e.conversation_id for e in examples})


@task(name="run-evaluation", task_run_name="evaluate/{plan.dataset}/{plan.out.name}", cache_policy=NO_CACHE)
def run_evaluation(plan: EvalPlan, store: str) -> dict[str, Any]:
    """The QA runner over every configuration of ``plan`` (resumable); returns a small summary."""
    settings = load_settings(store=Path(store))
    outcome = run_plan(plan, settings, now=datetime.now(UTC))
    return {
        "out": str(plan.out), "report": str(outcome.report.markdown), "questions": outcome.examples,
        "failures": sum(t.failures for t in outcome.tallies), "tallies": [t.__dict__ for t in outcome.tallies],
        "markdown": outcome.report.text,
    }


@flow(name="evaluate", flow_run_name="evaluate/{dataset}/{mode}")
def evaluate(
    data: str,
    out: str,
    dataset: str = "locomo",
    store: str | None = None,
    plus: str | None = None,
    mode: str = "single",
    preset: str = "default",
    sweep_param: str | None = None,
    sweep_values: str | None = None,
    conversations: list[str] | None = None,
    categories: list[int] | None = None,
    limit: int | None = None,
    build: bool = False,
    judge_runs: int = 1,
    answer_prompt: str | None = None,
    judge_prompt: str | None = None,
) -> dict[str, Any]:
    """Evaluate tmem on LoCoMo or LoCoMo-Plus; ``mode`` single, ablate (Table 4) or sweep (Figure 4)."""
    store_path = str(store or load_settings().store)
    options = RunOptions(
        judge_runs=judge_runs,
        answer=AnswerSetup(template=load_prompt_file(answer_prompt) if answer_prompt else None),
        judge=JudgeSetup(template=load_prompt_file(judge_prompt) if judge_prompt else None),
    )
    plan = EvalPlan(
        dataset="locomo-plus" if dataset == "locomo-plus" else "locomo", locomo=Path(data), out=Path(out),
        configs=eval_configs(mode, preset, param=sweep_param, values=sweep_values)[1], plus=Path(plus) if plus else None,
        categories=tuple(categories or (1, 2, 3, 4)), conversations=tuple(conversations or ()), limit=limit,
        options=options,
    )
    if build:
        ids = ingest_questions(plan, store_path, plan.dataset)
        summary = build_memory(store=store_path, conversation_ids=ids, only_changed=True, label=f"eval-{dataset}")
        if summary["status"] != "completed":
            raise BuildFailedError(f"build {summary['run_id']} {summary['status']}: {summary.get('failures')}")
    result = run_evaluation(plan, store_path)
    create_markdown_artifact(
        markdown=result.pop("markdown"), key=ARTIFACT_KEY,
        description=f"tmem evaluation of {dataset} ({mode}) in {Path(out).resolve()}",
    )
    return result

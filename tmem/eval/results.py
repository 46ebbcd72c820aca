"""Scores from saved outputs only: re-scoring a run makes no LLM call.

:func:`question_table` reads one run folder into one row per question (mean judge score over
the recorded judge runs, the three F1 variants computed from the saved answer, tokens);
:func:`summary_table` aggregates it into the tidy results table — one row per configuration
and category (plus ``overall``, the micro average over every judged question):

``config, label, dataset, category, n, missing, accuracy_pct, accuracy_std_pct, f1_official_pct,
f1_mem0_pct, f1_memos_pct, mean_input_tokens, mean_context_tokens, build_calls_per_conversation,
build_tokens_per_conversation``

``accuracy_std_pct`` is the standard deviation over judge runs of the per-run accuracy (null with
one run); ``missing`` counts questions without an answer or without any judgement.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import polars as pl

from tmem.eval.ablations import EvalConfig
from tmem.eval.costs import mean_build_cost
from tmem.eval.f1 import F1_VARIANTS, f1_all
from tmem.eval.run_folder import BUILD_COSTS, RunFolder, RunFolderError

OVERALL = "overall"
CATEGORY_ORDER = ("single-hop", "multi-hop", "temporal", "open-domain", "adversarial", "cognitive", OVERALL)
PLAN = "plan.json"  # at a results root: the configuration folders in run order

QUESTION_SCHEMA = {
    "config": pl.String, "label": pl.String, "dataset": pl.String, "qid": pl.String, "conversation_id": pl.String,
    "category": pl.String, "question": pl.String, "gold": pl.String, "answer": pl.String,
    "judge_score": pl.Float64, "judge_runs": pl.Int64, **{f"f1_{v}": pl.Float64 for v in F1_VARIANTS},
    "input_tokens": pl.Int64, "context_tokens": pl.Int64,
}
JUDGEMENT_SCHEMA = {"config": pl.String, "qid": pl.String, "category": pl.String, "run": pl.Int64, "score": pl.Float64}


def run_folders(path: Path) -> list[RunFolder]:
    """The run folders at ``path``: itself if it is one, else its configuration folders (plan order)."""
    root = RunFolder(Path(path))
    if root.exists:
        return [root]
    plan = root.read_json(PLAN) if Path(path).is_dir() else None
    names = [str(n) for n in plan["configs"]] if isinstance(plan, dict) and "configs" in plan else []
    found = {p.name: RunFolder(p) for p in sorted(Path(path).glob("*/")) if RunFolder(p).exists}
    ordered = [found.pop(n) for n in names if n in found] + list(found.values())
    if not ordered:
        raise RunFolderError(f"{path}: no evaluation runs here (no manifest.json in it or its folders)")
    return ordered


def question_table(folder: RunFolder) -> tuple[pl.DataFrame, pl.DataFrame]:
    """(one row per question, one row per recorded judgement) of one run folder."""
    manifest = folder.read_manifest()
    config = EvalConfig.from_dict(manifest["config"])
    judge_runs = int(manifest.get("judge_runs", 1))
    answers = folder.answered()
    scores: dict[str, dict[int, float]] = {}
    for (qid, run), record in folder.judged().items():
        if run <= judge_runs:
            scores.setdefault(qid, {})[run] = float(record["score"])
    rows: list[dict[str, Any]] = []
    judgements: list[dict[str, Any]] = []
    for example in folder.examples():
        answer = answers.get(example.qid)
        runs = scores.get(example.qid, {}) if answer is not None else {}
        f1 = f1_all(str(answer["answer"]), example.answer, example.category) if answer is not None else {}
        rows.append({
            "config": config.name, "label": config.display, "dataset": manifest.get("dataset", example.dataset),
            "qid": example.qid, "conversation_id": example.conversation_id, "category": example.category,
            "question": example.question, "gold": example.answer,
            "answer": None if answer is None else str(answer["answer"]),
            "judge_score": sum(runs.values()) / len(runs) if runs else None, "judge_runs": len(runs),
            **{f"f1_{v}": f1.get(v) for v in F1_VARIANTS},
            "input_tokens": None if answer is None else int(answer["input_tokens"]),
            "context_tokens": None if answer is None else int(answer["context_tokens"]),
        })
        judgements += [{"config": config.name, "qid": example.qid, "category": example.category, "run": r, "score": s}
                       for r, s in sorted(runs.items())]
    return pl.DataFrame(rows, schema=QUESTION_SCHEMA), pl.DataFrame(judgements, schema=JUDGEMENT_SCHEMA)


def _category_rank(category: str) -> int:
    return CATEGORY_ORDER.index(category) if category in CATEGORY_ORDER else len(CATEGORY_ORDER) - 1


def _aggregate(questions: pl.DataFrame, judgements: pl.DataFrame, category: str) -> dict[str, Any]:
    judged = questions.filter(pl.col("judge_score").is_not_null())
    per_run = judgements.group_by("run").agg(pl.col("score").mean()) if judgements.height else judgements
    std = per_run["score"].std() if per_run.height >= 2 else None
    out: dict[str, Any] = {
        "category": category, "n": judged.height, "missing": questions.height - judged.height,
        "accuracy_pct": None if judged.height == 0 else round(float(judged["judge_score"].mean()) * 100, 2),  # type: ignore[arg-type]
        "accuracy_std_pct": None if std is None else round(float(std) * 100, 2),  # type: ignore[arg-type]
    }
    for variant in F1_VARIANTS:
        values = questions[f"f1_{variant}"].drop_nulls()
        out[f"f1_{variant}_pct"] = round(float(values.mean()) * 100, 2) if values.len() else None  # type: ignore[arg-type]
    for column in ("input_tokens", "context_tokens"):
        values = questions[column].drop_nulls()
        out[f"mean_{column}"] = round(float(values.mean()), 1) if values.len() else None  # type: ignore[arg-type]
    return out


def summary_table(folders: Sequence[RunFolder]) -> tuple[pl.DataFrame, pl.DataFrame]:
    """(the tidy results table, every question of every folder)."""
    rows: list[dict[str, Any]] = []
    all_questions: list[pl.DataFrame] = []
    for folder in folders:
        questions, judgements = question_table(folder)
        all_questions.append(questions)
        manifest = folder.read_manifest()
        config = EvalConfig.from_dict(manifest["config"])
        head = {"config": config.name, "label": config.display, "dataset": manifest.get("dataset")}
        cost = mean_build_cost(folder.read_json(BUILD_COSTS))
        categories = sorted(set(questions["category"].to_list()), key=_category_rank)
        for category in [*categories, OVERALL]:
            q = questions if category == OVERALL else questions.filter(pl.col("category") == category)
            j = judgements if category == OVERALL else judgements.filter(pl.col("category") == category)
            rows.append({**head, **_aggregate(q, j, category), **cost})
    table = pl.DataFrame(rows, infer_schema_length=None) if rows else pl.DataFrame()
    questions = pl.concat(all_questions, how="vertical") if all_questions else pl.DataFrame(schema=QUESTION_SCHEMA)
    return table, questions


def write_results(path: Path, table: pl.DataFrame, questions: pl.DataFrame) -> dict[str, Path]:
    """``results.csv``, ``results.json`` and ``questions.csv`` in ``path``; returns their paths."""
    path.mkdir(parents=True, exist_ok=True)
    out = {"csv": path / "results.csv", "json": path / "results.json", "questions": path / "questions.csv"}
    table.write_csv(out["csv"])
    out["json"].write_text(json.dumps(table.to_dicts(), indent=1, ensure_ascii=False), encoding="utf-8")
    questions.write_csv(out["questions"])
    return out

"""The evaluation report: a markdown file with tables, and PNG charts beside it.

Everything is computed from the saved outputs of the run folders (:mod:`tmem.eval.results`), so
``tmem eval report RUN_DIR`` makes no LLM call. Charts (matplotlib's Agg canvas, no pyplot
global state): per-category accuracy, ablation deltas against the baseline (Table 4), budget
sweeps (Figure 4) and input tokens per query against accuracy (Figure 5).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import polars as pl

from tmem.eval.ablations import BASELINE, TABLE4, EvalConfig, sweep_of
from tmem.eval.f1 import F1_VARIANTS
from tmem.eval.results import OVERALL, run_folders, summary_table, write_results
from tmem.eval.run_folder import RunFolder

REPORT = "report.md"
CHARTS = "charts"


@dataclass(frozen=True)
class ReportFiles:
    markdown: Path
    text: str
    charts: tuple[Path, ...]
    results_csv: Path
    results_json: Path
    table: pl.DataFrame


def _fmt(value: Any, digits: int = 1) -> str:
    if value is None:
        return "–"
    if isinstance(value, float):
        return f"{value:.{digits}f}"
    return str(value)


def _table(header: Sequence[str], rows: Sequence[Sequence[Any]]) -> list[str]:
    lines = ["| " + " | ".join(header) + " |", "|" + "|".join("---" for _ in header) + "|"]
    lines += ["| " + " | ".join(_fmt(v) for v in row) + " |" for row in rows]
    return lines


def _overall(table: pl.DataFrame) -> pl.DataFrame:
    return table.filter(pl.col("category") == OVERALL)


def _configs(folders: Sequence[RunFolder]) -> dict[str, EvalConfig]:
    return {c.name: c for c in (EvalConfig.from_dict(f.read_manifest()["config"]) for f in folders)}


def _baseline_name(configs: dict[str, EvalConfig]) -> str | None:
    for config in configs.values():
        if config.preset == BASELINE and not config.overrides:
            return config.name
    return None


# --------------------------------------------------------------------------- charts


def _figure(width: float = 7.0, height: float = 4.0) -> Any:
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    fig = Figure(figsize=(width, height), dpi=110, layout="constrained")
    FigureCanvasAgg(fig)
    return fig


def chart_categories(table: pl.DataFrame, path: Path) -> Path | None:
    categories = [c for c in dict.fromkeys(table["category"].to_list())]
    labels = list(dict.fromkeys(table["label"].to_list()))
    if not categories or table["accuracy_pct"].drop_nulls().len() == 0:
        return None
    fig = _figure(max(6.0, 1.2 * len(categories) + 0.15 * len(labels) * len(categories)), 4.2)
    ax = fig.subplots()
    width = 0.8 / max(1, len(labels))
    for k, label in enumerate(labels):
        rows = {r["category"]: r["accuracy_pct"] for r in table.filter(pl.col("label") == label).iter_rows(named=True)}
        xs = [i + (k - (len(labels) - 1) / 2) * width for i in range(len(categories))]
        ax.bar(xs, [rows.get(c) or 0.0 for c in categories], width=width, label=label)
    ax.set_xticks(range(len(categories)), categories)
    ax.set_ylabel("LLM-judge accuracy (%)")
    ax.set_ylim(0, 100)
    ax.set_title("Accuracy per category")
    if len(labels) > 1:
        ax.legend(fontsize=7, ncols=min(3, len(labels)))
    fig.savefig(path)
    return path


def chart_ablations(deltas: Sequence[tuple[str, float]], path: Path) -> Path | None:
    if not deltas:
        return None
    fig = _figure(6.5, 0.45 * len(deltas) + 1.5)
    ax = fig.subplots()
    ax.barh([d[0] for d in deltas], [d[1] for d in deltas], color=["#c0392b" if d[1] < 0 else "#27ae60" for d in deltas])
    ax.axvline(0, color="black", linewidth=0.8)
    ax.invert_yaxis()
    ax.set_xlabel("Δ overall accuracy vs. baseline (pp)")
    ax.set_title("Component ablations")
    fig.savefig(path)
    return path


def chart_sweeps(sweeps: dict[str, list[tuple[int, float]]], defaults: dict[str, int], path: Path) -> Path | None:
    if not sweeps:
        return None
    fig = _figure(3.4 * len(sweeps) + 0.6, 3.4)
    axes = fig.subplots(1, len(sweeps), squeeze=False)[0]
    for ax, (symbol, points) in zip(axes, sorted(sweeps.items()), strict=True):
        points = sorted(points)
        ax.plot([p[0] for p in points], [p[1] for p in points], marker="o")
        for value, accuracy in points:
            if value == defaults.get(symbol):
                ax.plot([value], [accuracy], marker="s", color="red", markersize=9, linestyle="none")
        ax.set_xlabel(symbol)
        ax.set_ylabel("overall accuracy (%)")
        ax.set_title(f"sweep of {symbol}")
    fig.savefig(path)
    return path


def chart_tokens(overall: pl.DataFrame, path: Path) -> Path | None:
    rows = [r for r in overall.iter_rows(named=True) if r["mean_input_tokens"] and r["accuracy_pct"] is not None]
    if not rows:
        return None
    fig = _figure(6.0, 4.0)
    ax = fig.subplots()
    ax.scatter([r["mean_input_tokens"] for r in rows], [r["accuracy_pct"] for r in rows])
    for r in rows:
        ax.annotate(r["label"], (r["mean_input_tokens"], r["accuracy_pct"]), fontsize=7, xytext=(3, 3),
                    textcoords="offset points")
    ax.set_xscale("log")
    ax.set_xlabel("mean input tokens per query (log)")
    ax.set_ylabel("overall accuracy (%)")
    ax.set_title("Tokens vs. accuracy")
    fig.savefig(path)
    return path


# --------------------------------------------------------------------------- markdown


def _deltas(overall: pl.DataFrame, configs: dict[str, EvalConfig], base: str | None) -> list[tuple[str, float]]:
    if base is None:
        return []
    acc = {r["config"]: r["accuracy_pct"] for r in overall.iter_rows(named=True)}
    if acc.get(base) is None:
        return []
    out = []
    for name, config in configs.items():
        ablation = config.preset.split("+")[-1]
        if name != base and ablation in TABLE4 and not config.overrides and acc.get(name) is not None:
            out.append((config.display, round(float(acc[name]) - float(acc[base]), 2)))
    return out


def _sweeps(overall: pl.DataFrame, configs: dict[str, EvalConfig]) -> dict[str, list[tuple[int, float]]]:
    acc = {r["config"]: r["accuracy_pct"] for r in overall.iter_rows(named=True)}
    sweeps: dict[str, list[tuple[int, float]]] = {}
    for name, config in configs.items():
        point = sweep_of(config)
        if point is not None and acc.get(name) is not None:
            sweeps.setdefault(point[0], []).append((point[1], float(acc[name])))
    return sweeps


def outstanding_failures(folder: RunFolder) -> int:
    """Recorded failures whose answer or judge run has not succeeded since."""
    answered, judged = folder.answered(), folder.judged()
    pending = set()
    for error in folder.records("errors"):
        qid = str(error["qid"])
        if error.get("stage") == "answer" and qid not in answered:
            pending.add((qid, "answer", 0))
        elif error.get("stage") == "judge" and (qid, int(error.get("run") or 0)) not in judged:
            pending.add((qid, "judge", int(error.get("run") or 0)))
    return len(pending)


def render_markdown(
    table: pl.DataFrame, folders: Sequence[RunFolder], charts: Sequence[Path], root: Path, title: str
) -> str:
    manifests = [f.read_manifest() for f in folders]
    configs = _configs(folders)
    overall = _overall(table)
    f1_cols = [f"f1_{v}_pct" for v in F1_VARIANTS]
    lines = [f"# {title}", "", "Scored from the saved outputs of each run folder (no LLM call was made to write this).", ""]
    models = sorted({(m.get("answer_model"), m.get("judge_model")) for m in manifests}, key=str)
    lines += [f"- answer model `{a}`, judge model `{j}`" for a, j in models]
    lines.append(f"- judge runs averaged: {', '.join(sorted({str(m.get('judge_runs')) for m in manifests}))}")
    lines += ["", "## Overall", ""]
    lines += _table(
        ["config", "n", "missing", "accuracy %", "± std", "F1 official", "F1 mem0", "F1 memos", "input tok/query",
         "build tok/conv"],
        [[r["label"], r["n"], r["missing"], r["accuracy_pct"], r["accuracy_std_pct"], *(r[c] for c in f1_cols),
          r["mean_input_tokens"], r["build_tokens_per_conversation"]] for r in overall.iter_rows(named=True)],
    )
    categories = [c for c in dict.fromkeys(table["category"].to_list()) if c != OVERALL]
    lines += ["", "## Accuracy per category (%)", ""]
    lines += _table(["config", *categories, OVERALL], [
        [label, *({r["category"]: r["accuracy_pct"] for r in table.filter(pl.col("label") == label).iter_rows(named=True)}
                  .get(c) for c in [*categories, OVERALL])]
        for label in dict.fromkeys(table["label"].to_list())
    ])
    deltas = _deltas(overall, configs, _baseline_name(configs))
    if deltas:
        lines += ["", "## Ablations (Δ overall accuracy vs. baseline, pp)", ""]
        lines += _table(["configuration", "Δ pp"], [[label, delta] for label, delta in deltas])
    sweeps = _sweeps(overall, configs)
    for symbol, points in sorted(sweeps.items()):
        lines += ["", f"## Sweep of {symbol}", ""]
        lines += _table([symbol, "overall accuracy %"], sorted(points))
    lines += ["", "## Charts", ""] + [f"![{p.stem}]({p.relative_to(root).as_posix()})" for p in charts]
    errors = {f.path.name: outstanding_failures(f) for f in folders}
    lines += ["", "## Notes", "",
              "- F1: official = LoCoMo `evaluation.py` (stemmed, multiset); mem0 = Mem0 `calculate_metrics` (set); "
              "memos = MemOS `calculate_nlp_metrics` (NLTK-style tokens, set) — see F1_DEFINITIONS.md. Adversarial "
              "questions have no Mem0/MemOS F1; LoCoMo-Plus items have no F1 (no reference answer).",
              "- Tokens are estimated at 4 characters per token: input = the whole answer prompt, context included.",
              "- Build tokens per conversation are apportioned by turns within each build run (store build records).",
              f"- Failed calls not yet redone (the next run retries them): {sum(errors.values())}"
              + (f" ({', '.join(f'{k}: {v}' for k, v in errors.items() if v)})" if any(errors.values()) else ""),
              f"- Snapshots answered from: {', '.join(sorted({str(r.get('snapshot_id')) for f in folders for r in f.records('answers')})) or '–'}"]
    defects = RunFolder(root).read_json("defects.json")
    if isinstance(defects, dict) and defects.get("counts"):
        lines += ["", "## Data defects handled", ""]
        lines += _table(["defect", "count"], sorted(defects["counts"].items()))
    return "\n".join(lines) + "\n"


def build_report(path: Path, *, title: str | None = None) -> ReportFiles:
    """Score every run folder at ``path`` and write ``report.md``, ``results.csv``/``.json`` and charts."""
    path = Path(path)
    folders = run_folders(path)
    table, questions = summary_table(folders)
    written = write_results(path, table, questions)
    charts_dir = path / CHARTS
    charts_dir.mkdir(parents=True, exist_ok=True)
    configs = _configs(folders)
    overall = _overall(table)
    from tmem.eval.ablations import SWEEP_PARAMS

    made = [
        chart_categories(table, charts_dir / "accuracy_per_category.png"),
        chart_ablations(_deltas(overall, configs, _baseline_name(configs)), charts_dir / "ablation_deltas.png"),
        chart_sweeps(_sweeps(overall, configs), {s: d for s, (_, d, _) in SWEEP_PARAMS.items()},
                     charts_dir / "sweeps.png"),
        chart_tokens(overall, charts_dir / "tokens_vs_accuracy.png"),
    ]
    charts = tuple(p for p in made if p is not None)
    datasets = sorted({str(d) for d in table["dataset"].to_list()}) if table.height else []
    text = render_markdown(table, folders, charts, path, title or f"tmem evaluation: {', '.join(datasets) or path.name}")
    report = path / REPORT
    report.write_text(text, encoding="utf-8")
    return ReportFiles(report, text, charts, written["csv"], written["json"], table)

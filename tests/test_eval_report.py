"""The results table, the markdown report and its charts, from hand-made run folders.

Every run folder here is written directly (manifest, questions, answers, judgements), so the
expected numbers are worked out by hand from what was written.
"""

from __future__ import annotations

import io
import json
import math
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import polars as pl
import pytest

from tests.query_store import HashEmbedder, build_store, make_conv
from tmem.cli import run as cli_run
from tmem.cli.base import CliContext
from tmem.eval.ablations import EvalConfig, ablation_configs, sweep_configs
from tmem.eval.costs import build_costs
from tmem.eval.examples import QAExample
from tmem.eval.report import build_report
from tmem.eval.results import PLAN
from tmem.eval.run_folder import BUILD_COSTS, RunFolder
from tmem.store.duck import connect
from tmem.store.runs import finish_run, start_run

AT = datetime(2024, 1, 1, tzinfo=UTC)
PNG_MAGIC = b"\x89PNG\r\n\x1a\n"
CATEGORIES = ["single-hop", "single-hop", "temporal", "multi-hop"]
EXAMPLES = [
    QAExample(qid=f"c1#{i}", dataset="locomo", conversation_id="c1", question=f"question {i}?", answer=f"gold {i}",
              category=cat, category_id=None, evidence=(), question_date=None, speaker=None, extra={})
    for i, cat in enumerate(CATEGORIES)
]
COSTS = {"conversations": {"c1": {"conversation_id": "c1", "turns": 40, "runs": 1, "llm_calls": 10.0,
                                  "prompt_tokens": 1000.0, "completion_tokens": 100.0}}}


def write_run(root: Path, config: EvalConfig, scores: list[list[float]], tokens: list[int]) -> RunFolder:
    """A run folder whose judge run r gave question i the score ``scores[r][i]``."""
    folder = RunFolder(root / config.name)
    folder.open({"dataset": "locomo", "config": config.as_dict(), "judge_runs": len(scores),
                 "answer_model": "model-a", "judge_model": "model-j"})
    folder.add_examples(EXAMPLES)
    for example, n in zip(EXAMPLES, tokens, strict=True):
        folder.append("answers", {"qid": example.qid, "answer": example.answer, "input_tokens": n,
                                  "context_tokens": n // 2, "snapshot_id": "snap-1"})
    for run, row in enumerate(scores, start=1):
        for example, score in zip(EXAMPLES, row, strict=True):
            folder.append("judgements", {"qid": example.qid, "run": run, "score": score,
                                         "label": "correct" if score else "wrong"})
    folder.write_json(BUILD_COSTS, COSTS)
    return folder


@pytest.fixture
def results(tmp_path: Path) -> Path:
    root = tmp_path / "results"
    base, *ablations = ablation_configs(only=["no-horizon"])
    ks1, ks5 = sweep_configs("kS", [1, 5])
    # baseline: run 1 [1,1,0,1], run 2 [1,0,0,1] -> per question [1, .5, 0, 1] -> 62.5 %;
    # per-run accuracy 75 % and 50 % -> sample std sqrt(2 * 12.5^2 / 1) = 17.68 pp
    write_run(root, base, [[1, 1, 0, 1], [1, 0, 0, 1]], [100, 200, 300, 400])
    write_run(root, ablations[0], [[1, 0, 0, 0]], [50, 50, 50, 50])  # 25 % -> Δ -37.5 pp
    write_run(root, ks1, [[0, 0, 0, 0]], [10, 10, 10, 10])  # 0 %
    write_run(root, ks5, [[1, 1, 1, 1]], [1000, 1000, 1000, 1000])  # 100 %
    RunFolder(root).write_json(PLAN, {"configs": [base.name, ablations[0].name, ks1.name, ks5.name]})
    RunFolder(root).write_json("defects.json", {"counts": {"answer_int": 2}, "examples": {}})
    return root


def test_results_table_is_tidy_and_hand_computed(results: Path) -> None:
    files = build_report(results)
    table = pl.read_csv(files.results_csv)
    assert table.columns[:4] == ["config", "label", "dataset", "category"]
    assert table.height == 4 * 4  # 3 categories + overall, per config
    overall = {r["config"]: r for r in table.filter(pl.col("category") == "overall").iter_rows(named=True)}
    assert list(overall) == ["default", "no-horizon", "kS=1", "kS=5"]  # plan order
    base = overall["default"]
    assert base["n"] == 4 and base["missing"] == 0
    assert base["accuracy_pct"] == pytest.approx(62.5)
    assert base["accuracy_std_pct"] == pytest.approx(100 * math.sqrt(2 * 0.125**2), abs=0.01)
    assert base["mean_input_tokens"] == pytest.approx(250.0) and base["mean_context_tokens"] == pytest.approx(125.0)
    assert base["build_tokens_per_conversation"] == pytest.approx(1100.0)
    assert base["build_calls_per_conversation"] == pytest.approx(10.0)
    assert overall["no-horizon"]["accuracy_pct"] == pytest.approx(25.0)
    assert overall["no-horizon"]["accuracy_std_pct"] is None  # one judge run
    single = table.filter((pl.col("config") == "default") & (pl.col("category") == "single-hop")).row(0, named=True)
    assert single["n"] == 2 and single["accuracy_pct"] == pytest.approx(75.0)  # (1 + 0.5) / 2
    assert json.loads(files.results_json.read_text())[0]["config"] == "default"


def test_report_has_tables_deltas_sweeps_and_valid_charts(results: Path) -> None:
    files = build_report(results, title="Test report")
    text = files.markdown.read_text(encoding="utf-8")
    assert text.startswith("# Test report")
    assert "| T-Mem | 4 | 0 | 62.5 | 17.7 |" in text
    assert "## Ablations" in text and "| w/o HT | -37.5 |" in text
    assert "## Sweep of kS" in text and "| 1 | 0.0 |" in text and "| 5 | 100.0 |" in text
    assert "| answer_int | 2 |" in text
    names = sorted(p.name for p in files.charts)
    assert names == ["ablation_deltas.png", "accuracy_per_category.png", "sweeps.png", "tokens_vs_accuracy.png"]
    for chart in files.charts:
        data = chart.read_bytes()
        assert data.startswith(PNG_MAGIC) and len(data) > 2000
        assert f"]({chart.relative_to(results).as_posix()})" in text


def test_missing_answers_and_judgements_are_counted_not_scored(tmp_path: Path) -> None:
    folder = write_run(tmp_path, EvalConfig(name="default"), [[1, 1, 0, 1]], [1, 1, 1, 1])
    extra = QAExample(qid="c1#9", dataset="locomo", conversation_id="c1", question="q?", answer="a",
                      category="temporal", category_id=None, evidence=(), question_date=None, speaker=None, extra={})
    folder.add_examples([extra])
    table = build_report(folder.path).table
    overall = table.filter(pl.col("category") == "overall").row(0, named=True)
    assert (overall["n"], overall["missing"]) == (4, 1)
    assert overall["accuracy_pct"] == pytest.approx(75.0)


def test_cli_report_rescores_a_results_root(results: Path) -> None:
    out, err = io.StringIO(), io.StringIO()
    code = cli_run(["eval", "report", str(results), "--json"], CliContext(stdout=out, stderr=err))
    assert code == 0, err.getvalue()
    printed: dict[str, Any] = json.loads(out.getvalue())
    assert Path(printed["report"]).is_file() and len(printed["charts"]) == 4
    code = cli_run(["eval", "report", str(results / "nowhere")], CliContext(stdout=io.StringIO(), stderr=err))
    assert code == 2 and "no evaluation runs" in err.getvalue()


def test_build_costs_are_apportioned_by_turns(tmp_path: Path) -> None:
    store = tmp_path / "store"
    build_store(store, [make_conv("conv-a", mark="a", scenes=6), make_conv("conv-b", mark="b", scenes=3)],
                HashEmbedder())  # 24 and 12 turns
    con = connect(store)
    try:
        for run_id, ids, prompt, calls in (("r1", ["conv-a", "conv-b"], 300, 30), ("r2", ["conv-a"], 60, 6)):
            start_run(con, run_id, {"conversation_ids": ids}, at=AT)
            finish_run(con, run_id, status="completed", counts={}, failures=[], snapshot_id=None,
                       usage={"llm_calls": calls, "prompt_tokens": prompt, "completion_tokens": 0},
                       at=AT)
    finally:
        con.close()
    costs = build_costs(store, ["conv-a", "conv-b"])["conversations"]
    # r1 splits 24:12 -> conv-a 2/3 of 300 = 200 tokens, 20 calls; conv-b 100, 10; r2 adds 60 and 6 to conv-a
    assert (costs["conv-a"]["prompt_tokens"], costs["conv-a"]["llm_calls"], costs["conv-a"]["runs"]) == (260.0, 26.0, 2)
    assert (costs["conv-b"]["prompt_tokens"], costs["conv-b"]["llm_calls"], costs["conv-b"]["runs"]) == (100.0, 10.0, 1)


def test_eval_retrieval_delegates_to_its_module_or_says_it_is_missing(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    import sys

    import tmem.cli

    assert cli_run(["eval", "retrieval", "--help"], CliContext(stdout=io.StringIO(), stderr=io.StringIO())) == 0
    assert "--systems" in capsys.readouterr().out  # the retrieval command's own options
    monkeypatch.delattr(tmem.cli, "eval_retrieval", raising=False)
    monkeypatch.setitem(sys.modules, "tmem.cli.eval_retrieval", None)  # as if it were not installed
    err = io.StringIO()
    assert cli_run(["eval", "retrieval"], CliContext(stdout=io.StringIO(), stderr=err)) == 2
    assert "tmem.cli.eval_retrieval is missing" in err.getvalue()

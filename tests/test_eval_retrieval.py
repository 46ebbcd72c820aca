"""LLM-free retrieval metrics: recall math on hand-built rankings, the baselines on a tiny
conversation with a typed fake embedder, tmem on a hand-built published store, and the command."""

from __future__ import annotations

import argparse
import io
import json
from collections.abc import Sequence
from datetime import UTC, datetime, timedelta
from pathlib import Path

import numpy as np
import numpy.typing as npt
import polars as pl
import pytest

from tests.query_store import HashEmbedder, make_conv, publish
from tmem.cli import eval_retrieval
from tmem.cli.base import CliContext
from tmem.domain import Turn
from tmem.eval.baselines import BaselineRetriever, baseline, session_units, turn_units
from tmem.eval.examples import QAExample
from tmem.eval.retrieval_metrics import (
    Context,
    RetrievedUnit,
    VectorMemo,
    context_of,
    evaluate_retrieval,
    evidence_recall,
    pack_budget,
    rows_frame,
    summarise,
)
from tmem.eval.tmem_system import TmemRetriever, TmemSearcher
from tmem.ingest.load import ingest_archives
from tmem.query.memory import Memory
from tmem.retrieval.context import format_context
from tmem.settings import Settings

NOW = datetime(2026, 2, 1, 12, 0, tzinfo=UTC)
T0 = datetime(2023, 5, 8, 13, 0, tzinfo=UTC)


def example(qid: str, evidence: Sequence[str], category: str = "single-hop", question: str = "q?", cid: str = "c1") -> QAExample:
    return QAExample(qid=qid, dataset="locomo", conversation_id=cid, question=question, answer="", category=category,
                     category_id=None, evidence=tuple(evidence), question_date=None, speaker=None)


def unit(uid: str, turns: Sequence[str], text: str = "x" * 40) -> RetrievedUnit:
    return RetrievedUnit("scene", uid, tuple(turns), text)


# --------------------------------------------------------------------------- recall math


def test_evidence_recall() -> None:
    assert evidence_recall(["a", "b", "c", "d"], {"a", "c", "z"}) == 0.5
    assert evidence_recall(["a"], []) == 0.0
    assert evidence_recall(["a", "a", "b"], ["b"]) == 0.5  # evidence is a set
    with pytest.raises(ValueError, match="undefined"):
        evidence_recall([], ["a"])


def test_context_and_budget_packing() -> None:
    units = [unit("u1", ["a"], "x" * 40), unit("u2", ["b", "c"], "y" * 38), unit("u3", ["d"], "z" * 10)]
    assert units[0].tokens == 10
    whole = context_of(units)
    assert whole == Context(frozenset("abcd"), 3, 23)  # 40 + 2 + 38 + 2 + 10 = 92 chars, 4 per token
    # prefix packing: u1 = 10 tokens; u1+u2 = 80 chars = 20 tokens; all three = 92 chars = 23 tokens
    assert pack_budget(units, 9) == Context(frozenset(), 0, 0)
    assert pack_budget(units, 10) == Context(frozenset("a"), 1, 10)
    assert pack_budget(units, 22) == Context(frozenset("abc"), 2, 20)
    assert pack_budget(units, 23) == Context(frozenset("abcd"), 3, 23)
    with pytest.raises(ValueError):
        pack_budget(units, -1)


class OracleRetriever:
    """Hand-built rankings per question (best first)."""

    def __init__(self, name: str, rankings: dict[str, list[RetrievedUnit]]) -> None:
        self._name = name
        self.rankings = rankings

    @property
    def name(self) -> str:
        return self._name

    def ranked(self, example: QAExample, k: int) -> list[RetrievedUnit]:
        return self.rankings[example.qid][:k]

    def within_budget(self, example: QAExample, budget: int) -> Context:
        return pack_budget(self.rankings[example.qid], budget)


def test_recall_at_k_and_budget_on_hand_built_rankings() -> None:
    examples = [
        example("q1", ["a", "b"], "temporal"),
        example("q2", ["c"], "temporal"),
        example("q3", ["d", "e", "f", "g"], "multi-hop"),
        example("q4", [], "multi-hop"),  # no usable evidence: not scored
    ]
    rankings = {
        "q1": [unit("u1", ["x"]), unit("u2", ["a", "y"]), unit("u3", ["b"])],
        "q2": [unit("u4", ["c"]), unit("u5", ["z"])],
        "q3": [unit("u6", ["d", "e"]), unit("u7", ["q"]), unit("u8", ["f"])],
        "q4": [],
    }
    rows = evaluate_retrieval(examples, [OracleRetriever("oracle", rankings)], ks=(1, 2, 3), budgets=(10, 21))
    got = {(r.qid, r.mode, r.cut): (r.recall, r.hit, r.complete, r.units) for r in rows}
    assert {q for q, _, _ in got} == {"q1", "q2", "q3"}
    assert got[("q1", "k", 1)] == (0.0, False, False, 1)
    assert got[("q1", "k", 2)] == (0.5, True, False, 2)
    assert got[("q1", "k", 3)] == (1.0, True, True, 3)
    assert got[("q2", "k", 1)] == (1.0, True, True, 1)
    assert got[("q3", "k", 3)] == (0.75, True, False, 3)
    assert got[("q1", "budget", 10)] == (0.0, False, False, 1)  # one 10-token unit fits
    assert got[("q3", "budget", 21)] == (0.5, True, False, 2)  # 40 + 2 + 40 = 82 chars = 21 tokens

    summary = summarise(rows_frame(rows))
    cell = {(r["mode"], r["cut"], r["category"]): r for r in summary.to_dicts()}
    assert cell[("k", 2, "temporal")]["recall"] == pytest.approx((0.5 + 1.0) / 2)
    assert cell[("k", 2, "multi-hop")]["recall"] == pytest.approx(0.5)
    assert cell[("k", 2, "all")]["recall"] == pytest.approx((0.5 + 1.0 + 0.5) / 3)  # mean over questions
    assert cell[("k", 2, "all")]["questions"] == 3
    assert cell[("k", 3, "all")]["complete_rate"] == pytest.approx(2 / 3)
    assert cell[("k", 1, "all")]["hit_rate"] == pytest.approx(2 / 3)
    assert summary.filter(pl.col("category") == "all").height == 5  # 3 ks + 2 budgets


# --------------------------------------------------------------------------- baselines


class TableEmbedder:
    """A typed fake Embedder: a text's vector is the sum of the unit vectors of the topic words it
    contains (one dimension per topic), L2-normalised; texts with no topic word get the last axis."""

    TOPICS = ("dog", "paint", "race", "job", "trip")

    def __init__(self) -> None:
        self.texts: list[str] = []

    @property
    def model_name(self) -> str:
        return "table"

    @property
    def dim(self) -> int:
        return len(self.TOPICS) + 1

    @property
    def max_input_tokens(self) -> int | None:
        return None  # no input limit: dialogue views stay whole

    def embed(self, texts: list[str]) -> npt.NDArray[np.float32]:
        self.texts += texts
        out = np.zeros((len(texts), self.dim), dtype=np.float32)
        for i, text in enumerate(texts):
            for j, topic in enumerate(self.TOPICS):
                if topic in text.lower():
                    out[i, j] = 1.0
            if not out[i].any():
                out[i, -1] = 1.0
        return out / np.linalg.norm(out, axis=1, keepdims=True)


TEXTS = [  # two sessions of three turns
    "I adopted a puppy, the dog sleeps all day",
    "What colour did you paint the kitchen?",
    "Green! We finished last weekend.",
    "I signed up for the charity race in May",
    "Good luck, how long is the race?",
    "My new job starts on Monday",
]


def tiny_turns(cid: str = "c1") -> list[Turn]:
    return [
        Turn(conversation_id=cid, session_id=f"session_{1 + i // 3}", turn_id=f"D{1 + i // 3}:{1 + i % 3}", seq=i,
             speaker=("Ann", "Bob")[i % 2], text=text, event_time=T0 + timedelta(days=7 * (i // 3), seconds=i % 3))
        for i, text in enumerate(TEXTS)
    ]


def test_units_render_like_the_qa_context() -> None:
    turns = tiny_turns()
    units = turn_units(turns)
    assert units[0] == RetrievedUnit("turn", "D1:1", ("D1:1",), "[8 May 2023] Ann: I adopted a puppy, the dog sleeps all day")
    sessions, members = session_units(turns)
    assert [u.unit_id for u in sessions] == ["session_1", "session_2"] and members == [[0, 1, 2], [3, 4, 5]]
    assert sessions[1].turn_ids == ("D2:1", "D2:2", "D2:3")
    assert sessions[1].text.splitlines()[0] == "### session_2 (15 May 2023)"
    assert sessions[1].text.splitlines()[1] == "[15 May 2023] Bob: I signed up for the charity race in May"


def test_flat_baseline_fuses_bm25_and_dense() -> None:
    turns = {"c1": tiny_turns()}
    embedder = TableEmbedder()
    flat = baseline("flat", turns.__getitem__, VectorMemo(embedder))
    # lexical and dense agree: both race turns first (D2:1 has "race" and "charity"), then dense-only hits
    q = example("q1", ["D2:1", "D2:2"], question="Which charity race did Bob enter?")
    top = [u.unit_id for u in flat.ranked(q, 2)]
    assert set(top) == {"D2:1", "D2:2"}
    # no word in common with any turn: only the dense channel ranks (the dog turn)
    q2 = example("q2", ["D1:1"], question="canine companion or hotdog?")
    assert flat.ranked(q2, 1)[0].unit_id == "D1:1"
    # every turn's text was embedded once, whatever the number of questions
    flat.ranked(q, 3)
    assert sorted(embedder.texts.count(f"{t.speaker}: {t.text}") for t in turns["c1"]) == [1] * 6


def test_session_baseline_scores_sessions_by_their_best_turn() -> None:
    turns = {"c1": tiny_turns()}
    session = baseline("session", turns.__getitem__, VectorMemo(TableEmbedder()))
    assert isinstance(session, BaselineRetriever) and session.name == "session"
    q = example("q1", ["D1:2"], question="the paint colour")
    ranked = session.ranked(q, 2)
    assert [u.unit_id for u in ranked] == ["session_1", "session_2"]
    assert ranked[0].turn_ids == ("D1:1", "D1:2", "D1:3")
    small = session.within_budget(q, ranked[0].tokens)  # exactly one session fits
    assert small.turn_ids == frozenset(ranked[0].turn_ids) and small.units == 1
    assert session.within_budget(q, ranked[0].tokens - 1) == Context(frozenset(), 0, 0)
    rows = evaluate_retrieval([q], [session], ks=(1,), budgets=(5,))
    assert [(r.mode, r.recall) for r in rows] == [("k", 1.0), ("budget", 0.0)]
    with pytest.raises(ValueError, match="unknown baseline"):
        baseline("bm25", turns.__getitem__, VectorMemo(TableEmbedder()))


# --------------------------------------------------------------------------- tmem on a hand-built store


def locomo_archive(path: Path, turns: Sequence[Turn], cid: str) -> Path:
    """The turns (``D<s>:<k>``, a day apart per session, 1 s apart per turn) as a LoCoMo file, with QA."""
    conv: dict[str, object] = {"speaker_a": "Ann", "speaker_b": "Bob"}
    for t in turns:
        s = int(t.turn_id[1:].split(":")[0])
        start = t.event_time.replace(second=0)
        conv[f"session_{s}_date_time"] = f"{start:%I:%M %p} on {start.day} {start:%B, %Y}"
        conv.setdefault(f"session_{s}", [])
        conv[f"session_{s}"].append({"speaker": t.speaker, "dia_id": t.turn_id, "text": t.text})  # type: ignore[attr-defined]
    qa = [
        {"question": "Who talks about the kiln glaze?", "answer": "Ann", "evidence": ["D1:4"], "category": 4},
        {"question": "When was the hiking summit trip?", "answer": "x", "evidence": ["D2:1; D2:2"], "category": 2},
        {"question": "Was there a concert on stage?", "answer": "x", "evidence": ["D4:3", "D4:4"], "category": 1},
        {"question": "Anything?", "answer": "x", "evidence": [], "category": 3},
        {"question": "Adversarial?", "adversarial_answer": "x", "evidence": ["D1:1"], "category": 5},
    ]
    path.write_text(json.dumps([{"sample_id": cid, "conversation": conv, "qa": qa}]))
    return path


@pytest.fixture(scope="module")
def tmem_store(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path]:
    """A LoCoMo-format conversation of 6 themed scenes × 4 turns, ingested, with a hand-built
    memory published over it (no LLM)."""
    root = tmp_path_factory.mktemp("evalret")
    conv = make_conv("conv-x", mark="zeta", scenes=6, turns_per_scene=4, items_per_scene=2)
    data = locomo_archive(root / "locomo.json", conv.turns, "conv-x")
    store = root / "store"
    ingest_archives([data], store, now=NOW)
    publish(store, [conv], HashEmbedder())
    return store, data


def test_tmem_units_cover_scene_turns_and_item_sources(tmem_store: tuple[Path, Path]) -> None:
    store, _ = tmem_store
    memory = Memory.open(store, Settings(store=store), embedder=HashEmbedder())
    searcher = TmemSearcher(memory, "default", VectorMemo(HashEmbedder()), budget_k=6)
    full, scenes = TmemRetriever(searcher), TmemRetriever(searcher, scenes_only=True)
    assert (full.name, scenes.name) == ("tmem:default", "tmem-scenes:default")
    q = example("q", ["D2:3"], question="hiking trail mountain summit", cid="conv-x")
    units = full.ranked(q, 2)
    index = searcher.index("conv-x")
    kinds = [u.kind for u in units]
    assert kinds.count("scene") <= 2 and kinds.count("item") <= 2 and "scene" in kinds
    for u in units:
        if u.kind == "scene":
            assert u.turn_ids == index.scenes.turn_ids[index.scene_pos[u.unit_id]]
        else:
            sources = index.items.source_scene_ids[index.item_pos[u.unit_id]]
            assert u.turn_ids == tuple(t for s in sources for t in index.scenes.turn_ids[index.scene_pos[s]])
    assert units[0].kind == "scene" and "D2:3" in units[0].turn_ids  # the hiking scene (scene 2) first
    assert [u.kind for u in scenes.ranked(q, 2)] == ["scene"] * len(scenes.ranked(q, 2))

    result = searcher.result(q, 6)
    for budget in (60, 150, 400):
        ctx = full.within_budget(q, budget)
        formatted = format_context(result, budget)
        report = formatted.report
        assert ctx.tokens == report.tokens_used <= budget
        assert ctx.units == report.scenes_kept + report.items_kept
        # the turns the answer model reads (whole scenes or their best windows) are what counts
        assert {t for ids in formatted.kept_turns.values() for t in ids} <= ctx.turn_ids


def run_cli(argv: list[str], store: Path) -> tuple[int, str]:
    parser = argparse.ArgumentParser()
    eval_retrieval.configure(parser)
    args = parser.parse_args([*argv, "--store", str(store)])
    out = io.StringIO()
    ctx = CliContext(stdout=out, stderr=io.StringIO(), settings_loader=lambda: Settings(store=store))
    code = eval_retrieval.run(args, ctx, embedder=HashEmbedder())
    return code, out.getvalue()


def test_command_prints_tables_and_writes_tidy_results(tmem_store: tuple[Path, Path], tmp_path: Path) -> None:
    store, data = tmem_store
    code, text = run_cli(["--dataset", "locomo", "--data", str(data), "--systems", "tmem,tmem-scenes,flat,session",
                          "--preset", "default,paper", "--k", "1,3", "--budgets", "100,300", "--out", str(tmp_path / "res")],
                         store)
    assert code == 0
    assert "3 of 4 questions with usable evidence" in text  # category 5 left out; one question has no evidence
    header = next(line for line in text.splitlines() if line.startswith("evidence recall@3"))
    assert header.split()[-6:] == ["tmem:default", "tmem-scenes:default", "tmem:paper", "tmem-scenes:paper", "flat", "session"]
    rows = pl.read_csv(tmp_path / "res" / "rows.csv")
    assert rows.height == 3 * 6 * 4  # questions × systems × (2 ks + 2 budgets)
    assert set(rows["qid"].to_list()) == {"conv-x#0", "conv-x#1", "conv-x#2"}
    multi = rows.filter((pl.col("qid") == "conv-x#2") & (pl.col("mode") == "k"))
    assert set(multi["evidence"].to_list()) == {2}
    summary = json.loads((tmp_path / "res" / "summary.json").read_text())
    assert summary["defects"]["counts"]["malformed_evidence_normalised"] == 1
    assert summary["excluded_no_evidence"] == 1 and summary["scored"] == 3
    flat_k3 = [r for r in summary["summary"] if (r["system"], r["mode"], r["cut"], r["category"]) == ("flat", "k", 3, "all")]
    expected = rows.filter((pl.col("system") == "flat") & (pl.col("mode") == "k") & (pl.col("cut") == 3))["recall"].mean()
    assert flat_k3[0]["recall"] == pytest.approx(expected)

    code, text = run_cli(["--dataset", "locomo", "--data", str(data), "--systems", "flat", "--k", "2", "--json"], store)
    payload = json.loads(text)
    assert code == 0 and payload["systems"] == ["flat"] and payload["scored"] == 3


def test_command_refuses_unknown_systems_and_conversations(tmem_store: tuple[Path, Path], tmp_path: Path) -> None:
    from tmem.errors import ScopeError

    store, data = tmem_store
    with pytest.raises(ScopeError, match="unknown system"):
        run_cli(["--dataset", "locomo", "--data", str(data), "--systems", "bm25"], store)
    other = tmp_path / "other.json"
    other.write_text(data.read_text().replace('"conv-x"', '"conv-y"'))
    with pytest.raises(ScopeError, match="conv-y"):
        run_cli(["--dataset", "locomo", "--data", str(other), "--systems", "flat"], store)
    with pytest.raises(ScopeError, match="--plus"):
        run_cli(["--dataset", "locomo-plus", "--data", str(data)], store)


def test_command_measures_cue_recall_on_stitched_plus_conversations(tmp_path: Path) -> None:
    from tests.test_eval_datasets import _item, _tiny_locomo
    from tmem.eval.datasets import stitch_locomo_plus

    locomo = _tiny_locomo(tmp_path / "locomo.json")
    plus = tmp_path / "plus.json"
    plus.write_text(json.dumps([
        _item("A: My dog Rex hates thunder.\nB: Poor Rex!", "A: A storm is coming tonight.", "two months later", "state"),
        _item("A: I quit my job to paint.", "A: Any plans for Monday?", "three weeks later", "goal"),
    ]))
    store = tmp_path / "store"
    paths, examples, _ = stitch_locomo_plus(locomo, plus, tmp_path / "stitched")
    ingest_archives(paths, store, now=NOW)
    code, text = run_cli(["--dataset", "locomo-plus", "--data", str(locomo), "--plus", str(plus), "--systems", "flat,session",
                          "--k", "1,2", "--budgets", "50", "--out", str(tmp_path / "res")], store)
    assert code == 0
    lines = text.splitlines()
    assert "locomo-plus: 2 of 2 questions with usable evidence" in lines[0]
    assert any(line.startswith("cue recall@2") for line in lines)
    assert [line.split()[0] for line in lines if line.startswith(("state", "goal"))] == ["goal", "state"] * 2
    assert any(line.startswith("cue retrieved (any turn)") for line in lines)
    rows = pl.read_csv(tmp_path / "res" / "rows.csv")
    assert set(rows["category"].to_list()) == {"state", "goal"}
    assert set(rows["evidence"].to_list()) == {len(e.evidence) for e in examples} == {1, 2}

"""Malformed archives: each is refused by `tmem ingest` with exit code 2, a message naming the file
and the record, and nothing written to the store."""

from __future__ import annotations

import io
import json
import subprocess
import sys
from collections.abc import Callable
from dataclasses import dataclass
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import pytest

from tests.ingest_helpers import ingest_counts, jsonl_turn, locomo_sample, write_json, write_jsonl
from tmem.cli import run
from tmem.cli.base import CliContext

ZERO = {"conversations": 0, "sessions": 0, "turns": 0, "qa": 0}
NOW = datetime(2025, 1, 1, tzinfo=UTC)


@dataclass(frozen=True)
class Case:
    id: str
    build: Callable[[Path], Path]  # writes the archive, returns the path named in the error
    record: str
    reason: str


def _locomo(edit: Callable[[dict[str, Any]], Any], sessions: int = 2) -> Callable[[Path], Path]:
    def build(tmp: Path) -> Path:
        sample = locomo_sample(sessions=sessions)
        edit(sample)
        return write_json(tmp / "bad.json", [sample])

    return build


def _jsonl(records: list[Any]) -> Callable[[Path], Path]:
    return lambda tmp: write_jsonl(tmp / "bad.jsonl", records)


def _raw(name: str, data: bytes) -> Callable[[Path], Path]:
    def build(tmp: Path) -> Path:
        (tmp / name).write_bytes(data)
        return tmp / name

    return build


def _conv(sample: dict[str, Any]) -> dict[str, Any]:
    return sample["conversation"]


DECLARE = {"kind": "conversation", "conversation_id": "c1", "speakers": ["Ann", "Bob"]}

CASES = [
    Case("missing file", lambda tmp: tmp / "nowhere.json", "file", "no such file"),
    Case("not JSON", _raw("bad.json", b'[{"sample_id": "x",'), "line 1 column 20", "not valid JSON"),
    Case("not UTF-8", _raw("bad.json", b'[{"sample_id": "\xff"}]'), "line 1", "not UTF-8"),
    Case("root not array", lambda tmp: write_json(tmp / "bad.json", {"sample_id": "x"}), "(root)", "JSON array of samples"),
    Case("empty archive", lambda tmp: write_json(tmp / "bad.json", []), "(root)", "no samples"),
    Case("sample not object", lambda tmp: write_json(tmp / "bad.json", [locomo_sample(), 3]), "/1", "sample must be a JSON object, got number"),
    Case("missing speaker", _locomo(lambda s: _conv(s)["session_1"][1].pop("speaker")), "/0/conversation/session_1/1/speaker", "missing required field 'speaker'"),
    Case("text wrong type", _locomo(lambda s: _conv(s)["session_2"][0].update(text=7)), "/0/conversation/session_2/0/text", "must be a string, got number"),
    Case("empty dia_id", _locomo(lambda s: _conv(s)["session_1"][2].update(dia_id=" ")), "/0/conversation/session_1/2/dia_id", "must not be empty"),
    Case("bad date", _locomo(lambda s: _conv(s).update(session_2_date_time="yesterday")), "/0/conversation/session_2_date_time", "not a LoCoMo date"),
    Case("dates go backwards", _locomo(lambda s: _conv(s).update(session_2_date_time="1:00 pm on 1 May, 2023")), "/0/conversation/session_2_date_time", "timestamps go backwards"),
    Case("unknown speaker", _locomo(lambda s: _conv(s)["session_2"][1].update(speaker="Eve")), "/0/conversation/session_2/1/speaker", "unknown speaker 'Eve'"),
    Case("duplicate dia_id", _locomo(lambda s: _conv(s)["session_2"][2].update(dia_id="D1:1")), "/0/conversation/session_2/2/dia_id", "duplicate turn id 'D1:1' (first at /0/conversation/session_1/0)"),
    Case("duplicate session number", _locomo(lambda s: _conv(s).update(session_02=[])), "/0/conversation/session_02", "duplicate session number 2"),
    Case("duplicate JSON key", _raw("bad.json", b'[{"sample_id": "a", "sample_id": "b"}]'), "/0/sample_id", "duplicate key 'sample_id'"),
    Case("session gap", _locomo(lambda s: [_conv(s).pop("session_2"), _conv(s).pop("session_2_date_time")], sessions=3), "/0/conversation", "session_2 is missing"),
    Case("missing date key", _locomo(lambda s: _conv(s).pop("session_1_date_time")), "/0/conversation/session_1_date_time", "missing required field"),
    Case("empty session", _locomo(lambda s: _conv(s).update(session_2=[])), "/0/conversation/session_2", "session_2 has no turns"),
    Case("qa category bool", _locomo(lambda s: s["qa"][1].update(category=True)), "/0/qa/1/category", "must be an integer, got boolean"),
    Case("qa without answers", _locomo(lambda s: s["qa"][0].pop("answer")), "/0/qa/0", "needs 'answer' or 'adversarial_answer'"),
    Case("evidence not strings", _locomo(lambda s: s["qa"][0].update(evidence=["D1:1", 2])), "/0/qa/0/evidence/1", "evidence[1] must be a string"),
    Case("duplicate sample_id", lambda tmp: write_json(tmp / "bad.json", [locomo_sample(), locomo_sample()]), "/1/sample_id", "duplicate sample_id 'conv-t' (first at /0)"),
    Case("jsonl not JSON", _raw("bad.jsonl", json.dumps(jsonl_turn("t1")).encode() + b"\n\n{oops}\n"), "line 3", "not valid JSON"),
    Case("jsonl record not object", _jsonl([jsonl_turn("t1"), ["t2"]]), "line 2", "record must be a JSON object, got array"),
    Case("jsonl missing timestamp", _jsonl([{k: v for k, v in jsonl_turn("t1").items() if k != "timestamp"}]), "line 1", "missing required field 'timestamp'"),
    Case("jsonl naive timestamp", _jsonl([jsonl_turn("t1"), jsonl_turn("t2", timestamp="2024-05-01T10:00:00")]), "line 2", "has no UTC offset"),
    Case("jsonl unparseable timestamp", _jsonl([jsonl_turn("t1", timestamp="May 1st")]), "line 1", "is not ISO 8601"),
    Case("jsonl timestamps go backwards", _jsonl([jsonl_turn("t1"), jsonl_turn("t2", timestamp="2024-05-01T08:59:59+02:00")]), "line 2", "timestamps go backwards in conversation 'c1'"),
    Case("jsonl unknown speaker", _jsonl([DECLARE, jsonl_turn("t1"), jsonl_turn("t2", speaker="Eve")]), "line 3", "unknown speaker 'Eve'"),
    Case("jsonl duplicate turn id", _jsonl([jsonl_turn("t1"), jsonl_turn("t1", speaker="Bob")]), "line 2", "duplicate turn id 't1' in conversation 'c1' (first on line 1)"),
    Case("jsonl session resumes", _jsonl([jsonl_turn("t1"), jsonl_turn("t2", session_id="s2"), jsonl_turn("t3")]), "line 3", "session 's1' resumes after session 's2'"),
    Case("jsonl empty text", _jsonl([jsonl_turn("t1", text="")]), "line 1", "field 'text' must not be empty"),
    Case("jsonl wrong type", _jsonl([jsonl_turn("t1", speaker=["Ann"])]), "line 1", "field 'speaker' must be a string, got array"),
    Case("jsonl metadata value", _jsonl([jsonl_turn("t1", metadata={"n": 1})]), "line 1", "metadata value 'n' must be a string"),
    Case("jsonl unknown field", _jsonl([jsonl_turn("t1", speeker="Ann")]), "line 1", "unknown field 'speeker'"),
    Case("jsonl unknown kind", _jsonl([{"kind": "summary"}]), "line 1", "unknown record kind 'summary'"),
    Case("jsonl late declaration", _jsonl([jsonl_turn("t1"), DECLARE]), "line 2", "declared after its first turn"),
    Case("jsonl declared twice", _jsonl([DECLARE, DECLARE]), "line 2", "already declared on line 1"),
    Case("jsonl declared without turns", _jsonl([DECLARE]), "line 1", "conversation 'c1' has no turns"),
    Case("jsonl empty file", _raw("bad.jsonl", b"\n\n"), "file", "the archive holds no turns"),
]


def ingest_cli(argv: list[str]) -> tuple[int, str, str]:
    out, err = io.StringIO(), io.StringIO()
    code = run(argv, CliContext(stdout=out, stderr=err, clock=lambda: NOW))
    return code, out.getvalue(), err.getvalue()


def test_there_are_at_least_ten_distinct_cases():
    assert len({c.id for c in CASES}) == len(CASES) >= 10


@pytest.mark.parametrize("case", CASES, ids=[c.id for c in CASES])
def test_malformed_archive_is_refused_and_nothing_is_written(case, tmp_path):
    bad = case.build(tmp_path)
    store = tmp_path / "store"
    code, out, err = ingest_cli(["ingest", str(bad), "--store", str(store), "--json"])
    assert code == 2
    assert out == ""
    assert err.startswith("error: ") and err.endswith("\n")
    assert f"{bad}: {case.record}: " in err, err
    assert case.reason in err, err
    assert ingest_counts(store) == ZERO


def test_a_bad_file_among_good_ones_writes_nothing(tmp_path):
    good = write_json(tmp_path / "good.json", [locomo_sample("conv-a")])
    bad = write_jsonl(tmp_path / "bad.jsonl", [jsonl_turn("t1"), jsonl_turn("t1")])
    store = tmp_path / "store"
    code, _, err = ingest_cli(["ingest", str(good), str(bad), "--store", str(store)])
    assert code == 2 and f"{bad}: line 2: duplicate turn id" in err
    assert ingest_counts(store) == ZERO


def test_the_same_conversation_in_two_files_is_refused(tmp_path):
    a = write_jsonl(tmp_path / "a.jsonl", [jsonl_turn("t1")])
    b = write_jsonl(tmp_path / "b.jsonl", [jsonl_turn("t2", timestamp="2024-05-02T00:00:00Z")])
    code, _, err = ingest_cli(["ingest", str(a), str(b), "--store", str(tmp_path / "store")])
    assert code == 2
    assert f"{b}: line 1: conversation 'c1' also appears in {a}" in err
    assert ingest_counts(tmp_path / "store") == ZERO


def test_a_conflict_with_the_store_leaves_it_unchanged(tmp_path):
    store = tmp_path / "store"
    assert ingest_cli(["ingest", str(write_json(tmp_path / "v1.json", [locomo_sample("conv-a", sessions=2)])), "--store", str(store)])[0] == 0
    before = ingest_counts(store)
    fresh = write_json(tmp_path / "other.json", [locomo_sample("conv-b")])  # valid and new: must not land either
    edited = locomo_sample("conv-a", sessions=3)
    edited["conversation"]["session_1"][0]["speaker"] = "Bob"
    v2 = write_json(tmp_path / "v2.json", [edited])
    code, _, err = ingest_cli(["ingest", str(fresh), str(v2), "--store", str(store)])
    assert code == 2
    assert f"{v2}: /0/conversation/session_1/0: conflicting change: turn 'D1:1'" in err and "different speaker" in err
    assert ingest_counts(store) == before


def test_the_console_script_reports_a_malformed_archive(tmp_path):
    bad = write_jsonl(tmp_path / "bad.jsonl", [jsonl_turn("t1"), jsonl_turn("t2", timestamp="2024-05-01T10:00:00")])
    store = tmp_path / "store"
    script = Path(sys.executable).with_name("tmem")
    result = subprocess.run(
        [str(script), "ingest", str(bad), "--store", str(store)], capture_output=True, text=True, timeout=120, check=False
    )
    assert result.returncode == 2
    assert result.stdout == ""
    assert result.stderr == f"error: {bad}: line 2: field 'timestamp': timestamp '2024-05-01T10:00:00' has no UTC offset; add one, e.g. 'Z' or '+02:00'\n"
    assert ingest_counts(store) == ZERO


def test_json_errors_are_written_verbatim_into_the_message(tmp_path):
    # A speaker name with a slash is escaped in the pointer of a duplicate key (RFC 6901).
    data = b'[{"sample_id": "a", "conversation": {"speaker_a": "A", "speaker_b": "B", "a/b": 1, "a/b": 2}}]'
    bad = tmp_path / "bad.json"
    bad.write_bytes(data)
    code, _, err = ingest_cli(["ingest", str(bad), "--store", str(tmp_path / "s")])
    assert code == 2 and "/0/conversation/a~1b: duplicate key 'a/b'" in err
    json.loads(data)  # the file itself is valid JSON; only tmem's stricter reading refuses it

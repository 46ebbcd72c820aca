"""`tmem ingest` and `tmem stats` end to end: in-process through tmem.cli.run/main, and as real processes."""

from __future__ import annotations

import argparse
import io
import json
import os
import subprocess
import sys
from datetime import UTC, datetime
from pathlib import Path

import pytest

from tests.ingest_helpers import LOCOMO10, ingest_counts, jsonl_turn, query, write_jsonl
from tmem.cli import COMMANDS, main, run
from tmem.cli.base import CliContext, Command

NOW = datetime(2025, 3, 4, 5, 6, 7, tzinfo=UTC)


def cli(argv: list[str], clock: datetime = NOW) -> tuple[int, str, str]:
    out, err = io.StringIO(), io.StringIO()
    code = run(argv, CliContext(stdout=out, stderr=err, clock=lambda: clock))
    return code, out.getvalue(), err.getvalue()


def test_ingest_locomo10_json_output_then_idempotent(tmp_path):
    store = tmp_path / "store"
    code, out, err = cli(["ingest", str(LOCOMO10), "--store", str(store), "--json"])
    assert (code, err) == (0, "")
    assert out.count("\n") == 1
    first = json.loads(out)
    assert {k: first[k] for k in ("conversations", "sessions", "turns", "new_turns", "new_sessions", "qa")} == {
        "conversations": 10,
        "sessions": 272,
        "turns": 5882,
        "new_turns": 5882,
        "new_sessions": 272,
        "qa": 1986,
    }
    assert first["files"] == [str(LOCOMO10)] and first["store"] == str(store) and first["seconds"] >= 0
    assert query(store, "SELECT DISTINCT ingested_at FROM turns") == [(NOW,)]

    code, out, _ = cli(["ingest", str(LOCOMO10), "--store", str(store), "--json"], clock=datetime(2026, 1, 1, tzinfo=UTC))
    second = json.loads(out)
    assert code == 0 and second["new_turns"] == 0 and second["new_sessions"] == 0 and second["turns"] == 5882
    assert query(store, "SELECT DISTINCT updated_at FROM conversations") == [(NOW,)]

    code, out, _ = cli(["stats", "--store", str(store), "--json"])
    stats = json.loads(out)
    assert code == 0
    assert {k: stats["tables"][k] for k in ("conversations", "sessions", "turns", "qa", "scenes")} == {
        "conversations": 10,
        "sessions": 272,
        "turns": 5882,
        "qa": 1986,
        "scenes": 0,
    }
    assert (stats["conversations"], stats["sessions"], stats["turns"], stats["scenes"]) == (10, 272, 5882, 0)
    conv26 = stats["per_conversation"][0]
    assert conv26["conversation_id"] == "conv-26"
    assert (conv26["sessions"], conv26["turns"], conv26["qa"], conv26["watermark_session_index"]) == (19, 419, 199, 19)
    assert conv26["updated_at"] == "2025-03-04T05:06:07Z"


def test_text_output_of_ingest_and_stats(tmp_path):
    store = tmp_path / "store"
    path = write_jsonl(tmp_path / "a.jsonl", [jsonl_turn("t1"), jsonl_turn("t2", speaker="Bob")])
    code, out, _ = cli(["ingest", str(path), "--store", str(store)])
    assert code == 0
    assert "read 1 file: 1 conversations, 1 sessions, 2 turns, 0 QA items" in out
    assert "2 turns" in out.splitlines()[1]
    code, out, _ = cli(["stats", "--store", str(store)])
    lines = out.splitlines()
    assert code == 0 and lines[0] == f"store: {store}"
    assert any(line.split() == ["turns", "2"] and line.startswith("  ") for line in lines)  # the tables section
    assert any(line.startswith("  conversation_id=c1") and "speakers=Ann,Bob" in line for line in lines)


def test_default_store_comes_from_settings(tmp_path, monkeypatch):
    monkeypatch.setenv("TMEM_STORE", str(tmp_path / "env-store"))
    path = write_jsonl(tmp_path / "a.jsonl", [jsonl_turn("t1")])
    assert main(["ingest", str(path), "--json"]) == 0
    assert ingest_counts(tmp_path / "env-store")["turns"] == 1


def test_format_override(tmp_path):
    path = tmp_path / "export.json"  # JSON Lines under a .json name
    write_jsonl(path, [jsonl_turn("t1"), jsonl_turn("t2")])
    store = str(tmp_path / "store")
    code, _, err = cli(["ingest", str(path), "--store", store])
    assert code == 2 and "not valid JSON" in err
    code, out, _ = cli(["ingest", str(path), "--store", store, "--format", "jsonl", "--json"])
    assert code == 0 and json.loads(out)["new_turns"] == 2


def test_usage_errors_exit_2(tmp_path, capsys):
    assert main([]) == 2
    code, _, err = cli(["ingest", "--store", str(tmp_path / "nothing")])  # no archives: only the spool, of a store
    assert code == 2 and "no tmem store here" in err
    assert main(["ingest", "x.json", "--format", "csv"]) == 2
    assert "invalid choice" in capsys.readouterr().err
    code, _, err = cli(["stats", "--store", str(tmp_path / "nothing")])
    assert code == 2 and err.startswith("error: ") and "no tmem store here" in err


def test_version_and_help_exit_0(capsys):
    assert main(["--version"]) == 0
    assert main(["ingest", "--help"]) == 0
    assert "--format" in capsys.readouterr().out


def test_commands_are_registered_from_one_list():
    assert {"ingest", "stats", "build"} <= {c.name for c in COMMANDS}
    seen: list[str] = []

    def configure(parser: argparse.ArgumentParser) -> None:
        parser.add_argument("word")

    def echo(args: argparse.Namespace, ctx: CliContext) -> int:
        seen.append(args.word)
        ctx.print(args.word.upper())
        return 0

    extra = Command(name="echo", help="test double", configure=configure, run=echo)
    out = io.StringIO()
    assert run(["echo", "hi"], CliContext(stdout=out), commands=[*COMMANDS, extra]) == 0
    assert (seen, out.getvalue()) == (["hi"], "HI\n")


def test_python_dash_m_tmem_runs_ingest_and_stats(tmp_path):
    env = {**os.environ, "TMEM_STORE": str(tmp_path / "store"), "HF_HUB_OFFLINE": "1"}
    path = write_jsonl(tmp_path / "a.jsonl", [jsonl_turn("t1"), jsonl_turn("t2", speaker="Bob")])
    done = subprocess.run(
        [sys.executable, "-m", "tmem", "ingest", str(path), "--json"], capture_output=True, text=True, env=env, timeout=120, check=False
    )
    assert done.returncode == 0, done.stderr
    assert json.loads(done.stdout)["new_turns"] == 2
    stats = subprocess.run(
        [str(Path(sys.executable).with_name("tmem")), "stats", "--json"], capture_output=True, text=True, env=env, timeout=120, check=False
    )
    assert stats.returncode == 0, stats.stderr
    assert json.loads(stats.stdout)["tables"]["turns"] == 2


@pytest.mark.parametrize("flag", [[], ["--json"]])
def test_second_ingest_of_a_grown_archive_adds_only_the_new_turns(tmp_path, flag):
    store = str(tmp_path / "store")
    turns = [jsonl_turn("t1"), jsonl_turn("t2", speaker="Bob")]
    assert cli(["ingest", str(write_jsonl(tmp_path / "a.jsonl", turns)), "--store", store])[0] == 0
    grown = [*turns, jsonl_turn("t3", session_id="s2", timestamp="2024-05-02T09:00:00+02:00")]
    code, out, _ = cli(["ingest", str(write_jsonl(tmp_path / "b.jsonl", grown)), "--store", store, *flag])
    assert code == 0
    if flag:
        report = json.loads(out)
        assert (report["new_turns"], report["new_sessions"], report["turns"]) == (1, 1, 3)
    else:
        assert "0 new conversations (1 updated), 1 sessions, 1 turns" in out

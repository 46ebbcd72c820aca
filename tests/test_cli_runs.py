"""``tmem runs`` (recent builds from DuckDB) and the progress lines ``tmem build`` writes to stderr."""

from __future__ import annotations

import io
import json
import logging
from datetime import UTC, datetime, timedelta
from pathlib import Path

from tmem.cli import run as cli_run
from tmem.cli.base import CliContext
from tmem.cli.build_cmd import ProgressLines, progress_to
from tmem.store.duck import connect
from tmem.store.runs import finish_run, start_run

T0 = datetime(2026, 11, 29, 2, 0, tzinfo=UTC)


def _tmem(argv: list[str]) -> tuple[int, str, str]:
    out, err = io.StringIO(), io.StringIO()
    code = cli_run(argv, CliContext(stdout=out, stderr=err))
    return code, out.getvalue(), err.getvalue()


def _store_with_runs(store: Path) -> None:
    con = connect(store)
    try:
        start_run(con, "run-old-0001", {"conversation_ids": ["conv-26", "conv-30"], "label": "all"}, T0)
        finish_run(con, "run-old-0001", status="completed", counts={"scenes": 9},
                   usage={"llm_calls": 40, "llm_cache_hits": 2, "prompt_tokens": 1000, "completion_tokens": 200},
                   failures=[], snapshot_id="snap-1", at=T0 + timedelta(seconds=75))
        start_run(con, "run-new-0002", {"conversation_ids": ["conv-30"], "label": "nightly", "only_changed": True},
                  T0 + timedelta(days=1))
        finish_run(con, "run-new-0002", status="partial", counts={},
                   usage={"llm_calls": 3, "llm_cache_hits": 30, "prompt_tokens": 90, "completion_tokens": 10},
                   failures=[{"conversation_id": "conv-30", "error_type": "ValidationFailure"}], snapshot_id=None,
                   at=T0 + timedelta(days=1, seconds=5))
        start_run(con, "run-dead-0003", {"conversation_ids": ["conv-41"]}, T0 + timedelta(days=2))
    finally:
        con.close()


def test_runs_lists_recent_builds_newest_first_as_json_and_as_a_table(tmp_path: Path) -> None:
    _store_with_runs(tmp_path)

    code, out, _ = _tmem(["runs", "--store", str(tmp_path), "--json", "--limit", "2"])
    assert code == 0
    rows = json.loads(out)
    assert [r["run_id"] for r in rows] == ["run-dead-0003", "run-new-0002"]
    assert rows[0]["status"] == "running" and rows[0]["seconds"] is None
    assert rows[1] | {"failures": None} == rows[1] | {
        "status": "partial", "label": "nightly", "conversations": ["conv-30"], "llm_calls": 3, "llm_cache_hits": 30,
        "prompt_tokens": 90, "completion_tokens": 10, "seconds": 5.0, "snapshot_id": None, "failures": None}
    assert rows[1]["failures"][0]["conversation_id"] == "conv-30"

    code, out, _ = _tmem(["runs", "--store", str(tmp_path)])
    lines = out.splitlines()
    assert code == 0 and len(lines) == 4
    assert lines[0].split() == ["run", "started", "(UTC)", "secs", "status", "convs", "calls", "hits", "tokens",
                                "snapshot"]
    assert lines[1].split()[:2] == ["run-dead", "2026-12-01"]
    assert lines[2].split()[4:] == ["partial", "(1", "failed)", "1", "3", "30", "100", "-"]
    assert lines[3].split()[3:] == ["75.0", "completed", "2", "40", "2", "1200", "snap-1"]


def test_runs_on_a_missing_store_or_with_a_bad_limit_is_bad_input(tmp_path: Path) -> None:
    code, _, err = _tmem(["runs", "--store", str(tmp_path / "nowhere")])
    assert code == 2 and "no tmem store" in err
    code, _, _ = _tmem(["runs", "--store", str(tmp_path), "--limit", "0"])
    assert code == 2


def test_build_progress_is_one_line_per_finished_conversation_on_the_given_stream() -> None:
    log = logging.getLogger("tmem.build.progress")
    stream = io.StringIO()
    with progress_to(stream):
        log.info("x", extra={"conversation_id": "conv-26", "done": 1, "total": 4, "ok": True})
        log.info("x", extra={"conversation_id": "conv-30", "done": 2, "total": 4, "ok": False})
        log.info("a record without progress fields is ignored")
    log.info("after the block nothing is written", extra={"conversation_id": "c", "done": 3, "total": 4, "ok": True})
    lines = stream.getvalue().splitlines()
    assert len(lines) == 2
    assert lines[0].startswith("[" + "#" * 5 + "-" * 15 + "] 1/4 conv-26 built (")
    assert lines[1].startswith("[" + "#" * 10 + "-" * 10 + "] 2/4 conv-30 FAILED (")
    assert not any(isinstance(h, ProgressLines) for h in log.handlers)

"""Build-run bookkeeping in the working database (table ``build_runs``)."""

from __future__ import annotations

import json
from dataclasses import dataclass
from datetime import datetime
from typing import Any

import duckdb


@dataclass(frozen=True)
class RunRecord:
    run_id: str
    started_at: datetime
    finished_at: datetime | None
    status: str
    inputs: dict[str, Any]
    counts: dict[str, Any]
    llm_calls: int
    llm_cache_hits: int
    prompt_tokens: int
    completion_tokens: int
    failures: list[dict[str, Any]]
    snapshot_id: str | None

    @property
    def seconds(self) -> float | None:
        return None if self.finished_at is None else (self.finished_at - self.started_at).total_seconds()


def start_run(con: duckdb.DuckDBPyConnection, run_id: str, inputs: dict[str, Any], at: datetime) -> None:
    con.execute(
        "INSERT INTO build_runs (run_id, started_at, status, inputs) VALUES (?, ?, 'running', ?)",
        [run_id, at, json.dumps(inputs, sort_keys=True, default=str)],
    )


def finish_run(
    con: duckdb.DuckDBPyConnection,
    run_id: str,
    *,
    status: str,
    counts: dict[str, Any],
    usage: dict[str, int],
    failures: list[dict[str, Any]],
    snapshot_id: str | None,
    at: datetime,
) -> None:
    con.execute(
        "UPDATE build_runs SET finished_at = ?, status = ?, counts = ?, llm_calls = ?, llm_cache_hits = ?, "
        "prompt_tokens = ?, completion_tokens = ?, failures = ?, snapshot_id = ? WHERE run_id = ?",
        [
            at, status, json.dumps(counts, sort_keys=True), usage.get("llm_calls", 0), usage.get("llm_cache_hits", 0),
            usage.get("prompt_tokens", 0), usage.get("completion_tokens", 0),
            json.dumps(failures, sort_keys=True, default=str), snapshot_id, run_id,
        ],
    )


def close_interrupted_runs(con: duckdb.DuckDBPyConnection, *, current_pid: int, at: datetime) -> list[str]:
    """Mark runs left ``running`` by another process as ``interrupted``; return their ids.

    The working database has one writer process at a time, so while this process holds it no
    other process is building: a ``running`` row written by another pid is a build that died
    (killed, crashed, machine lost). Rows of this process may belong to a build still running
    in another thread and are left alone. Rows without a recorded pid count as another process.
    """
    rows = con.execute("SELECT run_id, inputs FROM build_runs WHERE status = 'running'").fetchall()
    stale = [r[0] for r in rows if json.loads(r[1] or "{}").get("pid") != current_pid]
    for run_id in stale:
        con.execute(
            "UPDATE build_runs SET status = 'interrupted', finished_at = ? WHERE run_id = ?", [at, run_id]
        )
    return stale


def list_runs(con: duckdb.DuckDBPyConnection, limit: int = 20) -> list[RunRecord]:
    rows = con.execute(
        "SELECT run_id, started_at, finished_at, status, inputs, counts, llm_calls, llm_cache_hits, prompt_tokens, "
        "completion_tokens, failures, snapshot_id FROM build_runs ORDER BY started_at DESC LIMIT ?",
        [limit],
    ).fetchall()
    return [
        RunRecord(
            run_id=r[0], started_at=r[1], finished_at=r[2], status=r[3], inputs=json.loads(r[4] or "{}"),
            counts=json.loads(r[5] or "{}"), llm_calls=int(r[6] or 0), llm_cache_hits=int(r[7] or 0),
            prompt_tokens=int(r[8] or 0), completion_tokens=int(r[9] or 0), failures=json.loads(r[10] or "[]"),
            snapshot_id=r[11],
        )
        for r in rows
    ]


def memory_counts(con: duckdb.DuckDBPyConnection) -> dict[str, int]:
    """The memory figures `tmem stats` and `tmem build` print."""

    def one(sql: str) -> int:
        row = con.execute(sql).fetchone()
        return int(row[0]) if row and row[0] is not None else 0

    return {
        "conversations": one("SELECT count(*) FROM conversations"),
        "sessions": one("SELECT count(*) FROM sessions"),
        "turns": one("SELECT count(*) FROM turns"),
        "scenes": one("SELECT count(*) FROM scenes"),
        "topics": one("SELECT count(*) FROM topics"),
        "items": one("SELECT count(*) FROM items"),
        "atomic_items": one("SELECT count(*) FROM items WHERE kind = 'atomic'"),
        "connected_items": one("SELECT count(*) FROM items WHERE kind = 'connected'"),
        "entity_triggers": one("SELECT count(*) FROM item_triggers WHERE family = 'entity'"),
        "bridge_triggers": one("SELECT count(*) FROM item_triggers WHERE family = 'bridge'"),
        "scene_triggers": one("SELECT count(*) FROM scene_triggers WHERE family = 'scene'"),
        "horizon_triggers": one("SELECT count(*) FROM scene_triggers WHERE family = 'horizon' AND text <> ''"),
        "personas": one("SELECT count(*) FROM personas"),
        "llm_calls": one("SELECT count(*) FROM llm_usage WHERE NOT cache_hit"),
        "llm_cache_hits": one("SELECT count(*) FROM llm_usage WHERE cache_hit"),
    }

"""Builders for small archives used by the ingest tests (LoCoMo-shaped JSON and tmem JSON Lines)."""

from __future__ import annotations

import json
from datetime import datetime, timedelta
from pathlib import Path
from typing import Any

from tests.paths import LOCOMO10
from tmem.store.duck import connect, table_counts

__all__ = ["LOCOMO10"]

INGEST_TABLES = ("conversations", "sessions", "turns", "qa")
SPEAKERS = ("Ann", "Bob")
MONTHS = ("January", "February", "March", "April", "May", "June", "July", "August", "September", "October",
          "November", "December")


def locomo_date(moment: datetime) -> str:
    """A LoCoMo session date string, e.g. ``1:56 pm on 8 May, 2023``."""
    hour = moment.hour % 12 or 12
    ampm = "am" if moment.hour < 12 else "pm"
    return f"{hour}:{moment.minute:02d} {ampm} on {moment.day} {MONTHS[moment.month - 1]}, {moment.year}"


def locomo_session(number: int, turns: int, speakers: tuple[str, str] = SPEAKERS) -> list[dict[str, Any]]:
    return [
        {"speaker": speakers[k % 2], "dia_id": f"D{number}:{k + 1}", "text": f"session {number} turn {k + 1}"}
        for k in range(turns)
    ]


def locomo_sample(
    sample_id: str = "conv-t",
    sessions: int = 2,
    turns_per_session: int = 3,
    first: datetime = datetime(2023, 5, 8, 13, 56),
    speakers: tuple[str, str] = SPEAKERS,
    qa: list[dict[str, Any]] | None = None,
) -> dict[str, Any]:
    """A valid LoCoMo sample: ``sessions`` sessions one day apart, each with ``turns_per_session`` turns."""
    conversation: dict[str, Any] = {"speaker_a": speakers[0], "speaker_b": speakers[1]}
    for n in range(1, sessions + 1):
        conversation[f"session_{n}_date_time"] = locomo_date(first + timedelta(days=n - 1))
        conversation[f"session_{n}"] = locomo_session(n, turns_per_session, speakers)
    if qa is None:
        qa = [
            {"question": "When did Ann speak first?", "answer": "8 May 2023", "evidence": ["D1:1"], "category": 2},
            {"question": "What year?", "answer": 2023, "evidence": ["D1:1"], "category": 4},
            {"question": "Did Bob fly?", "adversarial_answer": "no", "evidence": [], "category": 5},
        ]
    return {"sample_id": sample_id, "conversation": conversation, "qa": qa}


def write_json(path: Path, data: Any) -> Path:
    path.write_text(json.dumps(data, ensure_ascii=False), encoding="utf-8")
    return path


def jsonl_turn(
    turn_id: str,
    *,
    conversation_id: str = "c1",
    session_id: str = "s1",
    speaker: str = "Ann",
    text: str | None = None,
    timestamp: str = "2024-05-01T09:00:00+02:00",
    **extra: Any,
) -> dict[str, Any]:
    record = {
        "conversation_id": conversation_id,
        "session_id": session_id,
        "turn_id": turn_id,
        "speaker": speaker,
        "text": text if text is not None else f"text of {turn_id}",
        "timestamp": timestamp,
    }
    record.update(extra)
    return record


def write_jsonl(path: Path, records: list[Any]) -> Path:
    path.write_text("".join(json.dumps(r, ensure_ascii=False) + "\n" for r in records), encoding="utf-8")
    return path


def ingest_counts(store: Path) -> dict[str, int]:
    """Row counts of the ingest tables (opening the store creates an empty one)."""
    con = connect(store)
    try:
        counts = table_counts(con)
    finally:
        con.close()
    return {table: counts[table] for table in INGEST_TABLES}


def query(store: Path, sql: str, params: list[Any] | None = None) -> list[tuple[Any, ...]]:
    con = connect(store, read_only=True)
    try:
        con.execute("SET TimeZone = 'UTC'")
        return con.execute(sql, params or []).fetchall()
    finally:
        con.close()

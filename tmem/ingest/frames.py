"""Parsed archives as polars frames, and the pure plan of what an ingest adds to the store.

Ingest is append-only and idempotent:

- a turn already stored (same conversation id and turn id) must be identical (session, speaker,
  text, event time, metadata); a difference is an error, never a silent overwrite;
- new turns must come after everything stored: after the stored turns in archive order, not
  before the conversation's watermark time, and not inside a session that a later stored
  session has closed;
- new turns get ``seq`` after the watermark, new sessions an index after it; QA items follow the
  same rule as turns (identical or new).
"""

from __future__ import annotations

import json
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from datetime import UTC, datetime
from typing import Any

import polars as pl

from tmem.errors import IngestError
from tmem.ingest.archive import ParsedArchive, shown
from tmem.store.ingest_writer import UTC_TIME, IngestPlan, StoredState

TURN_KEY = ["conversation_id", "turn_id"]
COMPARED_TURN_FIELDS = ("session_id", "speaker", "text", "event_time", "metadata")
COMPARED_QA_FIELDS = ("question", "answer", "adversarial_answer", "evidence", "category")

_CONVERSATIONS = {
    "conversation_id": pl.String(),
    "source_format": pl.String(),
    "source_path": pl.String(),
    "speakers": pl.List(pl.String()),
    "source_record": pl.String(),
}
_SESSIONS = {
    "conversation_id": pl.String(),
    "session_id": pl.String(),
    "session_index": pl.Int64(),
    "started_at": UTC_TIME,
}
_TURNS = {
    "conversation_id": pl.String(),
    "session_id": pl.String(),
    "turn_id": pl.String(),
    "seq": pl.Int64(),
    "speaker": pl.String(),
    "text": pl.String(),
    "event_time": UTC_TIME,
    "metadata": pl.String(),
    "source_path": pl.String(),
    "source_record": pl.String(),
}
_QA = {
    "conversation_id": pl.String(),
    "qa_index": pl.Int64(),
    "question": pl.String(),
    "answer": pl.String(),
    "adversarial_answer": pl.String(),
    "evidence": pl.List(pl.String()),
    "category": pl.Int64(),
    "source_path": pl.String(),
    "source_record": pl.String(),
}


@dataclass(frozen=True)
class IngestFrames:
    """Every parsed conversation, session, turn and QA item, with where each came from."""

    conversations: pl.DataFrame
    sessions: pl.DataFrame
    turns: pl.DataFrame
    qa: pl.DataFrame

    @property
    def conversation_ids(self) -> list[str]:
        return self.conversations["conversation_id"].to_list()


@dataclass(frozen=True)
class PlanCounts:
    new_conversations: int
    updated_conversations: int
    new_sessions: int
    new_turns: int
    new_qa: int


def canonical_metadata(metadata: dict[str, str]) -> str:
    """Metadata as compact JSON with sorted keys, so equal metadata compares equal as text."""
    return json.dumps(metadata, sort_keys=True, ensure_ascii=False, separators=(",", ":"))


def archive_frames(archives: Sequence[ParsedArchive]) -> IngestFrames:
    """All archives' rows as typed polars frames (times converted to UTC instants)."""
    conversations: list[dict[str, object]] = []
    sessions: list[dict[str, object]] = []
    turns: dict[str, list[object]] = {name: [] for name in _TURNS}
    qa: list[dict[str, object]] = []
    for archive in archives:
        for conv in archive.conversations:
            cid = conv.conversation_id
            conversations.append(
                {
                    "conversation_id": cid,
                    "source_format": archive.source_format,
                    "source_path": archive.path,
                    "speakers": list(conv.speakers),
                    "source_record": archive.records.conversations[cid],
                }
            )
            sessions.extend(
                {"conversation_id": cid, "session_id": s.session_id, "session_index": s.index, "started_at": s.started_at.astimezone(UTC)}
                for s in conv.sessions
            )
            for t in conv.turns:
                row = (cid, t.session_id, t.turn_id, t.seq, t.speaker, t.text, t.event_time.astimezone(UTC),
                       canonical_metadata(t.metadata), archive.path, archive.records.turns[(cid, t.turn_id)])
                for name, value in zip(_TURNS, row, strict=True):
                    turns[name].append(value)
            qa.extend(
                {
                    "conversation_id": cid,
                    "qa_index": q.index,
                    "question": q.question,
                    "answer": q.answer,
                    "adversarial_answer": q.adversarial_answer,
                    "evidence": list(q.evidence),
                    "category": q.category,
                    "source_path": archive.path,
                    "source_record": archive.records.qa[(cid, q.index)],
                }
                for q in conv.qa
            )
    return IngestFrames(
        conversations=pl.DataFrame(conversations, schema=_CONVERSATIONS),
        sessions=pl.DataFrame(sessions, schema=_SESSIONS),
        turns=pl.DataFrame(turns, schema=_TURNS),
        qa=pl.DataFrame(qa, schema=_QA),
    )


def plan_ingest(incoming: IngestFrames, stored: StoredState, now: datetime) -> tuple[IngestPlan, PlanCounts]:
    """What to write so the store holds ``incoming``; raises IngestError on a conflict."""
    if now.tzinfo is None:
        raise ValueError("now must be timezone-aware")
    now = now.astimezone(UTC)
    watermarks = stored.conversations.select(
        "conversation_id", "watermark_session_index", "watermark_turn_seq", "watermark_time"
    )
    new_turns = _new_turns(incoming.turns, stored, watermarks, now)
    new_sessions = (
        incoming.sessions.join(stored.sessions.select("conversation_id", "session_id"), on=["conversation_id", "session_id"], how="anti")
        .join(watermarks, on="conversation_id", how="left")
        .sort("conversation_id", "session_index")
        .with_columns(
            (
                pl.col("watermark_session_index").fill_null(0)
                + pl.col("session_index").rank("ordinal").over("conversation_id").cast(pl.Int64)
            ).alias("session_index"),
            pl.lit(now, dtype=UTC_TIME).alias("ingested_at"),
        )
    )
    new_qa = _new_qa(incoming.qa, stored.qa)
    conversations, updated = _conversation_rows(incoming, stored, new_turns, new_sessions, new_qa, now)
    counts = PlanCounts(
        new_conversations=conversations.height - updated,
        updated_conversations=updated,
        new_sessions=new_sessions.height,
        new_turns=new_turns.height,
        new_qa=new_qa.height,
    )
    return IngestPlan(conversations=conversations, sessions=new_sessions, turns=new_turns, qa=new_qa), counts


def _short(value: object, limit: int = 60) -> str:
    text = repr(value.isoformat() if isinstance(value, datetime) else value)
    return text if len(text) <= limit else text[: limit - 1] + "…"


def _new_turns(turns: pl.DataFrame, stored: StoredState, watermarks: pl.DataFrame, now: datetime) -> pl.DataFrame:
    joined = turns.join(
        stored.turns.with_columns(pl.lit(True).alias("_stored")), on=TURN_KEY, how="left", suffix="_stored"
    ).with_columns(pl.col("_stored").fill_null(False))
    differs = [pl.col(f).ne_missing(pl.col(f"{f}_stored")) for f in COMPARED_TURN_FIELDS]
    conflicts = joined.filter(pl.col("_stored") & pl.any_horizontal(differs)).sort("conversation_id", "seq")
    if conflicts.height:
        row = conflicts.row(0, named=True)
        field = next(f for f in COMPARED_TURN_FIELDS if row[f] != row[f"{f}_stored"])
        raise IngestError(
            row["source_path"],
            row["source_record"],
            f"conflicting change: turn {shown(row['turn_id'])} of conversation {shown(row['conversation_id'])} is already "
            f"stored with a different {field} (stored {_short(row[f'{field}_stored'])}, archive {_short(row[field])}); "
            "ingested turns are never overwritten",
        )
    last_stored = (
        joined.filter(pl.col("_stored"))
        .group_by("conversation_id")
        .agg(pl.col("seq").max().alias("last_stored_seq"), pl.col("turn_id").sort_by("seq").last().alias("last_stored_turn"))
    )
    fresh = (
        joined.filter(~pl.col("_stored"))
        .select(turns.columns)
        .join(last_stored, on="conversation_id", how="left")
        .join(watermarks, on="conversation_id", how="left")
        .join(
            stored.sessions.rename({"session_index": "stored_session_index"}),
            on=["conversation_id", "session_id"],
            how="left",
        )
        .sort("conversation_id", "seq")
    )
    _refuse(
        fresh,
        pl.col("seq") < pl.col("last_stored_seq"),
        lambda r: f"turn {shown(r['turn_id'])} is new but comes before the already stored turn {shown(r['last_stored_turn'])} "
        "in the archive; ingest only appends after what is stored",
    )
    _refuse(
        fresh,
        pl.col("event_time") < pl.col("watermark_time"),
        lambda r: f"turn {shown(r['turn_id'])} at {r['event_time'].isoformat()} is earlier than the stored watermark "
        f"{r['watermark_time'].isoformat()} of conversation {shown(r['conversation_id'])}; ingest only appends",
    )
    _refuse(
        fresh,
        pl.col("stored_session_index") != pl.col("watermark_session_index"),
        lambda r: f"turn {shown(r['turn_id'])} continues session {shown(r['session_id'])}, which is closed: a later session "
        "is already stored",
    )
    return fresh.with_columns(
        (
            pl.col("watermark_turn_seq").fill_null(-1)
            + pl.col("seq").rank("ordinal").over("conversation_id").cast(pl.Int64)
        ).alias("seq"),
        pl.lit(now, dtype=UTC_TIME).alias("ingested_at"),
    ).select(*turns.columns, "ingested_at")


def _refuse(frame: pl.DataFrame, condition: pl.Expr, reason: Callable[[dict[str, Any]], str]) -> None:
    """Raise for the first row (in archive order) where ``condition`` holds."""
    bad = frame.filter(condition.fill_null(False))
    if bad.height:
        row = bad.row(0, named=True)
        raise IngestError(row["source_path"], row["source_record"], reason(row))


def _new_qa(qa: pl.DataFrame, stored: pl.DataFrame) -> pl.DataFrame:
    key = ["conversation_id", "qa_index"]
    joined = qa.join(stored.with_columns(pl.lit(True).alias("_stored")), on=key, how="left", suffix="_stored").with_columns(
        pl.col("_stored").fill_null(False)
    )
    differs = [pl.col(f).ne_missing(pl.col(f"{f}_stored")) for f in COMPARED_QA_FIELDS]
    conflicts = joined.filter(pl.col("_stored") & pl.any_horizontal(differs)).sort(key)
    if conflicts.height:
        row = conflicts.row(0, named=True)
        field = next(f for f in COMPARED_QA_FIELDS if row[f] != row[f"{f}_stored"])
        raise IngestError(
            row["source_path"],
            row["source_record"],
            f"conflicting change: QA item {row['qa_index']} of conversation {shown(row['conversation_id'])} is already "
            f"stored with a different {field} (stored {_short(row[f'{field}_stored'])}, archive {_short(row[field])})",
        )
    return joined.filter(~pl.col("_stored")).select(qa.columns)


def _conversation_rows(
    incoming: IngestFrames,
    stored: StoredState,
    new_turns: pl.DataFrame,
    new_sessions: pl.DataFrame,
    new_qa: pl.DataFrame,
    now: datetime,
) -> tuple[pl.DataFrame, int]:
    """Whole rows for conversations that are new or changed, and how many of them were already stored."""
    turn_marks = {
        r["conversation_id"]: r
        for r in new_turns.group_by("conversation_id")
        .agg(pl.len().alias("n"), pl.col("seq").max().alias("seq"), pl.col("event_time").max().alias("time"))
        .iter_rows(named=True)
    }
    session_marks = {
        r["conversation_id"]: r["index"]
        for r in new_sessions.group_by("conversation_id").agg(pl.col("session_index").max().alias("index")).iter_rows(named=True)
    }
    qa_added = set(new_qa["conversation_id"].to_list())
    previous = {r["conversation_id"]: r for r in stored.conversations.iter_rows(named=True)}
    rows: list[dict[str, object]] = []
    updated = 0
    for conv in incoming.conversations.iter_rows(named=True):
        cid = conv["conversation_id"]
        old = previous.get(cid)
        marks = turn_marks.get(cid)
        speakers = list(conv["speakers"])
        if old is not None:
            speakers = list(old["speakers"]) + [s for s in speakers if s not in old["speakers"]]
            changed = marks is not None or cid in session_marks or cid in qa_added or speakers != list(old["speakers"])
            if not changed:
                continue
            updated += 1
        rows.append(
            {
                "conversation_id": cid,
                "source_format": conv["source_format"],
                "source_path": conv["source_path"],
                "speakers": speakers,
                "watermark_session_index": session_marks.get(cid, old["watermark_session_index"] if old else 0),
                "watermark_turn_seq": marks["seq"] if marks else old["watermark_turn_seq"] if old else -1,
                "watermark_time": marks["time"] if marks else old["watermark_time"] if old else None,
                "ingested_at": old["ingested_at"] if old else now,
                "updated_at": now,
            }
        )
    schema = {
        "conversation_id": pl.String(),
        "source_format": pl.String(),
        "source_path": pl.String(),
        "speakers": pl.List(pl.String()),
        "watermark_session_index": pl.Int64(),
        "watermark_turn_seq": pl.Int64(),
        "watermark_time": UTC_TIME,
        "ingested_at": UTC_TIME,
        "updated_at": UTC_TIME,
    }
    return pl.DataFrame(rows, schema=schema), updated

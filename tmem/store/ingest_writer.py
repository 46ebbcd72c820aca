"""Write ingested archives into the working DuckDB database, in one transaction.

The ingest side (:mod:`tmem.ingest`) parses and validates archives and plans what is new; this
module only reads what is already stored and writes a plan's rows. A caller does::

    with ingest_transaction(store) as tx:
        stored = tx.stored_state(conversation_ids)
        plan = ...                      # pure; raises IngestError on a conflict
        tx.write(plan)

Leaving the block with an exception rolls everything back, so a refused ingest writes nothing.
Frames are polars DataFrames registered on the connection and inserted with ``INSERT … SELECT``.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from datetime import datetime
from pathlib import Path

import duckdb
import polars as pl

from tmem.errors import StoreError
from tmem.store.duck import connect
from tmem.store.tombstones import Tombstone, readmit, refused_ingests

UTC_TIME = pl.Datetime("us", "UTC")

STORED_CONVERSATIONS: dict[str, pl.DataType] = {
    "conversation_id": pl.String(),
    "speakers": pl.List(pl.String()),
    "watermark_session_index": pl.Int64(),
    "watermark_turn_seq": pl.Int64(),
    "watermark_time": UTC_TIME,
    "ingested_at": UTC_TIME,
}
STORED_SESSIONS: dict[str, pl.DataType] = {
    "conversation_id": pl.String(),
    "session_id": pl.String(),
    "session_index": pl.Int64(),
}
STORED_TURNS: dict[str, pl.DataType] = {
    "conversation_id": pl.String(),
    "turn_id": pl.String(),
    "session_id": pl.String(),
    "speaker": pl.String(),
    "text": pl.String(),
    "event_time": UTC_TIME,
    "metadata": pl.String(),
}
STORED_QA: dict[str, pl.DataType] = {
    "conversation_id": pl.String(),
    "qa_index": pl.Int64(),
    "question": pl.String(),
    "answer": pl.String(),
    "adversarial_answer": pl.String(),
    "evidence": pl.List(pl.String()),
    "category": pl.Int64(),
}

@dataclass(frozen=True)
class StoredState:
    """What the store already holds for some conversations (schemas: ``STORED_*`` above)."""

    conversations: pl.DataFrame
    sessions: pl.DataFrame
    turns: pl.DataFrame
    qa: pl.DataFrame

    @classmethod
    def empty(cls) -> StoredState:
        return cls(
            conversations=pl.DataFrame(schema=STORED_CONVERSATIONS),
            sessions=pl.DataFrame(schema=STORED_SESSIONS),
            turns=pl.DataFrame(schema=STORED_TURNS),
            qa=pl.DataFrame(schema=STORED_QA),
        )


@dataclass(frozen=True)
class IngestPlan:
    """Rows to write: conversations to insert or update (whole rows), and new sessions, turns, QA."""

    conversations: pl.DataFrame
    sessions: pl.DataFrame
    turns: pl.DataFrame
    qa: pl.DataFrame


class IngestTransaction:
    """One open write transaction on the working database."""

    def __init__(self, con: duckdb.DuckDBPyConnection, store: Path) -> None:
        self._con = con
        self._store = store

    def stored_state(self, conversation_ids: Sequence[str]) -> StoredState:
        """The stored rows of these conversations (empty frames for unknown ones)."""
        return read_stored_state(self._con, conversation_ids)

    def refused(self, conversation_ids: Sequence[str]) -> list[Tombstone]:
        """The conversations a forget tombstoned and no ingest readmitted (tmem.store.tombstones)."""
        return refused_ingests(self._con, conversation_ids)

    def readmit(self, conversation_ids: Sequence[str], at: datetime) -> int:
        return readmit(self._con, conversation_ids, at)

    def write(self, plan: IngestPlan) -> None:
        """Insert the plan's rows; conversations already stored are updated in place."""
        for name, frame, sql in (
            ("plan_conversations", plan.conversations, _UPSERT_CONVERSATIONS),
            ("plan_sessions", plan.sessions, _INSERT_SESSIONS),
            ("plan_turns", plan.turns, _INSERT_TURNS),
            ("plan_qa", plan.qa, _INSERT_QA),
        ):
            if frame.is_empty():
                continue
            self._con.register(name, frame)
            try:
                self._con.execute(sql)
            except duckdb.Error as exc:
                raise StoreError(f"{self._store}: writing {name.removeprefix('plan_')} failed: {exc}") from exc
            finally:
                self._con.unregister(name)


def read_stored_state(
    con: duckdb.DuckDBPyConnection, conversation_ids: Sequence[str], *, sessions_from_turns: bool = False
) -> StoredState:
    """The stored rows of these conversations (empty frames for unknown ones).

    ``sessions_from_turns``: derive the sessions from the turns (a published snapshot copies
    conversations and turns, not sessions): ingest numbers sessions 1, 2, … in the order of their
    first turn, so a session's index is the rank of its first ``seq``. QA is then not read."""
    ids = list(conversation_ids)
    if not ids:
        return StoredState.empty()
    return StoredState(
        conversations=_frame(con, _SELECT_CONVERSATIONS, ids, STORED_CONVERSATIONS),
        sessions=_frame(con, _SESSIONS_FROM_TURNS if sessions_from_turns else _SELECT_SESSIONS, ids, STORED_SESSIONS),
        turns=_frame(con, _SELECT_TURNS, ids, STORED_TURNS),
        qa=pl.DataFrame(schema=STORED_QA) if sessions_from_turns else _frame(con, _SELECT_QA, ids, STORED_QA),
    )


def _frame(con: duckdb.DuckDBPyConnection, query: str, ids: list[str], schema: dict[str, pl.DataType]) -> pl.DataFrame:
    frame = con.sql(query, params=[ids]).pl()
    return frame.cast(schema)  # type: ignore[arg-type]


# Plain SQL, no string building: the frames are registered under the names used here.
_SELECT_CONVERSATIONS = """
    SELECT conversation_id, speakers, watermark_session_index, watermark_turn_seq, watermark_time, ingested_at
    FROM conversations WHERE conversation_id IN (SELECT unnest(?::VARCHAR[]))
"""
_SELECT_SESSIONS = """
    SELECT conversation_id, session_id, session_index
    FROM sessions WHERE conversation_id IN (SELECT unnest(?::VARCHAR[]))
"""
_SESSIONS_FROM_TURNS = """
    SELECT conversation_id, session_id,
           dense_rank() OVER (PARTITION BY conversation_id ORDER BY first_seq)::BIGINT AS session_index
    FROM (SELECT conversation_id, session_id, min(seq) AS first_seq
          FROM turns WHERE conversation_id IN (SELECT unnest(?::VARCHAR[])) GROUP BY conversation_id, session_id)
"""
_SELECT_TURNS = """
    SELECT conversation_id, turn_id, session_id, speaker, text, event_time, metadata::VARCHAR AS metadata
    FROM turns WHERE conversation_id IN (SELECT unnest(?::VARCHAR[]))
"""
_SELECT_QA = """
    SELECT conversation_id, qa_index, question, answer, adversarial_answer, evidence, category
    FROM qa WHERE conversation_id IN (SELECT unnest(?::VARCHAR[]))
"""
_UPSERT_CONVERSATIONS = """
    INSERT INTO conversations (conversation_id, source_format, source_path, speakers, watermark_session_index,
                               watermark_turn_seq, watermark_time, ingested_at, updated_at)
    SELECT conversation_id, source_format, source_path, speakers, watermark_session_index,
           watermark_turn_seq, watermark_time, ingested_at, updated_at
    FROM plan_conversations
    ON CONFLICT (conversation_id) DO UPDATE SET
        source_format = excluded.source_format, source_path = excluded.source_path, speakers = excluded.speakers,
        watermark_session_index = excluded.watermark_session_index,
        watermark_turn_seq = excluded.watermark_turn_seq, watermark_time = excluded.watermark_time,
        updated_at = excluded.updated_at
"""
_INSERT_SESSIONS = """
    INSERT INTO sessions (conversation_id, session_id, session_index, started_at, ingested_at)
    SELECT conversation_id, session_id, session_index, started_at, ingested_at FROM plan_sessions
"""
_INSERT_TURNS = """
    INSERT INTO turns (conversation_id, session_id, turn_id, seq, speaker, text, event_time, metadata, ingested_at)
    SELECT conversation_id, session_id, turn_id, seq, speaker, text, event_time, CAST(metadata AS JSON), ingested_at
    FROM plan_turns
"""
_INSERT_QA = """
    INSERT INTO qa (conversation_id, qa_index, question, answer, adversarial_answer, evidence, category)
    SELECT conversation_id, qa_index, question, answer, adversarial_answer, evidence, category FROM plan_qa
"""


@contextmanager
def ingest_transaction(store: Path, con: duckdb.DuckDBPyConnection | None = None) -> Iterator[IngestTransaction]:
    """Open the working database (or use ``con``, an open connection to it, left open) and one
    transaction; commit on success, roll back on any error."""
    owned = con is None
    if con is None:
        con = connect(Path(store))
    try:
        # Event times are instants; read them back in UTC whatever the machine's zone.
        con.execute("SET TimeZone = 'UTC'")
        con.execute("BEGIN TRANSACTION")
        try:
            yield IngestTransaction(con, Path(store))
        except BaseException:
            con.execute("ROLLBACK")
            raise
        try:
            con.execute("COMMIT")
        except duckdb.Error as exc:
            raise StoreError(f"{store}: committing the ingest failed: {exc}") from exc
    finally:
        if owned:
            con.close()


def conversation_overview(con: duckdb.DuckDBPyConnection) -> list[dict[str, object]]:
    """Per stored conversation: speakers, session/turn/QA counts, watermark and update time (UTC ISO)."""
    rows = con.execute(
        """
        SELECT c.conversation_id, c.source_format, c.speakers,
               (SELECT count(*) FROM sessions s WHERE s.conversation_id = c.conversation_id),
               (SELECT count(*) FROM turns t WHERE t.conversation_id = c.conversation_id),
               (SELECT count(*) FROM qa q WHERE q.conversation_id = c.conversation_id),
               c.watermark_session_index, c.watermark_turn_seq,
               strftime(timezone('UTC', c.watermark_time), '%Y-%m-%dT%H:%M:%SZ'),
               strftime(timezone('UTC', c.updated_at), '%Y-%m-%dT%H:%M:%SZ')
        FROM conversations c ORDER BY c.conversation_id
        """
    ).fetchall()
    keys = (
        "conversation_id",
        "source_format",
        "speakers",
        "sessions",
        "turns",
        "qa",
        "watermark_session_index",
        "watermark_turn_seq",
        "watermark_time",
        "updated_at",
    )
    return [dict(zip(keys, row, strict=True)) for row in rows]

"""Quarantined conversations and units (table ``quarantine``, migrations m006 and m009).

A **conversation** is quarantined when an operation of its spine (segmentation, topic admission)
kept answering invalid output (not JSON, not the schema, contradicting its input, or cut at its
budget even for the smallest input) after the bounded repair: the adapter's re-asks, the
construction's checked re-asks and the stage task's retries. It keeps its previous memory; it is
still attempted by later builds, and the first one that builds it clears the record.

A **unit** — one topic chunk's items, one item's or one scene's triggers, one speaker's persona
(:class:`tmem.construct.outcome.QuarantinedUnit`) — is quarantined when its own answer stayed
invalid after the repair, the re-asks and the splits: the conversation publishes without it. A
later build of the conversation that publishes it without that unit failing clears the record;
one that quarantines the same unit again supersedes it.

A record names the operation, the input (digest of the messages sent, an excerpt of the input
block), the raw output and the reason, so the case can be reproduced and inspected. Transport
failures (endpoint down) are not quarantined: they say nothing about the conversation.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass
from datetime import datetime

import duckdb

from tmem.construct.outcome import QuarantinedUnit
from tmem.errors import LLMOutputError

RAW_OUTPUT_LIMIT = 20_000  # characters kept of a raw answer (a runaway answer is cut, and says so)
CONVERSATION_UNIT = "conversation"  # unit_kind of a whole-conversation record (unit_id: the conversation id)


@dataclass(frozen=True)
class QuarantineRecord:
    conversation_id: str
    run_id: str
    error_type: str
    operation: str
    input_ref: str
    input_digest: str | None
    input_excerpt: str | None
    raw_output: str | None
    reason: str
    quarantined_at: datetime
    state: str  # active | superseded | cleared
    cleared_at: datetime | None
    cleared_by_run: str | None
    unit_kind: str = CONVERSATION_UNIT  # conversation | topic_chunk | item | scene | speaker
    unit_id: str = ""  # the conversation, topic, item or scene id, or the speaker
    ordinal: int = 0  # several records of one unit in one run (two chunks of a topic)

    @property
    def whole_conversation(self) -> bool:
        return self.unit_kind == CONVERSATION_UNIT


def quarantines(exc: BaseException) -> bool:
    """Whether a conversation that failed with ``exc`` is quarantined (invalid LLM output)."""
    return isinstance(exc, LLMOutputError)


def _cut(text: str | None) -> str | None:
    if text is None or len(text) <= RAW_OUTPUT_LIMIT:
        return text
    return text[:RAW_OUTPUT_LIMIT] + f"... [cut: {len(text)} characters]"


def record_quarantine(
    con: duckdb.DuckDBPyConnection, run_id: str, conversation_id: str, exc: LLMOutputError, at: datetime
) -> None:
    """Quarantine ``conversation_id`` for ``exc`` (one transaction; its earlier active conversation-level
    records are superseded; unit records stay: the previous memory still lacks those units)."""
    con.execute("BEGIN TRANSACTION")
    try:
        con.execute(
            "UPDATE quarantine SET state = 'superseded' WHERE conversation_id = ? AND state = 'active' "
            "AND unit_kind = ?",
            [conversation_id, CONVERSATION_UNIT],
        )
        con.execute(
            "INSERT OR REPLACE INTO quarantine (conversation_id, run_id, unit_kind, unit_id, ordinal, error_type, "
            "operation, input_ref, input_digest, input_excerpt, raw_output, reason, quarantined_at, state) "
            "VALUES (?, ?, ?, ?, 0, ?, ?, ?, ?, ?, ?, ?, ?, 'active')",
            [conversation_id, run_id, CONVERSATION_UNIT, conversation_id, type(exc).__name__, exc.operation,
             exc.input_ref, exc.input_digest, exc.input_excerpt, _cut(exc.raw_output), exc.reason, at],
        )
    except duckdb.Error:
        con.execute("ROLLBACK")
        raise
    con.execute("COMMIT")


def record_unit_quarantines(
    con: duckdb.DuckDBPyConnection, run_id: str, conversation_id: str, units: Sequence[QuarantinedUnit],
    at: datetime,
) -> None:
    """Quarantine the units a build of ``conversation_id`` left out (one transaction). An earlier active
    record of the same unit and operation is superseded; the others are settled when the conversation
    is published (:func:`clear_quarantine`)."""
    if not units:
        return
    ordinals: Counter[tuple[str, str]] = Counter()
    con.execute("BEGIN TRANSACTION")
    try:
        for unit in units:
            key = (unit.unit_kind, unit.unit_id)
            con.execute(
                "UPDATE quarantine SET state = 'superseded' WHERE conversation_id = ? AND state = 'active' "
                "AND unit_kind = ? AND unit_id = ? AND operation = ? AND run_id <> ?",
                [conversation_id, unit.unit_kind, unit.unit_id, unit.operation, run_id],
            )
            con.execute(
                "INSERT OR REPLACE INTO quarantine (conversation_id, run_id, unit_kind, unit_id, ordinal, error_type, "
                "operation, input_ref, input_digest, input_excerpt, raw_output, reason, quarantined_at, state) "
                "VALUES (?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, 'active')",
                [conversation_id, run_id, unit.unit_kind, unit.unit_id, ordinals[key], unit.error_type,
                 unit.operation, unit.input_ref, unit.input_digest, unit.input_excerpt, _cut(unit.raw_output),
                 unit.reason, at],
            )
            ordinals[key] += 1
    except duckdb.Error:
        con.execute("ROLLBACK")
        raise
    con.execute("COMMIT")


def clear_quarantine(con: duckdb.DuckDBPyConnection, conversation_id: str, run_id: str, at: datetime) -> int:
    """Mark cleared the conversation's active records of earlier runs: run ``run_id`` built and published
    it (the units it left out again were recorded by it); returns rows cleared."""
    return clear_quarantines(con, [conversation_id], run_id, at)


def clear_quarantines(con: duckdb.DuckDBPyConnection, conversation_ids: Sequence[str], run_id: str, at: datetime) -> int:
    """:func:`clear_quarantine` of several published conversations, in one statement."""
    if not conversation_ids:
        return 0
    rows = con.execute(
        "UPDATE quarantine SET state = 'cleared', cleared_at = ?, cleared_by_run = ? "
        "WHERE list_contains(?, conversation_id) AND state = 'active' AND run_id <> ? RETURNING run_id",
        [at, run_id, list(conversation_ids), run_id],
    ).fetchall()
    return len(rows)


def _has_table(con: duckdb.DuckDBPyConnection) -> bool:
    found = con.execute("SELECT count(*) FROM information_schema.tables WHERE table_name = 'quarantine'").fetchone()
    return bool(found and found[0])


def _has_units(con: duckdb.DuckDBPyConnection) -> bool:
    found = con.execute(
        "SELECT count(*) FROM information_schema.columns WHERE table_name = 'quarantine' AND column_name = 'unit_kind'"
    ).fetchone()
    return bool(found and found[0])


_LIST_COLUMNS = (
    "SELECT conversation_id, run_id, error_type, operation, input_ref, input_digest, input_excerpt, raw_output, "
    "reason, quarantined_at, state, cleared_at, cleared_by_run"
)
_LIST_WHERE = " FROM quarantine WHERE (? OR state = 'active') AND (? IS NULL OR conversation_id = ?) "
_LIST_CONVERSATIONS = _LIST_COLUMNS + _LIST_WHERE + "ORDER BY quarantined_at DESC, conversation_id"
_LIST_UNITS = (_LIST_COLUMNS + ", unit_kind, unit_id, ordinal" + _LIST_WHERE
               + "ORDER BY quarantined_at DESC, conversation_id, unit_kind, unit_id, ordinal")


def list_quarantine(
    con: duckdb.DuckDBPyConnection, *, include_inactive: bool = False, conversation_id: str | None = None
) -> list[QuarantineRecord]:
    """Quarantine records, conversations and units, newest first: the active ones (default) or all.

    A store not yet migrated to m006 (opened read-only before its next build) has none; one not yet
    at m009 has conversation records only.
    """
    if not _has_table(con):
        return []
    query = _LIST_UNITS if _has_units(con) else _LIST_CONVERSATIONS
    rows = con.execute(query, [include_inactive, conversation_id, conversation_id]).fetchall()
    return [QuarantineRecord(*row) for row in rows]


def active_units(con: duckdb.DuckDBPyConnection, conversation_ids: Sequence[str]) -> dict[str, list[tuple[str, str, str]]]:
    """Per conversation, the (operation, unit kind, unit id) of its active unit records: the stage
    tasks a build must run again rather than take from Prefect's result cache."""
    if not conversation_ids or not _has_table(con) or not _has_units(con):
        return {}
    rows = con.execute(
        "SELECT DISTINCT conversation_id, operation, unit_kind, unit_id FROM quarantine "
        "WHERE state = 'active' AND unit_kind <> ? AND list_contains(?, conversation_id) "
        "ORDER BY conversation_id, operation, unit_kind, unit_id",
        [CONVERSATION_UNIT, list(conversation_ids)],
    ).fetchall()
    out: dict[str, list[tuple[str, str, str]]] = {}
    for cid, operation, kind, unit in rows:
        out.setdefault(str(cid), []).append((str(operation), str(kind), str(unit)))
    return out

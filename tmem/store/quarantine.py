"""Quarantined conversations (table ``quarantine``, migration m006).

A conversation is quarantined when one of its LLM operations kept answering invalid output
(not JSON, not the schema, or contradicting its input) after the bounded repair: the adapter's
re-asks, the construction's checked re-asks and the stage task's retries. The record names the
operation, the input (digest of the messages sent, an excerpt of the input block), the raw
output and the reason, so the case can be reproduced and inspected. The conversation keeps its
previous memory; it is still attempted by later builds, and the first one that builds it clears
the record. Transport failures (endpoint down) are not quarantined: they say nothing about the
conversation.
"""

from __future__ import annotations

from dataclasses import dataclass
from datetime import datetime

import duckdb

from tmem.errors import LLMOutputError

RAW_OUTPUT_LIMIT = 20_000  # characters kept of a raw answer (a runaway answer is cut, and says so)


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
    """Quarantine ``conversation_id`` for ``exc`` (one transaction; earlier active records are superseded)."""
    con.execute("BEGIN TRANSACTION")
    try:
        con.execute(
            "UPDATE quarantine SET state = 'superseded' WHERE conversation_id = ? AND state = 'active'",
            [conversation_id],
        )
        con.execute(
            "INSERT OR REPLACE INTO quarantine (conversation_id, run_id, error_type, operation, input_ref, input_digest, "
            "input_excerpt, raw_output, reason, quarantined_at, state) VALUES (?, ?, ?, ?, ?, ?, ?, ?, ?, ?, 'active')",
            [conversation_id, run_id, type(exc).__name__, exc.operation, exc.input_ref, exc.input_digest,
             exc.input_excerpt, _cut(exc.raw_output), exc.reason, at],
        )
    except duckdb.Error:
        con.execute("ROLLBACK")
        raise
    con.execute("COMMIT")


def clear_quarantine(con: duckdb.DuckDBPyConnection, conversation_id: str, run_id: str, at: datetime) -> int:
    """Mark the conversation's active quarantine cleared by a successful build; returns rows cleared."""
    rows = con.execute(
        "UPDATE quarantine SET state = 'cleared', cleared_at = ?, cleared_by_run = ? "
        "WHERE conversation_id = ? AND state = 'active' RETURNING run_id",
        [at, run_id, conversation_id],
    ).fetchall()
    return len(rows)


def list_quarantine(
    con: duckdb.DuckDBPyConnection, *, include_inactive: bool = False, conversation_id: str | None = None
) -> list[QuarantineRecord]:
    """Quarantine records, newest first: the active ones (default) or all.

    A store not yet migrated to m006 (opened read-only before its next build) has none.
    """
    found = con.execute("SELECT count(*) FROM information_schema.tables WHERE table_name = 'quarantine'").fetchone()
    if not found or not found[0]:
        return []
    rows = con.execute(
        "SELECT conversation_id, run_id, error_type, operation, input_ref, input_digest, input_excerpt, raw_output, "
        "reason, quarantined_at, state, cleared_at, cleared_by_run FROM quarantine "
        "WHERE (? OR state = 'active') AND (? IS NULL OR conversation_id = ?) "
        "ORDER BY quarantined_at DESC, conversation_id",
        [include_inactive, conversation_id, conversation_id],
    ).fetchall()
    return [QuarantineRecord(*row) for row in rows]

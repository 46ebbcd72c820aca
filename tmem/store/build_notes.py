"""The construction stages' notes per run (table ``build_notes``, migration m008), and construction
health per run and operation: the usage ledger's calls, re-asks, repairs and truncations joined
with the notes' splits, clipped lists, reclassified items, dropped refs and quarantined units.

A benchmark reads a build's health with :func:`construction_health`, or with SQL::

    SELECT operation, kind, count(*) FROM build_notes WHERE run_id = ? GROUP BY ALL
    SELECT operation, count(*) FILTER (WHERE truncated) FROM llm_usage WHERE run_id = ? GROUP BY ALL
"""

from __future__ import annotations

from collections.abc import Sequence
from datetime import datetime

import duckdb

from tmem.build_report import OperationHealth, health_table
from tmem.construct.outcome import BuildNote
from tmem.store.llm_cache import DuckUsageLedger

DETAIL_LIMIT = 2_000  # characters kept of a note's detail


def record_build_notes(
    con: duckdb.DuckDBPyConnection, run_id: str, conversation_id: str, notes: Sequence[BuildNote], at: datetime
) -> None:
    """Append the notes of one conversation's build (one statement)."""
    if not notes:
        return
    cur = con.cursor()
    try:
        cur.executemany(
            "INSERT INTO build_notes (run_id, conversation_id, operation, kind, input_ref, detail, recorded_at) "
            "VALUES (?, ?, ?, ?, ?, ?, ?)",
            [[run_id, conversation_id, n.operation, n.kind, n.input_ref, n.detail[:DETAIL_LIMIT], at] for n in notes],
        )
    finally:
        cur.close()


def note_counts(con: duckdb.DuckDBPyConnection, run_id: str) -> dict[str, dict[str, int]]:
    """``{operation: {kind: count}}`` of the run's notes, operations sorted."""
    rows = con.execute(
        "SELECT operation, kind, count(*) FROM build_notes WHERE run_id = ? GROUP BY operation, kind "
        "ORDER BY operation, kind",
        [run_id],
    ).fetchall()
    out: dict[str, dict[str, int]] = {}
    for operation, kind, count in rows:
        out.setdefault(str(operation), {})[str(kind)] = int(count)
    return out


def list_build_notes(
    con: duckdb.DuckDBPyConnection, run_id: str, conversation_id: str | None = None
) -> list[tuple[str, BuildNote]]:
    """(conversation id, note) of the run, in recording order."""
    rows = con.execute(
        "SELECT conversation_id, operation, kind, input_ref, detail FROM build_notes "
        "WHERE run_id = ? AND (? IS NULL OR conversation_id = ?) ORDER BY recorded_at, conversation_id",
        [run_id, conversation_id, conversation_id],
    ).fetchall()
    return [(str(cid), BuildNote(str(op), str(ref), kind, str(detail))) for cid, op, kind, ref, detail in rows]


def construction_health(con: duckdb.DuckDBPyConnection, run_id: str) -> dict[str, OperationHealth]:
    """Per operation of the run: calls, re-asks, repairs, truncations, splits, clipped lists,
    reclassified items, dropped refs and quarantined units."""
    return health_table(DuckUsageLedger(con).summary(run_id), note_counts(con, run_id))

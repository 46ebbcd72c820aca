"""What a published snapshot says about itself: per-conversation counts, build runs, quarantine.

The memory explorer reads these from the snapshot's immutable ``memory.duckdb`` (through
:meth:`~tmem.store.snapshot.reader.SnapshotReader.tables`), never from the builder's
``work.duckdb``: DuckDB lets no reader open a file another process holds read-write, and a
reader holding it would in turn keep the builder out. The run and quarantine records are the
builder's tables as they stood at publish (:data:`~tmem.store.snapshot.SNAPSHOT_RECORD_TABLES`);
a snapshot published before they were copied has none (``None`` below, not an empty list).
"""

from __future__ import annotations

from dataclasses import dataclass
from datetime import datetime

import duckdb

from tmem.store.quarantine import QuarantineRecord, list_quarantine
from tmem.store.runs import RunRecord, list_runs


@dataclass(frozen=True)
class ConversationCounts:
    """One published conversation: its build and how much memory it holds."""

    conversation_id: str
    speakers: tuple[str, ...]
    build_id: str
    run_id: str
    built_at: datetime
    turns: int
    sessions: int
    unbuilt_turns: int  # turns ingested after its build (in the snapshot's turns table, not in the memory)
    first_turn_at: datetime | None
    last_turn_at: datetime | None
    scenes: int
    topics: int
    items: int
    atomic_items: int
    connected_items: int
    entity_triggers: int
    bridge_triggers: int
    scene_triggers: int
    horizon_triggers: int  # non-empty horizon sentences
    personas: int


_COUNTS_SQL = """
WITH
  t AS (SELECT conversation_id, count(*) AS n, count(DISTINCT session_id) AS sessions,
               min(event_time) AS first_at, max(event_time) AS last_at FROM turns GROUP BY ALL),
  late AS (SELECT t.conversation_id, count(*) AS n FROM turns t JOIN memory_builds b USING (conversation_id)
           WHERE t.seq > b.watermark_turn_seq GROUP BY ALL),
  s AS (SELECT conversation_id, count(*) AS n FROM scenes GROUP BY ALL),
  tp AS (SELECT conversation_id, count(*) AS n FROM topics GROUP BY ALL),
  i AS (SELECT conversation_id, count(*) AS n, count(*) FILTER (WHERE kind = 'atomic') AS atomic,
               count(*) FILTER (WHERE kind = 'connected') AS connected FROM items GROUP BY ALL),
  it AS (SELECT conversation_id, count(*) FILTER (WHERE family = 'entity') AS entity,
                count(*) FILTER (WHERE family = 'bridge') AS bridge FROM item_triggers GROUP BY ALL),
  st AS (SELECT conversation_id, count(*) FILTER (WHERE family = 'scene') AS scene,
                count(*) FILTER (WHERE family = 'horizon' AND text <> '') AS horizon FROM scene_triggers GROUP BY ALL),
  p AS (SELECT conversation_id, count(*) AS n FROM personas GROUP BY ALL)
SELECT b.conversation_id, c.speakers, b.build_id, b.run_id, b.built_at,
       coalesce(t.n, 0), coalesce(t.sessions, 0), coalesce(late.n, 0), t.first_at, t.last_at,
       coalesce(s.n, 0), coalesce(tp.n, 0), coalesce(i.n, 0), coalesce(i.atomic, 0), coalesce(i.connected, 0),
       coalesce(it.entity, 0), coalesce(it.bridge, 0), coalesce(st.scene, 0), coalesce(st.horizon, 0),
       coalesce(p.n, 0)
FROM memory_builds b
LEFT JOIN conversations c USING (conversation_id)
LEFT JOIN t USING (conversation_id) LEFT JOIN late USING (conversation_id) LEFT JOIN s USING (conversation_id)
LEFT JOIN tp USING (conversation_id) LEFT JOIN i USING (conversation_id) LEFT JOIN it USING (conversation_id)
LEFT JOIN st USING (conversation_id) LEFT JOIN p USING (conversation_id)
ORDER BY b.conversation_id
"""


def conversation_counts(cursor: duckdb.DuckDBPyConnection) -> tuple[ConversationCounts, ...]:
    """Every conversation the snapshot holds memory for, with its counts, ordered by id."""
    rows = cursor.execute(_COUNTS_SQL).fetchall()
    return tuple(
        ConversationCounts(
            conversation_id=r[0], speakers=tuple(r[1] or ()), build_id=r[2], run_id=r[3], built_at=r[4],
            turns=int(r[5]), sessions=int(r[6]), unbuilt_turns=int(r[7]), first_turn_at=r[8], last_turn_at=r[9],
            scenes=int(r[10]), topics=int(r[11]), items=int(r[12]), atomic_items=int(r[13]), connected_items=int(r[14]),
            entity_triggers=int(r[15]), bridge_triggers=int(r[16]), scene_triggers=int(r[17]),
            horizon_triggers=int(r[18]), personas=int(r[19]),
        )
        for r in rows
    )


def _has_table(cursor: duckdb.DuckDBPyConnection, name: str) -> bool:
    found = cursor.execute(
        "SELECT count(*) FROM information_schema.tables WHERE table_schema = 'main' AND table_name = ?", [name]
    ).fetchone()
    return bool(found and found[0])


def snapshot_runs(cursor: duckdb.DuckDBPyConnection, limit: int = 50) -> list[RunRecord] | None:
    """The build runs recorded at publish, newest first; ``None`` when the snapshot carries none."""
    return list_runs(cursor, limit) if _has_table(cursor, "build_runs") else None


def snapshot_quarantine(
    cursor: duckdb.DuckDBPyConnection, *, conversation_id: str | None = None
) -> list[QuarantineRecord] | None:
    """Quarantine records at publish (every state), newest first, optionally of one conversation
    (exact id); ``None`` when the snapshot carries none."""
    if not _has_table(cursor, "quarantine"):
        return None
    return list_quarantine(cursor, include_inactive=True, conversation_id=conversation_id)

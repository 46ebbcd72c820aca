"""Tombstones of forgotten conversations (table ``forget_tombstones``, migration m010).

``tmem forget`` records, for the id it forgets, a digest of the id and when — never the id
itself — so that a later ingest of an archive that still holds the conversation is refused
(:func:`refused_ingests`) instead of quietly bringing it back. An ingest asked to readmit it
(``tmem ingest --allow-forgotten``) clears the refusal (``readmitted_at``); forgetting it again
arms it again. While a forget of the id is still in progress, even a readmitting ingest is
refused: the forget must finish first.

The digest is sha256 over a fixed prefix and the id's exact characters, so the rule has the
same exact-string scope as every read (``conv-1`` and ``conv-1 `` are different ids). It is not
a secret: anyone holding the store who can guess an id can test it.
"""

from __future__ import annotations

import hashlib
from collections.abc import Sequence
from dataclasses import dataclass
from datetime import datetime

import duckdb

_PREFIX = b"tmem-forgotten-conversation\x00"


def id_digest(conversation_id: str) -> str:
    """The tombstone key of an id: hex sha256 of a fixed prefix and the id's UTF-8 bytes."""
    return hashlib.sha256(_PREFIX + conversation_id.encode("utf-8", "surrogatepass")).hexdigest()


@dataclass(frozen=True)
class Tombstone:
    conversation_id: str
    forgotten_at: datetime
    in_progress: bool  # the forget has not finished (a readmitting ingest is refused too)


def _has_tables(con: duckdb.DuckDBPyConnection) -> bool:
    row = con.execute(
        "SELECT count(*) FROM information_schema.tables WHERE table_name IN ('forget_tombstones', 'forget_jobs')"
    ).fetchone()
    return bool(row and row[0] == 2)


def refused_ingests(con: duckdb.DuckDBPyConnection, conversation_ids: Sequence[str]) -> list[Tombstone]:
    """The conversations among ``conversation_ids`` an ingest must refuse: forgotten and not
    readmitted since, or with a forget in progress; in the order given."""
    if not conversation_ids or not _has_tables(con):
        return []
    digests = {id_digest(cid): cid for cid in conversation_ids}
    rows = con.execute(
        "SELECT t.id_digest, t.forgotten_at, t.finished_at IS NULL OR j.id_digest IS NOT NULL, t.readmitted_at "
        "FROM forget_tombstones t LEFT JOIN forget_jobs j USING (id_digest) "
        "WHERE t.id_digest IN (SELECT unnest(?::VARCHAR[]))",
        [list(digests)],
    ).fetchall()
    found = {str(d): Tombstone(digests[str(d)], at, bool(pending)) for d, at, pending, readmitted in rows
             if readmitted is None or pending}
    return [found[id_digest(cid)] for cid in conversation_ids if id_digest(cid) in found]


def readmit(con: duckdb.DuckDBPyConnection, conversation_ids: Sequence[str], at: datetime) -> int:
    """Mark these ids' finished tombstones readmitted (an explicit re-ingest); returns how many."""
    if not conversation_ids or not _has_tables(con):
        return 0
    rows = con.execute(
        "UPDATE forget_tombstones SET readmitted_at = ? WHERE readmitted_at IS NULL AND finished_at IS NOT NULL "
        "AND id_digest IN (SELECT unnest(?::VARCHAR[])) RETURNING id_digest",
        [at, [id_digest(cid) for cid in conversation_ids]],
    ).fetchall()
    return len(rows)

"""The builder's working DuckDB database: connection and migrations.

DuckDB allows one read-write process per file, and while it is open no other process can
open the file at all. So this database belongs to the builder; the query side reads
immutable snapshots (see :mod:`tmem.store.snapshot.published`).
"""

from __future__ import annotations

from collections.abc import Sequence
from datetime import UTC, datetime
from pathlib import Path

import duckdb
import pyarrow as pa

from tmem.errors import StoreError
from tmem.store.migrations import MIGRATIONS, Migration

WORK_DB = "work.duckdb"


def work_db_path(store: Path) -> Path:
    return Path(store) / WORK_DB


def open_read_only(path: Path, failure: str) -> duckdb.DuckDBPyConnection:
    """``path`` opened read-only in UTC; a DuckDB error is a StoreError ``"<path>: <failure> (<why>)"``."""
    try:
        con = duckdb.connect(str(path), read_only=True)
    except duckdb.Error as exc:
        raise StoreError(f"{path}: {failure} ({exc})") from exc
    con.execute("SET TimeZone = 'UTC'")
    return con


def connect(store: Path, *, read_only: bool = False) -> duckdb.DuckDBPyConnection:
    """Open (creating if needed) the store's working database with every migration applied."""
    store = Path(store)
    path = work_db_path(store)
    if read_only:
        if not path.exists():
            raise StoreError(f"{store}: no tmem store here (missing {WORK_DB}); run `tmem ingest` first")
        return open_read_only(path, "cannot open read-only")
    store.mkdir(parents=True, exist_ok=True)
    try:
        con = duckdb.connect(str(path))
    except duckdb.IOException as exc:
        raise StoreError(f"{path}: cannot open for writing; is another tmem process building? ({exc})") from exc
    con.execute("SET TimeZone = 'UTC'")
    apply_migrations(con, MIGRATIONS)
    return con


def apply_migrations(con: duckdb.DuckDBPyConnection, migrations: Sequence[Migration]) -> list[str]:
    """Apply the migrations not yet recorded; return the names applied now."""
    con.execute(
        "CREATE TABLE IF NOT EXISTS schema_migrations (name VARCHAR PRIMARY KEY, applied_at TIMESTAMPTZ NOT NULL)"
    )
    done = {row[0] for row in con.execute("SELECT name FROM schema_migrations").fetchall()}
    applied: list[str] = []
    for migration in migrations:
        if migration.name in done:
            continue
        con.execute("BEGIN TRANSACTION")
        try:
            con.execute(migration.sql)
            con.execute(
                "INSERT INTO schema_migrations VALUES (?, ?)", [migration.name, datetime.now(UTC)]
            )
        except duckdb.Error:
            con.execute("ROLLBACK")
            raise
        con.execute("COMMIT")
        applied.append(migration.name)
    return applied


def table_counts(con: duckdb.DuckDBPyConnection) -> dict[str, int]:
    """Row counts of every base table in the main schema."""
    names = [
        row[0]
        for row in con.execute(
            "SELECT table_name FROM information_schema.tables WHERE table_schema = 'main' AND table_type = 'BASE TABLE' ORDER BY table_name"
        ).fetchall()
    ]
    counts: dict[str, int] = {}
    for name in names:
        row = con.execute(f'SELECT count(*) FROM "{name}"').fetchone()  # noqa: S608 -- names from information_schema
        counts[name] = int(row[0]) if row else 0
    return counts


_STAGED = "tmem_rows_staged"


def insert_arrow(cur: duckdb.DuckDBPyConnection, statement: str, table: pa.Table) -> None:
    """Run ``statement`` (which reads ``{staged}``) with ``table`` registered under that name: one
    statement for all rows, where ``executemany`` runs one per row (~2-10 ms each into a keyed table)."""
    cur.register(_STAGED, table)
    try:
        cur.execute(statement.format(staged=_STAGED))
    finally:
        cur.unregister(_STAGED)

"""Forgetting a conversation in LanceDB: its rows, and every stored byte of them.

A Lance delete only marks rows deleted: the data file keeps their bytes (and their text) for as
long as any version references it, and compaction leaves a fragment alone when few of its rows
are deleted. So :func:`forget_vectors` rewrites every fragment that holds a row of the
conversation: one merge-insert per chunk re-writes the other conversations' rows of those
fragments into new files (same row ids and values) and deletes the conversation's rows, so the
old fragments are left with no live row and drop out of the table. The scope index (whose pages
hold conversation ids) is rebuilt, and the table compacted. :func:`drop_old_versions` then
deletes every version but the latest, and with them the files only old versions used.

The merge-insert names the conversation through a typed filter, which Lance does not write into
its transaction file; a ``delete(filter)`` would (and the latest version's transaction file is
kept by cleanup), so none is used.

Before rewriting, a table whose latest version is not the one the current snapshot pins is
restored to the pinned one: writes after it belong to a build that never published, whose
conversations the next build publishes again, and the republished snapshot must pin other
conversations' rows exactly as readers saw them.
"""

from __future__ import annotations

import warnings
from collections.abc import Mapping
from dataclasses import dataclass
from datetime import timedelta
from pathlib import Path

import lancedb
import pyarrow as pa
from lancedb.expr import Expr, col, lit

from tmem.errors import StoreError
from tmem.store.lance import scope_filter

REWRITE_CHUNK_ROWS = 262_144  # rows of other conversations re-written per merge-insert (~420 MB at 384-d)
NO_CLEANUP = timedelta(days=3650)  # optimize() without deleting versions
_FRAGMENT_BITS = 32  # a Lance row address is fragment id << 32 | row offset


@dataclass(frozen=True)
class TableForget:
    table: str
    rows_removed: int
    fragments_rewritten: int
    rows_rewritten: int  # other conversations' rows moved out of those fragments (values unchanged)
    restored_from: int | None  # the pinned version restored first, when the latest was another
    version: int  # the latest version afterwards


def _connect(uri: str) -> lancedb.DBConnection | None:
    if "://" not in uri and not Path(uri).is_dir():
        return None  # nothing was ever written (connecting would create the directory)
    try:
        return lancedb.connect(uri)
    except (OSError, ValueError, RuntimeError) as exc:
        raise StoreError(f"{uri}: cannot open LanceDB ({exc})") from exc


def _tables(db: lancedb.DBConnection) -> list[str]:
    names: list[str] = []
    page: str | None = None
    while True:
        response = db.list_tables(page_token=page)
        names.extend(response.tables)
        page = response.page_token
        if not page:
            return sorted(names)


def latest_versions(uri: str) -> dict[str, int]:
    db = _connect(uri)
    return {} if db is None else {t: int(db.open_table(t).version) for t in _tables(db)}


def vector_rows(uri: str, conversation_id: str) -> dict[str, int]:
    """Rows of the conversation in the latest version of each table (what a dry run reports)."""
    db = _connect(uri)
    if db is None:
        return {}
    out: dict[str, int] = {}
    for table in _tables(db):
        n = len(_addresses(db.open_table(table), scope_filter(conversation_id)))
        if n:
            out[table] = n
    return out


def _addresses(handle: lancedb.table.Table, where: Expr) -> list[int]:
    data = handle.search().where(where).select(["_rowaddr"]).limit(None).to_arrow()
    return sorted(int(a) for a in data.column("_rowaddr").to_pylist())


def _fragment_range(fragment: int, lo: int = 0, hi: int = 1 << _FRAGMENT_BITS) -> Expr:
    base = fragment << _FRAGMENT_BITS
    return (col("_rowaddr") >= lit(base + lo)) & (col("_rowaddr") < lit(base + hi))


def _rewrite_chunks(handle: lancedb.table.Table, fragments: list[int], conversation_id: str) -> list[Expr]:
    """Filters selecting the other conversations' rows of ``fragments``, at most REWRITE_CHUNK_ROWS each."""
    others = col("conversation_id") != lit(conversation_id)
    chunks: list[Expr] = []
    for fragment in fragments:
        offsets = [a & ((1 << _FRAGMENT_BITS) - 1) for a in _addresses(handle, _fragment_range(fragment) & others)]
        for start in range(0, len(offsets), REWRITE_CHUNK_ROWS):
            part = offsets[start : start + REWRITE_CHUNK_ROWS]
            chunks.append(_fragment_range(fragment, part[0], part[-1] + 1) & others)
    return chunks


def _forget_in_table(handle: lancedb.table.Table, table: str, conversation_id: str, pinned: int | None) -> TableForget:
    restored = None
    if pinned is not None and int(handle.version) != pinned:
        handle.restore(pinned)
        restored = pinned
    mine = _addresses(handle, scope_filter(conversation_id))
    if not mine:
        return TableForget(table, 0, 0, 0, restored, int(handle.version))
    fragments = sorted({a >> _FRAGMENT_BITS for a in mine})
    schema = handle.schema
    rewritten = 0
    chunks = _rewrite_chunks(handle, fragments, conversation_id)
    for n, where in enumerate(chunks or [None]):
        data = (handle.search().where(where).limit(None).to_arrow().select(schema.names) if where is not None
                else schema.empty_table())
        merge = handle.merge_insert("row_id").when_matched_update_all()
        if n == 0:  # the conversation's rows go with the first chunk (one version)
            merge = merge.when_not_matched_by_source_delete(scope_filter(conversation_id))
        try:
            merge.execute(pa.Table.from_batches(data.to_batches(), schema=schema))
        except (OSError, ValueError, RuntimeError) as exc:
            raise StoreError(f"{table}: rewriting {len(fragments)} fragments without {conversation_id!r} failed ({exc})") from exc
        rewritten += data.num_rows
    left = len(_addresses(handle, scope_filter(conversation_id)))
    if left:
        raise StoreError(f"{table}: {left} rows of {conversation_id!r} are still there after the rewrite")
    for index in handle.list_indices():
        if index.columns == ["conversation_id"]:  # its pages hold the ids: rebuilt from the live rows
            handle.create_scalar_index("conversation_id", replace=True, index_type="BTREE", name=index.name)
    # Compaction now (it is part of LanceDB's cleanup too): the version the snapshot will pin is then
    # the one the cleanup keeps. Nightly maintenance compacts as well, so this is mostly a no-op.
    handle.optimize(cleanup_older_than=NO_CLEANUP)
    return TableForget(table, len(mine), len(fragments), rewritten, restored, int(handle.version))


def forget_vectors(uri: str, conversation_id: str, pinned: Mapping[str, int]) -> list[TableForget]:
    """Remove the conversation's rows from every table under ``uri`` (see the module doc); a table
    in ``pinned`` (table -> version the current snapshot pins) is first restored to that version
    when its latest is another. Old versions still hold the rows: :func:`drop_old_versions`."""
    db = _connect(uri)
    if db is None:
        return []
    return [_forget_in_table(db.open_table(t), t, conversation_id, pinned.get(t)) for t in _tables(db)]


def drop_old_versions(uri: str) -> dict[str, tuple[int, int, int, int]]:
    """Delete every version of every table but the latest, and the files only they use; returns
    table -> (versions before, versions after, latest before, latest after). LanceDB's cleanup also
    compacts first: on a table with small fragments that makes a new latest version (same rows), and
    the caller must then pin that one (the one it pinned is gone)."""
    db = _connect(uri)
    if db is None:
        return {}
    out: dict[str, tuple[int, int, int, int]] = {}
    for table in _tables(db):
        handle = db.open_table(table)
        latest, before = int(handle.version), len(handle.list_versions())
        try:
            with warnings.catch_warnings():  # "removes every version except the latest": that is the point
                warnings.simplefilter("ignore", UserWarning)
                handle.optimize(cleanup_older_than=timedelta(0), delete_unverified=True)
        except (OSError, ValueError, RuntimeError) as exc:
            raise StoreError(f"{uri}/{table}: deleting old versions failed ({exc})") from exc
        out[table] = (before, len(handle.list_versions()), latest, int(handle.version))
    return out

"""Forgetting a conversation in published snapshots: republish the current one without it, then
delete every other.

A snapshot is immutable and readers may hold it open, so none is edited in place.
:func:`republish_without` writes a new snapshot derived from the current one — every table
without the conversation's rows, every other conversation's image copied byte for byte from the
current image file (documents, vector sections and prebuilt BM25 alike), the manifest without
the conversation and pinning the Lance versions the forget left — and flips ``CURRENT`` to it,
exactly as a publish does. Readers see the old snapshot or the new one, whole.

Older snapshots pin Lance versions the forget deletes (LanceDB deletes versions by age only, and
every version since the conversation was first published holds its rows), so they cannot stay
readable and are removed (:func:`remove_other_snapshots`): each is renamed to a temporary name
first (one atomic step, after which no reader can open it by id), then deleted.
"""

from __future__ import annotations

import json
import os
import shutil
from collections.abc import Mapping
from datetime import datetime
from pathlib import Path
from typing import Any

import duckdb
import pyarrow as pa

from tmem.errors import StoreError
from tmem.store.forget_work import scrubbed_run
from tmem.store.snapshot.formats import require_current
from tmem.store.snapshot.image import IMAGE_FILE, IMAGE_TABLE, open_image_file, write_image_index
from tmem.store.snapshot.published import (
    MANIFEST,
    MEMORY_DB,
    SNAPSHOTS,
    SnapshotInfo,
    commit_snapshot_dir,
    current_snapshot,
    list_snapshots,
    prune_snapshots,
    read_snapshot,
    snapshot_id_for,
    snapshot_tables,
    start_snapshot_dir,
)

_VECTORS_KEY, _LEXICAL_KEY = "|vectors:", "|lexical:"


def snapshots_holding(store: Path, conversation_id: str) -> list[str]:
    """Ids of the snapshots on disk whose manifest lists the conversation (exact match)."""
    return [s for s in list_snapshots(store) if conversation_id in read_snapshot(store, s).conversations]


def _new_source_key(old: str, conversation_id: str, vector_keys: Mapping[str, str] | None, absent: str) -> str:
    """An image's source key with the vector part recomputed at the new Lance version (the rows are
    the same, their addresses may not be: ``image_vectors`` keys digest row addresses)."""
    if vector_keys is None or _VECTORS_KEY not in old:
        return old
    base, rest = old.split(_VECTORS_KEY, 1)
    _, sep, lexical = rest.partition(_LEXICAL_KEY)
    return f"{base}{_VECTORS_KEY}{vector_keys.get(conversation_id, absent)}" + (f"{_LEXICAL_KEY}{lexical}" if sep else "")


def _copy_images(con: duckdb.DuckDBPyConnection, source: Path, target: Path, conversation_id: str,
                 vector_keys: Mapping[str, str] | None, absent: str) -> tuple[int, int]:
    """Copy every image but the conversation's from ``source`` to ``target``'s image file and index
    (``old`` is the source snapshot attached to ``con``). Returns (images, bytes) copied."""
    rows = con.execute(
        f"SELECT conversation_id, format, byte_offset, byte_length, vector_bytes, lexical_bytes, source_key "  # noqa: S608
        f"FROM old.{IMAGE_TABLE} WHERE conversation_id <> ? ORDER BY conversation_id", [conversation_id],
    ).fetchall()
    placed: list[tuple[Any, ...]] = []
    fd = open_image_file(source)
    try:
        with open(target / IMAGE_FILE, "wb") as out:
            for cid, fmt, offset, length, vector_bytes, lexical_bytes, key in rows:
                size = int(length) + int(vector_bytes) + int(lexical_bytes)
                data = os.pread(fd, size, int(offset))
                if len(data) != size:
                    raise StoreError(f"{source / IMAGE_FILE}: image of {cid!r} is cut short")
                placed.append((cid, fmt, out.tell(), length, vector_bytes, lexical_bytes,
                               _new_source_key(str(key), str(cid), vector_keys, absent)))
                out.write(data)
            out.flush()
            os.fsync(out.fileno())
    finally:
        os.close(fd)
    columns = ("conversation_id", "format", "byte_offset", "byte_length", "vector_bytes", "lexical_bytes", "source_key")
    types = (pa.string(), pa.int32(), pa.int64(), pa.int64(), pa.int64(), pa.int64(), pa.string())
    index = pa.table({c: pa.array([p[i] for p in placed], t) for i, (c, t) in enumerate(zip(columns, types, strict=True))})
    write_image_index(con, "main", index)
    return len(placed), sum(int(p[3]) + int(p[4]) + int(p[5]) for p in placed)


def _copy_scrubbed_runs(con: duckdb.DuckDBPyConnection, conversation_id: str) -> None:
    """Fill ``main.build_runs`` (created empty) from ``old.build_runs`` with the conversation taken out of
    each run's inputs and failures, so no byte of the old rows reaches the new file."""
    columns = [str(r[0]) for r in con.execute(
        "SELECT column_name FROM duckdb_columns() WHERE database_name = 'old' AND table_name = 'build_runs' "
        "ORDER BY column_index").fetchall()]
    at_inputs, at_failures = columns.index("inputs"), columns.index("failures")
    rows = []
    for row in con.execute('SELECT * FROM old."build_runs" ORDER BY started_at').fetchall():
        values = list(row)
        scrubbed = scrubbed_run(values[at_inputs], values[at_failures], conversation_id)
        if scrubbed is not None:
            values[at_inputs], values[at_failures] = scrubbed
        rows.append(values)
    if rows:
        marks = ", ".join("?" for _ in columns)
        con.executemany(f'INSERT INTO main."build_runs" VALUES ({marks})', rows)  # noqa: S608 -- placeholders only


def republish_without(
    store: Path, info: SnapshotInfo, conversation_id: str, *, lance_uri: str, lance_versions: dict[str, int],
    now: datetime, vector_keys: Mapping[str, str] | None = None, vector_key_absent: str = "",
) -> tuple[SnapshotInfo, int, int]:
    """Publish ``info`` without the conversation as a new current snapshot pinning ``lance_versions``
    of the tables at ``lance_uri`` (the ones the forget rewrote; see the module doc); ``vector_keys``
    are the images' vector source keys at those versions. Returns (the new snapshot, images copied,
    image bytes copied). A snapshot of an older format is refused (:class:`StoreError`: upgrade it first)."""
    require_current(info.path / MANIFEST, info.image_format, store=Path(store))
    builds = {c: b for c, b in info.conversations.items() if c != conversation_id}
    snapshot_id = snapshot_id_for(now, builds, lance_versions)
    tmp = start_snapshot_dir(store, snapshot_id)
    con = duckdb.connect(str(tmp / MEMORY_DB))
    copied = (0, 0)
    try:
        con.execute("ATTACH ? AS old (READ_ONLY)", [str(info.memory_db)])
        for name, scoped in snapshot_tables(con, "old").items():
            if name == IMAGE_TABLE:
                continue
            where = " WHERE conversation_id <> ? ORDER BY conversation_id" if scoped else ""
            if name == "build_runs":
                where = " WHERE false"
            con.execute(f'CREATE TABLE main."{name}" AS SELECT * FROM old."{name}"{where}',  # noqa: S608 -- names from the catalog
                        [conversation_id] if scoped else [])
            if name == "build_runs":  # the records copied at publish name it in their inputs: written scrubbed
                _copy_scrubbed_runs(con, conversation_id)
        copied = _copy_images(con, info.path, tmp, conversation_id, vector_keys, vector_key_absent)
        con.execute("DETACH old")
        con.execute("CHECKPOINT")
    except duckdb.Error as exc:
        raise StoreError(f"{info.memory_db}: writing snapshot {snapshot_id} without the conversation failed ({exc})") from exc
    finally:
        con.close()
    manifest: dict[str, Any] = json.loads((info.path / MANIFEST).read_text())
    pinned_uri = lance_uri if "://" in lance_uri else str(Path(lance_uri).resolve())
    manifest.update({"snapshot_id": snapshot_id, "created_at": now.isoformat(), "conversations": builds,
                     "lance_uri": pinned_uri, "lance_versions": lance_versions, "derived_from": info.snapshot_id,
                     "derived_by": "tmem forget"})
    return commit_snapshot_dir(store, tmp, manifest), copied[0], copied[1]


def remove_other_snapshots(store: Path, keep: str | None) -> list[str]:
    """Delete every snapshot on disk but ``keep`` (and leftovers of unfinished publishes); returns
    the ids removed. Each goes out of sight by one rename before its files are deleted."""
    root = Path(store) / SNAPSHOTS
    current = current_snapshot(store)
    if keep is not None and (current is None or current.snapshot_id != keep):
        raise StoreError(f"{store}: refusing to remove snapshots: CURRENT does not name {keep!r}")
    removed: list[str] = []
    for name in list_snapshots(store):
        if name == keep:
            continue
        hidden = root / f".forget-{name}.tmp"
        os.replace(root / name, hidden)
        shutil.rmtree(hidden)
        removed.append(name)
    prune_snapshots(store, keep=len(list_snapshots(store)))  # sweeps temporary leftovers, keeps every snapshot
    return removed

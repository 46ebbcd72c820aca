"""Immutable published snapshots and the pointer readers follow.

Layout under the store directory::

    work.duckdb                 builder's working database (single writer)
    lance/                      LanceDB tables (every write is a new table version)
    snapshots/<id>/memory.duckdb  memory tables + turns of every published conversation, the
                                  index of the derived per-conversation images, and the build
                                  records (build_runs, quarantine) as they stood at the publish
    snapshots/<id>/conversation_images.bin  those images, each with its pinned vector rows
                                  (image.py, image_vectors.py)
    snapshots/<id>/manifest.json  id, time, pinned Lance table versions, conversations
    CURRENT                     the id of the snapshot readers use (replaced atomically)

A snapshot directory is written under a temporary name, fsynced and renamed; only then
is ``CURRENT`` replaced (write-temp + ``os.replace``). A reader therefore sees either the
previous whole snapshot or the new whole one, never a half-written version.
"""

from __future__ import annotations

import json
import os
import shutil
from dataclasses import dataclass, field
from datetime import datetime
from pathlib import Path
from typing import Any

import duckdb

from tmem.errors import StoreError
from tmem.ids import content_hash
from tmem.retrieval.lexical import BM25Section
from tmem.store.migrations import MEMORY_TABLES
from tmem.store.snapshot.formats import IMAGE_FORMAT
from tmem.store.snapshot.formats import MANIFEST_KEY as IMAGE_MANIFEST_KEY
from tmem.store.snapshot.image import write_conversation_images
from tmem.store.snapshot.image_vectors import lance_source

SNAPSHOTS = "snapshots"
CURRENT = "CURRENT"
MEMORY_DB = "memory.duckdb"
MANIFEST = "manifest.json"
# Tables copied into a snapshot besides the memory tables (the query side renders turns).
SNAPSHOT_EXTRA_TABLES: tuple[str, ...] = ("conversations", "turns", "memory_builds")
# The build records as of the publish, for readers that may not open work.duckdb (the memory
# explorer): the publishing run is still 'running' in this copy; its final figures arrive with
# the next publish. Snapshots published before these were copied simply lack the tables.
SNAPSHOT_RECORD_TABLES: dict[str, str] = {"build_runs": "started_at", "quarantine": "quarantined_at, conversation_id"}


@dataclass(frozen=True)
class SnapshotInfo:
    snapshot_id: str
    path: Path
    created_at: str
    lance_uri: str
    lance_versions: dict[str, int]
    conversations: dict[str, str] = field(default_factory=dict)  # conversation id -> build id
    image_format: int | None = None  # format of conversation_images; None: published before images

    @property
    def memory_db(self) -> Path:
        return self.path / MEMORY_DB


def _fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def publish_snapshot(
    con: duckdb.DuckDBPyConnection,
    store: Path,
    *,
    lance_uri: str,
    lance_versions: dict[str, int],
    now: datetime,
    image_vectors: bool = True,
) -> SnapshotInfo:
    """Copy the working database's memory into a new immutable snapshot and point readers at it.
    ``image_vectors``: copy each conversation's pinned vector rows into its image (else cold loads
    read them from LanceDB)."""
    store = Path(store)
    builds = {r[0]: r[1] for r in con.execute("SELECT conversation_id, build_id FROM memory_builds").fetchall()}
    snapshot_id = snapshot_id_for(now, builds, lance_versions)
    tmp = start_snapshot_dir(store, snapshot_id)
    db_path = tmp / MEMORY_DB
    con.execute("ATTACH ? AS snap", [str(db_path)])
    try:
        for name in (*MEMORY_TABLES, *SNAPSHOT_EXTRA_TABLES):
            # Stored in conversation order, so each row group's min/max of conversation_id (DuckDB's
            # zone maps) lets a reader's `WHERE conversation_id = ?` skip all other row groups. In the
            # working database a rebuilt conversation's rows land at the end, scattered over time:
            # copied as they are, every scoped read scans the whole table (bench/query.py --part scale).
            con.execute(f"CREATE TABLE snap.{name} AS SELECT * FROM main.{name} ORDER BY conversation_id")  # noqa: S608 -- fixed names
        for name, order in SNAPSHOT_RECORD_TABLES.items():
            con.execute(f"CREATE TABLE snap.{name} AS SELECT * FROM main.{name} ORDER BY {order}")  # noqa: S608 -- fixed names
        # Derived from the tables just written, the pinned vectors and the BM25 built from them: a cold
        # query load reads one byte range instead of nine queries and a Lance scan, and skips BM25.
        write_conversation_images(con, "snap", tmp, previous=_previous_with_images(store),
                                  vectors=lance_source(_local_uri(lance_uri, store), lance_versions) if image_vectors else None,
                                  lexical=BM25Section())
    finally:
        con.execute("DETACH snap")
    manifest: dict[str, Any] = {
        "snapshot_id": snapshot_id,
        "created_at": now.isoformat(),
        "lance_uri": lance_uri,
        "lance_versions": lance_versions,
        "conversations": builds,
        IMAGE_MANIFEST_KEY: IMAGE_FORMAT,
    }
    return commit_snapshot_dir(store, tmp, manifest)


def snapshot_id_for(now: datetime, builds: dict[str, str], lance_versions: dict[str, int]) -> str:
    """A new snapshot's id: its time (ids sort by it) and a digest of what it publishes."""
    return f"{now.strftime('%Y%m%dT%H%M%S%fZ')}-{content_hash(builds, lance_versions)[:8]}"


def start_snapshot_dir(store: Path, snapshot_id: str) -> Path:
    """The temporary directory a new snapshot is written in (``snapshots/.<id>.tmp``). The store has
    one writer, so any temporary snapshot left here is from a publish that died: removed first."""
    root = Path(store) / SNAPSHOTS
    root.mkdir(parents=True, exist_ok=True)
    if (root / snapshot_id).exists():
        raise StoreError(f"{root / snapshot_id}: snapshot already exists")
    _remove_leftovers(root)
    tmp = root / f".{snapshot_id}.tmp"
    tmp.mkdir()
    return tmp


def commit_snapshot_dir(store: Path, tmp: Path, manifest: dict[str, Any]) -> SnapshotInfo:
    """Write the manifest into the finished temporary directory, rename it to its id and point
    ``CURRENT`` at it (each step fsynced; readers see the old snapshot or the new one, whole)."""
    store = Path(store)
    root = store / SNAPSHOTS
    final = root / str(manifest["snapshot_id"])
    (tmp / MANIFEST).write_text(json.dumps(manifest, indent=1, sort_keys=True))
    _fsync_dir(tmp)
    os.replace(tmp, final)
    _fsync_dir(root)
    pointer_tmp = store / f".{CURRENT}.tmp"
    pointer_tmp.write_text(str(manifest["snapshot_id"]))
    with open(pointer_tmp, "rb") as fh:
        os.fsync(fh.fileno())
    os.replace(pointer_tmp, store / CURRENT)
    _fsync_dir(store)
    return _info(final, manifest)


def _local_uri(uri: str, store: Path) -> str:
    """A relative Lance path as readers resolve it (relative to the store when it exists there)."""
    if "://" in uri or Path(uri).is_absolute() or not (Path(store) / uri).exists():
        return uri
    return str(Path(store) / uri)


def _previous_with_images(store: Path) -> Path | None:
    """The current snapshot's directory when its images are of this format (a publish copies the
    unchanged ones from there)."""
    try:
        info = current_snapshot(store)
    except StoreError:
        return None
    return info.path if info is not None and info.image_format == IMAGE_FORMAT else None


def snapshot_tables(con: duckdb.DuckDBPyConnection, catalog: str) -> dict[str, bool]:
    """table -> whether it has a conversation_id column, for the base tables of the snapshot
    attached to ``con`` as ``catalog``."""
    rows = con.execute(
        "SELECT t.table_name, bool_or(c.column_name = 'conversation_id') FROM duckdb_tables() t "
        "JOIN duckdb_columns() c USING (database_name, schema_name, table_name) "
        "WHERE t.database_name = ? AND t.schema_name = 'main' GROUP BY 1 ORDER BY 1",
        [catalog],
    ).fetchall()
    return {str(name): bool(scoped) for name, scoped in rows}


def _remove_leftovers(root: Path) -> list[str]:
    """Delete temporary snapshot directories (``.<id>.tmp``) of publishes that never finished."""
    removed: list[str] = []
    for leftover in sorted(root.glob(".*.tmp")):
        if leftover.is_dir():
            shutil.rmtree(leftover)
            removed.append(leftover.name)
    return removed


def _info(path: Path, manifest: dict[str, Any]) -> SnapshotInfo:
    return SnapshotInfo(
        snapshot_id=manifest["snapshot_id"],
        path=path,
        created_at=manifest["created_at"],
        lance_uri=manifest["lance_uri"],
        lance_versions={k: int(v) for k, v in manifest["lance_versions"].items()},
        conversations=dict(manifest.get("conversations", {})),
        image_format=None if manifest.get(IMAGE_MANIFEST_KEY) is None else int(manifest[IMAGE_MANIFEST_KEY]),
    )


def current_snapshot(store: Path) -> SnapshotInfo | None:
    """The snapshot ``CURRENT`` points to, or None when nothing was published yet."""
    store = Path(store)
    pointer = store / CURRENT
    if not pointer.exists():
        return None
    snapshot_id = pointer.read_text().strip()
    path = store / SNAPSHOTS / snapshot_id
    try:
        manifest = json.loads((path / MANIFEST).read_text())
    except FileNotFoundError as exc:
        raise StoreError(f"{store}: CURRENT names snapshot {snapshot_id!r} but its manifest is missing") from exc
    return _info(path, manifest)


def read_snapshot(store: Path, snapshot_id: str) -> SnapshotInfo:
    """A published snapshot by id (StoreError when it is missing or has no manifest)."""
    path = Path(store) / SNAPSHOTS / snapshot_id
    try:
        manifest = json.loads((path / MANIFEST).read_text())
    except FileNotFoundError as exc:
        raise StoreError(f"{store}: snapshot {snapshot_id!r} has no manifest") from exc
    return _info(path, manifest)


def unpublished_conversations(con: duckdb.DuckDBPyConnection, store: Path) -> list[str]:
    """Conversations whose working-database build differs from what ``CURRENT`` publishes.

    A publish records each conversation's build (``memory_builds``) before it writes the
    snapshot; a build killed between the two leaves the working database ahead of readers,
    with a watermark that says "nothing changed". These conversations must be published again.
    """
    current = current_snapshot(store)
    published = current.conversations if current is not None else {}
    rows = con.execute("SELECT conversation_id, build_id FROM memory_builds ORDER BY conversation_id").fetchall()
    return [cid for cid, build_id in rows if published.get(cid) != build_id]


def list_snapshots(store: Path) -> list[str]:
    root = Path(store) / SNAPSHOTS
    if not root.exists():
        return []
    return sorted(p.name for p in root.iterdir() if p.is_dir() and not p.name.startswith("."))


def prune_snapshots(store: Path, keep: int = 3) -> list[str]:
    """Delete all but the newest ``keep`` snapshots (never the current one); return deleted ids.

    Readers that still hold an older snapshot open keep working on POSIX (open files survive
    unlinking); a reader opening a pruned snapshot by id gets a StoreError.
    """
    current = current_snapshot(store)
    names = list_snapshots(store)
    doomed = [n for n in names[:-keep] if keep > 0 and (current is None or n != current.snapshot_id)]
    for name in doomed:
        shutil.rmtree(Path(store) / SNAPSHOTS / name)
    if (Path(store) / SNAPSHOTS).exists():
        _remove_leftovers(Path(store) / SNAPSHOTS)
    return doomed

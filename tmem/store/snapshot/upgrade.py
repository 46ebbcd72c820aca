"""``tmem snapshot upgrade``: rewrite the current snapshot, published in an older format, in the current one.

Readers read the current format only (:mod:`tmem.store.snapshot.formats`) and refuse an older
snapshot with a message naming this command. The upgrade is the one path from each older format:
it derives a new snapshot from the current one alone (the builder's ``work.duckdb`` is not read,
so the upgraded snapshot publishes exactly what the old one did), as a forget's republish does:

1. every table of the old ``memory.duckdb`` but its image index, copied in conversation order;
2. the memory tables brought to the current schema: items gain their time columns (migration
   ``m007_item_time``, which snapshots of format 2 and older predate; the rows read as stated days,
   as rows built before it do in the working database);
3. the images written afresh in the current format (:func:`~tmem.store.snapshot.image.write_conversation_images`),
   with the vector rows of the Lance versions the old manifest pins (unless ``image_vectors`` is
   off) and the prebuilt BM25;
4. the old manifest with the new id, time and format (``derived_from`` names the old snapshot), then
   ``CURRENT`` flipped to it, exactly as a publish does (readers see the old snapshot or the new one).

The old snapshot stays on disk until pruned. The caller keeps builds out while it runs (the CLI
holds the working database open for writing, as a build does).
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from datetime import datetime
from pathlib import Path
from typing import Any

import duckdb

from tmem.errors import StoreError
from tmem.retrieval.lexical import BM25Section
from tmem.store.migrations import M007_ITEM_TIME
from tmem.store.snapshot.formats import IMAGE_FORMAT, MANIFEST_KEY, UPGRADE_COMMAND, format_name, require_current
from tmem.store.snapshot.image import IMAGE_TABLE, write_conversation_images
from tmem.store.snapshot.image_vectors import lance_source
from tmem.store.snapshot.published import (
    MANIFEST,
    MEMORY_DB,
    SnapshotInfo,
    commit_snapshot_dir,
    current_snapshot,
    snapshot_id_for,
    snapshot_tables,
    start_snapshot_dir,
)
from tmem.store.snapshot.reader import resolve_lance_uri


@dataclass(frozen=True)
class SnapshotUpgrade:
    """What :func:`upgrade_current_snapshot` did: ``upgraded`` is ``None`` when the current snapshot
    was already of the current format (nothing written)."""

    snapshot_id: str
    from_format: int | None
    upgraded: SnapshotInfo | None
    images: int = 0

    def as_dict(self) -> dict[str, Any]:
        return {"snapshot_id": self.snapshot_id, "from_format": self.from_format,
                "upgraded_to": None if self.upgraded is None else self.upgraded.snapshot_id,
                "format": IMAGE_FORMAT, "images": self.images}


def upgrade_current_snapshot(store: Path, *, now: datetime, image_vectors: bool = True) -> SnapshotUpgrade:
    """Rewrite the store's current snapshot in the current format and point ``CURRENT`` at the result
    (see the module doc). :class:`StoreError` when nothing is published, the snapshot is of a newer
    format, or its tables cannot be brought to the current schema."""
    store = Path(store)
    info = current_snapshot(store)
    if info is None:
        raise StoreError(f"{store}: no published snapshot to upgrade")
    if info.image_format == IMAGE_FORMAT:
        return SnapshotUpgrade(info.snapshot_id, info.image_format, None)
    if info.image_format is not None and info.image_format > IMAGE_FORMAT:
        require_current(info.path / MANIFEST, info.image_format, store=store)  # raises: a newer tmem wrote it
    snapshot_id = snapshot_id_for(now, info.conversations, info.lance_versions)
    tmp = start_snapshot_dir(store, snapshot_id)
    con = duckdb.connect(str(tmp / MEMORY_DB))
    try:
        con.execute("SET TimeZone = 'UTC'")
        con.execute("ATTACH ? AS old (READ_ONLY)", [str(info.memory_db)])
        for name, scoped in snapshot_tables(con, "old").items():
            if name != IMAGE_TABLE:
                order = " ORDER BY conversation_id" if scoped else ""
                con.execute(f'CREATE TABLE main."{name}" AS SELECT * FROM old."{name}"{order}')  # noqa: S608 -- names from the catalog
        con.execute("DETACH old")
        if not _has_column(con, "items", "event_end"):
            con.execute(M007_ITEM_TIME.sql)
        vectors = lance_source(resolve_lance_uri(info, store), info.lance_versions) if image_vectors else None
        images, _ = write_conversation_images(con, "main", tmp, vectors=vectors, lexical=BM25Section())
        con.execute("CHECKPOINT")
    except duckdb.Error as exc:
        raise StoreError(f"{info.memory_db}: cannot upgrade snapshot {info.snapshot_id!r} of format "
                         f"{format_name(info.image_format)} to format {IMAGE_FORMAT} ({exc}); publish a new "
                         "snapshot with `tmem build` instead") from exc
    finally:
        con.close()
    manifest: dict[str, Any] = json.loads((info.path / MANIFEST).read_text())
    manifest.update({"snapshot_id": snapshot_id, "created_at": now.isoformat(), MANIFEST_KEY: IMAGE_FORMAT,
                     "derived_from": info.snapshot_id, "derived_by": UPGRADE_COMMAND})
    return SnapshotUpgrade(info.snapshot_id, info.image_format, commit_snapshot_dir(store, tmp, manifest), images)


def _has_column(con: duckdb.DuckDBPyConnection, table: str, column: str) -> bool:
    row = con.execute(
        "SELECT count(*) FROM duckdb_columns() WHERE database_name = current_database() AND schema_name = 'main' "
        "AND table_name = ? AND column_name = ?", [table, column],
    ).fetchone()
    return bool(row and row[0])

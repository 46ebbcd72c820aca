"""Snapshots of an older format (tmem/store/snapshot/formats.py, upgrade.py).

Readers read the current format only. These tests make snapshots of each older format from a
current one, as those versions wrote them (format 2: items without the m007 time columns; format 1:
an image index without the section columns; none: no images at all), and prove that a reader, the
query API and a forget refuse them with a message naming the manifest, the format and the command
to run, that a newer format is refused too, and that ``tmem snapshot upgrade`` rewrites the current
snapshot in the current format: reads equal the original's (memory, turns, vector rows, searches),
``CURRENT`` follows, and running it again does nothing.
"""

from __future__ import annotations

import io
import json
import shutil
from datetime import timedelta
from pathlib import Path

import duckdb
import pytest

from tests.query_store import NOW, HashEmbedder, build_store, make_conv
from tests.test_query_memory import CRAFTED_IDS, settings_for
from tmem.cli import run
from tmem.cli.base import CliContext
from tmem.errors import ForgetError, StoreError
from tmem.query.memory import Memory
from tmem.store.forget import forget_conversation
from tmem.store.snapshot.formats import IMAGE_FORMAT, MANIFEST_KEY, UPGRADE_COMMAND
from tmem.store.snapshot.image import IMAGE_FILE, IMAGE_TABLE, image_locations
from tmem.store.snapshot.published import MANIFEST, SnapshotInfo, current_snapshot, list_snapshots
from tmem.store.snapshot.reader import SnapshotReader
from tmem.store.snapshot.upgrade import upgrade_current_snapshot

DIM = 32
OLD_FORMATS = [None, 1, 2]
ITEM_TIME_COLUMNS = ("event_end", "time_granularity", "time_phrase", "time_source")


@pytest.fixture(scope="module")
def published(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, SnapshotInfo]:
    store = tmp_path_factory.mktemp("upgrade") / "store"
    convs = [make_conv(cid, mark=f"up{n}q", scenes=3 + n % 2, items_per_scene=2) for n, cid in enumerate(CRAFTED_IDS[:5])]
    return store, build_store(store, convs, HashEmbedder(DIM))


def _as_format(src: Path, dst: Path, fmt: int | None) -> SnapshotInfo:
    """A copy of the store whose current snapshot is laid out as format ``fmt`` was written."""
    shutil.copytree(src, dst)
    info = current_snapshot(dst)
    assert info is not None
    manifest = json.loads((info.path / MANIFEST).read_text())
    if fmt is None:
        manifest.pop(MANIFEST_KEY)
    else:
        manifest[MANIFEST_KEY] = fmt
    (info.path / MANIFEST).write_text(json.dumps(manifest))
    con = duckdb.connect(str(info.memory_db))
    try:
        if fmt is None:
            con.execute(f"DROP TABLE {IMAGE_TABLE}")
        elif fmt == 1:
            con.execute(f"ALTER TABLE {IMAGE_TABLE} DROP COLUMN vector_bytes")
            con.execute(f"ALTER TABLE {IMAGE_TABLE} DROP COLUMN lexical_bytes")
        if fmt is not None:
            con.execute(f"UPDATE {IMAGE_TABLE} SET format = ?", [fmt])
        if fmt is None or fmt <= 2:  # before m007 the snapshot's items had no time columns
            for column in ITEM_TIME_COLUMNS:
                con.execute(f"ALTER TABLE items DROP COLUMN {column}")
    finally:
        con.close()
    if fmt is None:
        (info.path / IMAGE_FILE).unlink()
    old = current_snapshot(dst)
    assert old is not None and old.image_format == fmt
    return old


@pytest.mark.parametrize("fmt", OLD_FORMATS)
def test_a_snapshot_of_an_older_format_is_refused_naming_its_manifest_format_and_the_upgrade(
    published: tuple[Path, SnapshotInfo], tmp_path: Path, fmt: int | None
) -> None:
    store = tmp_path / "store"
    old = _as_format(published[0], store, fmt)
    with pytest.raises(StoreError) as refused:
        SnapshotReader(old, store)
    message = str(refused.value)
    assert str(old.path / MANIFEST) in message
    assert f"image format {'none' if fmt is None else fmt}" in message
    assert f"`{UPGRADE_COMMAND} --store {store}`" in message
    with pytest.raises(StoreError, match=UPGRADE_COMMAND):
        Memory.open(store, settings_for(store)).search("pottery", conversation_id=CRAFTED_IDS[0], embed=False)


def test_a_snapshot_of_a_newer_format_is_refused_and_not_upgraded(published: tuple[Path, SnapshotInfo], tmp_path: Path) -> None:
    store = tmp_path / "store"
    newer = _as_format(published[0], store, IMAGE_FORMAT + 1)
    with pytest.raises(StoreError, match=f"image format {IMAGE_FORMAT + 1}.*newer tmem"):
        SnapshotReader(newer, store)
    with pytest.raises(StoreError, match="newer tmem"):
        upgrade_current_snapshot(store, now=NOW)
    assert list_snapshots(store) == [newer.snapshot_id]  # nothing written


@pytest.mark.parametrize("fmt", OLD_FORMATS)
def test_the_upgrade_rewrites_the_current_snapshot_in_the_current_format(
    published: tuple[Path, SnapshotInfo], tmp_path: Path, fmt: int | None
) -> None:
    original_store, original = published
    store = tmp_path / "store"
    old = _as_format(original_store, store, fmt)
    done = upgrade_current_snapshot(store, now=NOW + timedelta(days=1))
    assert done.snapshot_id == old.snapshot_id and done.from_format == fmt and done.upgraded is not None
    new = current_snapshot(store)
    assert new is not None and new.snapshot_id == done.upgraded.snapshot_id != old.snapshot_id
    assert new.image_format == IMAGE_FORMAT
    assert new.conversations == old.conversations and new.lance_versions == old.lance_versions
    assert json.loads((new.path / MANIFEST).read_text())["derived_from"] == old.snapshot_id
    assert sorted(list_snapshots(store)) == sorted([old.snapshot_id, new.snapshot_id])  # the old one stays until pruned
    con = duckdb.connect(str(new.memory_db), read_only=True)
    try:
        where = image_locations(con)
        columns = {r[0] for r in con.execute("DESCRIBE items").fetchall()}
    finally:
        con.close()
    assert sorted(where) == sorted(original.conversations) and done.images == len(where)
    assert all(loc.format == IMAGE_FORMAT and loc.vector_bytes > 0 and loc.lexical_bytes > 0 for loc in where.values())
    assert set(ITEM_TIME_COLUMNS) <= columns
    upgraded, before = SnapshotReader(new, store), SnapshotReader(original, original_store)
    for cid in original.conversations:
        assert upgraded.read_conversation(cid) == before.read_conversation(cid)
        assert upgraded.read_conversation(cid, from_tables=True) == before.read_conversation(cid)
        cold, want = upgraded.read_cold(cid), before.read_cold(cid)
        assert cold.vectors is not None and want.vectors is not None and len(cold.vectors) > 0
        assert cold.vectors.owner_ids == want.vectors.owner_ids and (cold.vectors.vectors == want.vectors.vectors).all()
        assert cold.bm25 is not None
    cid = CRAFTED_IDS[1]
    got = Memory.open(store, settings_for(store)).search("up1q pottery", conversation_id=cid, embed=False)
    expected = Memory.open(original_store, settings_for(original_store)).search("up1q pottery", conversation_id=cid, embed=False)
    assert got.items and [i.item_id for i in got.items] == [i.item_id for i in expected.items]
    again = upgrade_current_snapshot(store, now=NOW + timedelta(days=2))
    assert again.upgraded is None and again.snapshot_id == new.snapshot_id  # current already: nothing written


def test_an_upgrade_without_image_vectors_leaves_the_vectors_in_lance(published: tuple[Path, SnapshotInfo], tmp_path: Path) -> None:
    """``TMEM_SNAPSHOT_IMAGE_VECTORS=false`` is a choice within the current format: images without a
    vector section, whose cold loads read LanceDB at the pinned version and give the same rows."""
    original_store, original = published
    store = tmp_path / "store"
    _as_format(original_store, store, 1)
    done = upgrade_current_snapshot(store, now=NOW + timedelta(days=1), image_vectors=False)
    assert done.upgraded is not None
    con = duckdb.connect(str(done.upgraded.memory_db), read_only=True)
    try:
        assert {loc.vector_bytes for loc in image_locations(con).values()} == {0}
    finally:
        con.close()
    reader, before = SnapshotReader(done.upgraded, store), SnapshotReader(original, original_store)
    for cid in original.conversations:
        cold, want = reader.read_cold(cid), before.read_cold(cid)
        assert cold.vectors is not None and want.vectors is not None and len(cold.vectors) == len(want.vectors) > 0
        assert cold.vectors.owner_ids == want.vectors.owner_ids and (cold.vectors.vectors == want.vectors.vectors).all()


def test_tmem_snapshot_upgrade_from_the_command_line(published: tuple[Path, SnapshotInfo], tmp_path: Path) -> None:
    store = tmp_path / "store"
    old = _as_format(published[0], store, 2)
    out, err = io.StringIO(), io.StringIO()
    ctx = CliContext(stdout=out, stderr=err, clock=lambda: NOW + timedelta(days=1),
                     settings_loader=lambda: settings_for(store))
    assert run(["snapshot", "upgrade", "--store", str(store), "--json"], ctx) == 0, err.getvalue()
    report = json.loads(out.getvalue())
    current = current_snapshot(store)
    assert current is not None and report == {"snapshot_id": old.snapshot_id, "from_format": 2,
                                              "upgraded_to": current.snapshot_id, "format": IMAGE_FORMAT,
                                              "images": len(old.conversations)}
    out.truncate(0)
    out.seek(0)
    assert run(["snapshot", "upgrade", "--store", str(store)], ctx) == 0
    assert "nothing to do" in out.getvalue()
    empty = tmp_path / "empty"
    empty.mkdir()
    assert run(["snapshot", "upgrade", "--store", str(empty)], ctx) == 2
    assert "no published snapshot" in err.getvalue()


def test_a_forget_refuses_an_older_format_snapshot_before_removing_anything(
    published: tuple[Path, SnapshotInfo], tmp_path: Path
) -> None:
    store = tmp_path / "store"
    old = _as_format(published[0], store, 1)
    cid = CRAFTED_IDS[2]
    lance = str(store / "lance")
    with pytest.raises(ForgetError, match=f"image format 1.*{UPGRADE_COMMAND}.*nothing was removed"):
        forget_conversation(store, cid, now=NOW + timedelta(days=1), lance_uri=lance, unowned="keep")
    assert current_snapshot(store) == old and cid in old.conversations
    upgrade_current_snapshot(store, now=NOW + timedelta(days=1))
    report = forget_conversation(store, cid, now=NOW + timedelta(days=2), lance_uri=lance, unowned="keep")
    current = current_snapshot(store)
    assert current is not None and cid not in current.conversations and report["steps"]["snapshot"]["republished"]

"""Per-conversation images in published snapshots (tmem/store/snapshot/image.py).

The image is derived from the snapshot's tables at publish time; these tests prove that reading it
gives exactly what the table reads give and that an image never holds another conversation's rows
(crafted ids). Snapshots of older formats are refused or upgraded: tests/test_snapshot_upgrade.py.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import duckdb
import pytest

from tests.query_store import HashEmbedder, build_store, make_conv
from tests.test_query_memory import CRAFTED_IDS, settings_for
from tmem.errors import StoreError
from tmem.query.loader import load_index
from tmem.query.memory import Memory
from tmem.retrieval.lexical import BM25Section
from tmem.store.snapshot.formats import IMAGE_FORMAT
from tmem.store.snapshot.image import (
    IMAGE_FILE,
    IMAGE_TABLE,
    ImageLocation,
    decode_image,
    image_location,
    image_sql,
    read_image,
    write_conversation_images,
)
from tmem.store.snapshot.image_vectors import lance_source
from tmem.store.snapshot.published import SnapshotInfo, current_snapshot
from tmem.store.snapshot.reader import SnapshotReader

MARKS = {cid: f"mark{chr(65 + n)}q" for n, cid in enumerate(CRAFTED_IDS)}  # no mark contains another


@pytest.fixture(scope="module")
def published(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, SnapshotInfo]:
    store = tmp_path_factory.mktemp("images") / "store"
    convs = [make_conv(cid, mark=MARKS[cid], scenes=5 + n % 3, items_per_scene=2 + n % 2) for n, cid in enumerate(CRAFTED_IDS)]
    info = build_store(store, convs, HashEmbedder())
    return store, info


def _copy_store(src: Path, dst: Path) -> SnapshotInfo:
    shutil.copytree(src, dst)
    info = current_snapshot(dst)
    assert info is not None
    return info


def test_publish_writes_one_image_per_conversation(published: tuple[Path, SnapshotInfo]) -> None:
    _, info = published
    assert info.image_format == IMAGE_FORMAT
    con = duckdb.connect(str(info.memory_db), read_only=True)
    try:
        rows = con.execute(f"SELECT conversation_id, format FROM {IMAGE_TABLE}").fetchall()
    finally:
        con.close()
    assert sorted(rows) == sorted((cid, IMAGE_FORMAT) for cid in CRAFTED_IDS)


@pytest.mark.parametrize("cid", CRAFTED_IDS)
def test_image_read_equals_the_table_read(published: tuple[Path, SnapshotInfo], cid: str) -> None:
    store, info = published
    reader = SnapshotReader(info, store)
    memory, turns = reader.read_conversation(cid)
    table_memory, table_turns = reader.read_conversation(cid, from_tables=True)
    assert memory == table_memory
    assert turns == table_turns
    # the comparison is not vacuous: every part of the memory is there, including absent event times
    assert memory.scenes and memory.topics and memory.items and memory.item_triggers and memory.scene_triggers
    assert len(memory.personas) == 2 and turns
    assert any(it.event_time is None for it in memory.items) and any(it.event_time for it in memory.items)
    assert all(s.start_time.utcoffset() is not None for s in memory.scenes)


@pytest.mark.parametrize("cid", CRAFTED_IDS)
def test_an_image_holds_only_its_conversation(published: tuple[Path, SnapshotInfo], cid: str) -> None:
    _, info = published
    con = duckdb.connect(str(info.memory_db), read_only=True)
    try:
        found = read_image(con, info.path, cid)
        counts = {
            name: con.execute(f"SELECT count(*) FROM {name} WHERE conversation_id = ?", [cid]).fetchone()
            for name in ("scenes", "topics", "items", "item_scene", "item_triggers", "scene_triggers", "personas", "turns")
        }
    finally:
        con.close()
    assert found is not None
    fmt, image = found
    doc = json.loads(image)
    assert doc["conversation_id"] == cid and fmt == doc["format"] == IMAGE_FORMAT
    assert {name: len(doc[name]) for name in counts} == {name: c[0] for name, c in counts.items() if c}
    assert MARKS[cid] in image
    assert [m for other, m in MARKS.items() if other != cid and m in image] == []


def test_an_index_loaded_from_the_image_answers_like_one_from_the_tables(published: tuple[Path, SnapshotInfo]) -> None:
    store, info = published
    cid = CRAFTED_IDS[1]
    index, _ = load_index(SnapshotReader(info, store), cid)
    assert index.items.ids and index.scenes.turns[0]
    mem = Memory.open(store, settings_for(store))
    hit = mem.search(f"{MARKS[cid]} pottery", conversation_id=cid, embed=False)
    assert hit.items and {index.items.contents[index.item_pos[i.item_id]] for i in hit.items} <= set(index.items.contents)


def test_a_missing_image_row_is_a_store_error(published: tuple[Path, SnapshotInfo], tmp_path: Path) -> None:
    store, _ = published
    info = _copy_store(store, tmp_path / "store")
    con = duckdb.connect(str(info.memory_db))
    con.execute(f"DELETE FROM {IMAGE_TABLE} WHERE conversation_id = ?", [CRAFTED_IDS[0]])
    con.close()
    reader = SnapshotReader(info, tmp_path / "store")
    with pytest.raises(StoreError, match="image row is missing"):
        reader.read_conversation(CRAFTED_IDS[0])
    assert reader.read_conversation(CRAFTED_IDS[3])[0].items  # the others still read


def _image_of(info: SnapshotInfo, conversation_id: str) -> tuple[int, str] | None:
    """(format, document) of one conversation's image in a published snapshot, or None."""
    con = duckdb.connect(str(info.memory_db), read_only=True)
    try:
        return read_image(con, info.path, conversation_id)
    finally:
        con.close()


def test_decoding_rejects_another_conversations_image_a_wrong_format_and_garbage(
    published: tuple[Path, SnapshotInfo],
) -> None:
    _, info = published
    assert _image_of(info, "conv-a' OR '1'='1") is None
    found = _image_of(info, CRAFTED_IDS[1])
    assert found is not None
    fmt, image = found
    with pytest.raises(StoreError, match="belongs to"):
        decode_image(CRAFTED_IDS[0], fmt, image, source="snap.duckdb")
    with pytest.raises(StoreError, match="format 7"):
        decode_image(CRAFTED_IDS[1], 7, image)
    with pytest.raises(StoreError, match="not JSON"):
        decode_image(CRAFTED_IDS[1], fmt, image[:-5])
    broken = json.loads(image)
    del broken["items"]
    with pytest.raises(StoreError, match="malformed"):
        decode_image(CRAFTED_IDS[1], fmt, json.dumps(broken))


def test_a_memory_only_decode_gives_the_same_memory_and_leaves_the_turns_alone(
    published: tuple[Path, SnapshotInfo],
) -> None:
    """What a publish decodes to index a memory (``turns=False``): the same memory, no turns parsed."""
    found = _image_of(published[1], CRAFTED_IDS[1])
    assert found is not None
    fmt, image = found
    memory, turns = decode_image(CRAFTED_IDS[1], fmt, image)
    assert turns and memory.items
    assert decode_image(CRAFTED_IDS[1], fmt, image, turns=False) == (memory, ())
    broken = json.loads(image)
    broken["turns"] = [["not", "a", "turn"]]  # only a decode that reads the turns notices
    assert decode_image(CRAFTED_IDS[1], fmt, json.dumps(broken), turns=False) == (memory, ())
    with pytest.raises(StoreError, match="malformed"):
        decode_image(CRAFTED_IDS[1], fmt, json.dumps(broken))


def test_images_written_in_small_batches_equal_the_published_ones(
    published: tuple[Path, SnapshotInfo], tmp_path: Path
) -> None:
    store, _ = published
    info = _copy_store(store, tmp_path / "store")
    again = tmp_path / "again"
    again.mkdir()
    con = duckdb.connect(str(info.memory_db))
    try:
        whole = {cid: read_image(con, info.path, cid) for cid in CRAFTED_IDS}
        con.execute(f"DROP TABLE {IMAGE_TABLE}")
        assert write_conversation_images(con, "main", again, batch=4) == (len(CRAFTED_IDS), 0)
        assert {cid: read_image(con, again, cid) for cid in CRAFTED_IDS} == whole
    finally:
        con.close()
    with pytest.raises(ValueError, match="identifier"):
        image_sql("main; DROP TABLE scenes")


def test_a_damaged_image_file_is_a_store_error(published: tuple[Path, SnapshotInfo], tmp_path: Path) -> None:
    store, _ = published
    info = _copy_store(store, tmp_path / "store")
    path = info.path / IMAGE_FILE
    data = bytearray(path.read_bytes())
    path.write_bytes(bytes(data[: len(data) // 2]))  # cut short: the last conversations' images are gone
    last = max(CRAFTED_IDS, key=lambda cid: _location(info, cid)[1])
    with pytest.raises(StoreError, match="cut short"):
        SnapshotReader(info, tmp_path / "store").read_conversation(last)
    offset = _location(info, CRAFTED_IDS[0])[1]
    data[offset : offset + 8] = b"\xff" * 8
    path.write_bytes(bytes(data))
    with pytest.raises(StoreError, match="corrupt"):
        SnapshotReader(info, tmp_path / "store").read_conversation(CRAFTED_IDS[0])
    path.unlink()
    with pytest.raises(StoreError, match="cannot open the conversation images"):
        SnapshotReader(info, tmp_path / "store").read_conversation(CRAFTED_IDS[0])


def test_a_reader_keeps_reading_a_snapshot_pruned_under_it(published: tuple[Path, SnapshotInfo], tmp_path: Path) -> None:
    store, _ = published
    info = _copy_store(store, tmp_path / "store")
    reader = SnapshotReader(info, tmp_path / "store")
    first = reader.read_conversation(CRAFTED_IDS[0])
    shutil.rmtree(info.path)  # open files survive unlinking (POSIX), like the DuckDB file
    assert reader.read_conversation(CRAFTED_IDS[4])[0].items
    assert reader.read_conversation(CRAFTED_IDS[0]) == first


def _location(info: SnapshotInfo, cid: str) -> ImageLocation:
    con = duckdb.connect(str(info.memory_db), read_only=True)
    try:
        where = image_location(con, cid)
    finally:
        con.close()
    assert where is not None
    return where


def test_a_publish_copies_unchanged_images_and_recomputes_changed_ones(
    published: tuple[Path, SnapshotInfo], tmp_path: Path
) -> None:
    """Images are keyed by what they derive from (build, turns, conversation row, Lance rows): a
    republish after one conversation was rebuilt and another gained a turn copies every other image
    from the last snapshot, and the result equals images computed from scratch."""
    store, _ = published
    info = _copy_store(store, tmp_path / "store")
    vectors = lance_source(info.lance_uri, info.lance_versions)
    rebuilt, grown = CRAFTED_IDS[0], CRAFTED_IDS[3]
    previous = tmp_path / "previous"
    shutil.copytree(info.path, previous)
    con = duckdb.connect(str(info.memory_db))
    try:
        con.execute("UPDATE scenes SET title = 'retitled' WHERE conversation_id = ? AND seq = 0", [rebuilt])
        con.execute("UPDATE memory_builds SET build_id = 'rebuilt' WHERE conversation_id = ?", [rebuilt])
        con.execute(
            "INSERT INTO turns SELECT * REPLACE (seq + 1000 AS seq, turn_id || '-late' AS turn_id) FROM turns "
            "WHERE conversation_id = ? ORDER BY seq DESC LIMIT 1", [grown],
        )
        con.execute(f"DROP TABLE {IMAGE_TABLE}")
        incremental, fresh = tmp_path / "incremental", tmp_path / "fresh"
        incremental.mkdir()
        fresh.mkdir()
        assert write_conversation_images(con, "main", incremental, batch=3, previous=previous, vectors=vectors, lexical=BM25Section()) == (
            len(CRAFTED_IDS), len(CRAFTED_IDS) - 2)
        copied = {cid: read_image(con, incremental, cid) for cid in CRAFTED_IDS}
        con.execute(f"DROP TABLE {IMAGE_TABLE}")
        assert write_conversation_images(con, "main", fresh, previous=None, vectors=vectors, lexical=BM25Section()) == (len(CRAFTED_IDS), 0)
        assert {cid: read_image(con, fresh, cid) for cid in CRAFTED_IDS} == copied
    finally:
        con.close()
    assert '"retitled"' in str(copied[rebuilt]) and "-late" in str(copied[grown])

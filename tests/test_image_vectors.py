"""Vector sections of conversation images (tmem/store/snapshot/image_vectors.py).

A publish copies each conversation's rows of the pinned Lance vector table into its image. These
tests prove the section equals the Lance read of the same conversation (crafted ids included), that
searches over an index loaded from the image equal searches over one loaded through Lance, that a
damaged or misplaced section is a StoreError, that images published without a vector section
(``TMEM_SNAPSHOT_IMAGE_VECTORS=false``) are read with vectors from Lance and search alike, and that
a publish reuses an image only while the conversation's Lance rows are unchanged.
"""

from __future__ import annotations

import json
import shutil
from datetime import timedelta
from pathlib import Path

import duckdb
import numpy as np
import pytest

from tests.query_store import NOW, THEMES, HashEmbedder, build_store, make_conv
from tests.test_query_memory import CRAFTED_IDS, settings_for
from tmem.errors import StoreError
from tmem.query.loader import load_index
from tmem.retrieval.cascade import search
from tmem.retrieval.config import config_from_settings
from tmem.retrieval.lexical import BM25Section
from tmem.store.duck import connect
from tmem.store.lance import VectorStore
from tmem.store.snapshot.formats import IMAGE_FORMAT
from tmem.store.snapshot.image import IMAGE_FILE, IMAGE_TABLE, image_locations, write_conversation_images
from tmem.store.snapshot.image_vectors import VectorSection, decode_section, encode_section, lance_source
from tmem.store.snapshot.published import MANIFEST, SnapshotInfo, current_snapshot, publish_snapshot
from tmem.store.snapshot.reader import SnapshotReader

DIM = 64


@pytest.fixture(scope="module")
def published(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, SnapshotInfo]:
    store = tmp_path_factory.mktemp("image-vectors") / "store"
    convs = [make_conv(cid, mark=f"own{n}x", scenes=4 + n % 3, items_per_scene=2) for n, cid in enumerate(CRAFTED_IDS)]
    return store, build_store(store, convs, HashEmbedder(DIM))


def _copy(src: Path, dst: Path) -> SnapshotInfo:
    shutil.copytree(src, dst)
    info = current_snapshot(dst)
    assert info is not None
    return info


def _assert_same_rows(a: VectorSection | None, b: VectorSection | None) -> None:
    assert a is not None and b is not None
    assert (a.owner_kinds, a.owner_ids, a.views, a.ordinals) == (b.owner_kinds, b.owner_ids, b.views, b.ordinals)
    assert a.vectors.dtype == b.vectors.dtype == np.float32
    assert np.array_equal(a.vectors, b.vectors)


@pytest.mark.parametrize("cid", CRAFTED_IDS)
def test_the_image_section_equals_the_lance_read(published: tuple[Path, SnapshotInfo], cid: str) -> None:
    store, info = published
    assert info.image_format == IMAGE_FORMAT
    reader = SnapshotReader(info, store)
    from_image = reader.read_vector_rows(cid)
    from_lance = reader.read_vector_rows(cid, from_lance=True)
    _assert_same_rows(from_image, from_lance)
    assert from_image is not None and len(from_image) > 20  # not vacuous: every view of the memory is there
    memory, _ = reader.read_conversation(cid)
    owners = {s.scene_id for s in memory.scenes} | {t.topic_id for t in memory.topics} | {i.item_id for i in memory.items}
    assert set(from_image.owner_ids) <= owners  # only this conversation's owners
    cold = reader.read_cold(cid)
    _assert_same_rows(cold.vectors, from_lance)
    assert cold.memory == memory


def test_every_image_has_a_section_of_its_own_conversation(published: tuple[Path, SnapshotInfo]) -> None:
    _, info = published
    con = duckdb.connect(str(info.memory_db), read_only=True)
    try:
        where = image_locations(con)
    finally:
        con.close()
    data = (info.path / IMAGE_FILE).read_bytes()
    assert sorted(where) == sorted(CRAFTED_IDS)
    for cid, loc in where.items():
        assert loc.vector_bytes > 0
        start = loc.byte_offset + loc.byte_length
        section = decode_section(data[start : start + loc.vector_bytes], cid, "vectors", source="t")
        assert section.conversation_id == cid and section.vectors.shape[1] == DIM
        with pytest.raises(StoreError, match="belongs to"):
            other = CRAFTED_IDS[(CRAFTED_IDS.index(cid) + 1) % len(CRAFTED_IDS)]
            decode_section(data[start : start + loc.vector_bytes], other, "vectors", source="t")


def test_searches_over_image_and_lance_loads_are_identical(published: tuple[Path, SnapshotInfo], tmp_path: Path) -> None:
    """The same snapshot read twice: once with its vector sections, once with images written
    without them (as ``TMEM_SNAPSHOT_IMAGE_VECTORS=false`` publishes), whose vectors come from Lance."""
    store, _ = published
    info = _copy(store, tmp_path / "store")
    manifest = json.loads((info.path / MANIFEST).read_text())
    old_dir = tmp_path / "store" / "snapshots" / "old"
    shutil.copytree(info.path, old_dir)
    (old_dir / MANIFEST).write_text(json.dumps(manifest | {"snapshot_id": "old"}))
    con = duckdb.connect(str(old_dir / "memory.duckdb"))
    con.execute(f"DROP TABLE {IMAGE_TABLE}")
    write_conversation_images(con, "main", old_dir, lexical=BM25Section())
    assert {r[0] for r in con.execute(f"SELECT vector_bytes FROM {IMAGE_TABLE}").fetchall()} == {0}
    con.close()
    from tmem.store.snapshot.published import read_snapshot

    old = SnapshotReader(read_snapshot(tmp_path / "store", "old"), tmp_path / "store")
    new = SnapshotReader(info, tmp_path / "store")
    config = config_from_settings(settings_for(tmp_path / "store"), "default")
    embedder = HashEmbedder(DIM)
    compared = 0
    for n, cid in enumerate(CRAFTED_IDS[:6]):
        new_index, new_timing = load_index(new, cid)
        old_index, old_timing = load_index(old, cid)
        assert new_timing.vector_rows == old_timing.vector_rows > 0
        for theme in THEMES[:4]:
            query = f"{theme[0]} {theme[2]} own{n}x"
            vector = embedder.embed([query])[0]
            got = search(new_index, query, vector, config, trace=True)
            want = search(old_index, query, vector, config, trace=True)
            assert got == want
            compared += len(got.items) + len(got.scenes)
    assert compared > 50  # the results compared are not empty


def test_a_damaged_vector_section_is_a_store_error(published: tuple[Path, SnapshotInfo], tmp_path: Path) -> None:
    store, _ = published
    info = _copy(store, tmp_path / "store")
    con = duckdb.connect(str(info.memory_db), read_only=True)
    where = image_locations(con)
    con.close()
    path = info.path / IMAGE_FILE
    pristine = path.read_bytes()
    first, second = CRAFTED_IDS[0], CRAFTED_IDS[1]
    loc = where[first]
    start = loc.byte_offset + loc.byte_length

    def fails(data: bytes, cid: str, match: str) -> None:
        path.write_bytes(data)
        with pytest.raises(StoreError, match=match):
            SnapshotReader(info, tmp_path / "store").read_cold(cid)

    damaged = bytearray(pristine)
    damaged[start + 4 : start + 12] = b"\xff" * 8  # inside the header
    fails(bytes(damaged), first, "corrupt")
    damaged = bytearray(pristine)
    damaged[start : start + 4] = (10**6).to_bytes(4, "little")  # header length past the section
    fails(bytes(damaged), first, "corrupt|malformed|vector bytes")
    last = max(where, key=lambda c: where[c].byte_offset)
    cut = where[last].byte_offset + where[last].byte_length + where[last].vector_bytes // 2
    fails(pristine[:cut], last, "cut short")
    # another conversation's section placed after this conversation's document
    other = where[second]
    other_start = other.byte_offset + other.byte_length
    path.write_bytes(pristine[:start] + pristine[other_start : other_start + other.vector_bytes])
    con = duckdb.connect(str(info.memory_db))
    con.execute(f"UPDATE {IMAGE_TABLE} SET vector_bytes = ? WHERE conversation_id = ?", [other.vector_bytes, first])
    con.close()
    with pytest.raises(StoreError, match="belongs to"):
        SnapshotReader(info, tmp_path / "store").read_cold(first)


def test_sections_round_trip_and_reject_bad_lengths() -> None:
    rng = np.random.default_rng(3)
    section = VectorSection("c' OR 1=1", "vectors", ("item", "scene"), ("i1", "s1"), ("con", "hor"), (0, 2),
                            rng.standard_normal((2, 5)).astype(np.float32))
    data = encode_section(section)
    back = decode_section(data, "c' OR 1=1", "vectors", source="t")
    _assert_same_rows(back, section)
    with pytest.raises(StoreError, match="vector bytes"):
        decode_section(data[:-4], "c' OR 1=1", "vectors", source="t")
    with pytest.raises(StoreError, match="table"):
        decode_section(data, "c' OR 1=1", "other", source="t")
    with pytest.raises(StoreError, match="cut short"):
        decode_section(data[:2], "c' OR 1=1", "vectors", source="t")
    empty = VectorSection("c", "vectors", (), (), (), (), np.zeros((0, 5), np.float32))
    assert len(decode_section(encode_section(empty), "c", "vectors", source="t")) == 0


def test_a_publish_reuses_images_only_while_their_lance_rows_are_unchanged(
    published: tuple[Path, SnapshotInfo], tmp_path: Path
) -> None:
    store, _ = published
    info = _copy(store, tmp_path / "store")
    lance = str(tmp_path / "store" / "lance")
    vectors = VectorStore(lance, DIM)
    changed = CRAFTED_IDS[2]
    rows = vectors.load_conversation("vectors", changed, version=info.lance_versions["vectors"])
    from tmem.store.lance import VectorRow

    new_rows = [VectorRow(changed, m["owner_kind"], m["owner_id"], m["view"], int(m["ordinal"]), m["text"], -v)
                for m, v in zip(rows.meta.to_pylist(), rows.vectors, strict=True)]
    version = vectors.replace_conversation("vectors", changed, new_rows)  # same row ids, new values
    source = lance_source(lance, {"vectors": version})
    assert source is not None
    previous = tmp_path / "previous"
    shutil.copytree(info.path, previous)
    con = duckdb.connect(str(info.memory_db))
    try:
        con.execute(f"DROP TABLE {IMAGE_TABLE}")
        out = tmp_path / "incremental"
        out.mkdir()
        assert write_conversation_images(con, "main", out, batch=4, previous=previous, vectors=source, lexical=BM25Section()) == (
            len(CRAFTED_IDS), len(CRAFTED_IDS) - 1)
        incremental = image_locations(con)
        con.execute(f"DROP TABLE {IMAGE_TABLE}")
        fresh = tmp_path / "fresh"
        fresh.mkdir()
        assert write_conversation_images(con, "main", fresh, vectors=source, lexical=BM25Section()) == (len(CRAFTED_IDS), 0)
        assert image_locations(con) == incremental
        con.execute(f"DROP TABLE {IMAGE_TABLE}")
        lexical = tmp_path / "lexical"
        lexical.mkdir()  # without a source nothing is reused: the old keys include the vectors
        assert write_conversation_images(con, "main", lexical, previous=previous) == (len(CRAFTED_IDS), 0)
        assert all(loc.vector_bytes == 0 for loc in image_locations(con).values())
    finally:
        con.close()
    assert (fresh / IMAGE_FILE).read_bytes() == (out / IMAGE_FILE).read_bytes()
    loc = incremental[changed]
    data = (out / IMAGE_FILE).read_bytes()[loc.byte_offset + loc.byte_length : loc.byte_offset + loc.byte_length + loc.vector_bytes]
    section = decode_section(data, changed, "vectors", source="t")
    assert np.array_equal(section.vectors, -rows.vectors)


def test_a_publish_without_the_vector_table_writes_no_sections_and_no_directory(
    published: tuple[Path, SnapshotInfo], tmp_path: Path
) -> None:
    store, _ = published
    _copy(store, tmp_path / "store")
    missing = tmp_path / "no-lance"
    con = connect(tmp_path / "store")
    try:
        info = publish_snapshot(con, tmp_path / "store", lance_uri=str(missing), lance_versions={"vectors": 3},
                                now=NOW + timedelta(days=1))
    finally:
        con.close()
    assert not missing.exists()
    db = duckdb.connect(str(info.memory_db), read_only=True)
    try:
        where = image_locations(db)
    finally:
        db.close()
    assert sorted(where) == sorted(CRAFTED_IDS)
    assert all(loc.vector_bytes == 0 and loc.lexical_bytes > 0 for loc in where.values())
    cold = SnapshotReader(info, tmp_path / "store").read_cold(CRAFTED_IDS[0], vectors=False)
    assert cold.vectors is None and cold.bm25 is not None and cold.memory.items


def test_a_publish_with_image_vectors_off_reads_cold_vectors_from_lance(
    published: tuple[Path, SnapshotInfo], tmp_path: Path
) -> None:
    """TMEM_SNAPSHOT_IMAGE_VECTORS=false: images carry no vector section (smaller snapshot) and a
    cold load reads the same rows from the Lance version the snapshot pins."""
    store, before = published
    _copy(store, tmp_path / "store")
    con = connect(tmp_path / "store")
    try:
        info = publish_snapshot(con, tmp_path / "store", lance_uri=str(tmp_path / "store" / "lance"),
                                lance_versions=before.lance_versions, now=NOW + timedelta(days=2), image_vectors=False)
    finally:
        con.close()
    assert (info.path / IMAGE_FILE).stat().st_size < (before.path / IMAGE_FILE).stat().st_size
    db = duckdb.connect(str(info.memory_db), read_only=True)
    try:
        where = image_locations(db)
    finally:
        db.close()
    assert all(loc.vector_bytes == 0 and loc.lexical_bytes > 0 for loc in where.values())
    off = SnapshotReader(info, tmp_path / "store")
    on = SnapshotReader(before, store)
    for cid in CRAFTED_IDS[:4]:
        cold = off.read_cold(cid)
        _assert_same_rows(cold.vectors, on.read_cold(cid).vectors)
        assert cold.bm25 is not None

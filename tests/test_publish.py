"""The publisher (tmem/build/publish.py) writes what changed: a rebuilt conversation whose memory and
vectors are the ones published is not written again, yet every publish makes a whole new snapshot;
a conversation whose build id changed (its memory, or the embedding of its views) is rewritten."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import numpy.typing as npt
import pytest

from tests.fakes import FakeChatModel
from tests.flow_helpers import ingest_slice
from tests.query_store import HashEmbedder
from tmem.build.conversation import build_conversation
from tmem.build.publish import build_id_of, publish_builds, ready_to_publish
from tmem.build.runtime import BuildRuntime
from tmem.build.spec import BuildSpec, build_fingerprint
from tmem.errors import StoreError
from tmem.settings import load_settings
from tmem.store.duck import connect
from tmem.store.lance import VectorStore
from tmem.store.memory_image import diff_images, memory_image
from tmem.store.snapshot.published import current_snapshot
from tmem.store.stage_cache import StageCache

IDS = ("conv-26", "conv-30")


class RenamedEmbedder(HashEmbedder):
    """The same vectors under another model name."""

    @property
    def model_name(self) -> str:
        return "hash-renamed"


class OtherModelEmbedder(HashEmbedder):
    """Other vectors under another model name (as if TMEM_EMBEDDING_MODEL changed)."""

    @property
    def model_name(self) -> str:
        return "hash-other"

    def embed(self, texts: list[str]) -> npt.NDArray[np.float32]:
        return np.ascontiguousarray(-super().embed(texts))


def runtime(store: Path, run_id: str, embedder: HashEmbedder) -> BuildRuntime:
    settings = load_settings(store=store)
    chat = FakeChatModel()
    return BuildRuntime(spec=BuildSpec.resolve(store, settings), settings=settings, run_id=run_id, con=connect(store),
                        chat=chat, embedder=embedder, stages=StageCache.of_store(store),
                        fingerprint=build_fingerprint(settings, chat.model_name))


def publish(store: Path, run_id: str, embedder: HashEmbedder, ids: tuple[str, ...] = IDS,
            ready: bool = False) -> tuple[str, dict[str, str]]:
    """Build and publish ``ids``; ``ready``: each build made ready as the flow does when it arrives."""
    rt = runtime(store, run_id, embedder)
    try:
        builds = {cid: build_conversation(rt, cid) for cid in ids}
        ids_of = {cid: build_id_of(b, embedder.model_name) for cid, b in builds.items()}
        if ready:
            builds = {cid: ready_to_publish(rt, b) for cid, b in builds.items()}
        return publish_builds(rt, builds), ids_of
    finally:
        rt.con.close()


def versions(store: Path) -> list[int]:
    return VectorStore(store / "lance", dim=64).list_versions("vectors")


def memory_rows_written(store: Path) -> int:
    con = connect(store, read_only=True)
    try:
        row = con.execute("SELECT count(*) FROM memory_builds").fetchone()
        return int(row[0]) if row else 0
    finally:
        con.close()


def test_an_unchanged_conversation_is_not_written_again_and_a_changed_one_is(tmp_path: Path) -> None:
    store = tmp_path / "store"
    ingest_slice(store, tmp_path / "s1.json", {cid: 1 for cid in IDS})
    first, first_ids = publish(store, "r1", HashEmbedder())
    before = current_snapshot(store)
    assert before is not None and before.snapshot_id == first and before.conversations == first_ids
    lance_before = versions(store)

    again, again_ids = publish(store, "r2", HashEmbedder())  # the same turns, the same models: nothing changed

    after = current_snapshot(store)
    assert after is not None and after.snapshot_id == again != first  # a whole new snapshot all the same
    assert again_ids == first_ids and after.conversations == before.conversations
    assert versions(store) == lance_before  # not one vector row written
    assert after.lance_versions == {"vectors": lance_before[-1]}
    for cid in IDS:
        assert diff_images(memory_image(after, cid), memory_image(before, cid)) == []
    assert memory_rows_written(store) == len(IDS)

    # conv-30 gains a session: only it is rewritten (one new Lance version), conv-26 stays as it was.
    ingest_slice(store, tmp_path / "s2.json", {"conv-26": 1, "conv-30": 2})
    _, grown_ids = publish(store, "r3", HashEmbedder())
    grown = current_snapshot(store)
    assert grown is not None and len(versions(store)) > len(lance_before)
    assert grown_ids["conv-26"] == first_ids["conv-26"] and grown_ids["conv-30"] != first_ids["conv-30"]
    assert diff_images(memory_image(grown, "conv-26"), memory_image(after, "conv-26")) == []
    assert memory_image(grown, "conv-30").rows["scenes"] != memory_image(after, "conv-30").rows["scenes"]

    # Another embedding model: the memory is the same, its vectors are not, so both are republished.
    lance_grown = versions(store)
    _, renamed_ids = publish(store, "r4", RenamedEmbedder())
    assert all(renamed_ids[cid] != grown_ids[cid] for cid in IDS)
    assert len(versions(store)) > len(lance_grown)
    # ... and with other vectors they are written again (RenamedEmbedder's are the same bits).
    _, other_ids = publish(store, "r5", OtherModelEmbedder())
    assert all(other_ids[cid] != renamed_ids[cid] for cid in IDS)
    vectors = VectorStore(store / "lance", dim=HashEmbedder().dim)
    latest = vectors.load_conversation("vectors", "conv-26")
    assert np.allclose(latest.vectors, OtherModelEmbedder().embed(latest.meta.column("text").to_pylist()))


def test_a_failed_vector_write_records_no_build_and_publishes_nothing(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The Lance write runs beside the working database's rows; when it fails the publish raises, no
    build is recorded, readers keep what they had, and the next publish writes everything."""
    store = tmp_path / "store"
    ingest_slice(store, tmp_path / "s1.json", {cid: 1 for cid in IDS})

    def broken(self: VectorStore, table: str, rows: object, converted: object = None) -> int:
        raise StoreError(f"{self.uri}/{table}: disk full")

    with monkeypatch.context() as patch:
        patch.setattr(VectorStore, "replace_conversations", broken)
        with pytest.raises(StoreError, match="disk full"):
            publish(store, "r1", HashEmbedder())
    assert current_snapshot(store) is None and memory_rows_written(store) == 0

    snapshot_id, ids = publish(store, "r2", HashEmbedder())
    info = current_snapshot(store)
    assert info is not None and info.snapshot_id == snapshot_id and info.conversations == ids
    assert memory_rows_written(store) == len(IDS)


def test_build_records_replace_a_conversations_row_and_keep_their_types(tmp_path: Path) -> None:
    from datetime import UTC, datetime

    from tmem.store.memory_rows import record_memory_builds, recorded_builds

    con = connect(tmp_path / "store")
    try:
        first, later = datetime(2026, 12, 1, 3, 0, tzinfo=UTC), datetime(2026, 12, 2, 3, 0, 0, 123456, tzinfo=UTC)
        record_memory_builds(con, [("a", "b1", 7), ("b", "b1", 9)], "run-1", first)
        record_memory_builds(con, [("b", "b2", 12), ("c", "b3", 3)], "run-2", later)
        assert recorded_builds(con) == {"a": "b1", "b": "b2", "c": "b3"}
        rows = con.execute("SELECT conversation_id, run_id, watermark_turn_seq, built_at FROM memory_builds "
                           "ORDER BY conversation_id").fetchall()
        assert rows == [("a", "run-1", 7, first), ("b", "run-2", 12, later), ("c", "run-2", 3, later)]
        record_memory_builds(con, [], "run-3", later)  # nothing to record: nothing changes
        assert con.execute("SELECT count(*) FROM memory_builds").fetchone() == (3,)
    finally:
        con.close()


def lance_rows(store: Path, cid: str) -> list[tuple[object, ...]]:
    loaded = VectorStore(store / "lance", dim=HashEmbedder().dim).load_conversation("vectors", cid)
    meta = loaded.meta.to_pylist()
    return sorted((tuple(m.values()), loaded.vectors[n].tobytes()) for n, m in enumerate(meta))


def test_builds_made_ready_as_they_arrive_publish_what_the_builds_themselves_publish(tmp_path: Path) -> None:
    """The flow makes each build's id and vector table as it arrives; the store published from those is
    the one published from the builds as they came (memory, vectors and their bits, build ids), first
    build and grown alike."""
    stores = {"as built": tmp_path / "a", "ready": tmp_path / "b"}
    for store in stores.values():
        ingest_slice(store, tmp_path / f"{store.name}-s1.json", {cid: 1 for cid in IDS})
    first = {name: publish(store, "r1", HashEmbedder(), ready=name == "ready")[1] for name, store in stores.items()}
    for store in stores.values():
        ingest_slice(store, tmp_path / f"{store.name}-s2.json", {"conv-26": 1, "conv-30": 2})
    grown = {name: publish(store, "r2", HashEmbedder(), ready=name == "ready")[1] for name, store in stores.items()}
    assert first["as built"] == first["ready"] and grown["as built"] == grown["ready"] != first["ready"]
    a, b = (current_snapshot(store) for store in stores.values())
    assert a is not None and b is not None and a.conversations == b.conversations
    for cid in IDS:
        assert diff_images(memory_image(a, cid), memory_image(b, cid)) == []
        assert lance_rows(stores["as built"], cid) == lance_rows(stores["ready"], cid)

    rt = runtime(stores["ready"], "r3", HashEmbedder())
    try:
        built = build_conversation(rt, "conv-26")
        ready = ready_to_publish(rt, built)
    finally:
        rt.con.close()
    assert ready.vectors == [] and ready.vector_table is not None  # the table holds the rows, not both
    assert ready.vector_table.column("text").to_pylist() == [r.text for r in built.vectors]
    assert ready.build_id == build_id_of(built, HashEmbedder().model_name)


def test_a_build_whose_rows_fail_the_checks_is_left_for_the_publish_to_refuse(tmp_path: Path) -> None:
    """A row the store refuses (here a non-finite vector) gets no table on arrival; the publish then
    converts the rows itself and raises the store's error naming the row, and publishes nothing."""
    from dataclasses import replace

    store = tmp_path / "store"
    ingest_slice(store, tmp_path / "s1.json", {cid: 1 for cid in IDS})
    rt = runtime(store, "r1", HashEmbedder())
    try:
        builds = {cid: build_conversation(rt, cid) for cid in IDS}
        first = builds["conv-30"].vectors[0]
        broken = replace(first, vector=np.full_like(first.vector, np.nan))
        builds["conv-30"] = replace(builds["conv-30"], vectors=[broken, *builds["conv-30"].vectors[1:]])
        ready = {cid: ready_to_publish(rt, b) for cid, b in builds.items()}
        assert ready["conv-30"].vector_table is None and ready["conv-30"].vectors == builds["conv-30"].vectors
        assert ready["conv-26"].vector_table is not None
        with pytest.raises(StoreError, match=f"row {broken.row_id} .*non-finite vector"):
            publish_builds(rt, ready)
    finally:
        rt.con.close()
    assert current_snapshot(store) is None and memory_rows_written(store) == 0

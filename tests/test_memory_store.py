from __future__ import annotations

import threading
from datetime import UTC, datetime
from pathlib import Path

import duckdb
import pytest

from tests.factories import sample_memory
from tmem.domain import ConversationMemory
from tmem.errors import StoreError
from tmem.store.duck import connect, table_counts
from tmem.store.memory_rows import read_memory, record_memory_build, replace_memories
from tmem.store.snapshot.published import current_snapshot, list_snapshots, prune_snapshots, publish_snapshot

NOW = datetime(2026, 11, 29, 12, 0, tzinfo=UTC)


def test_memory_round_trips_through_duckdb(tmp_path: Path) -> None:
    con = connect(tmp_path)
    memory = sample_memory()
    replace_memories(con, [memory])
    assert read_memory(con, "conv-a") == memory


def test_replace_is_per_conversation_and_idempotent(tmp_path: Path) -> None:
    con = connect(tmp_path)
    replace_memories(con, [sample_memory("conv-a"), sample_memory("conv-b", tag="b")])
    before = table_counts(con)
    replace_memories(con, [sample_memory("conv-a")])
    assert table_counts(con) == before
    replace_memories(con, [sample_memory("conv-a", tag="new")])
    assert read_memory(con, "conv-b") == sample_memory("conv-b", tag="b")
    assert {s.scene_id for s in read_memory(con, "conv-a").scenes} == {"scn_new0", "scn_new1", "scn_new2"}


def _row_ids(con: duckdb.DuckDBPyConnection, table: str, key: str) -> dict[str, int]:
    """key column -> DuckDB's rowid of the row (a row deleted and inserted again gets a new one)."""
    return {str(k): int(r) for k, r in con.execute(f"SELECT {key}, rowid FROM {table}").fetchall()}


def test_replace_writes_only_the_rows_that_differ_and_ends_as_a_full_rewrite(tmp_path: Path) -> None:
    con = connect(tmp_path)
    old = sample_memory("conv-a")
    replace_memories(con, [old, sample_memory("conv-b", tag="b")])
    items, scenes = _row_ids(con, "items", "item_id"), _row_ids(con, "scenes", "scene_id")
    triggers = _row_ids(con, "item_triggers", "text")  # entity rows hold a NULL rationale

    # The same memory again: no row is touched (NULLs compare equal: itm_1 has no event time).
    replace_memories(con, [old])
    assert (_row_ids(con, "items", "item_id"), _row_ids(con, "scenes", "scene_id")) == (items, scenes)
    assert _row_ids(con, "item_triggers", "text") == triggers

    # One item reworded, one scene dropped (with what pointed at it), one item added.
    added = old.items[0].model_copy(update={"item_id": "itm_new", "content": "A new fact."})
    new = old.model_copy(update={
        "items": (old.items[0].model_copy(update={"content": "Caroline made two bowls."}),
                  old.items[1].model_copy(update={"source_scene_ids": (old.scenes[0].scene_id,)}), added),
        "scenes": old.scenes[:2],
        "topics": (old.topics[0].model_copy(update={"scene_ids": (old.scenes[0].scene_id,)}), old.topics[1]),
    })
    replace_memories(con, [new])
    after = _row_ids(con, "items", "item_id")
    assert after["itm_0"] != items["itm_0"]  # changed: written again
    assert after["itm_1"] == items["itm_1"]  # only its scene links changed (item_scene), not its row
    assert "itm_new" in after
    links = con.execute("SELECT item_id, scene_id FROM item_scene WHERE conversation_id = 'conv-a' ORDER BY 1, 2").fetchall()
    assert links == [("itm_0", "scn_0"), ("itm_1", "scn_0"), ("itm_new", "scn_0")]
    assert {k: v for k, v in _row_ids(con, "scenes", "scene_id").items() if k in ("scn_0", "scn_1")} == \
        {k: scenes[k] for k in ("scn_0", "scn_1")}  # unchanged: where they were
    assert _row_ids(con, "item_triggers", "text") == triggers
    assert read_memory(con, "conv-a") == read_memory(_fresh(tmp_path / "fresh", new), "conv-a")
    assert read_memory(con, "conv-b") == sample_memory("conv-b", tag="b")


def _fresh(path: Path, memory: ConversationMemory) -> duckdb.DuckDBPyConnection:
    con = connect(path)
    replace_memories(con, [memory])
    return con


def test_failed_replace_leaves_previous_memory(tmp_path: Path) -> None:
    con = connect(tmp_path)
    replace_memories(con, [sample_memory("conv-a")])
    broken = sample_memory("conv-a", tag="x")
    # Two items with the same id violate the primary key half-way through the write.
    broken = broken.model_copy(update={"items": broken.items + broken.items[:1]})
    with pytest.raises(duckdb.ConstraintException):
        replace_memories(con, [broken])
    assert read_memory(con, "conv-a") == sample_memory("conv-a")


def test_migrations_are_recorded_once(tmp_path: Path) -> None:
    connect(tmp_path).close()
    con = connect(tmp_path)
    names = [r[0] for r in con.execute("SELECT name FROM schema_migrations ORDER BY name").fetchall()]
    assert names[:3] == ["m001_ingest", "m002_memory", "m003_llm"]
    assert len(names) == len(set(names))


def test_publish_snapshot_and_pointer(tmp_path: Path) -> None:
    con = connect(tmp_path)
    assert current_snapshot(tmp_path) is None
    replace_memories(con, [sample_memory("conv-a")])
    record_memory_build(con, "conv-a", "b1", "run1", 5, NOW)
    first = publish_snapshot(con, tmp_path, lance_uri="lance", lance_versions={"vectors": 3}, now=NOW)
    assert current_snapshot(tmp_path) == first
    snap = duckdb.connect(str(first.memory_db), read_only=True)
    assert snap.execute("SELECT count(*) FROM scenes").fetchone() == (3,)
    snap.close()

    replace_memories(con, [sample_memory("conv-a", tag="v2")])
    second = publish_snapshot(con, tmp_path, lance_uri="lance", lance_versions={"vectors": 4},
                              now=NOW.replace(minute=1))
    assert current_snapshot(tmp_path) == second
    assert second.lance_versions == {"vectors": 4}
    # The first snapshot is immutable: it still holds the old scenes.
    old = duckdb.connect(str(first.memory_db), read_only=True)
    assert {r[0] for r in old.execute("SELECT scene_id FROM scenes").fetchall()} == {"scn_0", "scn_1", "scn_2"}
    old.close()
    assert list_snapshots(tmp_path) == [first.snapshot_id, second.snapshot_id]
    assert prune_snapshots(tmp_path, keep=1) == [first.snapshot_id]
    assert list_snapshots(tmp_path) == [second.snapshot_id]


def test_snapshot_readable_by_many_readers_while_builder_writes(tmp_path: Path) -> None:
    con = connect(tmp_path)
    replace_memories(con, [sample_memory("conv-a")])
    info = publish_snapshot(con, tmp_path, lance_uri="lance", lance_versions={}, now=NOW)
    errors: list[Exception] = []

    def read() -> None:
        try:
            for _ in range(20):
                c = duckdb.connect(str(info.memory_db), read_only=True)
                assert c.execute("SELECT count(*) FROM items").fetchone() == (2,)
                c.close()
        except (AssertionError, duckdb.Error) as exc:  # collected and asserted in the main thread
            errors.append(exc)

    threads = [threading.Thread(target=read) for _ in range(4)]
    for t in threads:
        t.start()
    replace_memories(con, [sample_memory("conv-a", tag="z")])  # builder keeps writing its own file
    for t in threads:
        t.join()
    assert errors == []


def test_missing_manifest_is_a_store_error(tmp_path: Path) -> None:
    (tmp_path / "CURRENT").write_text("nope")
    with pytest.raises(StoreError, match="nope"):
        current_snapshot(tmp_path)


def test_typed_errors_survive_pickling() -> None:
    import pickle

    from tmem.errors import IngestError, LLMRequestRejectedError, ValidationFailure

    for err in (
        ValidationFailure("item_extract", "conv-1 topic t", "unknown scene S9", raw_output="{}"),
        IngestError("a.jsonl", "line 3", "unknown speaker 'Eve'"),
        LLMRequestRejectedError("persona", "conv-1 Ann", "HTTP 400", 400),
    ):
        back = pickle.loads(pickle.dumps(err))
        assert type(back) is type(err)
        assert str(back) == str(err)
        assert back.__dict__ == err.__dict__

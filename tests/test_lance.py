"""The LanceDB vector adapter against real LanceDB tables in a temp directory."""

from __future__ import annotations

from dataclasses import replace
from datetime import timedelta
from pathlib import Path

import numpy as np
import pyarrow as pa
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from tmem.errors import ScopeError, StoreError
from tmem.store.lance import (
    ConversationVectors,
    VectorRow,
    VectorStore,
    _difference,
    _same_vectors,
    make_row_id,
    scope_filter,
    vector_rows_table,
    vector_schema,
)

DIM = 8
TABLE = "item_views"

CRAFTED_IDS = [
    "x' OR '1'='1",
    "x' OR 1=1 --",
    "') OR ('a'='a",
    "%",
    "_",
    '"',
    "''",
    "ünïcödé-会话-🙂",
    "a/b/../c",
    "back\\slash\\",
    "new\nline",
    "tab\tand\r\ncrlf",
    "x'); DELETE FROM item_views; --",
]


def unit(seed: int) -> np.ndarray:
    rng = np.random.default_rng(seed)
    v = rng.standard_normal(DIM).astype(np.float32)
    return v / np.linalg.norm(v)


def rows_for(conversation_id: str, n: int, *, seed: int = 0, view: str = "content", text: str = "t") -> list[VectorRow]:
    return [
        VectorRow(
            conversation_id=conversation_id,
            owner_kind="item",
            owner_id=f"itm_{i}",
            view=view,
            ordinal=0,
            text=f"{text} {i}",
            vector=unit(seed * 1000 + i),
        )
        for i in range(n)
    ]


@pytest.fixture
def store(tmp_path: Path) -> VectorStore:
    return VectorStore(tmp_path / "lance", dim=DIM)


def test_table_is_created_on_first_write_with_the_explicit_schema(store: VectorStore) -> None:
    assert not store.has_table(TABLE)
    with pytest.raises(StoreError, match="no vector table"):
        store.version(TABLE)
    version = store.replace_conversation(TABLE, "conv-a", rows_for("conv-a", 3))
    assert store.has_table(TABLE)
    assert version == store.version(TABLE)
    loaded = store.load_conversation(TABLE, "conv-a")
    assert loaded.meta.schema.names == [f.name for f in vector_schema(DIM) if f.name != "vector"]
    assert loaded.meta.schema.field("ordinal").type == pa.int32()


def test_load_returns_meta_aligned_with_a_float32_matrix(store: VectorStore) -> None:
    rows = rows_for("conv-a", 5)
    rows.append(VectorRow("conv-a", "scene", "scn_1", "hor", 2, "horizon two", unit(77)))
    rows.append(VectorRow("conv-a", "scene", "scn_1", "hor", 0, "horizon zero", unit(78)))
    store.replace_conversation(TABLE, "conv-a", rows)
    loaded = store.load_conversation(TABLE, "conv-a")
    assert isinstance(loaded, ConversationVectors)
    assert loaded.vectors.dtype == np.float32
    assert loaded.vectors.shape == (7, DIM)
    by_id = {r.row_id: r for r in rows}
    for i, row_id in enumerate(loaded.meta.column("row_id").to_pylist()):
        np.testing.assert_array_equal(loaded.vectors[i], by_id[row_id].vector)
        assert loaded.meta.column("text")[i].as_py() == by_id[row_id].text
    # deterministic order: owner_kind, owner_id, view, ordinal
    keys = list(zip(*(loaded.meta.column(c).to_pylist() for c in ("owner_kind", "owner_id", "view", "ordinal")), strict=True))
    assert keys == sorted(keys)
    assert keys[-2:] == [("scene", "scn_1", "hor", 0), ("scene", "scn_1", "hor", 2)]
    frame = loaded.to_polars()
    assert frame.height == 7
    assert frame["row_id"].to_list() == loaded.meta.column("row_id").to_pylist()


def test_replace_swaps_one_conversation_and_leaves_others(store: VectorStore) -> None:
    store.replace_conversation(TABLE, "conv-a", rows_for("conv-a", 4, seed=1))
    v_b = store.replace_conversation(TABLE, "conv-b", rows_for("conv-b", 3, seed=2))
    v_a2 = store.replace_conversation(TABLE, "conv-a", rows_for("conv-a", 2, seed=3, text="new"))
    assert v_a2 == v_b + 1  # one replace is one version
    a = store.load_conversation(TABLE, "conv-a")
    assert a.meta.column("text").to_pylist() == ["new 0", "new 1"]
    np.testing.assert_array_equal(a.vectors[0], unit(3000))
    assert len(store.load_conversation(TABLE, "conv-b")) == 3
    v_empty = store.replace_conversation(TABLE, "conv-a", [])
    assert len(store.load_conversation(TABLE, "conv-a")) == 0
    assert len(store.load_conversation(TABLE, "conv-b")) == 3
    assert v_empty == v_a2 + 1


def test_replace_several_conversations_in_one_version(store: VectorStore) -> None:
    store.replace_conversations(TABLE, {"conv-a": rows_for("conv-a", 3, seed=1), "keep": rows_for("keep", 2, seed=2)})
    before = store.version(TABLE)
    crafted = "conv-a' OR '1'='1"
    version = store.replace_conversations(
        TABLE, {"conv-a": rows_for("conv-a", 1, seed=3, text="new"), crafted: rows_for(crafted, 1, seed=4)}
    )
    assert version == before + 1
    assert store.load_conversation(TABLE, "conv-a").meta.column("text").to_pylist() == ["new 0"]
    assert len(store.load_conversation(TABLE, crafted)) == 1
    assert len(store.load_conversation(TABLE, "keep")) == 2
    assert store.replace_conversations(TABLE, {}) == version


def _addresses(store: VectorStore, conversation_id: str) -> dict[str, int]:
    """row_id -> where Lance keeps the row now (``_rowaddr``: fragment and offset; a rewritten row moves)."""
    data = store._table(TABLE, create=False).search().where(scope_filter(conversation_id)).with_row_id(False) \
        .select(["row_id", "_rowaddr"]).limit(None).to_arrow()
    return dict(zip(data.column("row_id").to_pylist(), data.column("_rowaddr").to_pylist(), strict=True))


def test_replace_writes_only_the_rows_that_differ_with_the_same_result(store: VectorStore) -> None:
    rows = rows_for("conv-a", 5, seed=1) + rows_for("conv-a", 2, seed=9, view="gist")
    store.replace_conversations(TABLE, {"conv-a": rows, "conv-b": rows_for("conv-b", 2, seed=2)})
    before, version = _addresses(store, "conv-a"), store.version(TABLE)

    # The same rows again: nothing differs, no row is written, the write still commits its own version.
    assert store.replace_conversations(TABLE, {"conv-a": rows}) == version + 1 == store.version(TABLE)
    assert _addresses(store, "conv-a") == before
    version += 1

    # Row 0 keeps its text under other vector bits (another model), row 1 gets another text, a gist row
    # goes away and a new row arrives; rows 2-4 and the other gist are stored exactly already.
    new_row = VectorRow("conv-a", "item", "itm_new", "content", 0, "brand new", unit(77))
    changed = [replace(rows[0], vector=unit(500)), replace(rows[1], text="other text"), *rows[2:6], new_row]
    assert store.replace_conversations(TABLE, {"conv-a": changed}) == version + 1
    after = _addresses(store, "conv-a")
    unchanged = {r.row_id for r in rows[2:6]}
    assert {r: after[r] for r in unchanged} == {r: before[r] for r in unchanged}  # not rewritten
    assert after[rows[0].row_id] != before[rows[0].row_id] and after[rows[1].row_id] != before[rows[1].row_id]
    assert set(after) == {r.row_id for r in changed}  # the dropped gist row is gone, the new one is in
    loaded = store.load_conversation(TABLE, "conv-a")
    got = dict(zip(loaded.meta.column("row_id").to_pylist(), range(len(loaded)), strict=True))
    for row in changed:  # the table holds exactly what was asked for, as a full rewrite would
        assert loaded.meta.column("text")[got[row.row_id]].as_py() == row.text
        np.testing.assert_array_equal(loaded.vectors[got[row.row_id]], row.vector)
    assert len(store.load_conversation(TABLE, "conv-b")) == 2


def test_the_difference_is_found_across_chunks_by_bits(store: VectorStore) -> None:
    """The matching behind a replace (``_difference``) on stored rows as Lance returns them, in several
    chunks and out of order: only a new row, a new text and a vector one bit apart differ, -0.0 is
    not 0.0, and a stored row the input lacks is gone; compared a few rows at a time or all at once."""
    rows = rows_for("c", 9, seed=4)
    zero = replace(rows[8], vector=np.zeros(DIM, dtype=np.float32))
    table = store._to_arrow(TABLE, [*rows[:8], zero])
    stored = pa.Table.from_batches([table.slice(6).to_batches()[0], table.slice(0, 3).to_batches()[0],
                                    table.slice(3, 3).to_batches()[0]]).select(["row_id", "text", "vector"])
    assert stored.column("vector").num_chunks == 3
    flipped = rows[4].vector.copy()
    flipped.view(np.uint32)[2] ^= 1  # one bit of one float
    negative_zero = np.zeros(DIM, dtype=np.float32)
    negative_zero[0] = -0.0
    fresh = VectorRow("c", "item", "itm_new", "content", 0, "new", unit(5))
    asked = [rows[0], replace(rows[1], text="changed"), rows[2], rows[3], replace(rows[4], vector=flipped),
             rows[5], rows[6], replace(zero, vector=negative_zero), fresh]  # rows[7] is no longer asked for
    differ, gone = _difference(store._to_arrow(TABLE, asked), stored, DIM)
    assert differ.tolist() == [False, True, False, False, True, False, False, True, True]
    assert gone == [rows[7].row_id]
    # stored position of each asked row (as laid out above: rows 6-8, then 0-2, then 3-5)
    at = {0: 3, 1: 4, 2: 5, 3: 6, 4: 7, 5: 8, 6: 0, 7: 2}
    n = np.array(list(at), dtype=np.int64)
    o = np.array(list(at.values()), dtype=np.int64)
    matrix = np.stack([r.vector for r in asked[:8]])
    for step in (1, 2, 3, 4096):
        same = _same_vectors(matrix, stored.column("vector"), n, o, DIM, step=step)
        assert same.tolist() == [True, True, True, True, False, True, True, False]


def test_reader_pinned_at_a_version_keeps_the_old_rows(store: VectorStore) -> None:
    v1 = store.replace_conversation(TABLE, "conv-a", rows_for("conv-a", 3, text="old"))
    v2 = store.replace_conversation(TABLE, "conv-a", rows_for("conv-a", 1, text="new"))
    assert v2 > v1
    old = store.load_conversation(TABLE, "conv-a", version=v1)
    assert old.version == v1
    assert old.meta.column("text").to_pylist() == ["old 0", "old 1", "old 2"]
    assert store.load_conversation(TABLE, "conv-a").meta.column("text").to_pylist() == ["new 0"]
    hits_old = store.search(TABLE, unit(2), "conv-a", k=5, version=v1)
    assert {h.text for h in hits_old} == {"old 0", "old 1", "old 2"}
    with pytest.raises(StoreError, match="version 999"):
        store.load_conversation(TABLE, "conv-a", version=999)


def test_a_second_store_on_the_same_directory_sees_new_writes(tmp_path: Path) -> None:
    writer = VectorStore(tmp_path / "lance", dim=DIM)
    writer.replace_conversation(TABLE, "conv-a", rows_for("conv-a", 1, text="first"))
    reader = VectorStore(tmp_path / "lance", dim=DIM)
    assert reader.load_conversation(TABLE, "conv-a").meta.column("text").to_pylist() == ["first 0"]
    writer.replace_conversation(TABLE, "conv-a", rows_for("conv-a", 1, text="second"))
    assert reader.load_conversation(TABLE, "conv-a").meta.column("text").to_pylist() == ["second 0"]
    assert reader.version(TABLE) == writer.version(TABLE)


def test_upsert_updates_by_row_id_and_inserts_new(store: VectorStore) -> None:
    v1 = store.upsert(TABLE, rows_for("conv-a", 2, seed=1))
    changed = VectorRow("conv-a", "item", "itm_1", "content", 0, "changed", unit(999))
    v2 = store.upsert(TABLE, [changed, *rows_for("conv-b", 1, seed=2)])
    assert v2 == v1 + 1
    a = store.load_conversation(TABLE, "conv-a")
    assert a.meta.column("text").to_pylist() == ["t 0", "changed"]
    np.testing.assert_array_equal(a.vectors[1], unit(999))
    assert store.count_rows(TABLE) == 3
    assert store.upsert(TABLE, []) == v2  # nothing to write, no new version


def test_writes_reject_bad_rows_before_touching_the_table(store: VectorStore) -> None:
    store.replace_conversation(TABLE, "conv-a", rows_for("conv-a", 1))
    version = store.version(TABLE)
    with pytest.raises(ScopeError, match="conv-b"):
        store.replace_conversation(TABLE, "conv-a", rows_for("conv-b", 1))
    nan_row = VectorRow("conv-a", "item", "itm_9", "con", 0, "x", np.full(DIM, np.nan, dtype=np.float32))
    with pytest.raises(StoreError, match="non-finite"):
        store.upsert(TABLE, [nan_row])
    with pytest.raises(StoreError, match="shape"):
        store.upsert(TABLE, [VectorRow("conv-a", "item", "itm_9", "con", 0, "x", np.ones(DIM + 1, dtype=np.float32))])
    with pytest.raises(StoreError, match="duplicate row ids"):
        store.upsert(TABLE, rows_for("conv-a", 1) + rows_for("conv-a", 1))
    with pytest.raises(StoreError, match="owner_kind"):
        store.upsert(TABLE, [VectorRow("conv-a", "persona", "p", "con", 0, "x", unit(1))])  # type: ignore[arg-type]
    with pytest.raises(ScopeError):
        store.replace_conversation(TABLE, "", [])
    assert store.version(TABLE) == version
    assert len(store.load_conversation(TABLE, "conv-a")) == 1


def test_table_names_and_dimension_are_checked(tmp_path: Path) -> None:
    store = VectorStore(tmp_path / "lance", dim=DIM)
    with pytest.raises(StoreError, match="invalid vector table name"):
        store.upsert("../escape", rows_for("conv-a", 1))
    store.upsert(TABLE, rows_for("conv-a", 1))
    other = VectorStore(tmp_path / "lance", dim=DIM * 2)
    with pytest.raises(StoreError, match="expected 16"):
        other.load_conversation(TABLE, "conv-a")


def test_search_is_restricted_to_the_scope_and_ranked_by_cosine(store: VectorStore) -> None:
    store.replace_conversation(TABLE, "conv-a", rows_for("conv-a", 6, seed=1))
    store.replace_conversation(TABLE, "conv-b", rows_for("conv-b", 6, seed=2))
    query = unit(2003)  # identical to conv-b's itm_3
    hits = store.search(TABLE, query, "conv-a", k=10)
    assert len(hits) == 6
    assert {h.row_id for h in hits} == {r.row_id for r in rows_for("conv-a", 6, seed=1)}
    scores = [h.score for h in hits]
    assert scores == sorted(scores, reverse=True)
    expected = sorted((float(unit(1000 + i) @ query) for i in range(6)), reverse=True)
    np.testing.assert_allclose(scores, expected, atol=1e-5)
    top_b = store.search(TABLE, query, "conv-b", k=1)
    assert top_b[0].owner_id == "itm_3"
    assert top_b[0].score == pytest.approx(1.0, abs=1e-5)
    assert store.search(TABLE, query, "conv-missing", k=5) == []
    with pytest.raises(ScopeError):
        store.search(TABLE, query, "", k=5)


def test_view_filter_on_load_and_search(store: VectorStore) -> None:
    rows = rows_for("conv-a", 3, view="con", seed=1) + rows_for("conv-a", 2, view="brg", seed=2)
    store.replace_conversation(TABLE, "conv-a", rows)
    assert set(store.load_conversation(TABLE, "conv-a", views=["brg"]).meta.column("view").to_pylist()) == {"brg"}
    assert len(store.load_conversation(TABLE, "conv-a", views=["con", "brg"])) == 5
    assert {h.view for h in store.search(TABLE, unit(1), "conv-a", k=10, views=["con"])} == {"con"}
    assert len(store.load_conversation(TABLE, "conv-a", views=["x' OR '1'='1"])) == 0


def test_scope_filter_renders_crafted_ids_as_one_literal() -> None:
    rendered = scope_filter("x' OR '1'='1").to_sql()
    assert rendered == "(conversation_id = 'x'' OR ''1''=''1')"


def test_crafted_conversation_ids_never_reach_other_rows(store: VectorStore) -> None:
    store.replace_conversation(TABLE, "x", rows_for("x", 2, seed=1))
    store.replace_conversation(TABLE, "victim", rows_for("victim", 2, seed=2))
    for n, crafted in enumerate(CRAFTED_IDS):
        # reading a crafted id that stores nothing returns nothing
        assert len(store.load_conversation(TABLE, crafted)) == 0, crafted
        assert store.search(TABLE, unit(1000), crafted, k=10) == [], crafted
        # writing under a crafted id touches only that id
        store.replace_conversation(TABLE, crafted, rows_for(crafted, 1, seed=10 + n))
        loaded = store.load_conversation(TABLE, crafted)
        assert loaded.meta.column("conversation_id").to_pylist() == [crafted]
        assert {h.row_id for h in store.search(TABLE, unit(1000), crafted, k=10)} == {rows_for(crafted, 1)[0].row_id}
    # emptying every crafted scope deleted nothing else
    for crafted in CRAFTED_IDS:
        store.replace_conversation(TABLE, crafted, [])
    assert len(store.load_conversation(TABLE, "x")) == 2
    assert len(store.load_conversation(TABLE, "victim")) == 2
    assert store.count_rows(TABLE) == 4


@pytest.fixture(scope="module")
def populated(tmp_path_factory: pytest.TempPathFactory) -> VectorStore:
    store = VectorStore(tmp_path_factory.mktemp("lance-prop"), dim=DIM)
    rows = [r for i, c in enumerate(["x", "victim", "a'b", "%"]) for r in rows_for(c, 2, seed=i)]
    store.upsert(TABLE, rows)
    return store


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(conversation_id=st.text(min_size=1, max_size=30))
def test_any_conversation_id_reads_only_its_own_rows(populated: VectorStore, conversation_id: str) -> None:
    loaded = populated.load_conversation(TABLE, conversation_id)
    hits = populated.search(TABLE, unit(0), conversation_id, k=20)
    expected = 2 if conversation_id in {"x", "victim", "a'b", "%"} else 0
    assert len(loaded) == expected
    assert set(loaded.meta.column("conversation_id").to_pylist()) <= {conversation_id}
    assert len(hits) == expected
    assert {h.row_id for h in hits} == set(loaded.meta.column("row_id").to_pylist())


def test_scope_index_is_created_once_the_table_is_large(store: VectorStore) -> None:
    store.replace_conversation(TABLE, "conv-a", rows_for("conv-a", 6, seed=1))
    assert store.ensure_scope_index(TABLE, min_rows=10) is False
    store.replace_conversation(TABLE, "conv-b", rows_for("conv-b", 6, seed=2))
    assert store.ensure_scope_index(TABLE, min_rows=10) is True
    # rows written after the index are still found, and the scope still holds
    store.replace_conversation(TABLE, "conv-c", rows_for("conv-c", 3, seed=3))
    assert len(store.load_conversation(TABLE, "conv-c")) == 3
    assert {h.row_id for h in store.search(TABLE, unit(1), "conv-b", k=20)} == {
        r.row_id for r in rows_for("conv-b", 6, seed=2)
    }
    assert VectorStore(store.uri, dim=DIM).ensure_scope_index(TABLE, min_rows=10_000) is True  # found, not rebuilt


@pytest.mark.filterwarnings("ignore:optimize")
def test_optimize_keeps_the_latest_rows_and_drops_old_versions(store: VectorStore) -> None:
    v1 = store.replace_conversation(TABLE, "conv-a", rows_for("conv-a", 3, seed=1))
    for seed in range(2, 5):
        store.replace_conversation(TABLE, "conv-a", rows_for("conv-a", 3, seed=seed))
    before = store.load_conversation(TABLE, "conv-a")
    kept = store.optimize(TABLE, keep_newer_than=timedelta(days=1))
    assert store.load_conversation(TABLE, "conv-a", version=v1).version == v1  # young versions survive
    latest = store.optimize(TABLE, keep_newer_than=timedelta(0))
    assert latest >= kept
    assert store.list_versions(TABLE) == [latest]
    after = store.load_conversation(TABLE, "conv-a")
    assert after.meta.column("row_id").to_pylist() == before.meta.column("row_id").to_pylist()
    np.testing.assert_array_equal(after.vectors, before.vectors)
    with pytest.raises(StoreError, match=f"version {v1}"):
        store.load_conversation(TABLE, "conv-a", version=v1)


def test_object_store_uri_strings_are_accepted() -> None:
    store = VectorStore("memory://tmem-test", dim=DIM)
    store.replace_conversation(TABLE, "conv-a", rows_for("conv-a", 2))
    assert len(store.load_conversation(TABLE, "conv-a")) == 2


def test_row_ids_are_deterministic_and_distinct_per_key() -> None:
    a = make_row_id("c", "item", "i1", "con", 0)
    assert a == make_row_id("c", "item", "i1", "con", 0)
    assert len({a, make_row_id("c", "item", "i1", "con", 1), make_row_id("d", "item", "i1", "con", 0)}) == 3


def test_rows_converted_ahead_write_the_same_table_and_are_still_checked(store: VectorStore, tmp_path: Path) -> None:
    """Conversations handed over already converted (vector_rows_table, as the publisher makes them when each
    build arrives) are written with the others in the one version, giving the table the rows themselves give;
    a converted table of another schema or conversation, or a row id twice across both kinds, is refused."""
    rows = {"conv-a": rows_for("conv-a", 4, seed=1), "conv-b": rows_for("conv-b", 3, seed=5, text="b")}
    plain = VectorStore(tmp_path / "plain", dim=DIM)
    plain.replace_conversations(TABLE, rows)
    version = store.replace_conversations(TABLE, {"conv-a": [], "conv-b": rows["conv-b"]},
                                          {"conv-a": vector_rows_table(TABLE, rows["conv-a"], DIM)})
    assert version == store.version(TABLE)
    for cid in rows:
        ours, theirs = store.load_conversation(TABLE, cid), plain.load_conversation(TABLE, cid)
        assert ours.meta.equals(theirs.meta) and ours.vectors.tobytes() == theirs.vectors.tobytes()

    with pytest.raises(StoreError, match="converted for another schema"):
        wider = [replace(r, vector=np.full(DIM + 1, 1 / 3, dtype=np.float32)) for r in rows["conv-a"]]
        store.replace_conversations(TABLE, {"conv-a": []}, {"conv-a": vector_rows_table(TABLE, wider, DIM + 1)})
    with pytest.raises(ScopeError, match="its converted rows hold another conversation's"):
        store.replace_conversations(TABLE, {"conv-b": []}, {"conv-b": vector_rows_table(TABLE, rows["conv-a"], DIM)})
    twice = rows_for("conv-a", 1, seed=9)
    with pytest.raises(StoreError, match="duplicate row ids in one write"):
        store.replace_conversations(TABLE, {"conv-a": twice, "conv-c": []},
                                    {"conv-c": vector_rows_table(TABLE, twice, DIM)
                                     .set_column(1, pa.field("conversation_id", pa.string(), nullable=False),
                                                 pa.array(["conv-c"]))})
    assert store.version(TABLE) == version  # nothing refused was written
    with pytest.raises(StoreError, match="non-finite vector"):
        vector_rows_table(TABLE, [replace(rows["conv-a"][0], vector=np.full(DIM, np.nan, dtype=np.float32))], DIM)

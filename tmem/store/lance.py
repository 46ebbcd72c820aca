"""Vector tables in LanceDB: one row per embedded view of a topic, scene or item.

Every read and write is scoped to one conversation. The scope filter is a typed
``lancedb.expr`` expression (``col("conversation_id") == lit(x)``), never an SQL string
built from an id: a crafted id such as ``x' OR '1'='1`` is a literal, not SQL
(``tests/test_lance.py`` proves it for reads, searches and replacing writes).

Every Lance write makes a table version. Writers batch rows; a reader that pins a
version (``version=...``) keeps seeing that version's rows after later writes, until
:meth:`VectorStore.optimize` removes versions older than its retention window.
"""

from __future__ import annotations

import re
import threading
from collections import Counter, OrderedDict
from collections.abc import Mapping, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from datetime import timedelta
from pathlib import Path
from typing import TYPE_CHECKING, NoReturn, get_args

import lancedb
import numpy as np
import numpy.typing as npt
import pyarrow as pa
import pyarrow.compute as pc
from lancedb.expr import Expr, col, lit
from lancedb.index import BTree
from lancedb.query import LanceVectorQueryBuilder

from tmem.errors import ScopeError, StoreError
from tmem.store.vector_rows import VectorRow as VectorRow  # re-exported: the row type of this store
from tmem.store.vector_rows import make_row_id as make_row_id
from tmem.views.catalog import OwnerKind

if TYPE_CHECKING:
    import polars as pl

OWNER_KINDS: frozenset[str] = frozenset(get_args(OwnerKind))

# Views written by the indexer (DESIGN.md §3). Other names are allowed; these are the known ones.

# Below this many rows a conversation_id scan costs a few ms; above it a BTREE index pays off.
# Measured here (384-d, ~300 rows per conversation): filtered vector search 16.6 -> 6.2 ms at
# 10k rows and 181 -> 5.3 ms at 100k rows; building the index takes 8-23 ms.
SCOPE_INDEX_MIN_ROWS = 5_000

# Handles of pinned (immutable) table versions kept open for reads: the current snapshot's and a
# few recent ones (a reader still finishing on a replaced snapshot).
PINNED_HANDLES = 4

_TABLE_NAME = re.compile(r"^[A-Za-z0-9_-]{1,64}$")
_META_COLUMNS = ("row_id", "conversation_id", "owner_kind", "owner_id", "view", "ordinal", "text")


def vector_schema(dim: int) -> pa.Schema:
    """The explicit schema of every vector table (``dim`` floats per row)."""
    return pa.schema(
        [
            pa.field("row_id", pa.string(), nullable=False),
            pa.field("conversation_id", pa.string(), nullable=False),
            pa.field("owner_kind", pa.string(), nullable=False),
            pa.field("owner_id", pa.string(), nullable=False),
            pa.field("view", pa.string(), nullable=False),
            pa.field("ordinal", pa.int32(), nullable=False),
            pa.field("text", pa.string(), nullable=False),
            pa.field("vector", pa.list_(pa.float32(), dim), nullable=False),
        ]
    )


def vector_rows_table(table: str, rows: Sequence[VectorRow], dim: int) -> pa.Table:
    """``rows`` as an Arrow table of the vector schema, each row checked (a known owner kind, a view and an
    owner id, ``dim`` finite floats) and their row ids unique; :class:`StoreError` naming ``table`` and the
    row otherwise. What a write sends to Lance; the publisher also makes it for each conversation as its
    build arrives (:func:`tmem.build.publish.ready_to_publish`)."""
    n = len(rows)
    matrix = np.empty((n, dim), dtype=np.float32)
    row_ids: list[str] = []
    for i, row in enumerate(rows):
        if row.owner_kind not in OWNER_KINDS:
            raise StoreError(f"{table}: row {row.owner_id!r} has owner_kind {row.owner_kind!r}, not one of {sorted(OWNER_KINDS)}")
        if not row.view or not row.owner_id:
            raise StoreError(f"{table}: row of {row.owner_kind} {row.owner_id!r} needs a view and an owner id")
        vector = np.asarray(row.vector, dtype=np.float32)
        if vector.shape != (dim,):
            raise StoreError(f"{table}: row {row.row_id} has vector shape {vector.shape}, expected ({dim},)")
        if not np.isfinite(vector).all():
            # Missing views are absent rows; NaN sentinels belong to scoring, not storage.
            raise StoreError(f"{table}: row {row.row_id} ({row.owner_id}/{row.view}) has a non-finite vector")
        matrix[i] = vector
        row_ids.append(row.row_id)
    if len(set(row_ids)) != n:
        _refuse_duplicates(table, row_ids)
    vectors = pa.FixedSizeListArray.from_arrays(pa.array(matrix.reshape(-1), type=pa.float32()), dim)
    columns = {
        "row_id": pa.array(row_ids, type=pa.string()),
        "conversation_id": pa.array([r.conversation_id for r in rows], type=pa.string()),
        "owner_kind": pa.array([r.owner_kind for r in rows], type=pa.string()),
        "owner_id": pa.array([r.owner_id for r in rows], type=pa.string()),
        "view": pa.array([r.view for r in rows], type=pa.string()),
        "ordinal": pa.array([r.ordinal for r in rows], type=pa.int32()),
        "text": pa.array([r.text for r in rows], type=pa.string()),
        "vector": vectors,
    }
    return pa.Table.from_arrays(list(columns.values()), schema=vector_schema(dim))


def _refuse_duplicates(table: str, row_ids: Sequence[str]) -> NoReturn:
    dupes = sorted(r for r, count in Counter(row_ids).items() if count > 1)
    raise StoreError(f"{table}: duplicate row ids in one write: {dupes[:5]}")


def scope_filter(conversation_id: str) -> Expr:
    """The typed, injection-safe filter ``conversation_id = <literal>``."""
    return col("conversation_id") == lit(_checked_scope(conversation_id))


@dataclass(frozen=True)
class ConversationVectors:
    """All rows of one conversation in one table at one version, sorted by (owner_kind, owner_id, view, ordinal).

    ``meta`` holds every column but ``vector``; ``vectors[i]`` is the vector of ``meta`` row i.
    """

    table: str
    version: int
    meta: pa.Table
    vectors: npt.NDArray[np.float32]

    def __len__(self) -> int:
        return self.meta.num_rows

    def to_polars(self) -> pl.DataFrame:
        import polars as pl

        frame = pl.from_arrow(self.meta)
        assert isinstance(frame, pl.DataFrame)
        return frame


@dataclass(frozen=True)
class VectorHit:
    """One search result; ``score`` is the cosine similarity (1 - cosine distance)."""

    row_id: str
    owner_kind: str
    owner_id: str
    view: str
    ordinal: int
    text: str
    score: float


class VectorStore:
    """Vector tables under one LanceDB directory (a local path or an object-store URI)."""

    def __init__(self, uri: str | Path, dim: int) -> None:
        if dim < 1:
            raise StoreError(f"vector dimension must be positive, got {dim}")
        self.uri = str(uri)
        self.dim = dim
        self._schema = vector_schema(dim)
        self._lock = threading.Lock()
        self._tables: dict[str, lancedb.table.Table] = {}
        self._indexed: set[str] = set()
        self._pinned: OrderedDict[tuple[str, int], lancedb.table.Table] = OrderedDict()  # (table, version)
        try:
            # interval 0: a handle re-checks the latest version on each unpinned read, so
            # writes by another process are seen (pinned reads never change).
            self._db = lancedb.connect(self.uri, read_consistency_interval=timedelta(0))
        except (OSError, ValueError, RuntimeError) as exc:
            raise StoreError(f"{self.uri}: cannot open LanceDB ({exc})") from exc

    # ---- tables -------------------------------------------------------------------------

    def table_names(self) -> list[str]:
        names: list[str] = []
        page: str | None = None
        while True:
            response = self._db.list_tables(page_token=page)
            names.extend(response.tables)
            page = response.page_token
            if not page:
                return sorted(names)

    def has_table(self, table: str) -> bool:
        return _checked_table_name(table) in self.table_names()

    def _table(self, table: str, *, create: bool) -> lancedb.table.Table:
        name = _checked_table_name(table)
        with self._lock:
            handle = self._tables.get(name)
            if handle is None:
                if name in self.table_names():
                    handle = self._db.open_table(name)
                    self._check_schema(name, handle.schema)
                elif create:
                    handle = self._db.create_table(name, schema=self._schema, exist_ok=True)
                    self._check_schema(name, handle.schema)
                else:
                    raise StoreError(f"{self.uri}: no vector table {name!r}")
                self._tables[name] = handle
            return handle

    def _check_schema(self, name: str, schema: pa.Schema) -> None:
        if schema.names != self._schema.names:
            raise StoreError(f"{self.uri}/{name}: columns {schema.names} differ from {self._schema.names}")
        vector_type = schema.field("vector").type
        if not pa.types.is_fixed_size_list(vector_type) or vector_type.list_size != self.dim:
            raise StoreError(f"{self.uri}/{name}: vector column is {vector_type}, expected {self.dim} float32")

    def _reader(self, table: str, version: int | None) -> lancedb.table.Table:
        if version is None:
            return self._table(table, create=False)
        name = _checked_table_name(table)
        key = (name, int(version))
        with self._lock:
            pinned = self._pinned.get(key)
            if pinned is not None:
                self._pinned.move_to_end(key)
                return pinned
        if not self.has_table(name):
            raise StoreError(f"{self.uri}: no vector table {name!r}")
        try:
            handle = self._db.open_table(name, version=version)
        except ValueError as exc:
            raise StoreError(f"{self.uri}/{name}: cannot read version {version} ({exc})") from exc
        # A version never changes, so its handle is kept: Lance caches the version's manifest and
        # the pages of its conversation_id index per handle, and opening the version afresh for
        # every cold conversation load re-read them (bench/query.py --part scale).
        with self._lock:
            self._pinned[key] = handle
            while len(self._pinned) > PINNED_HANDLES:
                self._pinned.popitem(last=False)
        return handle

    def version(self, table: str) -> int:
        """The latest version of ``table``."""
        return int(self._table(table, create=False).version)

    def count_rows(self, table: str, version: int | None = None) -> int:
        return int(self._reader(table, version).count_rows())

    # ---- writes -------------------------------------------------------------------------

    def replace_conversation(self, table: str, conversation_id: str, rows: Sequence[VectorRow]) -> int:
        """Make ``rows`` the only rows of ``conversation_id`` in ``table``; return the new version."""
        return self.replace_conversations(table, {conversation_id: rows})

    def replace_conversations(self, table: str, rows_by_conversation: Mapping[str, Sequence[VectorRow]],
                              converted: Mapping[str, pa.Table] | None = None) -> int:
        """Replace the rows of several conversations in one write; return the new version.

        One merge-insert (match on row_id, insert new, delete the named conversations' rows
        absent from the input) commits as one version, so readers see all old rows or all new
        ones, and publishing many conversations costs one version. A row already stored exactly
        (same row_id, text and vector bits) is left where it is: the write sends only the rows
        that differ and deletes only the rows that went away, with the same resulting table (a
        nightly that adds one session to each of 1,000 conversations changes ~16 % of their
        ~160,000 rows; rewriting all of them took ~4.6 core-s, the difference ~1.2). Nothing
        differing, the write still commits its version (no rows): every replace makes one, as a
        publish resumed after its vectors were written expects. Creates the table on
        first use, and the scope index once the table is large (that index build adds a later
        version holding the same rows; the version returned is this write's own).

        ``converted``: conversations whose rows were already made into their Arrow table by
        :func:`vector_rows_table` (the publisher makes it as each build arrives, outside the publish);
        their rows are not converted again, only checked to be of this table's schema and conversation.
        """
        ids = [_checked_scope(c) for c in rows_by_conversation]
        converted = converted or {}
        if not ids:
            return int(self._table(table, create=True).version)
        scope = scope_filter(ids[0]) if len(ids) == 1 else col("conversation_id").isin(ids)
        rows: list[VectorRow] = []
        made: list[pa.Table] = []
        for conversation_id, conversation_rows in rows_by_conversation.items():
            if (ready := converted.get(conversation_id)) is not None:
                made.append(self._checked_converted(table, conversation_id, ready))
                continue
            for row in conversation_rows:
                if row.conversation_id != conversation_id:
                    raise ScopeError(
                        f"replacing conversation {conversation_id!r} in {table!r}: row {row.row_id} belongs to "
                        f"conversation {row.conversation_id!r}"
                    )
            rows.extend(conversation_rows)
        # The stored rows are read (Lance, off the interpreter's lock) while the new ones are checked and
        # converted (Python): one after the other they were ~3 + ~3.7 s of a 1,000-conversation nightly's
        # publish, its longest part. A table not there yet has no rows, and is made only once the new
        # rows passed their checks.
        columns = ["row_id", "text", "vector"]
        existing = self._table(table, create=False) if self.has_table(table) else None
        with ThreadPoolExecutor(max_workers=1, thread_name_prefix="tmem-lance-read") as reader:
            reading = (reader.submit(lambda: existing.search().where(scope).select(columns).limit(None).to_arrow())
                       if existing is not None else None)
            data = self._to_arrow(table, rows)
            if made:
                data = pa.concat_tables([*made, data]) if rows else pa.concat_tables(made)
                if pc.count_distinct(data.column("row_id")).as_py() != data.num_rows:
                    _refuse_duplicates(table, data.column("row_id").to_pylist())
        handle = existing if existing is not None else self._table(table, create=True)
        try:
            stored = reading.result() if reading is not None else self._schema.empty_table().select(columns)
            differ, gone = _difference(data, stored, self.dim)
            merge = handle.merge_insert("row_id").when_matched_update_all().when_not_matched_insert_all()
            if gone:
                merge = merge.when_not_matched_by_source_delete(col("row_id").isin(gone))
            result = merge.execute(data.filter(pa.array(differ)))
        except (OSError, ValueError, RuntimeError) as exc:
            raise StoreError(f"{self.uri}/{table}: replacing conversations {ids[:3]} failed ({exc})") from exc
        self.ensure_scope_index(table)
        return int(result.version or handle.version)

    def _checked_converted(self, table: str, conversation_id: str, data: pa.Table) -> pa.Table:
        if not data.schema.equals(self._schema):
            raise StoreError(f"{table}: rows of {conversation_id!r} were converted for another schema: {data.schema}")
        if data.num_rows and not pc.all(pc.equal(data.column("conversation_id"), conversation_id)).as_py():
            raise ScopeError(f"replacing conversation {conversation_id!r} in {table!r}: its converted rows hold "
                             "another conversation's")
        return data

    def upsert(self, table: str, rows: Sequence[VectorRow]) -> int:
        """Insert ``rows``, replacing rows with the same row_id; return the new version."""
        data = self._to_arrow(table, rows)
        handle = self._table(table, create=True)
        if data.num_rows == 0:
            return int(handle.version)
        try:
            result = handle.merge_insert("row_id").when_matched_update_all().when_not_matched_insert_all().execute(data)
        except (OSError, ValueError, RuntimeError) as exc:
            raise StoreError(f"{self.uri}/{table}: upsert of {data.num_rows} rows failed ({exc})") from exc
        self.ensure_scope_index(table)
        return int(result.version or handle.version)

    def _to_arrow(self, table: str, rows: Sequence[VectorRow]) -> pa.Table:
        return vector_rows_table(table, rows, self.dim)

    # ---- reads --------------------------------------------------------------------------

    def load_conversation(
        self,
        table: str,
        conversation_id: str,
        version: int | None = None,
        views: Sequence[str] | None = None,
    ) -> ConversationVectors:
        """Every row of one conversation (optionally only ``views``) at ``version`` (default latest)."""
        where = scope_filter(conversation_id)
        if views is not None:
            where = where & col("view").isin(list(views))
        reader = self._reader(table, version)
        read_version = int(reader.version)
        try:
            data = reader.search().where(where).limit(None).to_arrow()
        except (OSError, ValueError, RuntimeError) as exc:
            raise StoreError(f"{self.uri}/{table}@{read_version}: loading {conversation_id!r} failed ({exc})") from exc
        data = data.select([*_META_COLUMNS, "vector"]).sort_by(
            [("owner_kind", "ascending"), ("owner_id", "ascending"), ("view", "ascending"), ("ordinal", "ascending")]
        )
        return ConversationVectors(
            table=table,
            version=read_version,
            meta=data.select(list(_META_COLUMNS)),
            vectors=_vector_matrix(data.column("vector"), self.dim),
        )

    def search(
        self,
        table: str,
        vector: npt.NDArray[np.float32],
        conversation_id: str,
        k: int,
        version: int | None = None,
        views: Sequence[str] | None = None,
    ) -> list[VectorHit]:
        """The ``k`` rows of one conversation nearest to ``vector`` by cosine, best first.

        The scope filter is applied before the nearest-neighbour step (prefilter), so ``k``
        hits come from this conversation whenever it has ``k`` rows.
        """
        where = scope_filter(conversation_id)
        if views is not None:
            where = where & col("view").isin(list(views))
        query = np.asarray(vector, dtype=np.float32)
        if query.shape != (self.dim,):
            raise StoreError(f"{table}: query vector shape {query.shape}, expected ({self.dim},)")
        if k < 1:
            return []
        builder = self._reader(table, version).search(query, vector_column_name="vector")
        if not isinstance(builder, LanceVectorQueryBuilder):
            raise StoreError(f"{table}: LanceDB did not build a vector query (got {type(builder).__name__})")
        try:
            result = (
                builder.distance_type("cosine")
                .where(where, prefilter=True)
                .select([*_META_COLUMNS, "_distance"])
                .limit(k)
                .to_arrow()
            )
        except (OSError, ValueError, RuntimeError) as exc:
            raise StoreError(f"{self.uri}/{table}: search in {conversation_id!r} failed ({exc})") from exc
        rows = result.to_pylist()
        return [
            VectorHit(
                row_id=r["row_id"],
                owner_kind=r["owner_kind"],
                owner_id=r["owner_id"],
                view=r["view"],
                ordinal=int(r["ordinal"]),
                text=r["text"],
                score=1.0 - float(r["_distance"]),
            )
            for r in rows
        ]

    # ---- maintenance --------------------------------------------------------------------

    def ensure_scope_index(self, table: str, min_rows: int = SCOPE_INDEX_MIN_ROWS) -> bool:
        """Create a BTREE index on conversation_id once ``table`` has ``min_rows`` rows.

        Returns whether the index exists afterwards. Rows written after the index are still
        found (Lance scans unindexed fragments); :meth:`optimize` folds them into the index.
        """
        name = _checked_table_name(table)
        if name in self._indexed:
            return True
        handle = self._table(name, create=False)
        if any(cfg.columns == ["conversation_id"] for cfg in handle.list_indices()):
            self._indexed.add(name)
            return True
        if handle.count_rows() < min_rows:
            return False
        try:
            handle.create_index("conversation_id", config=BTree())
        except (OSError, ValueError, RuntimeError) as exc:
            raise StoreError(f"{self.uri}/{name}: creating the conversation_id index failed ({exc})") from exc
        self._indexed.add(name)
        return True

    def optimize(self, table: str, keep_newer_than: timedelta = timedelta(days=7)) -> int:
        """Compact files, update indices and delete versions older than ``keep_newer_than``.

        For nightly maintenance. Versions pinned by a published snapshot must be younger than
        ``keep_newer_than``, or their readers fail. Returns the latest version afterwards.
        """
        self.ensure_scope_index(table)
        handle = self._table(table, create=False)
        with self._lock:  # versions may be deleted below: reopen pinned ones, so a gone one fails typed
            for key in [k for k in self._pinned if k[0] == table]:
                del self._pinned[key]
        try:
            handle.optimize(cleanup_older_than=keep_newer_than)
        except (OSError, ValueError, RuntimeError) as exc:
            raise StoreError(f"{self.uri}/{table}: optimize failed ({exc})") from exc
        return int(handle.version)

    def list_versions(self, table: str) -> list[int]:
        return sorted(int(v["version"]) for v in self._table(table, create=False).list_versions())


def _difference(data: pa.Table, stored: pa.Table, dim: int) -> tuple[npt.NDArray[np.bool_], list[str]]:
    """Which rows of ``data`` differ from ``stored`` (the same conversations' rows now: row_id,
    text, vector) — new, or another text or vector under their row_id — and the stored row ids
    that ``data`` no longer has. Matched in Arrow and numpy, not row by row in Python: the publish
    runs this beside the working database's rows, and a Python loop over ~160,000 rows held the
    interpreter from that thread for seconds (a nightly of 1,000 conversations)."""
    new = pa.table({"row_id": data.column("row_id"), "text": data.column("text"),
                    "n": pa.array(np.arange(data.num_rows, dtype=np.int64))})
    old = pa.table({"row_id": stored.column("row_id"), "stored_text": stored.column("text"),
                    "o": pa.array(np.arange(stored.num_rows, dtype=np.int64))})
    matched = new.join(old, "row_id", join_type="inner")  # row ids are unique on both sides
    n = matched.column("n").to_numpy()
    o = matched.column("o").to_numpy()
    same_text = pc.equal(matched.column("text"), matched.column("stored_text")).to_numpy(zero_copy_only=False)
    same_vector = _same_vectors(_vector_matrix(data.column("vector"), dim), stored.column("vector"), n, o, dim)
    differ = np.ones(data.num_rows, dtype=bool)
    differ[n] = ~(same_text & same_vector)
    gone = pc.filter(stored.column("row_id"), pc.invert(pc.is_in(stored.column("row_id"), value_set=data.column("row_id"))))
    return differ, [str(r) for r in gone.to_pylist()]


def _same_vectors(new: npt.NDArray[np.float32], stored: pa.ChunkedArray, n: npt.NDArray[np.int64],
                  o: npt.NDArray[np.int64], dim: int, step: int = 4096) -> npt.NDArray[np.bool_]:
    """Whether ``new[n[i]]`` and stored row ``o[i]`` hold the same bits (not values: a vector written
    again with other bits, by another model say, differs). Read chunk by chunk where Lance returned
    them, ``step`` rows at a time: gathering both sides whole (2 x 250 MB at 160,000 rows of 384)
    cost ~3 s here in fresh pages, this ~0.1 s."""
    same = np.zeros(n.size, dtype=bool)
    order = np.argsort(o, kind="stable")
    placed = o[order]  # stored positions, ascending
    new_bits = new.view(np.uint32)
    start = 0
    for chunk in stored.chunks:
        stop = start + len(chunk)
        lo, hi = (int(x) for x in np.searchsorted(placed, [start, stop]))
        if hi > lo:
            bits = np.asarray(chunk.flatten().to_numpy(zero_copy_only=False), dtype=np.float32).reshape(-1, dim).view(np.uint32)
            for first in range(lo, hi, step):
                rows = order[first:min(first + step, hi)]
                same[rows] = (new_bits[n[rows]] == bits[o[rows] - start]).all(axis=1)
        start = stop
    return same


def _vector_matrix(column: pa.ChunkedArray, dim: int) -> npt.NDArray[np.float32]:
    if column.num_chunks == 0 or len(column) == 0:
        return np.zeros((0, dim), dtype=np.float32)
    values = column.combine_chunks().flatten().to_numpy(zero_copy_only=False)
    return np.ascontiguousarray(values, dtype=np.float32).reshape(-1, dim)


def _checked_table_name(table: str) -> str:
    if not _TABLE_NAME.match(table):
        raise StoreError(f"invalid vector table name {table!r} (letters, digits, _ and -, at most 64)")
    return table


def _checked_scope(conversation_id: str) -> str:
    if not isinstance(conversation_id, str) or not conversation_id:
        raise ScopeError(f"a vector read or write needs a conversation id, got {conversation_id!r}")
    return conversation_id

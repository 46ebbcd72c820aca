"""Reading conversations back from one published snapshot (the query side's only store access).

A snapshot's DuckDB file is immutable, so a :class:`SnapshotReader` keeps one read-only
connection to it and gives each read its own cursor (DuckDB cursors are independent connections
to the same database, safe to use from different threads). Every read is scoped to one
conversation with ``?`` parameters; vector rows come from LanceDB at the version the snapshot
pins, through the typed scope filter of :class:`~tmem.store.lance.VectorStore`. The vector
width is read from the Lance table's schema, so the store describes itself.

A reader reads snapshots of the current format only (:mod:`tmem.store.snapshot.formats`; an older
one is refused when the reader is made, with the command that upgrades it). A cold load reads the
conversation's image: memory and turns, its vector section (:meth:`SnapshotReader.read_vector_rows`)
and its prebuilt BM25. LanceDB stays the system of record, and the source of the vectors of an image
published without a vector section (``TMEM_SNAPSHOT_IMAGE_VECTORS=false``).

Opening the DuckDB file costs ~15-25 ms and LanceDB ~1.5 s to import, so both happen on first
use only; a lexical-only reader never imports LanceDB.
"""

from __future__ import annotations

import os
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from datetime import datetime
from pathlib import Path
from typing import TYPE_CHECKING

import duckdb

from tmem.domain import ConversationMemory, Turn
from tmem.errors import ScopeError, StoreError
from tmem.retrieval.lexical import PrebuiltBM25, decode_bm25
from tmem.store.conversations import load_turns
from tmem.store.ingest_writer import StoredState, read_stored_state
from tmem.store.memory_rows import read_memory
from tmem.store.snapshot.formats import require_current
from tmem.store.snapshot.image import (
    IMAGE_FILE,
    ImageLocation,
    decode_image,
    image_locations,
    open_image_file,
    read_bytes_at,
    read_image_at,
)
from tmem.store.snapshot.image_vectors import QUERY_VECTOR_TABLE, VectorSection, decode_section
from tmem.store.snapshot.published import MANIFEST, SnapshotInfo

if TYPE_CHECKING:
    from tmem.store.lance import ConversationVectors, VectorStore


@dataclass(frozen=True)
class ColdRead:
    """What :meth:`SnapshotReader.read_cold` read, with how long the two parts took (seconds)."""

    memory: ConversationMemory
    turns: tuple[Turn, ...]
    vectors: VectorSection | None  # None: not asked for, or the snapshot pins no vector table
    bm25: PrebuiltBM25 | None  # the BM25 built at publish; None: build it from the memory
    read_memory_s: float
    read_vectors_s: float
    read_bm25_s: float = 0.0


@dataclass(frozen=True)
class SnapshotConversation:
    """A conversation whose memory a snapshot holds."""

    conversation_id: str
    build_id: str
    built_at: datetime | None
    speakers: tuple[str, ...]
    turns: int


def resolve_lance_uri(info: SnapshotInfo, store: Path) -> str:
    """The snapshot's Lance URI; a relative path is taken relative to the store, else to the cwd."""
    uri = info.lance_uri
    if "://" in uri or Path(uri).is_absolute():
        return uri
    under_store = Path(store) / uri
    if under_store.exists() or not Path(uri).exists():
        return str(under_store)
    return str(Path(uri).resolve())


class SnapshotReader:
    """Read access to one snapshot of the current format (:class:`StoreError` for any other, naming
    what to run). Thread-safe; :meth:`retire` it when a newer snapshot is current (its file is closed
    once idle; a query still pinned to it reopens and finishes)."""

    def __init__(self, info: SnapshotInfo, store: Path, vector_table: str = "vectors") -> None:
        require_current(info.path / MANIFEST, info.image_format, store=Path(store))
        self.info = info
        self.store = Path(store)
        self.vector_table = vector_table
        self._lock = threading.Lock()
        self._con: duckdb.DuckDBPyConnection | None = None
        self._image_fd: int | None = None  # conversation_images.bin, open while _con is
        self._locations: dict[str, ImageLocation] | None = None  # the image index, read once (immutable)
        self._vectors: VectorStore | None = None
        self._vectors_resolved = False
        self._inflight = 0
        self._retired = False

    # ---- DuckDB ----------------------------------------------------------------------------

    def _open_locked(self) -> duckdb.DuckDBPyConnection:
        """The open connection (opened with the image file now if closed); call with the lock held."""
        if self._con is None:
            path = self.info.memory_db
            if not path.is_file():
                raise StoreError(f"snapshot {self.info.snapshot_id!r}: {path} is missing (pruned while in use?)")
            image_fd = open_image_file(self.info.path)
            try:
                self._con = duckdb.connect(str(path), read_only=True)
            except duckdb.Error as exc:
                if image_fd is not None:
                    os.close(image_fd)
                raise StoreError(f"snapshot {self.info.snapshot_id!r}: cannot open {path} read-only ({exc})") from exc
            self._image_fd = image_fd
        return self._con

    def _release(self) -> None:
        with self._lock:
            self._inflight -= 1
            idle = self._retired and self._inflight == 0
        if idle:
            self._close_connection()

    @contextmanager
    def _image_file(self) -> Iterator[int]:
        """The open image file descriptor, kept open while the block runs (no DuckDB cursor)."""
        with self._lock:
            self._open_locked()
            assert self._image_fd is not None  # opened with the connection
            fd = self._image_fd
            self._inflight += 1
        try:
            yield fd
        finally:
            self._release()

    @contextmanager
    def _cursor(self) -> Iterator[duckdb.DuckDBPyConnection]:
        with self._lock:
            cursor = self._open_locked().cursor()
            self._inflight += 1
        try:
            cursor.execute("SET TimeZone = 'UTC'")
            yield cursor
        except duckdb.Error as exc:
            raise StoreError(f"snapshot {self.info.snapshot_id!r}: read failed ({exc})") from exc
        finally:
            cursor.close()
            self._release()

    @contextmanager
    def tables(self) -> Iterator[duckdb.DuckDBPyConnection]:
        """A read-only cursor on the snapshot's tables, for catalogue reads (counts, run and
        quarantine records: :mod:`tmem.store.snapshot.catalog`); DuckDB errors become StoreError."""
        with self._cursor() as cursor:
            yield cursor

    def read_conversation(self, conversation_id: str, *, from_tables: bool = False) -> tuple[ConversationMemory, tuple[Turn, ...]]:
        """The memory and turns of one conversation. :class:`ScopeError` when the snapshot holds
        no memory for it (exact match on the id, whatever characters it contains).

        Read from the conversation's image (one point read), or with ``from_tables`` from the
        snapshot's tables (the system of record the images are derived from); both give equal objects."""
        self._check_scope(conversation_id)
        if from_tables:
            with self._cursor() as cursor:
                return read_memory(cursor, conversation_id), load_turns(cursor, conversation_id)
        where = self._locate(conversation_id)
        with self._image_file() as fd:
            document = read_image_at(fd, self._image_source, conversation_id, where.byte_offset, where.byte_length)
        return decode_image(conversation_id, where.format, document, source=self._image_source)

    def read_cold(self, conversation_id: str, *, vectors: bool = True) -> ColdRead:
        """Everything a cold index load reads: memory, turns, (with ``vectors``) the vector rows and
        the prebuilt BM25, from one image with one lookup; vectors the image has no section for come
        from LanceDB (:meth:`read_vector_rows`)."""
        started = time.perf_counter()
        self._check_scope(conversation_id)
        where = self._locate(conversation_id)
        source = self._image_source
        in_image = vectors and where.vector_bytes > 0 and self.vector_table == QUERY_VECTOR_TABLE
        rows: VectorSection | None = None
        bm25: PrebuiltBM25 | None = None
        with self._image_file() as fd:
            document = read_image_at(fd, source, conversation_id, where.byte_offset, where.byte_length)
            memory, turns = decode_image(conversation_id, where.format, document, source=source)
            memory_done = time.perf_counter()
            start = where.byte_offset + where.byte_length
            if in_image:
                rows = self._vector_section(fd, conversation_id, where)
            vectors_done = time.perf_counter()
            if where.lexical_bytes > 0:
                data = read_bytes_at(fd, source, conversation_id, start + where.vector_bytes, where.lexical_bytes)
                n_docs = len(memory.topics) + len(memory.scenes) + len(memory.items)
                bm25 = decode_bm25(data, n_docs, source=f"{source}: image of {conversation_id!r}")
            bm25_done = time.perf_counter()
        if vectors and not in_image:  # published without a vector section: LanceDB
            rows = self.read_vector_rows(conversation_id, from_lance=True)
        return ColdRead(memory, turns, rows, bm25, memory_done - started,
                        vectors_done - memory_done + time.perf_counter() - bm25_done, bm25_done - vectors_done)

    def _vector_section(self, fd: int, conversation_id: str, where: ImageLocation) -> VectorSection:
        """The vector section stored right after the conversation's document in the open image file."""
        data = read_bytes_at(fd, self._image_source, conversation_id, where.byte_offset + where.byte_length,
                             where.vector_bytes)
        return decode_section(data, conversation_id, self.vector_table, source=self._image_source)

    @property
    def _image_source(self) -> str:
        return f"snapshot {self.info.snapshot_id!r} ({self.info.path / IMAGE_FILE})"

    def _locate(self, conversation_id: str) -> ImageLocation:
        """Where the conversation's image is: the snapshot's image index is read once into a dict
        (a few ms; a point query per cold load cost a cursor and a query), then looked up by id."""
        locations = self._locations
        if locations is None:
            with self._cursor() as cursor:
                locations = image_locations(cursor)
            self._locations = locations
        where = locations.get(conversation_id)
        if where is None:
            raise StoreError(f"{self._image_source}: the manifest lists {conversation_id!r} but its image row is missing")
        return where

    def _check_scope(self, conversation_id: str) -> None:
        if not isinstance(conversation_id, str) or conversation_id not in self.info.conversations:
            raise ScopeError(f"snapshot {self.info.snapshot_id!r} holds no memory for conversation {conversation_id!r}")

    def stored_state(self, conversation_id: str) -> StoredState:
        """The conversation's ingested rows as this snapshot copied them (conversation, turns and
        the sessions they imply), in the shape ingest plans against; empty when it holds none."""
        with self._cursor() as cursor:
            return read_stored_state(cursor, [conversation_id], sessions_from_turns=True)

    def list_conversations(self) -> tuple[SnapshotConversation, ...]:
        """Every conversation with published memory, ordered by id."""
        with self._cursor() as cursor:
            rows = cursor.execute(
                "SELECT b.conversation_id, b.build_id, b.built_at, c.speakers, "
                "(SELECT count(*) FROM turns t WHERE t.conversation_id = b.conversation_id) "
                "FROM memory_builds b LEFT JOIN conversations c USING (conversation_id) ORDER BY b.conversation_id"
            ).fetchall()
        return tuple(
            SnapshotConversation(
                conversation_id=r[0], build_id=r[1], built_at=r[2], speakers=tuple(r[3] or ()), turns=int(r[4])
            )
            for r in rows
        )

    # ---- LanceDB ---------------------------------------------------------------------------

    @property
    def vector_version(self) -> int | None:
        version = self.info.lance_versions.get(self.vector_table)
        return version if version is not None and version >= 1 else None

    def _vector_store(self) -> VectorStore | None:
        with self._lock:
            if not self._vectors_resolved:
                version = self.vector_version
                if version is not None:
                    from tmem.store.lance import VectorStore  # lancedb costs ~1.5 s to import

                    uri = resolve_lance_uri(self.info, self.store)
                    dim = _vector_dim(uri, self.vector_table, version)
                    self._vectors = VectorStore(uri, dim) if dim is not None else None
                self._vectors_resolved = True
            return self._vectors

    def read_vector_rows(self, conversation_id: str, *, from_lance: bool = False) -> VectorSection | None:
        """The conversation's query-side vector rows at the pinned version; ``None`` when the
        snapshot pins no vector table. From the conversation's image when it has a vector section
        (one ``pread``), else, or with ``from_lance``, from LanceDB; both give equal rows."""
        self._check_scope(conversation_id)
        if not from_lance and self.vector_table == QUERY_VECTOR_TABLE:
            where = self._locate(conversation_id)
            if where.vector_bytes > 0:
                with self._image_file() as fd:
                    return self._vector_section(fd, conversation_id, where)
        rows = self.read_vectors(conversation_id)
        if rows is None:
            return None
        meta = rows.meta
        return VectorSection(
            conversation_id, self.vector_table, tuple(meta.column("owner_kind").to_pylist()),
            tuple(meta.column("owner_id").to_pylist()), tuple(meta.column("view").to_pylist()),
            tuple(int(o) for o in meta.column("ordinal").to_pylist()), rows.vectors,
        )

    def read_vectors(self, conversation_id: str) -> ConversationVectors | None:
        """The conversation's vector rows at the pinned version; ``None`` when the snapshot pins
        no vector table. Raises :class:`StoreError` if a row of another conversation came back."""
        self._check_scope(conversation_id)
        store = self._vector_store()
        version = self.vector_version
        if store is None or version is None:
            return None
        rows = store.load_conversation(self.vector_table, conversation_id, version=version)
        owners = set(rows.meta.column("conversation_id").to_pylist())
        if owners - {conversation_id}:  # the typed filter makes this impossible; checked anyway
            raise StoreError(
                f"{store.uri}/{self.vector_table}@{version}: rows of other conversations returned for {conversation_id!r}"
            )
        return rows

    @property
    def retired(self) -> bool:
        return self._retired

    def retire(self) -> None:
        """The snapshot is no longer current: close the file once no read is using it (a later
        read reopens it and closes it again when done)."""
        with self._lock:
            self._retired = True
            idle = self._inflight == 0
        if idle:
            self._close_connection()

    def _close_connection(self) -> None:
        with self._lock:
            if self._inflight:
                return
            con, self._con = self._con, None
            image_fd, self._image_fd = self._image_fd, None
        if con is not None:
            con.close()
        if image_fd is not None:
            os.close(image_fd)


def _vector_dim(uri: str, table: str, version: int) -> int | None:
    """The vector width of ``table`` at ``version``; ``None`` when the table does not exist."""
    import lancedb
    import pyarrow as pa

    try:
        db = lancedb.connect(uri)
        names: set[str] = set()
        page: str | None = None
        while True:
            response = db.list_tables(page_token=page)
            names.update(response.tables)
            page = response.page_token
            if not page:
                break
        if table not in names:
            return None
        schema = db.open_table(table, version=version).schema
    except (OSError, ValueError, RuntimeError) as exc:
        raise StoreError(f"{uri}/{table}@{version}: cannot read the vector schema ({exc})") from exc
    vector_type = schema.field("vector").type
    if not pa.types.is_fixed_size_list(vector_type):
        raise StoreError(f"{uri}/{table}@{version}: vector column is {vector_type}, not a fixed-size list")
    return int(vector_type.list_size)

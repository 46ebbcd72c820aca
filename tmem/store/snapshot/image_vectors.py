"""The vector section of a conversation image: its query-side vector rows as raw float32 bytes.

LanceDB stays the system of record for vectors; at publish, :func:`~tmem.store.snapshot.image.
write_conversation_images` copies each conversation's rows of the query table (``vectors``) at the
version the snapshot pins into the conversation's image, right after its memory document, so a cold
load reads them with one ``pread`` instead of a scoped Lance query (bench/query.py --part scale).

A section is ``<u32 header length><header JSON><float32 rows, little-endian>``; the header names the
conversation, the Lance table, the width and, per row, ``[owner_kind, owner_id, view, ordinal]`` in
the order :meth:`~tmem.store.lance.VectorStore.load_conversation` returns them. The reader checks the
conversation, the table and that the byte count matches the rows, so a damaged or misplaced section
is a :class:`StoreError`, never wrong vectors.

Reuse: an unchanged image is copied from the previous snapshot when its source key is equal. For the
vectors that key digests the Lance row addresses of the conversation's rows at the pinned version:
Lance data files are immutable and a rewritten row (update, compaction) gets a new address, so equal
addresses mean the same stored rows, whatever the table version (every publish makes a new one).
"""

from __future__ import annotations

import hashlib
import itertools
import json
import struct
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, Protocol

import numpy as np
import numpy.typing as npt

from tmem.errors import StoreError

if TYPE_CHECKING:
    import pyarrow as pa

    from tmem.store.lance import VectorStore

QUERY_VECTOR_TABLE = "vectors"  # the table the query side reads (SnapshotReader's default)
_LEN = struct.Struct("<I")
_ORDER = ["owner_kind", "owner_id", "view", "ordinal"]


@dataclass(frozen=True)
class VectorSection:
    """One conversation's vector rows: ``vectors[i]`` is the vector of row ``i``."""

    conversation_id: str
    table: str
    owner_kinds: tuple[str, ...]
    owner_ids: tuple[str, ...]
    views: tuple[str, ...]
    ordinals: tuple[int, ...]
    vectors: npt.NDArray[np.float32]

    def __len__(self) -> int:
        return len(self.owner_ids)


class VectorSource(Protocol):
    """Where a publish takes the vector sections from (the Lance table at the pinned version)."""

    table: str
    dim: int

    def keys(self) -> dict[str, str]:
        """Per conversation, a digest of its stored rows (equal digests: equal rows)."""
        ...

    def load(self, conversation_ids: list[str]) -> dict[str, VectorSection]:
        """The sections of these conversations (an empty one for a conversation without rows)."""
        ...


def encode_section(section: VectorSection) -> bytes:
    n = len(section)
    dim = int(section.vectors.shape[1]) if section.vectors.ndim == 2 else 0
    if section.vectors.shape[0] != n or not (len(section.owner_kinds) == len(section.views) == len(section.ordinals) == n):
        raise StoreError(f"vector section of {section.conversation_id!r}: columns of different lengths")
    header = json.dumps({
        "conversation_id": section.conversation_id, "table": section.table, "dim": dim,
        "owner_kinds": section.owner_kinds, "owner_ids": section.owner_ids, "views": section.views,
        "ordinals": section.ordinals,
    }, separators=(",", ":")).encode("utf-8")
    body = np.ascontiguousarray(section.vectors, dtype="<f4").tobytes()
    return _LEN.pack(len(header)) + header + body


def decode_section(data: bytes, conversation_id: str, table: str, *, source: str) -> VectorSection:
    """The section in ``data``; :class:`StoreError` (naming ``source``) when it belongs to another
    conversation or table, or is cut short or malformed."""
    what = f"{source}: vector section of {conversation_id!r}"
    if len(data) < _LEN.size:
        raise StoreError(f"{what} is cut short ({len(data)} bytes)")
    (size,) = _LEN.unpack_from(data)
    view = memoryview(data)
    try:
        header: Any = json.loads(bytes(view[_LEN.size : _LEN.size + size]).decode("utf-8"))
    except (UnicodeDecodeError, ValueError) as exc:
        raise StoreError(f"{what} is corrupt ({exc})") from exc
    if not isinstance(header, dict) or header.get("conversation_id") != conversation_id:
        owner = header.get("conversation_id") if isinstance(header, dict) else None
        raise StoreError(f"{what}: the section read belongs to {owner!r} (or has no header)")
    if header.get("table") != table:
        raise StoreError(f"{what} holds table {header.get('table')!r}, the reader wants {table!r}")
    try:
        columns = [tuple(header[c]) for c in ("owner_kinds", "owner_ids", "views", "ordinals")]
        n, dim = len(columns[1]), int(header["dim"])
        body = view[_LEN.size + size :]
        if any(len(c) != n for c in columns) or len(body) != n * dim * 4:
            raise StoreError(f"{what}: {len(body)} vector bytes and columns of {[len(c) for c in columns]} "
                             f"rows for {n} rows of {dim} floats")
        vectors = np.frombuffer(body, dtype="<f4").reshape(n, dim)
        if vectors.dtype != np.float32:  # a big-endian machine
            vectors = vectors.astype(np.float32)
        kinds, owners, views, ordinals = columns
        return VectorSection(conversation_id, table, kinds, owners, views, ordinals, vectors)
    except (KeyError, TypeError, ValueError) as exc:
        raise StoreError(f"{what} is malformed ({exc!r})") from exc


class LanceVectorSource:
    """The conversations' rows of ``table`` at ``version`` (a pinned, immutable table version)."""

    def __init__(self, store: VectorStore, table: str, version: int) -> None:
        self.store, self.table, self.version, self.dim = store, table, int(version), store.dim

    def keys(self) -> dict[str, str]:
        handle = self.store._reader(self.table, self.version)
        data = handle.search().select(["conversation_id", "_rowaddr"]).limit(None).to_arrow()
        data = data.sort_by([("conversation_id", "ascending"), ("_rowaddr", "ascending")])
        ids = data.column("conversation_id").combine_chunks()
        addrs = data.column("_rowaddr").to_numpy().astype("<u8")
        codes = ids.dictionary_encode().indices.to_numpy()
        bounds = [0, *(np.flatnonzero(np.diff(codes) != 0) + 1).tolist(), len(codes)]
        out: dict[str, str] = {}
        for start, end in itertools.pairwise(bounds):
            if end > start:
                digest = hashlib.md5(addrs[start:end].tobytes(), usedforsecurity=False).hexdigest()
                out[str(ids[start].as_py())] = f"{self.table}|{self.dim}|{digest}"
        return out

    def load(self, conversation_ids: list[str]) -> dict[str, VectorSection]:
        from lancedb.expr import col

        handle = self.store._reader(self.table, self.version)
        try:
            data = handle.search().where(col("conversation_id").isin(list(conversation_ids))).limit(None).to_arrow()
        except (OSError, ValueError, RuntimeError) as exc:
            raise StoreError(f"{self.store.uri}/{self.table}@{self.version}: reading vectors failed ({exc})") from exc
        data = data.sort_by([("conversation_id", "ascending")] + [(c, "ascending") for c in _ORDER])
        return _split(data, conversation_ids, self.table, self.dim)


def _split(data: pa.Table, conversation_ids: list[str], table: str, dim: int) -> dict[str, VectorSection]:
    from tmem.store.lance import _vector_matrix

    wanted = set(conversation_ids)
    cids = data.column("conversation_id").to_pylist()
    stray = set(cids) - wanted
    if stray:  # the typed filter makes this impossible; checked anyway
        raise StoreError(f"{table}: rows of {sorted(stray)[:3]} returned for conversations {sorted(wanted)[:3]}")
    columns = {c: data.column(c).to_pylist() for c in _ORDER}
    matrix = _vector_matrix(data.column("vector"), dim)
    out = {cid: VectorSection(cid, table, (), (), (), (), np.zeros((0, dim), np.float32)) for cid in conversation_ids}
    start = 0
    for end in range(1, len(cids) + 1):
        if end == len(cids) or cids[end] != cids[start]:
            out[cids[start]] = VectorSection(
                cids[start], table, tuple(columns["owner_kind"][start:end]), tuple(columns["owner_id"][start:end]),
                tuple(columns["view"][start:end]), tuple(int(o) for o in columns["ordinal"][start:end]),
                matrix[start:end],
            )
            start = end
    return out


def lance_source(uri: str, versions: dict[str, int], table: str = QUERY_VECTOR_TABLE) -> LanceVectorSource | None:
    """The source of a publish pinning ``versions`` of the Lance tables at ``uri``; ``None`` when
    it pins no version of ``table`` or the table does not exist (images then carry no vector
    section: readers go to Lance, which has none either, as ``SnapshotReader`` does)."""
    version = versions.get(table)
    if version is None or version < 1:
        return None
    import lancedb

    from tmem.store.lance import VectorStore

    if "://" not in uri and not Path(uri).is_dir():  # connecting would create the directory
        return None
    try:
        db = lancedb.connect(uri)
        if not VectorStore(uri, 1).has_table(table):
            return None
        schema = db.open_table(table, version=version).schema
    except (OSError, ValueError, RuntimeError) as exc:
        raise StoreError(f"{uri}/{table}@{version}: cannot read the vector schema for the images ({exc})") from exc
    return LanceVectorSource(VectorStore(uri, int(schema.field("vector").type.list_size)), table, version)

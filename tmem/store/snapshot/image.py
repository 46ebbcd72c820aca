"""A conversation's query-side image: its memory and turns as ONE record of a published snapshot.

The snapshot's memory tables and turns stay the system of record. At publish time
:func:`write_conversation_images` derives from them, with SQL over the snapshot's own tables, one
JSON document per published conversation, holding per table exactly the rows the per-table reads
of :mod:`tmem.store.memory_rows` (``MEMORY_ROW_QUERIES``) and :mod:`tmem.store.conversations`
(``TURN_ROW_QUERY``) return, in the same order, with timestamps as epoch microseconds. A cold load
then costs a dict lookup, one ``pread`` and one ``json.loads`` instead of nine queries, and
is assembled by the same functions as the table read (``memory_from_rows``, ``turns_from_rows``),
so both paths give equal objects (``tests/test_conversation_image.py``).

The documents are zlib-compressed into ``conversation_images.bin`` beside ``memory.duckdb``; the
snapshot's table ``conversation_images(conversation_id, format, byte_offset, byte_length,
vector_bytes, lexical_bytes, source_key)`` says where each is. (Stored as a VARCHAR column of the
snapshot instead, one ~120 KB document per row, a point read cost 0.6-1.9 s at 10,000
conversations: DuckDB decompressed whole column segments.) A reader loads that table once into a
dict (:func:`image_locations`), so a cold load makes no DuckDB query at all.

Each document is followed by two derived sections: the conversation's vector rows of the pinned
Lance table (``vector_bytes``, :mod:`tmem.store.snapshot.image_vectors`) and its BM25 index built at
publish (``lexical_bytes``, :mod:`tmem.retrieval.lexical`); either may be absent (0 bytes: published
with ``TMEM_SNAPSHOT_IMAGE_VECTORS=false``, or by a caller without a lexical section), and the reader
then goes to Lance or builds BM25 itself. Each section names its conversation and is checked.

Rows are grouped by ``conversation_id`` in SQL, so a document holds only its conversation's rows
whatever characters the id contains; the reader also checks the id stored inside the document.
``format`` versions the image: this module writes and decodes :data:`~tmem.store.snapshot.formats.IMAGE_FORMAT`
only (older snapshots are refused, or rewritten by :mod:`tmem.store.snapshot.upgrade`).
"""

from __future__ import annotations

import json
import logging
import os
import zlib
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import Any, NamedTuple, Protocol

import duckdb
import pyarrow as pa

from tmem.domain import ConversationMemory, Turn
from tmem.errors import StoreError
from tmem.store.conversations import turns_from_rows
from tmem.store.memory_rows import Rows, memory_from_rows
from tmem.store.snapshot.formats import IMAGE_FORMAT
from tmem.store.snapshot.image_vectors import VectorSource, encode_section

log = logging.getLogger(__name__)

IMAGE_TABLE = "conversation_images"
IMAGE_FILE = "conversation_images.bin"

_EPOCH = datetime(1970, 1, 1, tzinfo=UTC)

# name -> (row expression, FROM clause, ORDER BY inside the conversation); the orders are those
# of MEMORY_ROW_QUERIES / TURN_ROW_QUERY. Every FROM exposes the grouping column as ``g``.
_PARTS: dict[str, tuple[str, str, str]] = {
    "scenes": (
        "json_array(scene_id, seq, title, summary, narrative, turn_ids, epoch_us(start_time), epoch_us(end_time))",
        "(SELECT *, conversation_id AS g FROM {s}.scenes)", "seq, scene_id",
    ),
    "topic_scene": (
        "json_array(ts.topic_id, ts.scene_id)",
        "(SELECT ts.conversation_id AS g, ts.topic_id, ts.scene_id, s.seq FROM {s}.topic_scene ts "
        "JOIN {s}.scenes s USING (conversation_id, scene_id)) ts", "ts.seq, ts.topic_id, ts.scene_id",
    ),
    "topics": ("json_array(topic_id, seq, title, keywords)", "(SELECT *, conversation_id AS g FROM {s}.topics)", "seq, topic_id"),
    "item_scene": (
        "json_array(i.item_id, i.scene_id)",
        "(SELECT i.conversation_id AS g, i.item_id, i.scene_id, s.seq FROM {s}.item_scene i "
        "JOIN {s}.scenes s USING (conversation_id, scene_id)) i", "i.seq, i.item_id, i.scene_id",
    ),
    "items": (
        "json_array(item_id, topic_id, kind, content, epoch_us(event_time), keywords, epoch_us(event_end), "
        "time_granularity, time_phrase, time_source)",
        "(SELECT *, conversation_id AS g FROM {s}.items)", "item_id",
    ),
    "item_triggers": (
        "json_array(item_id, family, text, rationale)",
        "(SELECT *, conversation_id AS g FROM {s}.item_triggers)", "item_id, family, ordinal",
    ),
    "scene_triggers": (
        "json_array(scene_id, family, channel, text)",
        "(SELECT *, conversation_id AS g FROM {s}.scene_triggers)", "scene_id, family, channel",
    ),
    "personas": ("json_array(speaker, persona::VARCHAR)", "(SELECT *, conversation_id AS g FROM {s}.personas)", "speaker"),
    "turns": (
        "json_array(session_id, turn_id, seq, speaker, text, epoch_us(event_time), metadata::VARCHAR)",
        "(SELECT *, conversation_id AS g FROM {s}.turns)", "seq, turn_id",
    ),
}


class LexicalSection(Protocol):
    """What a publish stores after the vectors: the prebuilt BM25 of a memory
    (:mod:`tmem.retrieval.lexical`); ``recipe`` is part of the images' source keys."""

    recipe: str

    def encode(self, memory: ConversationMemory) -> bytes: ...


# Conversations per INSERT: list aggregation keeps a batch's documents in memory (~1 MB per
# conversation of the bench's synthetic shape); all 10,000 at once needed > 12 GB.
IMAGE_BATCH = 256


def image_sql(schema: str) -> str:
    """The SELECT building the images of the conversations of ``schema.memory_builds`` whose ids lie
    in ``[$1, $2]`` from that schema's tables, ordered by conversation id."""
    if not schema.isidentifier():
        raise ValueError(f"schema must be a plain identifier, got {schema!r}")
    ctes = ",\n".join(
        f"p_{name} AS (SELECT g, to_json(list({expr} ORDER BY {order})) AS r "  # noqa: S608 -- fixed names
        f"FROM {source.format(s=schema)} WHERE g BETWEEN $1 AND $2 GROUP BY g)"
        for name, (expr, source, order) in _PARTS.items()
    )
    fields = ", ".join(f"'{name}', coalesce(p_{name}.r, '[]'::JSON)" for name in _PARTS)
    joins = " ".join(f"LEFT JOIN p_{name} ON p_{name}.g = b.conversation_id" for name in _PARTS)
    return (
        f"WITH {ctes}\n"
        f"SELECT b.conversation_id, {IMAGE_FORMAT} AS format, "
        f"json_object('conversation_id', b.conversation_id, 'format', {IMAGE_FORMAT}, {fields})::VARCHAR AS image "
        f"FROM {schema}.memory_builds b {joins} WHERE b.conversation_id BETWEEN $1 AND $2 ORDER BY b.conversation_id"
    )


def _source_keys(con: duckdb.DuckDBPyConnection, schema: str) -> dict[str, str]:
    """Per conversation, a digest of everything its image is derived from: the build (a content hash
    of its memory), its turns (append-only: their count and last sequence number) and its
    conversation row. Equal keys mean equal images, so a publish copies those from the last one."""
    rows = con.execute(
        f"SELECT b.conversation_id, md5(concat_ws('|', b.build_id, coalesce(t.n, 0)::VARCHAR, "  # noqa: S608
        f"coalesce(t.m, -1)::VARCHAR, coalesce(to_json(c)::VARCHAR, ''))) "
        f"FROM {schema}.memory_builds b "
        f"LEFT JOIN (SELECT conversation_id, count(*) AS n, max(seq) AS m FROM {schema}.turns GROUP BY 1) t "
        f"USING (conversation_id) LEFT JOIN {schema}.conversations c USING (conversation_id)"
    ).fetchall()
    return {str(r[0]): str(r[1]) for r in rows}


def _previous_images(previous: Path | None) -> dict[str, tuple[str, int, int, int, int]]:
    """``conversation_id -> (source_key, offset, length, vector bytes, lexical bytes)`` of a published snapshot's
    images (the caller passes a snapshot of the current format only); empty when there is none."""
    if previous is None or not (previous / IMAGE_FILE).is_file():
        return {}
    prev = duckdb.connect(str(previous / "memory.duckdb"), read_only=True)
    try:
        rows = prev.execute(
            f"SELECT conversation_id, source_key, byte_offset, byte_length, vector_bytes, lexical_bytes FROM {IMAGE_TABLE} "  # noqa: S608
            f"WHERE format = {IMAGE_FORMAT}"
        ).fetchall()
    except duckdb.Error as exc:  # nothing is reused: every image is computed afresh (same result, slower)
        log.warning("%s: cannot read the previous images' index, recomputing every image (%s)", previous, exc)
        return {}
    finally:
        prev.close()
    return {str(r[0]): (str(r[1]), int(r[2]), int(r[3]), int(r[4]), int(r[5])) for r in rows}


def _runs(ids: list[str], todo: set[str], batch: int) -> list[list[str]]:
    """Consecutive (in id order) conversations to compute, cut into runs of at most ``batch``: each
    run is one ``BETWEEN first AND last`` statement that covers no reused conversation."""
    runs: list[list[str]] = []
    current: list[str] = []
    for cid in ids:
        if cid in todo and len(current) < batch:
            current.append(cid)
            continue
        if current:
            runs.append(current)
        current = [cid] if cid in todo else []
    if current:
        runs.append(current)
    return runs


def write_conversation_images(
    con: duckdb.DuckDBPyConnection, schema: str, directory: Path, batch: int = IMAGE_BATCH,
    previous: Path | None = None, vectors: VectorSource | None = None, lexical: LexicalSection | None = None,
) -> tuple[int, int]:
    """Write ``directory/conversation_images.bin`` and its table ``<schema>.conversation_images`` from
    that schema's tables, ``batch`` conversations per statement; with ``vectors``, each image is
    followed by the conversation's vector section. Images whose source key equals the one in the
    ``previous`` snapshot directory are copied from it instead of recomputed. Returns ``(images
    written, images copied)``."""
    select = image_sql(schema)
    keys = _source_keys(con, schema)
    if vectors is not None:
        vector_keys = vectors.keys()
        keys = {cid: f"{key}|vectors:{vector_keys.get(cid, f'{vectors.table}|{vectors.dim}|none')}"
                for cid, key in keys.items()}
    if lexical is not None:
        keys = {cid: f"{key}|lexical:{lexical.recipe}" for cid, key in keys.items()}
    ids = sorted(keys)
    old = _previous_images(previous)
    reuse = {cid for cid in ids if cid in old and old[cid][0] == keys[cid]}
    computed: dict[str, tuple[int, str]] = {}
    sections: dict[str, bytes] = {}
    placed: dict[str, tuple[int, int, int, int, int]] = {}
    prev_fd = open_image_file(previous) if reuse and previous is not None else None
    try:
        with open(Path(directory) / IMAGE_FILE, "wb") as out:

            def put(cid: str, fmt: int, data: bytes, vector_bytes: int, lexical_bytes: int) -> None:
                placed[cid] = (fmt, out.tell(), len(data) - vector_bytes - lexical_bytes, vector_bytes, lexical_bytes)
                out.write(data)

            runs = iter(_runs(ids, set(ids) - reuse, batch))
            for cid in ids:
                if cid in reuse and prev_fd is not None:
                    _, offset, length, vector_bytes, lexical_bytes = old[cid]
                    data = os.pread(prev_fd, length + vector_bytes + lexical_bytes, offset)
                    if len(data) != length + vector_bytes + lexical_bytes:
                        raise StoreError(f"{previous}/{IMAGE_FILE}: image of {cid!r} is cut short")
                    put(cid, IMAGE_FORMAT, data, vector_bytes, lexical_bytes)
                    continue
                if cid not in computed:
                    chunk = next(runs)
                    for row_id, fmt, image in con.execute(select, [chunk[0], chunk[-1]]).fetchall():
                        computed[row_id] = (int(fmt), str(image))
                    if vectors is not None:
                        sections = {c: encode_section(v) for c, v in vectors.load(chunk).items()}
                fmt, image = computed.pop(cid)
                section = sections.pop(cid, b"")
                lex = lexical.encode(decode_image(cid, fmt, image, turns=False)[0]) if lexical is not None else b""
                put(cid, fmt, zlib.compress(image.encode("utf-8"), 1) + section + lex, len(section), len(lex))
            out.flush()
            os.fsync(out.fileno())
    finally:
        if prev_fd is not None:
            os.close(prev_fd)
    index = pa.table({
        "conversation_id": pa.array(ids, pa.string()),
        "format": pa.array([placed[c][0] for c in ids], pa.int32()),
        "byte_offset": pa.array([placed[c][1] for c in ids], pa.int64()),
        "byte_length": pa.array([placed[c][2] for c in ids], pa.int64()),
        "vector_bytes": pa.array([placed[c][3] for c in ids], pa.int64()),
        "lexical_bytes": pa.array([placed[c][4] for c in ids], pa.int64()),
        "source_key": pa.array([keys[c] for c in ids], pa.string()),
    })
    write_image_index(con, schema, index)
    return len(ids), len(reuse)


def write_image_index(con: duckdb.DuckDBPyConnection, schema: str, index: pa.Table) -> None:
    """Create ``<schema>.conversation_images`` holding ``index`` (its columns in table order)."""
    con.execute(
        f"CREATE TABLE {schema}.{IMAGE_TABLE} (conversation_id VARCHAR NOT NULL, format INTEGER NOT NULL, "
        "byte_offset BIGINT NOT NULL, byte_length BIGINT NOT NULL, vector_bytes BIGINT NOT NULL, "
        "lexical_bytes BIGINT NOT NULL, "
        "source_key VARCHAR NOT NULL)"
    )
    con.register("tmem_image_index", index)
    try:
        con.execute(
            f"INSERT INTO {schema}.{IMAGE_TABLE} SELECT * FROM tmem_image_index ORDER BY conversation_id"  # noqa: S608
        )
    finally:
        con.unregister("tmem_image_index")


class ImageLocation(NamedTuple):
    """Where one conversation's image lies in the image file; its vector section (when the publish
    wrote one) follows the document directly, its prebuilt BM25 the vector section."""

    format: int
    byte_offset: int
    byte_length: int
    vector_bytes: int
    lexical_bytes: int


_LOCATION_COLUMNS = "format, byte_offset, byte_length, vector_bytes, lexical_bytes"


def image_location(con: duckdb.DuckDBPyConnection, conversation_id: str) -> ImageLocation | None:
    """Where one conversation's image is, or ``None`` if it has none."""
    row = con.execute(
        f"SELECT {_LOCATION_COLUMNS} FROM {IMAGE_TABLE} WHERE conversation_id = ?",  # noqa: S608
        [conversation_id],
    ).fetchone()
    return None if row is None else ImageLocation(*(int(v) for v in row))


def image_locations(con: duckdb.DuckDBPyConnection) -> dict[str, ImageLocation]:
    """Every conversation's image location, by conversation id (the reader keeps this in memory)."""
    rows = con.execute(f"SELECT conversation_id, {_LOCATION_COLUMNS} FROM {IMAGE_TABLE}").fetchall()  # noqa: S608
    return {str(r[0]): ImageLocation(*(int(v) for v in r[1:])) for r in rows}


def read_image_at(fd: int, source: str, conversation_id: str, offset: int, length: int) -> str:
    """The document stored at ``offset`` in the open image file ``fd`` (``source`` names it in
    errors). :class:`StoreError` when it is cut short or corrupt."""
    data = read_bytes_at(fd, source, conversation_id, offset, length)
    try:
        return zlib.decompress(data).decode("utf-8")
    except (zlib.error, UnicodeDecodeError) as exc:
        raise StoreError(f"{source}: image of {conversation_id!r} is corrupt ({exc})") from exc


def read_bytes_at(fd: int, source: str, conversation_id: str, offset: int, length: int) -> bytes:
    """``length`` bytes of the image file at ``offset``; :class:`StoreError` when cut short."""
    data = os.pread(fd, length, offset)
    if len(data) != length:
        raise StoreError(f"{source}: image of {conversation_id!r} is cut short ({len(data)} of {length} bytes)")
    return data


def open_image_file(directory: Path) -> int:
    """A read-only descriptor of the snapshot directory's image file (:class:`StoreError` if missing)."""
    path = Path(directory) / IMAGE_FILE
    try:
        return os.open(path, os.O_RDONLY)
    except OSError as exc:
        raise StoreError(f"{path}: cannot open the conversation images ({exc})") from exc


def read_image(con: duckdb.DuckDBPyConnection, directory: Path, conversation_id: str) -> tuple[int, str] | None:
    """``(format, document)`` of one conversation of the snapshot in ``directory`` (``con`` is its
    ``memory.duckdb``), or ``None`` when it holds no image for it."""
    where = image_location(con, conversation_id)
    if where is None:
        return None
    fd = open_image_file(directory)
    try:
        return where[0], read_image_at(fd, str(Path(directory) / IMAGE_FILE), conversation_id, where[1], where[2])
    finally:
        os.close(fd)


def _ts(us: int | None) -> datetime | None:
    return None if us is None else _EPOCH + timedelta(microseconds=int(us))


def _with_times(rows: list[list[Any]], *columns: int) -> list[list[Any]]:
    """Epoch-microsecond columns as datetimes."""
    for r in rows:
        for c in columns:
            r[c] = _ts(r[c])
    return rows


def decode_image(conversation_id: str, fmt: int, image: str, *, source: str = "image",
                 turns: bool = True) -> tuple[ConversationMemory, tuple[Turn, ...]]:
    """The memory and turns an image's document holds (``turns=False``: the memory only, and no turns;
    what a publish needs to index the memory, ~40 % of the decoding of a nightly's images).
    :class:`StoreError` (naming ``source``) for an image of another format or conversation, or a
    document that is not an image."""
    if fmt != IMAGE_FORMAT:
        raise StoreError(f"{source}: image of {conversation_id!r} has format {fmt}, this reader reads "
                         f"format {IMAGE_FORMAT} only")
    try:
        doc = json.loads(image)
    except ValueError as exc:
        raise StoreError(f"{source}: image of {conversation_id!r} is not JSON ({exc})") from exc
    if not isinstance(doc, dict) or doc.get("conversation_id") != conversation_id or doc.get("format") != fmt:
        owner = doc.get("conversation_id") if isinstance(doc, dict) else None
        raise StoreError(f"{source}: image read for {conversation_id!r} belongs to {owner!r} (or has no header)")
    try:
        rows: Rows = {name: doc[name] for name in _PARTS if name != "turns"}
        _with_times(doc["scenes"], 6, 7)
        _with_times(doc["items"], 4, 6)
        said = turns_from_rows(conversation_id, _with_times(doc["turns"], 5)) if turns else ()
        return memory_from_rows(conversation_id, rows), said
    except (KeyError, IndexError, TypeError, ValueError) as exc:
        raise StoreError(f"{source}: image of {conversation_id!r} is malformed ({exc!r})") from exc

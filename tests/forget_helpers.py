"""Helpers for the forget tests: look for strings in every file under some directories, in every
form a file may hold them, and capture what other conversations have, to compare after a forget.

:func:`find_strings` reads each file's raw bytes and also what it holds decoded: base64 (Prefect
result files, alone or inside a result record's JSON), every zlib stream in it (conversation
images, lexical sections), and for DuckDB files every value of every table read back through
DuckDB (its string compression hides text from a raw scan). Matching ignores case (BM25 sections
hold lower-cased tokens).
"""

from __future__ import annotations

import base64
import binascii
import json
import os
import zlib
from collections.abc import Iterable, Sequence
from pathlib import Path

import duckdb

DUCKDB_MAGIC = b"DUCK"  # at byte 8 of a DuckDB database file
_ZLIB_HEADERS = (b"\x78\x01", b"\x78\x5e", b"\x78\x9c", b"\x78\xda")


def _zlib_streams(data: bytes) -> Iterable[bytes]:
    for header in _ZLIB_HEADERS:
        start = data.find(header)
        while start != -1:
            try:
                out = zlib.decompressobj().decompress(data[start:], 64 << 20)
            except zlib.error:
                out = b""
            if len(out) > 8:
                yield out
            start = data.find(header, start + 1)


def _base64(data: bytes) -> Iterable[bytes]:
    text = data.strip()
    candidates = [text]
    if text[:1] == b"{":
        try:
            record = json.loads(text)
        except ValueError:
            record = None
        if isinstance(record, dict) and isinstance(record.get("result"), str):
            candidates.append(record["result"].encode("ascii", "ignore"))
    for candidate in candidates:
        try:
            yield base64.b64decode(b"".join(candidate.split()), validate=True)
        except (binascii.Error, ValueError):
            continue


def duckdb_text(path: Path) -> bytes:
    """Every value of every table of a DuckDB file, as text (empty if it cannot be opened)."""
    try:
        con = duckdb.connect(str(path), read_only=True)
    except duckdb.Error:
        return b""
    try:
        parts: list[str] = []
        tables = con.execute("SELECT database_name, schema_name, table_name FROM duckdb_tables()").fetchall()
        for db, schema, table in tables:
            rows = con.execute(f'SELECT * FROM "{db}"."{schema}"."{table}"').fetchall()
            parts.append(repr(rows))
        return "\n".join(parts).encode("utf-8", "surrogatepass")
    finally:
        con.close()


def file_forms(path: Path) -> list[bytes]:
    """The file's bytes and everything decoded from them (see the module doc)."""
    data = path.read_bytes()
    forms = [data, *_base64(data)]
    forms += [s for form in list(forms) for s in _zlib_streams(form)]
    if data[8:12] == DUCKDB_MAGIC:
        forms.append(duckdb_text(path))
    return forms


def find_strings(roots: Sequence[Path], needles: Sequence[str]) -> dict[str, list[str]]:
    """``relative-ish path -> needles found in it`` for every file under ``roots`` (case-insensitive)."""
    wanted = [(n, n.lower().encode("utf-8", "surrogatepass")) for n in needles]
    hits: dict[str, list[str]] = {}
    for root in roots:
        for directory, _, names in os.walk(root):
            for name in names:
                path = Path(directory) / name
                if path.is_symlink() or not path.is_file():
                    continue
                blob = b"\n".join(f.lower() for f in file_forms(path))
                found = [n for n, b in wanted if b in blob]
                if found:
                    hits[str(path)] = found
    return hits


def tree_bytes(root: Path) -> dict[str, bytes]:
    """Every file under ``root`` by relative path, with its bytes."""
    out: dict[str, bytes] = {}
    if not root.is_dir():
        return out
    for path in sorted(root.rglob("*")):
        if path.is_file():
            out[str(path.relative_to(root))] = path.read_bytes()
    return out


def image_bytes(snapshot_dir: Path, conversation_id: str) -> bytes:
    """The conversation's whole image (document, vector section, BM25) as stored in a snapshot."""
    from tmem.store.snapshot.image import IMAGE_FILE, image_location

    con = duckdb.connect(str(snapshot_dir / "memory.duckdb"), read_only=True)
    try:
        where = image_location(con, conversation_id)
    finally:
        con.close()
    assert where is not None, f"{snapshot_dir}: no image of {conversation_id!r}"
    with open(snapshot_dir / IMAGE_FILE, "rb") as fh:
        fh.seek(where.byte_offset)
        return fh.read(where.byte_length + where.vector_bytes + where.lexical_bytes)


def work_rows(store: Path, conversation_id: str) -> dict[str, list[str]]:
    """Every row naming the conversation in the working database, by table (sorted reprs)."""
    from tmem.store.duck import connect
    from tmem.store.forget_work import conversation_tables

    con = connect(store, read_only=True)
    try:
        return {t: sorted(repr(r) for r in con.execute(f'SELECT * FROM "{t}" WHERE conversation_id = ?',
                                                         [conversation_id]).fetchall())
                for t in conversation_tables(con)}
    finally:
        con.close()


def owned_cache(store: Path, conversation_id: str) -> tuple[dict[str, str], dict[str, bytes]]:
    """(LLM cache key -> answer, embedding hash -> vector bytes) of the rows the conversation owns."""
    from tmem.store.duck import connect

    con = connect(store, read_only=True)
    try:
        llm = dict(con.execute(
            "SELECT c.cache_key, c.response::VARCHAR FROM llm_cache c WHERE c.cache_key IN "
            "(SELECT cache_key FROM llm_usage WHERE conversation_id = ?)", [conversation_id]).fetchall())
        emb = {str(h): repr(v).encode() for h, v in con.execute(
            "SELECT c.text_hash, c.vector FROM embedding_cache c JOIN embedding_owners o USING (model, text_hash) "
            "WHERE o.conversation_id = ?", [conversation_id]).fetchall()}
    finally:
        con.close()
    return {str(k): str(v) for k, v in llm.items()}, emb

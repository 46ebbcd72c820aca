"""The embedding cache in the builder's working DuckDB (table ``embedding_cache``, migration m003).

Implements :class:`tmem.ports.EmbeddingCache`. Every call runs on its own cursor
under a lock, so the cache can share the builder's connection with other threads.
"""

from __future__ import annotations

import threading
from collections.abc import Mapping, Sequence

import duckdb
import numpy as np
import numpy.typing as npt
import pyarrow as pa

from tmem.errors import StoreError

_STAGED = "tmem_embedding_cache_staged"
_OWNERS = "tmem_embedding_owners_staged"


class DuckEmbeddingCache:
    """Vectors by (model, text hash) in ``embedding_cache``; existing entries are never overwritten."""

    def __init__(self, con: duckdb.DuckDBPyConnection, *, lock: threading.Lock | None = None) -> None:
        self._con = con
        self._lock = lock or threading.Lock()  # shared with other readers of ``con`` when given

    def get_many(self, model: str, text_hashes: Sequence[str]) -> dict[str, npt.NDArray[np.float32]]:
        if not text_hashes:
            return {}
        with self._lock:
            cur = self._con.cursor()
            try:
                relation = cur.sql(
                    "SELECT c.text_hash, c.vector FROM embedding_cache AS c "
                    "JOIN (SELECT DISTINCT unnest(?::VARCHAR[]) AS text_hash) AS q USING (text_hash) "
                    "WHERE c.model = ?",
                    params=[list(text_hashes), model],
                )
                if relation is None:
                    raise StoreError(f"embedding_cache: lookup for {model!r} returned no relation")
                result = relation.to_arrow_table()
            except duckdb.Error as exc:
                raise StoreError(f"embedding_cache: lookup of {len(text_hashes)} texts for {model!r} failed ({exc})") from exc
            finally:
                cur.close()
        return _vectors_by_hash(result)

    def put_many(self, model: str, vectors: Mapping[str, npt.NDArray[np.float32]]) -> None:
        if not vectors:
            return
        staged = pa.table(
            {
                "model": pa.array([model] * len(vectors), type=pa.string()),
                "text_hash": pa.array(list(vectors), type=pa.string()),
                "vector": pa.array(
                    [np.asarray(v, dtype=np.float32) for v in vectors.values()], type=pa.list_(pa.float32())
                ),
            }
        )
        with self._lock:
            cur = self._con.cursor()
            try:
                cur.register(_STAGED, staged)
                cur.execute(
                    f"INSERT INTO embedding_cache SELECT model, text_hash, vector FROM {_STAGED} "  # noqa: S608 -- constant name
                    "ON CONFLICT DO NOTHING"
                )
                cur.unregister(_STAGED)
            except duckdb.Error as exc:
                raise StoreError(f"embedding_cache: storing {len(vectors)} vectors for {model!r} failed ({exc})") from exc
            finally:
                cur.close()

    def count(self, model: str | None = None) -> int:
        with self._lock:
            cur = self._con.cursor()
            try:
                if model is None:
                    row = cur.execute("SELECT count(*) FROM embedding_cache").fetchone()
                else:
                    row = cur.execute("SELECT count(*) FROM embedding_cache WHERE model = ?", [model]).fetchone()
            finally:
                cur.close()
        return int(row[0]) if row else 0


def _vectors_by_hash(result: pa.Table) -> dict[str, npt.NDArray[np.float32]]:
    if result.num_rows == 0:
        return {}
    hashes = result.column("text_hash").to_pylist()
    lists = result.column("vector").combine_chunks()
    values = lists.flatten().to_numpy(zero_copy_only=False).astype(np.float32, copy=False)
    offsets = lists.offsets.to_numpy() - lists.offsets[0].as_py()
    return {h: values[offsets[i] : offsets[i + 1]].copy() for i, h in enumerate(hashes)}


def record_embedding_owners(con: duckdb.DuckDBPyConnection, model: str, texts_by_conversation: Mapping[str, Sequence[str]]) -> int:
    """Record that each conversation's published vectors embed these texts (``embedding_owners``,
    m010): ``tmem forget`` deletes a cached embedding once no remaining conversation owns it.
    Returns the rows written (existing ones are kept)."""
    from tmem.llm.cached_embedder import embedding_key

    rows = {(embedding_key(model, text), cid) for cid, texts in texts_by_conversation.items() for text in texts}
    if not rows:
        return 0
    staged = pa.table({
        "model": pa.array([model] * len(rows), type=pa.string()),
        "text_hash": pa.array([h for h, _ in rows], type=pa.string()),
        "conversation_id": pa.array([c for _, c in rows], type=pa.string()),
    })
    cur = con.cursor()
    try:
        cur.register(_OWNERS, staged)
        cur.execute(
            f"INSERT INTO embedding_owners SELECT model, text_hash, conversation_id FROM {_OWNERS} "  # noqa: S608 -- constant name
            "ON CONFLICT DO NOTHING"
        )
        cur.unregister(_OWNERS)
    except duckdb.Error as exc:
        raise StoreError(f"embedding_owners: recording {len(rows)} owners for {model!r} failed ({exc})") from exc
    finally:
        cur.close()
    return len(rows)

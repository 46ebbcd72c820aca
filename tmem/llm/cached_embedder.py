"""A content-hash cache in front of any embedder: each distinct text of a model is embedded once.

The storage is the :class:`tmem.ports.EmbeddingCache` protocol: in memory here, DuckDB in
:mod:`tmem.store.embed_cache`, journalled on a read-only worker (:mod:`tmem.llm.journal`).
"""

from __future__ import annotations

import threading
from collections.abc import Mapping, Sequence

import numpy as np
import numpy.typing as npt

from tmem.errors import EmbeddingError
from tmem.ids import content_hash
from tmem.llm.embedder_wrapper import EmbedderWrapper
from tmem.ports import Embedder, EmbeddingCache


def embedding_key(model_name: str, text: str) -> str:
    """Cache key of one text under one model (sha256 of both)."""
    return content_hash("embedding", model_name, text)


class InMemoryEmbeddingCache:
    """A process-local :class:`EmbeddingCache` (tests, one-off runs)."""

    def __init__(self) -> None:
        self._entries: dict[tuple[str, str], npt.NDArray[np.float32]] = {}
        self._lock = threading.Lock()

    def __len__(self) -> int:
        return len(self._entries)

    def get_many(self, model: str, text_hashes: Sequence[str]) -> dict[str, npt.NDArray[np.float32]]:
        with self._lock:
            return {h: self._entries[(model, h)] for h in text_hashes if (model, h) in self._entries}

    def put_many(self, model: str, vectors: Mapping[str, npt.NDArray[np.float32]]) -> None:
        with self._lock:
            for text_hash, vector in vectors.items():
                self._entries.setdefault((model, text_hash), np.array(vector, dtype=np.float32))


class CachedEmbedder(EmbedderWrapper):
    """An :class:`Embedder` that embeds each distinct text of a model at most once per cache.

    Hits come from ``cache``; the distinct misses go to ``inner`` in batches of ``batch_size``
    and are stored after each batch, so an interrupted run keeps what it paid for.
    """

    def __init__(self, inner: Embedder, cache: EmbeddingCache, *, batch_size: int = 256) -> None:
        if batch_size < 1:
            raise EmbeddingError(inner.model_name, f"batch_size must be positive, got {batch_size}")
        super().__init__(inner)
        self.cache = cache
        self.batch_size = batch_size

    def embed_texts(self, texts: list[str]) -> npt.NDArray[np.float32]:
        model, dim = self.model_name, self.dim
        keys = [embedding_key(model, t) for t in texts]
        text_by_key = dict(zip(keys, texts, strict=True))  # first-occurrence order, duplicates merged
        found = self.cache.get_many(model, list(text_by_key))
        wrong = [k for k, v in found.items() if v.shape != (dim,)]
        if wrong:
            raise EmbeddingError(model, f"{len(wrong)} cached vectors do not have dim {dim} (e.g. key {wrong[0]})")
        misses = [k for k in text_by_key if k not in found]
        for start in range(0, len(misses), self.batch_size):
            batch = misses[start : start + self.batch_size]
            vectors = self.inner.embed([text_by_key[k] for k in batch])
            if vectors.shape != (len(batch), dim):
                raise EmbeddingError(model, f"returned shape {vectors.shape} for {len(batch)} texts, expected dim {dim}")
            fresh = {k: np.asarray(v, dtype=np.float32) for k, v in zip(batch, vectors, strict=True)}
            self.cache.put_many(model, fresh)
            found.update(fresh)
        return np.stack([found[k] for k in keys]).astype(np.float32, copy=False)

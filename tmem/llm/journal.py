"""Cache writes and usage rows kept in memory, for a build process that must not write the store.

A Dask worker builds against a read-only view of the caches (the run's exchange file, see
:mod:`tmem.store.exchange`). What the builder would have written to the working database —
new LLM answers, usage-ledger rows, new embeddings — goes to a :class:`WorkJournal` instead.
Its batches travel back with the conversation results, and the flow process (the single
publisher) writes them in one transaction (:func:`tmem.store.exchange.write_journal`).

The journaling cache and embedding cache also remember what they recorded, so a later call
in the same worker hits it although the read-only view never changes.
"""

from __future__ import annotations

import threading
from collections.abc import Iterable, Mapping, Sequence

import numpy as np
import numpy.typing as npt

from tmem.llm.usage import summarize_usage
from tmem.ports import (
    CacheEntry,
    EmbeddingCache,
    EmbeddingEntry,
    JournalBatch,
    OperationUsage,
    ResponseCache,
    UsageRecord,
)


class WorkJournal:
    """Thread-safe append-only record; :meth:`drain` hands out everything recorded so far, once."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._cache: list[CacheEntry] = []
        self._usage: list[UsageRecord] = []
        self._embeddings: list[EmbeddingEntry] = []

    def add_cache_entry(self, entry: CacheEntry) -> None:
        with self._lock:
            self._cache.append(entry)

    def add_usage(self, record: UsageRecord) -> None:
        with self._lock:
            self._usage.append(record)

    def add_embeddings(self, entries: Iterable[EmbeddingEntry]) -> None:
        with self._lock:
            self._embeddings.extend(entries)

    def drain(self) -> JournalBatch:
        with self._lock:
            batch = JournalBatch(tuple(self._cache), tuple(self._usage), tuple(self._embeddings))
            self._cache, self._usage, self._embeddings = [], [], []
        return batch


class JournalingResponseCache:
    """A :class:`ResponseCache`: reads ``base`` (read-only), records new answers in ``journal``."""

    def __init__(self, base: ResponseCache, journal: WorkJournal) -> None:
        self._base = base
        self._journal = journal
        self._lock = threading.Lock()
        self._recorded: dict[str, str] = {}

    def get(self, cache_key: str) -> str | None:
        with self._lock:
            found = self._recorded.get(cache_key)
        return found if found is not None else self._base.get(cache_key)

    def put(self, entry: CacheEntry) -> None:
        with self._lock:
            self._recorded[entry.cache_key] = entry.response_json
        self._journal.add_cache_entry(entry)


class JournalingUsageLedger:
    """A :class:`~tmem.ports.UsageLedger` whose rows go to ``journal``."""

    def __init__(self, journal: WorkJournal) -> None:
        self._journal = journal
        self._lock = threading.Lock()
        self._records: list[UsageRecord] = []

    def record(self, record: UsageRecord) -> None:
        with self._lock:
            self._records.append(record)
        self._journal.add_usage(record)

    def summary(self, run_id: str) -> dict[str, OperationUsage]:
        """This process's rows of ``run_id`` (the store's ledger is the publisher's to read)."""
        with self._lock:
            records = list(self._records)
        return summarize_usage(records, run_id)


class JournalingEmbeddingCache:
    """An :class:`EmbeddingCache`: reads ``base`` (read-only), records new vectors in ``journal``."""

    def __init__(self, base: EmbeddingCache, journal: WorkJournal) -> None:
        self._base = base
        self._journal = journal
        self._lock = threading.Lock()
        self._recorded: dict[tuple[str, str], npt.NDArray[np.float32]] = {}

    def get_many(self, model: str, text_hashes: Sequence[str]) -> dict[str, npt.NDArray[np.float32]]:
        with self._lock:
            found = {h: self._recorded[(model, h)] for h in text_hashes if (model, h) in self._recorded}
        rest = [h for h in text_hashes if h not in found]
        if rest:
            found.update(self._base.get_many(model, rest))
        return found

    def put_many(self, model: str, vectors: Mapping[str, npt.NDArray[np.float32]]) -> None:
        fresh: list[EmbeddingEntry] = []
        with self._lock:
            for text_hash, vector in vectors.items():
                if (model, text_hash) in self._recorded:
                    continue  # an existing entry is kept (the EmbeddingCache contract)
                kept = np.array(vector, dtype=np.float32)
                self._recorded[(model, text_hash)] = kept
                fresh.append(EmbeddingEntry(model, text_hash, kept))
        self._journal.add_embeddings(fresh)

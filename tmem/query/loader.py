"""Published snapshot → :class:`~tmem.retrieval.index.ConversationIndex`, loaded once and cached.

A cold load reads one conversation's memory and turns from the snapshot's DuckDB file
(read-only, ``?`` parameters), its vector rows from the image's vector section (or, for older
snapshots, LanceDB at the version the snapshot pins, typed scope filter), and builds the
numpy/BM25 index. Later queries of the same conversation in the same snapshot reuse the index: a
warm search is numpy only.

The cache is a bounded LRU keyed by ``(snapshot_id, conversation_id, with_vectors)``. It is
thread-safe, and concurrent first queries of one conversation share a single load instead of
loading it once per thread.
"""

from __future__ import annotations

import threading
import time
from collections import OrderedDict
from concurrent.futures import Future
from dataclasses import dataclass

from tmem.errors import ScopeError
from tmem.retrieval.index import ConversationIndex, VectorBundle, build_index
from tmem.store.snapshot.image_vectors import VectorSection
from tmem.store.snapshot.reader import SnapshotReader

CacheKey = tuple[str, str, bool]  # (snapshot id, conversation id, vectors loaded)


@dataclass(frozen=True)
class LoadTiming:
    """How long one cold load took, by phase (seconds)."""

    snapshot_id: str
    conversation_id: str
    read_memory_s: float  # memory + turns: the snapshot image (point read + pread + decode), else the DuckDB tables
    read_vectors_s: float  # the image's vector section, else LanceDB at the pinned version (0: not asked for)
    build_index_s: float  # arrays, CSR links, BM25 (deserialised when the image holds it prebuilt)
    vector_rows: int

    @property
    def total_s(self) -> float:
        return self.read_memory_s + self.read_vectors_s + self.build_index_s


def _vector_bundle(rows: VectorSection | None) -> VectorBundle:
    if rows is None or len(rows) == 0:
        return VectorBundle.empty()
    return VectorBundle.from_columns(rows.owner_kinds, rows.owner_ids, rows.views, rows.ordinals, rows.vectors)


def load_index(reader: SnapshotReader, conversation_id: str, *, vectors: bool = True) -> tuple[ConversationIndex, LoadTiming]:
    """Build the index of one conversation of the reader's snapshot (no cache). ``vectors=False``
    skips LanceDB (a lexical-only index). :class:`ScopeError` for a conversation it lacks."""
    if not isinstance(conversation_id, str) or not conversation_id:
        raise ScopeError(f"loading an index needs a conversation id, got {conversation_id!r}")
    cold = reader.read_cold(conversation_id, vectors=vectors)
    memory, turns = cold.memory, cold.turns
    started = time.perf_counter()
    bundle = _vector_bundle(cold.vectors)
    read_vectors_done = time.perf_counter()
    index = build_index(
        conversation_id,
        memory.scenes,
        memory.topics,
        memory.items,
        memory.item_triggers,
        memory.scene_triggers,
        memory.personas,
        turns,
        bundle,
        bm25=cold.bm25,
    )
    done = time.perf_counter()
    timing = LoadTiming(
        snapshot_id=reader.info.snapshot_id,
        conversation_id=conversation_id,
        read_memory_s=cold.read_memory_s,
        read_vectors_s=cold.read_vectors_s + read_vectors_done - started,
        build_index_s=cold.read_bm25_s + done - read_vectors_done,
        vector_rows=sum(len(v.owner_ids) for v in bundle.views.values()),
    )
    return index, timing


@dataclass(frozen=True)
class CacheStats:
    size: int
    capacity: int
    hits: int
    misses: int  # loads started
    shared: int  # requests that waited for a load another thread had started
    last_load: LoadTiming | None


class IndexCache:
    """A thread-safe LRU of loaded conversation indexes, at most ``capacity`` entries."""

    def __init__(self, capacity: int) -> None:
        if capacity < 1:
            raise ValueError(f"index cache capacity must be ≥ 1, got {capacity}")
        self.capacity = capacity
        self._lock = threading.Lock()
        self._entries: OrderedDict[CacheKey, ConversationIndex] = OrderedDict()
        self._loading: dict[CacheKey, Future[ConversationIndex]] = {}
        self._hits = 0
        self._misses = 0
        self._shared = 0
        self._last_load: LoadTiming | None = None

    def get(self, reader: SnapshotReader, conversation_id: str, *, vectors: bool = True) -> ConversationIndex:
        """The index of ``conversation_id`` in the reader's snapshot, loading it on a miss.

        A lexical request (``vectors=False``) is served by a cached full index when there is one.
        """
        snapshot_id = reader.info.snapshot_id
        key: CacheKey = (snapshot_id, conversation_id, vectors)
        keys = [key] if vectors else [(snapshot_id, conversation_id, True), key]
        with self._lock:
            for k in keys:
                hit = self._entries.get(k)
                if hit is not None:
                    self._entries.move_to_end(k)
                    self._hits += 1
                    return hit
            pending = self._loading.get(key)
            owner = pending is None
            if pending is None:
                pending = Future()
                self._loading[key] = pending
                self._misses += 1
            else:
                self._shared += 1
        if not owner:
            return pending.result()
        try:
            index, timing = load_index(reader, conversation_id, vectors=vectors)
        except BaseException as exc:
            with self._lock:
                self._loading.pop(key, None)
            pending.set_exception(exc)
            raise
        with self._lock:
            self._loading.pop(key, None)
            self._last_load = timing
            if not reader.retired:  # a query still pinned to a replaced snapshot gets its index uncached
                self._entries[key] = index
                self._entries.move_to_end(key)
                while len(self._entries) > self.capacity:
                    self._entries.popitem(last=False)
        pending.set_result(index)
        return index

    def evict_snapshots_except(self, snapshot_id: str) -> int:
        """Drop the entries of every other snapshot (after a switch); returns how many."""
        with self._lock:
            stale = [k for k in self._entries if k[0] != snapshot_id]
            for k in stale:
                del self._entries[k]
        return len(stale)

    def stats(self) -> CacheStats:
        with self._lock:
            return CacheStats(
                size=len(self._entries),
                capacity=self.capacity,
                hits=self._hits,
                misses=self._misses,
                shared=self._shared,
                last_load=self._last_load,
            )

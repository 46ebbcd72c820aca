"""One embedding worker for a whole build: texts from every conversation, embedded in full batches.

A build embeds each conversation's new view texts when the conversation is done, from as many
threads as conversations are built at once. Called directly, each call is a small batch padded to
its longest text, and concurrent calls fight over the same cores (torch's own threads times the
callers): on 2 cores a nightly of 1,000 conversations spent far longer embedding than the same
texts take in one pass. :class:`CoalescingEmbedder` puts every call on one queue; a single worker
thread takes what is waiting — after waiting ``linger_s`` for more — and embeds its new texts in
calls of the inner embedder (sentence-transformers sorts a call's texts by length,
so batches are dense), then hands each caller its rows. Errors reach the callers whose texts were
in the failed call. It also counts what it embedded and how long the inner embedder took.

The same text (a templated horizon, a shared greeting) reaches the queue from several conversations
built at the same time. The worker merges duplicates inside a call and answers a text it embedded or
looked up in the last ``memo_texts`` from memory (measured on 40 synthetic conversations: 13 % of the
new texts sent were such repeats).

With a ``cache`` (the build's embedding cache, :class:`tmem.ports.EmbeddingCache`) the worker also
looks the texts up there, once per call for every conversation in it, and stores what the model
embedded after the call, so each distinct text of a model is embedded once per cache (what
:class:`tmem.llm.cached_embedder.CachedEmbedder` does per caller). One lookup per call, not one per
conversation: the cache is a DuckDB table that a lookup scans (~100 ms at 83,000 vectors, for 10 keys
or 2,000 alike), so one lookup per conversation cost a nightly of 1,000 conversations ~100 s of CPU
and a serialised ~110 s under the cache's lock, growing with the archive (``bench/nightly_scale.py``).

The worker takes every request waiting (up to ``max_requested`` texts), answers what the memo and
the cache hold, and embeds the rest in calls of up to ``max_texts`` = 2,048 new texts, answering each
caller as soon as its texts are in. The model pads each batch to its longest text, and the more texts
a call sorts by length, the less padding — on 40 synthetic conversations the word pieces processed per
real one fall from 1.33 (512 texts, ~5 conversations a call) to 1.19 (``bench/embed_build.py --parts
padding``). The cap counts new texts, not requested ones: a nightly conversation asks for all its
views (~200) of which ~26 are new, and a cap of 2,048 *requested* texts made calls of ~250 new texts,
which cost the encoder ~20 % more CPU per text than calls of 1,000 or more (3,000 texts of a nightly:
58 against 48-50 core-s on 2 cores).
"""

from __future__ import annotations

import logging
import threading
import time
from collections import OrderedDict, deque
from concurrent.futures import Future
from dataclasses import dataclass

import numpy as np
import numpy.typing as npt

from tmem.errors import EmbeddingError
from tmem.llm.cached_embedder import embedding_key
from tmem.llm.embedder_wrapper import EmbedderWrapper
from tmem.ports import Embedder, EmbeddingCache

log = logging.getLogger(__name__)


@dataclass
class EmbeddingUsage:
    texts: int = 0  # distinct texts the inner embedder embedded
    calls: int = 0  # calls of the inner embedder
    seconds: float = 0.0  # spent inside them
    requested: int = 0  # texts the callers asked for (repeats included)
    cache_hits: int = 0  # distinct texts found in the cache
    lookups: int = 0  # cache lookups (one per call of the worker that had texts to look up)
    lookup_s: float = 0.0  # spent in them and in storing the new vectors
    prefetched: int = 0  # texts queued ahead of their conversation's embed stage (``prefetch``)
    opened_at: float = 0.0  # perf_counter when the queue was made (the build's start, near enough)
    first_call_at: float | None = None  # perf_counter when the first inner call started
    last_call_end: float | None = None  # ... and when the last one ended

    def window(self) -> tuple[float, float] | None:
        """Seconds from the queue's start to its first inner call and to the end of its last one."""
        if self.first_call_at is None or self.last_call_end is None:
            return None
        return self.first_call_at - self.opened_at, self.last_call_end - self.opened_at


def _note_prefetch_failure(done: Future[npt.NDArray[np.float32]]) -> None:
    if done.exception() is not None:
        log.info("prefetched texts were not embedded (%s); the stage that needs them embeds them again",
                 done.exception())


class CoalescingEmbedder(EmbedderWrapper):
    """An :class:`Embedder` funnelling every caller's texts through one worker thread (see the module)."""

    def __init__(self, inner: Embedder, *, cache: EmbeddingCache | None = None, max_texts: int = 2048,
                 linger_s: float = 0.02, memo_texts: int = 16384, max_requested: int = 16384) -> None:
        super().__init__(inner)
        self.cache = cache
        self.max_texts = max_texts  # new texts per inner call
        self.max_requested = max(max_texts, max_requested)  # texts asked for, per take of the queue
        self.linger_s = linger_s
        self.memo_texts = memo_texts  # ~25 MB of 384-d vectors
        self.usage = EmbeddingUsage(opened_at=time.perf_counter())
        self._memo: OrderedDict[str, npt.NDArray[np.float32]] = OrderedDict()  # the worker's own
        self._queue: deque[tuple[list[str], Future[npt.NDArray[np.float32]]]] = deque()
        self._ready = threading.Condition()
        self._worker: threading.Thread | None = None
        self._closed = False

    def embed_texts(self, texts: list[str]) -> npt.NDArray[np.float32]:
        done: Future[npt.NDArray[np.float32]] = Future()
        with self._ready:
            if self._closed:
                raise RuntimeError("the build's embedder was closed")
            self._enqueue(list(texts), done)
        return done.result()

    def prefetch(self, texts: list[str]) -> None:
        """Queue ``texts`` without waiting: the worker embeds them (or finds them in the cache) in turn
        and keeps their rows in its memo, where a later :meth:`embed` of the same texts finds them.
        A prefetch that fails is not retried or reported here: the later call that needs the texts
        embeds them again and raises the failure to its caller. A closed queue ignores a prefetch."""
        if not texts:
            return
        done: Future[npt.NDArray[np.float32]] = Future()
        done.add_done_callback(_note_prefetch_failure)
        with self._ready:
            if self._closed:
                return
            self.usage.prefetched += len(texts)
            self._enqueue(list(texts), done)

    def _enqueue(self, texts: list[str], done: Future[npt.NDArray[np.float32]]) -> None:
        self._queue.append((texts, done))
        if self._worker is None:
            self._worker = threading.Thread(target=self._work, name="tmem-embedder", daemon=True)
            self._worker.start()
        self._ready.notify()

    def close(self) -> None:
        """Stop the worker once the queue is empty (the build is over)."""
        with self._ready:
            self._closed = True
            self._ready.notify()

    def _take(self) -> list[tuple[list[str], Future[npt.NDArray[np.float32]]]] | None:
        with self._ready:
            while not self._queue:
                if self._closed:
                    return None
                self._ready.wait()
        time.sleep(self.linger_s)  # let the other conversations finishing now join this call
        taken: list[tuple[list[str], Future[npt.NDArray[np.float32]]]] = []
        size = 0
        with self._ready:
            while self._queue and (not taken or size + len(self._queue[0][0]) <= self.max_requested):
                texts, done = self._queue.popleft()
                taken.append((texts, done))
                size += len(texts)
        return taken

    def _work(self) -> None:
        while (taken := self._take()) is not None:
            waiting = list(taken)
            try:
                fresh, keys = self._lookup([t for batch, _ in taken for t in batch])
                for start in range(0, len(fresh), self.max_texts):
                    self._embed_call(fresh[start:start + self.max_texts], keys)
                    waiting = self._answer(waiting)  # callers whose texts are all in go on now
                self._answer(waiting, finished=True)
            except BaseException as exc:  # noqa: BLE001 -- not swallowed: every caller still waiting re-raises it
                for _, done in waiting:
                    if not done.done():
                        done.set_exception(exc)
                continue
            while len(self._memo) > self.memo_texts:
                self._memo.popitem(last=False)

    def _answer(self, waiting: list[tuple[list[str], Future[npt.NDArray[np.float32]]]], *,
                finished: bool = False) -> list[tuple[list[str], Future[npt.NDArray[np.float32]]]]:
        """Answer the callers whose texts are all in the memo (every one once ``finished``); the rest."""
        left = []
        for batch, done in waiting:
            if finished or all(t in self._memo for t in batch):
                done.set_result(self._rows(batch))
            else:
                left.append((batch, done))
        return left

    def _lookup(self, texts: list[str]) -> tuple[list[str], dict[str, str]]:
        """Put the distinct texts found in the cache (one lookup) into the memo; the distinct texts
        neither the memo nor the cache holds, in the order asked, and their cache keys (with a cache)."""
        fresh = [t for t in dict.fromkeys(texts) if t not in self._memo]
        self.usage.requested += len(texts)
        keys: dict[str, str] = {}
        if fresh and self.cache is not None:
            started = time.perf_counter()
            keys = {t: embedding_key(self.model_name, t) for t in fresh}
            found = self.cache.get_many(self.model_name, list(keys.values()))
            self.usage.lookup_s += time.perf_counter() - started
            self.usage.lookups += 1
            wrong = [k for k, v in found.items() if v.shape != (self.dim,)]
            if wrong:
                raise EmbeddingError(self.model_name, f"{len(wrong)} cached vectors do not have dim {self.dim} "
                                                      f"(e.g. key {wrong[0]})")
            hits = {t: found[keys[t]] for t in fresh if keys[t] in found}
            self._memo.update(hits)
            self.usage.cache_hits += len(hits)
            fresh = [t for t in fresh if t not in hits]
        return fresh, keys

    def _embed_call(self, fresh: list[str], keys: dict[str, str]) -> None:
        """One inner call for ``fresh`` (distinct texts in neither memo nor cache): into the memo, and
        stored in the cache under ``keys`` (from :meth:`_lookup`)."""
        started = time.perf_counter()
        if self.usage.first_call_at is None:
            self.usage.first_call_at = started
        matrix = self.inner.embed(fresh)
        if matrix.shape != (len(fresh), self.dim):
            raise EmbeddingError(self.model_name, f"returned shape {matrix.shape} for {len(fresh)} texts")
        self.usage.last_call_end = time.perf_counter()
        self.usage.seconds += self.usage.last_call_end - started
        self.usage.texts += len(fresh)
        self.usage.calls += 1
        vectors = np.asarray(matrix, dtype=np.float32)
        if self.cache is not None:
            started = time.perf_counter()
            self.cache.put_many(self.model_name, {keys[t]: vectors[n] for n, t in enumerate(fresh)})
            self.usage.lookup_s += time.perf_counter() - started
        self._memo.update(zip(fresh, vectors, strict=True))

    def _rows(self, batch: list[str]) -> npt.NDArray[np.float32]:
        for text in batch:
            self._memo.move_to_end(text)  # recently asked: kept longest
        return np.stack([self._memo[t] for t in batch]).astype(np.float32, copy=False)

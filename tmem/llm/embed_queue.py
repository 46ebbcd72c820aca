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

With an inner embedder that takes calls while earlier ones run (:class:`~tmem.ports.PipelinedEmbedder`:
the build's pool of encoder children), the worker does not wait for a call's rows before taking the
next: once every share of the running call is with a child, it takes what waits, looks it up and hands
its new texts over, so a child that ends its last share starts on the next call at once instead of
idling through the other child's last share, the answers, the cache's store and the next lookup. A
text the running call embeds is not sent again: its new caller gets the row when that call ends (or
its error). Otherwise (an embedder in this process) calls run one at a time, as before.
"""

from __future__ import annotations

import logging
import threading
import time
from collections import OrderedDict, deque
from concurrent.futures import Future
from dataclasses import dataclass, field

import numpy as np
import numpy.typing as npt

from tmem.errors import EmbeddingError
from tmem.llm.cached_embedder import embedding_key
from tmem.llm.embedder_wrapper import EmbedderWrapper
from tmem.ports import Embedder, EmbeddingCache, PipelinedEmbedder

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


@dataclass
class _Take:
    """What the worker took from the queue in one go, from its lookup to its callers' answers."""

    taken: list[tuple[list[str], Future[npt.NDArray[np.float32]]]]
    keys: dict[str, str] = field(default_factory=dict)  # cache keys of the texts it embeds
    rows: dict[str, npt.NDArray[np.float32]] = field(default_factory=dict)  # its texts' rows, as they come in
    # its inner calls' texts, each with its rows to come (None: not handed over yet, the inner embedder
    # is not pipelined and is called when the take is finished)
    calls: list[tuple[list[str], Future[npt.NDArray[np.float32]] | None]] = field(default_factory=list)
    coming: set[str] = field(default_factory=set)  # the texts of those calls
    waits: set[str] = field(default_factory=set)  # its texts an earlier take's calls embed
    failed: dict[str, BaseException] = field(default_factory=dict)  # ... whose call failed, with its error
    error: BaseException | None = None  # its lookup or hand-over failed


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
        self._pipelined = inner if isinstance(inner, PipelinedEmbedder) else None
        self._busy_until = 0.0  # the end of the inner embedder's latest call (its busy time, usage.seconds)

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

    def _take(self, *, wait: bool) -> list[tuple[list[str], Future[npt.NDArray[np.float32]]]] | None:
        """What waits in the queue (after ``linger_s`` for more), up to ``max_requested`` texts; when
        nothing waits, None once closed if ``wait`` (else blocks), and an empty list if not ``wait``."""
        with self._ready:
            while not self._queue:
                if not wait:
                    return []
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
        """Take what waits, look it up and hand its new texts to the inner embedder; while that runs,
        take the next (once a pipelined inner has every share of the current call with a child:
        :meth:`PipelinedEmbedder.wait_taken`), then answer the oldest call's callers when its rows are in."""
        running: deque[_Take] = deque()  # handed to the inner embedder, oldest first (at most two)
        while True:
            if not running:
                taken = self._take(wait=True)
                if taken is None:
                    return
                running.append(self._start(taken, running))
            if self._pipelined is not None and len(running) == 1:
                self._pipelined.wait_taken()  # the last shares of the running call are with the children
                taken = self._take(wait=False)
                if taken:
                    running.append(self._start(taken, running))
            self._finish(running.popleft(), running)

    def _start(self, taken: list[tuple[list[str], Future[npt.NDArray[np.float32]]]],
               running: deque[_Take]) -> _Take:
        """Look ``taken`` up (memo, then cache) and hand its new texts to the inner embedder, in calls of
        up to ``max_texts``; texts an earlier call still embeds are waited for, not embedded again."""
        take = _Take(taken)
        try:
            texts = [t for batch, _ in taken for t in batch]
            self.usage.requested += len(texts)
            coming = {t for earlier in running for t in earlier.coming}
            distinct = list(dict.fromkeys(texts))
            take.waits = {t for t in distinct if t in coming}
            fresh, take.keys = self._lookup([t for t in distinct if t not in take.waits])
            take.rows.update((t, self._memo[t]) for t in distinct if t in self._memo)
            for at in range(0, len(fresh), self.max_texts):
                chunk = fresh[at:at + self.max_texts]  # handed over now if the inner embedder is pipelined
                take.calls.append((chunk, self._submit(chunk) if self._pipelined is not None else None))
                take.coming.update(chunk)
        except BaseException as exc:  # noqa: BLE001 -- not swallowed: every caller of the take re-raises it
            take.error = exc
        return take

    def _submit(self, texts: list[str]) -> Future[npt.NDArray[np.float32]]:
        started = time.perf_counter()
        if self.usage.first_call_at is None:
            self.usage.first_call_at = started
        if self._pipelined is not None:
            done = self._pipelined.submit(texts)
        else:
            done = Future()
            try:
                done.set_result(self.inner.embed(texts))
            except BaseException as exc:  # noqa: BLE001 -- not swallowed: the take's callers re-raise it
                done.set_exception(exc)
        done.add_done_callback(lambda _: self._count_call(started))
        return done

    def _count_call(self, started: float) -> None:
        """The inner embedder's busy time: the union of its calls' spans (pipelined calls overlap)."""
        ended = time.perf_counter()
        with self._ready:
            self.usage.seconds += max(0.0, ended - max(started, self._busy_until))
            self._busy_until = max(self._busy_until, ended)
            self.usage.last_call_end = max(self.usage.last_call_end or ended, ended)

    def _finish(self, take: _Take, later: deque[_Take]) -> None:
        """The take's rows as its calls end: into the memo, the cache and the later takes waiting for
        them; each caller answered once its texts are in, or with the error that kept them out."""
        waiting = list(take.taken)
        try:
            if take.error is not None:
                for other in later:  # texts it had handed over are not answered through it either
                    other.failed.update(dict.fromkeys(take.coming & other.waits, take.error))
                raise take.error
            for chunk, handed in take.calls:
                try:
                    matrix = (handed or self._submit(chunk)).result()
                except BaseException as exc:
                    for other in later:  # a later take's callers waiting for its texts not in yet fail with it
                        other.failed.update(dict.fromkeys((take.coming & other.waits) - other.rows.keys(), exc))
                    raise
                vectors = self._check(chunk, matrix)
                self.usage.texts += len(chunk)
                self.usage.calls += 1
                if self.cache is not None:
                    started = time.perf_counter()
                    self.cache.put_many(self.model_name, {take.keys[t]: vectors[n] for n, t in enumerate(chunk)})
                    self.usage.lookup_s += time.perf_counter() - started
                fresh = dict(zip(chunk, vectors, strict=True))
                self._memo.update(fresh)
                take.rows.update(fresh)
                for other in later:
                    other.rows.update((t, fresh[t]) for t in other.waits if t in fresh)
                waiting = self._answer(take, waiting)  # callers whose texts are all in go on now
            self._answer(take, waiting, finished=True)
        except BaseException as exc:  # noqa: BLE001 -- not swallowed: every caller still waiting re-raises it
            for _, done in waiting:
                if not done.done():
                    done.set_exception(exc)
        while len(self._memo) > self.memo_texts:
            self._memo.popitem(last=False)

    def _check(self, chunk: list[str], matrix: npt.NDArray[np.float32]) -> npt.NDArray[np.float32]:
        if matrix.shape != (len(chunk), self.dim):
            raise EmbeddingError(self.model_name, f"returned shape {matrix.shape} for {len(chunk)} texts")
        return np.asarray(matrix, dtype=np.float32)

    def _answer(self, take: _Take, waiting: list[tuple[list[str], Future[npt.NDArray[np.float32]]]], *,
                finished: bool = False) -> list[tuple[list[str], Future[npt.NDArray[np.float32]]]]:
        """Answer the callers whose texts are all in (every one once ``finished``: rows, or the error of
        an earlier call that was to embed one of its texts); the rest."""
        left = []
        for batch, done in waiting:
            failed = next((take.failed[t] for t in batch if t in take.failed), None)
            if failed is not None:
                done.set_exception(failed)
            elif finished or all(t in take.rows for t in batch):
                done.set_result(self._rows(take, batch))
            else:
                left.append((batch, done))
        return left

    def _lookup(self, texts: list[str]) -> tuple[list[str], dict[str, str]]:
        """Put the distinct texts found in the cache (one lookup) into the memo; the distinct texts
        neither the memo nor the cache holds, in the order asked, and their cache keys (with a cache)."""
        fresh = [t for t in dict.fromkeys(texts) if t not in self._memo]
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

    def _rows(self, take: _Take, batch: list[str]) -> npt.NDArray[np.float32]:
        for text in batch:
            if text in self._memo:
                self._memo.move_to_end(text)  # recently asked: kept longest
        return np.stack([take.rows[t] for t in batch]).astype(np.float32, copy=False)

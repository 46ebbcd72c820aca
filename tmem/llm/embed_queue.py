"""One embedding worker for a whole build: texts from every conversation, embedded in full batches.

A build embeds each conversation's new view texts when the conversation is done, from as many
threads as conversations are built at once. Called directly, each call is a small batch padded to
its longest text, and concurrent calls fight over the same cores (torch's own threads times the
callers): on 2 cores a nightly of 1,000 conversations spent far longer embedding than the same
texts take in one pass. :class:`CoalescingEmbedder` puts every call on one queue; a single worker
thread takes what is waiting — up to ``max_texts`` texts, after waiting ``linger_s`` for more — and
embeds it in one call of the inner embedder (sentence-transformers sorts a call's texts by length,
so batches are dense), then hands each caller its rows. Errors reach the callers whose texts were
in the failed call. It also counts what it embedded and how long the inner embedder took.
"""

from __future__ import annotations

import threading
import time
from collections import deque
from concurrent.futures import Future
from dataclasses import dataclass

import numpy as np
import numpy.typing as npt

from tmem.llm.embedder_wrapper import EmbedderWrapper
from tmem.ports import Embedder


@dataclass
class EmbeddingUsage:
    texts: int = 0
    calls: int = 0  # calls of the inner embedder
    seconds: float = 0.0  # spent inside them


class CoalescingEmbedder(EmbedderWrapper):
    """An :class:`Embedder` funnelling every caller's texts through one worker thread (see the module)."""

    def __init__(self, inner: Embedder, *, max_texts: int = 512, linger_s: float = 0.02) -> None:
        super().__init__(inner)
        self.max_texts = max_texts
        self.linger_s = linger_s
        self.usage = EmbeddingUsage()
        self._queue: deque[tuple[list[str], Future[npt.NDArray[np.float32]]]] = deque()
        self._ready = threading.Condition()
        self._worker: threading.Thread | None = None
        self._closed = False

    def embed_texts(self, texts: list[str]) -> npt.NDArray[np.float32]:
        done: Future[npt.NDArray[np.float32]] = Future()
        with self._ready:
            if self._closed:
                raise RuntimeError("the build's embedder was closed")
            self._queue.append((list(texts), done))
            if self._worker is None:
                self._worker = threading.Thread(target=self._work, name="tmem-embedder", daemon=True)
                self._worker.start()
            self._ready.notify()
        return done.result()

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
            while self._queue and (not taken or size + len(self._queue[0][0]) <= self.max_texts):
                texts, done = self._queue.popleft()
                taken.append((texts, done))
                size += len(texts)
        return taken

    def _work(self) -> None:
        while (taken := self._take()) is not None:
            texts = [t for batch, _ in taken for t in batch]
            started = time.perf_counter()
            try:
                matrix = self.inner.embed(texts)
            except BaseException as exc:  # noqa: BLE001 -- not swallowed: every caller of this call re-raises it
                for _, done in taken:
                    done.set_exception(exc)
                continue
            self.usage.seconds += time.perf_counter() - started
            self.usage.texts += len(texts)
            self.usage.calls += 1
            at = 0
            for batch, done in taken:
                done.set_result(matrix[at : at + len(batch)])
                at += len(batch)

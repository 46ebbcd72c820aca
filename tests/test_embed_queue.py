"""The build's one embedding worker (tmem/llm/embed_queue.py): callers from many threads get
their own rows, their texts share calls of the inner embedder, a failed call fails exactly its
callers, and a closed queue refuses work."""

from __future__ import annotations

import threading
from concurrent.futures import ThreadPoolExecutor

import numpy as np
import numpy.typing as npt
import pytest

from tests.test_embed import CountingEmbedder, HashEmbedder
from tmem.llm.embed_queue import CoalescingEmbedder


class GatedEmbedder(CountingEmbedder):
    """Blocks its first call until released, so the callers behind it pile up in the queue."""

    def __init__(self) -> None:
        super().__init__(HashEmbedder())
        self.release = threading.Event()

    def embed(self, texts: list[str]) -> npt.NDArray[np.float32]:
        if not self.calls:
            self.release.wait(10)
        return super().embed(texts)


def test_concurrent_callers_get_their_own_rows_from_shared_calls() -> None:
    inner = GatedEmbedder()
    queue = CoalescingEmbedder(inner, max_texts=64, linger_s=0.01)
    reference = HashEmbedder()
    asks = [[f"conversation {n} text {k}" for k in range(n % 5 + 1)] for n in range(40)]
    with ThreadPoolExecutor(40) as pool:
        futures = [pool.submit(queue.embed, texts) for texts in asks]
        inner.release.set()
        results = [f.result(timeout=30) for f in futures]
    for texts, got in zip(asks, results, strict=True):
        assert np.array_equal(got, reference.embed(texts))
    assert inner.texts_embedded == sum(len(t) for t in asks) == queue.usage.texts
    assert len(inner.calls) < len(asks) / 4 and all(len(c) <= 64 or len(c) == 5 for c in inner.calls)
    assert queue.usage.calls == len(inner.calls) and queue.usage.seconds > 0
    queue.close()


class FailingOn(CountingEmbedder):
    def __init__(self, poison: str) -> None:
        super().__init__(HashEmbedder())
        self.poison = poison

    def embed(self, texts: list[str]) -> npt.NDArray[np.float32]:
        if self.poison in texts:
            raise RuntimeError("the model fell over")
        return super().embed(texts)


def test_a_failed_call_fails_its_callers_and_the_queue_goes_on() -> None:
    queue = CoalescingEmbedder(FailingOn("poison"), linger_s=0.0)
    with pytest.raises(RuntimeError, match="fell over"):
        queue.embed(["fine", "poison"])
    assert queue.embed(["fine"]).shape == (1, 16)
    assert queue.embed([]).shape == (0, 16)
    queue.close()
    with pytest.raises(RuntimeError, match="closed"):
        queue.embed(["late"])

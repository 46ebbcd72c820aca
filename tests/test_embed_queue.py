"""The build's one embedding worker (tmem/llm/embed_queue.py): callers from many threads get
their own rows, their texts share calls of the inner embedder, a failed call fails exactly its
callers, and a closed queue refuses work."""

from __future__ import annotations

import threading
import time
from collections.abc import Sequence
from concurrent.futures import Future, ThreadPoolExecutor

import numpy as np
import numpy.typing as npt
import pytest

from tests.test_embed import CountingEmbedder, HashEmbedder
from tmem.errors import EmbeddingError
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


def embed_at_once(queue: CoalescingEmbedder, inner: GatedEmbedder, asks: list[list[str]]) -> None:
    """Every ask from a thread of its own while the first inner call is held; each gets its own rows."""
    with ThreadPoolExecutor(len(asks)) as pool:
        futures = [pool.submit(queue.embed, texts) for texts in asks]
        inner.release.set()
        results = [f.result(timeout=30) for f in futures]
    reference = HashEmbedder()
    for texts, got in zip(asks, results, strict=True):
        assert np.array_equal(got, reference.embed(texts))


def test_concurrent_callers_get_their_own_rows_from_shared_calls() -> None:
    inner = GatedEmbedder()
    queue = CoalescingEmbedder(inner, max_texts=64, linger_s=0.01)
    asks = [[f"conversation {n} text {k}" for k in range(n % 5 + 1)] for n in range(40)]
    embed_at_once(queue, inner, asks)
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


def test_a_text_several_conversations_send_at_once_is_embedded_once() -> None:
    inner = GatedEmbedder()
    queue = CoalescingEmbedder(inner, max_texts=1000, linger_s=0.01)
    shared = ["the same greeting", "a templated horizon sentence"]
    asks = [[*shared, f"conversation {n} own text"] for n in range(20)]
    embed_at_once(queue, inner, asks)
    embedded = [t for call in inner.calls for t in call]
    assert sorted(embedded) == sorted({t for texts in asks for t in texts})  # each distinct text once
    assert queue.usage.texts == len(embedded) == 22 and queue.usage.requested == 60
    queue.close()


def test_a_recent_text_is_answered_from_memory_and_an_old_one_embedded_again() -> None:
    inner = CountingEmbedder(HashEmbedder())
    queue = CoalescingEmbedder(inner, linger_s=0.0, memo_texts=3)
    queue.embed(["a", "b"])
    assert np.array_equal(queue.embed(["b", "a"]), HashEmbedder().embed(["b", "a"]))
    assert inner.calls == [["a", "b"]]  # the second ask cost no inner call
    queue.embed(["c", "d", "e"])  # the memo keeps 3: "a" and "b" fall out
    queue.embed(["a", "e"])
    assert inner.calls == [["a", "b"], ["c", "d", "e"], ["a"]]
    queue.close()


class WrongShape(CountingEmbedder):
    def embed(self, texts: list[str]) -> npt.NDArray[np.float32]:
        return super().embed(texts)[:-1]


def test_an_inner_answer_of_the_wrong_shape_fails_its_callers() -> None:
    queue = CoalescingEmbedder(WrongShape(HashEmbedder()), linger_s=0.0)
    with pytest.raises(EmbeddingError, match="shape"):
        queue.embed(["x", "y"])
    queue.close()


def test_conversations_queued_behind_a_call_share_one_large_call() -> None:
    """Twenty conversations of 100 texts waiting for the model go in one call (sorted by length there:
    less padding than five calls of four conversations)."""
    inner = GatedEmbedder()
    queue = CoalescingEmbedder(inner, linger_s=0.05)
    first = threading.Thread(target=queue.embed, args=(["the first conversation"],))
    first.start()
    time.sleep(0.2)  # the worker is inside its first call, held by the gate
    asks = [[f"conversation {n} text {k}" for k in range(100)] for n in range(20)]
    with ThreadPoolExecutor(20) as pool:
        futures = [pool.submit(queue.embed, texts) for texts in asks]
        time.sleep(0.5)
        inner.release.set()
        [f.result(timeout=30) for f in futures]
    first.join(10)
    assert [len(c) for c in inner.calls] == [1, 2000]
    queue.close()


def test_with_a_cache_the_queue_looks_up_once_per_call_and_stores_what_it_embedded() -> None:
    """Twenty conversations queued behind a call: their texts are looked up in the cache in one
    lookup, only the misses reach the model, and those are stored for the next build."""
    from tmem.llm.cached_embedder import InMemoryEmbeddingCache, embedding_key

    class CountingCache(InMemoryEmbeddingCache):
        def __init__(self) -> None:
            super().__init__()
            self.lookups: list[int] = []

        def get_many(self, model: str, text_hashes: Sequence[str]) -> dict[str, npt.NDArray[np.float32]]:
            self.lookups.append(len(text_hashes))
            return super().get_many(model, text_hashes)

    reference = HashEmbedder()
    cache = CountingCache()
    old = [f"old text {k}" for k in range(10)]
    cache.put_many(reference.model_name, {embedding_key(reference.model_name, t): reference.embed([t])[0] for t in old})
    inner = GatedEmbedder()
    queue = CoalescingEmbedder(inner, cache=cache, linger_s=0.05)
    first = threading.Thread(target=queue.embed, args=(["the first conversation"],))
    first.start()
    time.sleep(0.2)  # the worker is inside its first call, held by the gate
    asks = [[*old[n % 10 : n % 10 + 1], f"conversation {n} new text"] for n in range(20)]
    with ThreadPoolExecutor(20) as pool:
        futures = [pool.submit(queue.embed, texts) for texts in asks]
        time.sleep(0.5)
        inner.release.set()
        results = [f.result(timeout=30) for f in futures]
    first.join(10)
    for texts, got in zip(asks, results, strict=True):
        assert np.array_equal(got, reference.embed(texts))
    assert cache.lookups == [1, 30]  # the first conversation's text, then all twenty at once (10 old + 20 new)
    assert inner.calls[1] == [f"conversation {n} new text" for n in range(20)]  # no cached text embedded again
    assert queue.usage.cache_hits == 10 and queue.usage.texts == 21 and queue.usage.lookups == 2
    assert len(cache) == 10 + 21  # what the model embedded is in the cache now
    queue.embed(["conversation 3 new text", "old text 4"])  # both in the memo or the cache: no model call
    assert len(inner.calls) == 2
    queue.close()


def test_a_cached_vector_of_the_wrong_dimension_fails_its_callers() -> None:
    from tmem.llm.cached_embedder import InMemoryEmbeddingCache, embedding_key

    inner = CountingEmbedder(HashEmbedder())
    cache = InMemoryEmbeddingCache()
    cache.put_many(inner.model_name, {embedding_key(inner.model_name, "stale"): np.zeros(3, dtype=np.float32)})
    queue = CoalescingEmbedder(inner, cache=cache, linger_s=0.0)
    with pytest.raises(EmbeddingError, match="do not have dim"):
        queue.embed(["stale", "fresh"])
    assert inner.calls == []
    queue.close()


def test_prefetched_texts_are_embedded_once_and_answered_from_the_memo() -> None:
    inner = CountingEmbedder(HashEmbedder())
    queue = CoalescingEmbedder(inner, linger_s=0.0)
    queue.prefetch(["scene summary", "dialogue window"])
    rows = queue.embed(["dialogue window", "an item", "scene summary"])  # queued behind the prefetch
    assert np.array_equal(rows, HashEmbedder().embed(["dialogue window", "an item", "scene summary"]))
    assert sorted(t for call in inner.calls for t in call) == ["an item", "dialogue window", "scene summary"]
    assert queue.usage.prefetched == 2 and queue.usage.texts == 3
    window = queue.usage.window()
    assert window is not None and 0 <= window[0] <= window[1]
    queue.close()
    queue.prefetch(["after close"])  # ignored, not an error: nobody waits for it
    assert queue.usage.prefetched == 2


def test_a_failed_prefetch_is_raised_by_the_call_that_needs_the_texts() -> None:
    inner = FailingOn("poison")
    queue = CoalescingEmbedder(inner, linger_s=0.0)
    queue.prefetch(["poison", "fine"])
    with pytest.raises(RuntimeError, match="fell over"):
        queue.embed(["poison"])
    assert queue.embed(["fine"]).shape == (1, 16)  # embedded again: the failed prefetch kept nothing
    queue.close()


def test_the_call_cap_counts_new_texts_not_the_views_already_embedded() -> None:
    """A nightly conversation asks for all its views, most of them embedded before: the queue takes
    every waiting caller and fills its calls with new texts only (a cap on texts asked made calls of
    ~250 new texts out of 2,048 asked, ~20 % dearer per text on the encoder)."""
    inner = GatedEmbedder()
    queue = CoalescingEmbedder(inner, max_texts=8, linger_s=0.01)
    known = [f"old view {k}" for k in range(30)]
    asks = [[*known, f"new text of conversation {n}"] for n in range(12)]
    with ThreadPoolExecutor(len(asks) + 1) as pool:
        first = pool.submit(queue.embed, known)  # the first call, held: the conversations queue up behind it
        time.sleep(0.05)
        futures = [pool.submit(queue.embed, texts) for texts in asks]
        time.sleep(0.1)
        inner.release.set()
        first.result(timeout=30)
        results = [f.result(timeout=30) for f in futures]
    reference = HashEmbedder()
    for texts, got in zip(asks, results, strict=True):
        assert np.array_equal(got, reference.embed(texts))
    new_calls = [c for c in inner.calls if any(t.startswith("new text") for t in c)]
    assert sorted(t for c in new_calls for t in c) == sorted(a[-1] for a in asks)  # each new text once
    assert [len(c) for c in new_calls] == [8, 4]  # 12 new texts among 372 asked: two calls, full ones first
    queue.close()


def test_a_caller_whose_texts_are_in_goes_on_before_the_rest_of_the_take_is_embedded() -> None:
    class HoldSecond(CountingEmbedder):
        def __init__(self) -> None:
            super().__init__(HashEmbedder())
            self.second = threading.Event()
            self.release = threading.Event()

        def embed(self, texts: list[str]) -> npt.NDArray[np.float32]:
            if len(self.calls) == 1:
                self.second.set()
                self.release.wait(10)
            return super().embed(texts)

    inner = HoldSecond()
    queue = CoalescingEmbedder(inner, max_texts=2, linger_s=0.05)
    with ThreadPoolExecutor(2) as pool:
        early = pool.submit(queue.embed, ["a", "b"])
        late = pool.submit(queue.embed, ["c", "d"])
        assert inner.second.wait(10)  # the take's second call is running
        assert early.result(timeout=10).shape == (2, 16)  # answered after the first call
        assert not late.done()
        inner.release.set()
        assert late.result(timeout=10).shape == (2, 16)
    assert inner.calls == [["a", "b"], ["c", "d"]]
    queue.close()


class PipelinedDouble(CountingEmbedder):
    """A typed double of :class:`tmem.ports.PipelinedEmbedder`: :meth:`submit` records the call and
    returns a future the test completes (:meth:`complete`); ``wait_taken`` returns once the test sets
    ``taken`` (the encoder's children have taken every share of what was submitted)."""

    def __init__(self) -> None:
        super().__init__(HashEmbedder())
        self.pending: list[tuple[list[str], Future[npt.NDArray[np.float32]]]] = []
        self.submitted = threading.Semaphore(0)
        self.taken = threading.Event()

    def submit(self, texts: list[str]) -> Future[npt.NDArray[np.float32]]:
        done: Future[npt.NDArray[np.float32]] = Future()
        self.calls.append(list(texts))
        self.pending.append((list(texts), done))
        self.submitted.release()
        return done

    def wait_taken(self, timeout: float | None = None) -> bool:
        return self.taken.wait(10 if timeout is None else timeout)

    def complete(self, n: int, error: BaseException | None = None) -> None:
        texts, done = self.pending[n]
        if error is not None:
            done.set_exception(error)
        else:
            done.set_result(self.inner.embed(texts))



def _second_while_first_runs(queue: CoalescingEmbedder, inner: PipelinedDouble, pool: ThreadPoolExecutor
                             ) -> tuple[Future[npt.NDArray[np.float32]], Future[npt.NDArray[np.float32]]]:
    """Ask for ["a", "b"], then, while that call runs, for ["b", "c"]: the two asks' futures, once the
    second call is handed over (the encoder's children took every share of the first meanwhile)."""
    first = pool.submit(queue.embed, ["a", "b"])
    assert inner.submitted.acquire(timeout=10)
    second = pool.submit(queue.embed, ["b", "c"])
    time.sleep(0.1)  # queued while the encoder's children are on the first call
    inner.taken.set()
    assert inner.submitted.acquire(timeout=10)
    return first, second


def test_with_a_pipelined_encoder_the_next_call_is_handed_over_while_the_first_runs() -> None:
    """The worker hands the encoder its next call while the current one runs (one at a time, the
    encoder idled while the worker answered the callers, stored the vectors and looked up the next
    texts); a text the running call embeds is not sent again, and its caller gets its row from it."""
    inner = PipelinedDouble()
    queue = CoalescingEmbedder(inner, linger_s=0.0)
    with ThreadPoolExecutor(3) as pool:
        first, second = _second_while_first_runs(queue, inner, pool)  # handed over before the first's rows are in
        assert inner.calls == [["a", "b"], ["c"]] and not first.done()
        inner.complete(1)  # the second call ends first: its caller still waits for "b"
        time.sleep(0.1)
        assert not second.done()
        inner.complete(0)
        reference = HashEmbedder()
        assert np.array_equal(first.result(timeout=10), reference.embed(["a", "b"]))
        assert np.array_equal(second.result(timeout=10), reference.embed(["b", "c"]))
    assert queue.usage.texts == 3 and queue.usage.calls == 2 and queue.usage.requested == 4
    assert np.array_equal(queue.embed(["c", "a"]), HashEmbedder().embed(["c", "a"]))  # from the memo
    assert len(inner.calls) == 2
    queue.close()


def test_with_a_pipelined_encoder_a_failed_call_fails_the_callers_waiting_for_its_texts() -> None:
    inner = PipelinedDouble()
    queue = CoalescingEmbedder(inner, linger_s=0.0)
    with ThreadPoolExecutor(3) as pool:
        first, needs_b = _second_while_first_runs(queue, inner, pool)
        inner.complete(1)
        inner.complete(0, RuntimeError("the encoder fell over"))
        with pytest.raises(RuntimeError, match="fell over"):
            first.result(timeout=10)
        with pytest.raises(RuntimeError, match="fell over"):
            needs_b.result(timeout=10)
    assert np.array_equal(queue.embed(["c"]), HashEmbedder().embed(["c"]))  # its own text came in
    later = threading.Thread(target=lambda: queue.embed(["b"]))
    later.start()
    assert inner.submitted.acquire(timeout=10) and inner.calls[-1] == ["b"]  # embedded again, not lost
    inner.complete(2)
    later.join(10)
    assert not later.is_alive()
    queue.close()


class FactsNotYet(PipelinedDouble):
    """A pipelined embedder whose model facts must not be asked for (its model has not loaded)."""

    @property
    def dim(self) -> int:
        raise AssertionError("the model's dimension was asked for")


def test_a_queue_over_a_pipelined_encoder_opens_without_asking_for_the_model() -> None:
    """Opening the build's queue must not wait for the encoder's model (a Dask publisher's pool starts
    no child unless asked); the pipelined check once read every member of the embedder, ``dim`` too."""
    queue = CoalescingEmbedder(FactsNotYet(), linger_s=0.0)
    assert queue._pipelined is not None
    queue.close()

"""The build's encoder in child processes: same rows, errors named, no child left behind; the pool's
shares and the token-budget batches."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Iterator

import numpy as np
import numpy.typing as npt
import pytest

from tests.test_embed import HashEmbedder
from tmem.build.runtime import _embedder, encoder_layout
from tmem.errors import EmbeddingError
from tmem.providers.encoder_process import EncoderPool, EncoderProcess, EncoderSpec, length_shares
from tmem.providers.sentence_transformer import SentenceTransformerEmbedder, token_batches
from tmem.settings import load_settings

TEXTS = ["Ana glazed a bowl in the pottery class.", "Ben ran his first marathon in Berlin.", "", "ok"]


@pytest.fixture
def encoder() -> Iterator[EncoderProcess]:
    found = EncoderProcess(EncoderSpec("all-MiniLM-L6-v2"))
    yield found
    found.close()


def _gone(pid: int, within_s: float = 20.0) -> bool:
    deadline = time.monotonic() + within_s
    while time.monotonic() < deadline:
        try:
            os.kill(pid, 0)
        except ProcessLookupError:
            return True
        try:  # our own child: reap it, or it stays a zombie that kill(pid, 0) still finds
            if os.waitpid(pid, os.WNOHANG) != (0, 0):
                return True
        except ChildProcessError:
            pass
        time.sleep(0.2)
    return False


def test_rows_width_and_limit_are_the_in_process_encoders(encoder: EncoderProcess) -> None:
    here = SentenceTransformerEmbedder("all-MiniLM-L6-v2")
    rows = encoder.embed(TEXTS)
    assert rows.dtype == np.float32 and rows.shape == (4, 384)
    np.testing.assert_allclose(rows, here.embed(TEXTS), atol=1e-5)
    assert (encoder.dim, encoder.max_input_tokens) == (here.dim, here.max_input_tokens) == (384, 256)
    assert encoder.pid is not None and encoder.pid != os.getpid()
    assert encoder.embed([]).shape == (0, 384)


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="malloc is tuned on glibc only")
def test_a_child_tunes_its_malloc_whatever_the_environment_it_inherits(monkeypatch: pytest.MonkeyPatch) -> None:
    """A local Dask cluster's nanny writes MALLOC_TRIM_THRESHOLD_=65536 into the flow process's environment,
    which every encoder child started after the cluster inherits; the child sets its own thresholds."""
    monkeypatch.setenv("MALLOC_TRIM_THRESHOLD_", "65536")
    child = EncoderProcess(EncoderSpec("all-MiniLM-L6-v2"))
    try:
        assert child.malloc_tuned is True
        assert child.embed(TEXTS).shape == (4, 384)
    finally:
        child.close()


def test_a_model_that_cannot_load_is_named_and_leaves_no_child() -> None:
    broken = EncoderProcess(EncoderSpec("/nonexistent/model-dir"))
    with pytest.raises(EmbeddingError, match="could not start") as caught:
        broken.embed(["x"])
    assert caught.value.model == "/nonexistent/model-dir" and "cannot load" in caught.value.reason
    assert broken.pid is None


def test_a_killed_child_is_an_error_and_the_next_call_starts_a_new_one(encoder: EncoderProcess) -> None:
    first = encoder.embed(TEXTS[:2])
    pid = encoder.pid
    assert pid is not None
    os.kill(pid, signal.SIGKILL)
    assert _gone(pid)
    with pytest.raises(EmbeddingError, match="ended"):
        encoder.embed(TEXTS[:2])
    again = encoder.embed(TEXTS[:2])
    assert encoder.pid not in (None, pid)
    np.testing.assert_allclose(again, first, atol=1e-6)


def test_close_ends_the_child(encoder: EncoderProcess) -> None:
    encoder.embed(["x"])
    pid = encoder.pid
    assert pid is not None
    encoder.close()
    assert encoder.pid is None and _gone(pid)


class _Told(EncoderProcess):
    """A child that records being told to end (no process behind it)."""

    def __init__(self, n: int, events: list[str]) -> None:
        super().__init__(EncoderSpec("all-MiniLM-L6-v2"))
        self.n, self.events = n, events

    def stop(self) -> subprocess.Popen[bytes] | None:
        self.events.append(f"told {self.n}")
        return None


def test_a_pool_tells_every_child_to_end_before_waiting_for_any(monkeypatch: pytest.MonkeyPatch) -> None:
    events: list[str] = []
    monkeypatch.setattr(EncoderProcess, "reap", staticmethod(lambda process: events.append("waited")))
    pool = EncoderPool(EncoderSpec("all-MiniLM-L6-v2"), 3)
    pool.children = [_Told(n, events) for n in range(3)]
    pool.close()
    assert events == ["told 0", "told 1", "told 2", "waited", "waited", "waited"]


def test_closed_pool_children_have_all_exited_cleanly() -> None:
    pool = EncoderPool(EncoderSpec("all-MiniLM-L6-v2", 16, "cpu", 1), 2)
    pool.start()
    processes = [child._process for child in pool.children]
    assert all(p is not None for p in processes)
    pool.close()
    assert [p.returncode for p in processes if p is not None] == [0, 0]  # each child ended itself
    assert pool.pids == [None, None]


def test_a_parent_killed_with_sigkill_leaves_no_encoder() -> None:
    script = (
        "from tmem.providers.encoder_process import EncoderPool, EncoderProcess, EncoderSpec, length_shares\n"
        "e = EncoderProcess(EncoderSpec('all-MiniLM-L6-v2'))\n"
        "e.embed(['x'])\n"
        "print(e.pid, flush=True)\n"
        "import time; time.sleep(600)\n"
    )
    parent = subprocess.Popen([sys.executable, "-c", script], stdout=subprocess.PIPE, text=True,
                              env={**os.environ, "HF_HUB_OFFLINE": "1"})
    try:
        assert parent.stdout is not None
        child = int(parent.stdout.readline())
        parent.kill()
        parent.wait(30)
        assert _gone(child), f"encoder {child} outlived its killed parent"
    finally:
        parent.kill()


def test_the_build_encoder_is_a_pool_of_single_threaded_children_by_default() -> None:
    on = _embedder(load_settings(embedding_batch_size=17), worker=False, cores=2, start=False)  # a pool of its own
    assert isinstance(on, EncoderPool) and len(on.children) == 2
    assert on.spec == EncoderSpec("all-MiniLM-L6-v2", 17, "cpu", 1, 2048)
    assert on.pids == [None, None]  # not started: a Dask run's publisher starts none unless asked to embed
    assert _embedder(load_settings(embedding_batch_size=17), worker=False, cores=2, start=False) is on  # one per process
    assert encoder_layout(load_settings(), worker=False, cores=2) == (2, 1)
    assert encoder_layout(load_settings(), worker=False, cores=16) == (4, 4)  # at most 4 model copies
    assert encoder_layout(load_settings(embedding_processes=1), worker=False, cores=2) == (1, 2)
    assert encoder_layout(load_settings(embedding_processes=2, embedding_threads=3), worker=False, cores=2) == (2, 3)
    # a local Dask worker's share of the cores; an external cluster's worker embeds in its process
    assert encoder_layout(load_settings(dask_workers=2), worker=True, cores=2) == (1, 1)
    assert encoder_layout(load_settings(dask_workers=2), worker=True, cores=8) == (4, 1)
    assert encoder_layout(load_settings(dask_workers=2, dask_address="tcp://10.0.0.5:8786"), worker=True,
                          cores=8) == (0, 0)
    # 0: in the build's process, as another provider's embedder always is
    assert isinstance(_embedder(load_settings(embedding_processes=0), worker=False, cores=2),
                      SentenceTransformerEmbedder)
    assert encoder_layout(load_settings(embedding_processes=0), worker=True, cores=2) == (0, 1)
    assert encoder_layout(load_settings(embedding_provider="other"), worker=False, cores=2) == (0, 0)


def test_a_pool_embeds_what_one_model_embeds_with_every_child_taking_shares() -> None:
    texts = [f"{'a long sentence about pottery and marathons ' * (n % 9)}item {n}" for n in range(300)]
    pool = EncoderPool(EncoderSpec("all-MiniLM-L6-v2", 16, "cpu", 1), 2)
    try:
        rows = pool.embed(texts)
        assert all(pid is not None for pid in pool.pids) and len(set(pool.pids)) == 2  # both children served
        here = SentenceTransformerEmbedder("all-MiniLM-L6-v2")
        np.testing.assert_allclose(rows, here.embed(texts), atol=1e-5)
        assert pool.embed([]).shape == (0, 384) and pool.embed(["one"]).shape == (1, 384)
    finally:
        pool.close()
    assert pool.pids == [None, None]


def test_a_pool_whose_child_dies_raises_and_the_next_call_restarts_it() -> None:
    texts = [f"text number {n} " * (1 + n % 5) for n in range(200)]
    pool = EncoderPool(EncoderSpec("all-MiniLM-L6-v2", 16, "cpu", 1), 2)
    try:
        pool.start()
        first = pool.embed(texts)
        victim = pool.pids[1]
        assert victim is not None
        os.kill(victim, signal.SIGKILL)
        assert _gone(victim)
        with pytest.raises(EmbeddingError, match="ended"):
            pool.embed(texts)
        np.testing.assert_allclose(pool.embed(texts), first, atol=1e-6)
        assert victim not in pool.pids
    finally:
        pool.close()


def test_length_shares_are_longest_first_and_cover_every_text_once() -> None:
    lengths = [5, 400, 30, 30, 1200, 7, 90, 90, 3, 250]
    shares = length_shares(lengths, 4, 2)
    assert sorted(i for share in shares for i in share) == list(range(len(lengths)))
    flat = [lengths[i] for share in shares for i in share]
    assert flat == sorted(lengths, reverse=True)
    assert all(len(share) >= 2 for share in shares[:-1]) and len(shares) <= 4
    assert len(shares[0]) <= len(shares[-1])  # the longest texts come in the smallest shares


def test_token_batches_keep_each_batch_within_the_budget() -> None:
    lengths = [256, 12, 200, 9, 40, 41, 256, 3, 100, 15] * 10
    batches = token_batches(lengths, 1024, 64)
    assert sorted(i for b in batches for i in b) == list(range(len(lengths)))
    for batch in batches:
        assert len(batch) <= 64 and (len(batch) == 1 or len(batch) * max(lengths[i] for i in batch) <= 1024)
    assert [lengths[b[0]] for b in batches] == sorted((lengths[b[0]] for b in batches), reverse=True)
    assert len(batches[0]) == 4 and len(batches[-1]) > 4 * len(batches[0])  # long texts in small batches, short in large
    assert token_batches([5000, 10], 1024, 64) == [[0], [1]]  # a text beyond the budget goes alone


def test_token_batches_embed_what_sentence_transformers_own_batches_embed() -> None:
    texts = [("word " * (n * 7 % 180)) + f"end {n}" for n in range(120)]
    budgeted = SentenceTransformerEmbedder("all-MiniLM-L6-v2", batch_tokens=512)
    plain = SentenceTransformerEmbedder("all-MiniLM-L6-v2", batch_tokens=0)
    np.testing.assert_allclose(budgeted.embed(texts), plain.embed(texts), atol=1e-5)


def test_a_call_of_a_few_hundred_texts_is_shared_evenly_between_the_children() -> None:
    """A nightly's queue hands the pool calls of a few hundred texts, long dialogue windows and short
    triggers mixed: every child gets shares, and no share holds most of the call's text."""
    pool = EncoderPool(EncoderSpec(model="all-MiniLM-L6-v2", batch_size=64), 2)
    texts = [("dialogue " * 40) if n % 5 == 0 else ("trigger " * 4) for n in range(125)]
    shares = pool.plan(texts)
    assert sorted(i for share in shares for i in share) == list(range(len(texts)))
    total = sum(len(t) for t in texts)
    assert len(shares) >= 2 * len(pool.children)
    assert max(sum(len(texts[i]) for i in share) for share in shares) < total / 3


class _HeldChild(EncoderProcess):
    """A typed double of one encoder child (no process): rows from :class:`HashEmbedder`; a share
    holding a text that starts with "slow" waits for ``release``; every share it embeds is recorded."""

    def __init__(self, n: int, done: list[tuple[int, str]], release: threading.Event) -> None:
        super().__init__(EncoderSpec("all-MiniLM-L6-v2"))
        self.n, self.done, self.release = n, done, release

    def embed(self, texts: list[str]) -> npt.NDArray[np.float32]:
        if any(t.startswith("slow") for t in texts):
            assert self.release.wait(10)
        if any(t.startswith("broken") for t in texts):
            raise EmbeddingError("all-MiniLM-L6-v2", "in the encoder process: the share fell over")
        self.done.append((self.n, texts[0][:4]))
        return HashEmbedder(dim=4).embed(texts)

    def stop(self) -> subprocess.Popen[bytes] | None:
        return None


def _held_pool(done: list[tuple[int, str]], release: threading.Event) -> EncoderPool:
    pool = EncoderPool(EncoderSpec("all-MiniLM-L6-v2"), 2)
    pool.children = [_HeldChild(n, done, release) for n in range(2)]
    return pool


def test_a_child_done_with_its_shares_starts_on_the_next_call_while_the_other_finishes() -> None:
    """Calls overlap: the next call's shares queue behind the current call's, and a child that ends
    its last share takes them at once (one call at a time, it idled until the slowest share was in)."""
    done: list[tuple[int, str]] = []
    release = threading.Event()
    pool = _held_pool(done, release)
    first = [f"slow and long text {n} " * 3 for n in range(8)] + [f"fast {n}" for n in range(8)]
    second = [f"next {n}" for n in range(8)]
    try:
        held = pool.submit(first)  # two shares: the eight long "slow" texts, and the eight short ones
        following = pool.submit(second)
        assert np.array_equal(following.result(timeout=10), HashEmbedder(dim=4).embed(second))
        assert not held.done()  # the second call was embedded while a share of the first was held
        assert pool.wait_taken(timeout=1)  # and no share waits for a child
        release.set()
        assert np.array_equal(held.result(timeout=10), HashEmbedder(dim=4).embed(first))
        assert [kind for _, kind in done] == ["fast", "next", "slow"]
        assert {n for n, kind in done if kind != "slow"} != {n for n, kind in done if kind == "slow"}
    finally:
        release.set()
        pool.close()


def test_a_failed_share_fails_its_call_only_and_a_closed_pool_fails_what_still_waits() -> None:
    done: list[tuple[int, str]] = []
    release = threading.Event()
    pool = _held_pool(done, release)
    try:
        broken = pool.submit([f"broken text {n}" for n in range(8)])
        with pytest.raises(EmbeddingError, match="fell over"):
            broken.result(timeout=10)
        assert pool.embed(["fine"]).shape == (1, 4)  # the pool goes on
        blocking = pool.submit([f"slow {n}" for n in range(16)])  # both children held
        waiting = pool.submit(["queued behind them"])
        assert not pool.wait_taken(timeout=0.2)
        closer = threading.Thread(target=pool.close)
        closer.start()
        with pytest.raises(EmbeddingError, match="closed"):
            waiting.result(timeout=10)
        release.set()  # the held shares end; close waits for them
        closer.join(10)
        assert blocking.result(timeout=10).shape == (16, 4)
        assert pool.embed(["after close"]).shape == (1, 4)  # a call after close starts anew
    finally:
        release.set()
        pool.close()

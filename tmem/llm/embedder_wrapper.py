"""The one base of the embedders the call layer wraps around another (cache, build queue).

simonw/llm's ``EmbeddingModel`` writes batching once around ``embed_batch``; here the identity of
the model (name, width, input limit) and the empty call are written once, and a wrapper writes only
what it adds around the inner embedder's ``embed``.
"""

from __future__ import annotations

from abc import ABC, abstractmethod

import numpy as np
import numpy.typing as npt

from tmem.ports import Embedder


class EmbedderWrapper(ABC):
    """An :class:`~tmem.ports.Embedder` in front of ``inner``: the same model, width and input limit;
    no texts give an empty ``(0, dim)`` array without a call; the rest is :meth:`embed_texts`."""

    def __init__(self, inner: Embedder) -> None:
        self.inner = inner

    @property
    def model_name(self) -> str:
        return self.inner.model_name

    @property
    def dim(self) -> int:
        return self.inner.dim

    @property
    def max_input_tokens(self) -> int | None:
        return self.inner.max_input_tokens

    def embed(self, texts: list[str]) -> npt.NDArray[np.float32]:
        if not texts:
            return np.zeros((0, self.dim), dtype=np.float32)
        return self.embed_texts(texts)

    @abstractmethod
    def embed_texts(self, texts: list[str]) -> npt.NDArray[np.float32]:
        """The rows of one or more texts (what the wrapper adds around ``inner.embed``)."""

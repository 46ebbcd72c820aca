"""The two capability interfaces of the core: chat with structured output, and embedding."""

from __future__ import annotations

from typing import Protocol, TypeVar

import numpy as np
import numpy.typing as npt
from pydantic import BaseModel

from tmem.prompts.base import Prompt

R = TypeVar("R", bound=BaseModel)


class ChatModel(Protocol):
    """Sends a prompt and returns its validated response model, or raises :class:`tmem.errors.LLMError`."""

    @property
    def model_name(self) -> str: ...

    def complete(self, prompt: Prompt[R]) -> R: ...


class Embedder(Protocol):
    """Embeds texts as L2-normalised float32 rows of shape (len(texts), dim)."""

    @property
    def model_name(self) -> str: ...

    @property
    def dim(self) -> int: ...

    @property
    def max_input_tokens(self) -> int | None:
        """The longest input the encoder reads, in its own tokens (longer inputs are cut); None: unknown."""
        ...

    def embed(self, texts: list[str]) -> npt.NDArray[np.float32]: ...

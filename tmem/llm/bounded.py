"""The in-flight bound: at most ``limit`` chat calls at once across all threads of a process."""

from __future__ import annotations

import threading
from typing import TypeVar

from pydantic import BaseModel

from tmem.ports import ChatModel
from tmem.prompts.base import Prompt

R = TypeVar("R", bound=BaseModel)


class BoundedChatModel:
    """Caps in-flight calls of the wrapped model at ``limit`` across all threads of a process.

    Prefect's tag concurrency limit (``llm``) bounds task runs on a server; this bound holds
    for every code path, including local ephemeral runs where no limit is configured.
    """

    def __init__(self, inner: ChatModel, limit: int) -> None:
        self._inner = inner
        self._slots = threading.BoundedSemaphore(limit)

    @property
    def model_name(self) -> str:
        return self._inner.model_name

    def complete(self, prompt: Prompt[R]) -> R:
        with self._slots:
            return self._inner.complete(prompt)

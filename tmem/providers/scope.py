"""Which conversation an LLM call or an embedding is made for, so that its cache and ledger rows
can be found again when the conversation is forgotten (``tmem forget``, :mod:`tmem.store.forget`).

Cache keys are content hashes of the messages, which do not name the conversation. So the
construction stages run inside :func:`conversation_scope` (via :func:`scoped`), and the cached
chat model records the scope with every ledger row (``llm_usage.conversation_id`` next to the
row's ``cache_key``); the batching adapter records it with each journalled batch request. A
context variable carries it: each thread (a Prefect task run, a Dask worker thread) sees the
scope its own code entered, and nothing else.
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from contextvars import ContextVar
from typing import ParamSpec, TypeVar

P = ParamSpec("P")
R = TypeVar("R")

_SCOPE: ContextVar[str | None] = ContextVar("tmem_conversation_scope", default=None)


def current_conversation() -> str | None:
    """The conversation the current code works for, or ``None`` outside any scope."""
    return _SCOPE.get()


@contextmanager
def conversation_scope(conversation_id: str) -> Iterator[None]:
    """Attribute the LLM calls made inside the block to ``conversation_id``."""
    token = _SCOPE.set(conversation_id)
    try:
        yield
    finally:
        _SCOPE.reset(token)


def scoped(fn: Callable[P, R]) -> Callable[P, R]:
    """Run ``fn(conversation_id, ...)`` inside :func:`conversation_scope` of its ``conversation_id``
    argument (the first positional one, or the keyword)."""

    @functools.wraps(fn)
    def wrapper(*args: P.args, **kwargs: P.kwargs) -> R:
        conversation_id = args[0] if args else kwargs.get("conversation_id")
        if not isinstance(conversation_id, str):
            return fn(*args, **kwargs)
        with conversation_scope(conversation_id):
            return fn(*args, **kwargs)

    return wrapper

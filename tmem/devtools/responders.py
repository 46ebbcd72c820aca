"""The responders of the scripted server: ``(operation, request_json) -> content``, registered by operation.

:class:`tmem.devtools.scripted_llm.ScriptedLLM` asks the responders it was given, then this
registry (``tmem.devtools.synth`` registers its deterministic responders here on import), then its
``default``. The request's input data is ``request_input(request_json)`` (``parse_input`` of the last
user message with an input block). Kept apart from the server so that responders and the server
import this module, never each other.
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from typing import Any

from tmem.prompts.base import INPUT_OPEN, parse_input

Responder = Callable[[str, dict[str, Any]], str]

_REGISTRY: dict[str, Responder] = {}
_REGISTRY_LOCK = threading.Lock()


def register_responder(operation: str, responder: Responder) -> Responder:
    """Register the default responder of ``operation`` (replacing any earlier one)."""
    with _REGISTRY_LOCK:
        _REGISTRY[operation] = responder
    return responder


def responder_for(operation: str) -> Callable[[Responder], Responder]:
    """Decorator form of :func:`register_responder`."""
    return lambda fn: register_responder(operation, fn)


def unregister_responder(operation: str) -> None:
    with _REGISTRY_LOCK:
        _REGISTRY.pop(operation, None)


def registered_responders() -> dict[str, Responder]:
    with _REGISTRY_LOCK:
        return dict(_REGISTRY)


def input_message(request_json: dict[str, Any]) -> str:
    """The last user message that carries an ``<input>`` block (repair re-asks come after it)."""
    for message in reversed(request_json.get("messages", [])):
        content = str(message.get("content") or "")
        if message.get("role") == "user" and INPUT_OPEN in content:
            return content
    raise LookupError("no user message with an <input> block in the request")


def request_input(request_json: dict[str, Any]) -> Any:
    """The prompt's input data, as rendered by :func:`tmem.prompts.base.render_input`."""
    return parse_input(input_message(request_json))


def sequence_responder(*contents: str) -> Responder:
    """Answers ``contents`` in order, then repeats the last one (thread-safe)."""
    if not contents:
        raise ValueError("sequence_responder needs at least one content")
    lock = threading.Lock()
    calls = [0]

    def respond(operation: str, request_json: dict[str, Any]) -> str:
        with lock:
            index = min(calls[0], len(contents) - 1)
            calls[0] += 1
        return contents[index]

    return respond

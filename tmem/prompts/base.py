"""What every prompt module produces: a :class:`Prompt` bound to its response model.

A prompt module (one per LLM operation) defines a typed input, a pydantic response model
whose field descriptions carry the instructions, a ``VERSION`` string and a pure
``build(input) -> Prompt`` function. The input is rendered as a JSON block between
``<input>`` and ``</input>`` at the end of the last user message, so that the model (and
the scripted development server) reads structured data rather than prose.
"""

from __future__ import annotations

import copy
import functools
import json
from dataclasses import dataclass
from typing import Any, Generic, Literal, TypeVar

from pydantic import BaseModel

from tmem.ids import content_hash

R = TypeVar("R", bound=BaseModel)

INPUT_OPEN = "<input>"
INPUT_CLOSE = "</input>"


@dataclass(frozen=True)
class Message:
    role: Literal["system", "user", "assistant"]
    content: str


@dataclass(frozen=True)
class Prompt(Generic[R]):
    """One LLM request, ready to send: operation name, version, messages and the response model."""

    operation: str
    version: str
    messages: tuple[Message, ...]
    response_model: type[R]
    input_ref: str  # short human-readable description of the input, for errors and logs
    # Completion-token budget of the operation (tmem.prompts.budgets); None: the adapter's fallback.
    # Not part of the cache key: a valid answer is valid whatever the cap it was asked under.
    max_tokens: int | None = None
    # True when the messages carry the rejection feedback of an earlier answer (a checked re-ask of
    # the construction stage, tmem.construct.common.ask_checked); the usage ledger counts them.
    checked_reask: bool = False

    def json_schema(self) -> dict[str, Any]:
        """The response model's JSON schema (a copy: the caller may change it)."""
        return copy.deepcopy(response_schema(self.response_model))

    def input_digest(self) -> str:
        """Content hash of the messages as sent (what a quarantine record names the input by)."""
        return content_hash([(m.role, m.content) for m in self.messages])

    def input_excerpt(self, limit: int = 2000) -> str:
        """The start of the input block of the last user message that has one (else of that message)."""
        users = [m.content for m in self.messages if m.role == "user"]
        with_input = [c for c in users if INPUT_OPEN in c]
        text = with_input[-1][with_input[-1].rindex(INPUT_OPEN):] if with_input else (users[-1] if users else "")
        return text if len(text) <= limit else text[:limit] + "..."

    def cache_key(self, model: str) -> str:
        """Content key: model, operation, prompt version, messages and response schema.

        ``max_tokens`` is left out on purpose: an answer that validated is as valid under any other
        budget (a cut answer never validates and is never cached), so a changed budget re-asks nothing.
        """
        return content_hash(
            model,
            self.operation,
            self.version,
            [(m.role, m.content) for m in self.messages],
            self.json_schema(),
        )


@functools.cache
def response_schema(model: type[BaseModel]) -> dict[str, Any]:
    """A response model's JSON schema, generated once per process. pydantic builds it anew on every
    ``model_json_schema()`` call, and a build asked for it three times per LLM call (cache key,
    request, JSON-mode instruction): in a 200-conversation nightly that was ~5 % of the time some
    thread held the GIL, taken from the embedding worker (``bench/embed_build.py``)."""
    return model.model_json_schema()


def render_input(payload: BaseModel | dict[str, Any]) -> str:
    """The input block appended to a user message."""
    data = payload.model_dump(mode="json") if isinstance(payload, BaseModel) else payload
    body = json.dumps(data, ensure_ascii=False, indent=1, sort_keys=False)
    return f"{INPUT_OPEN}\n{body}\n{INPUT_CLOSE}"


def parse_input(content: str) -> Any:
    """Inverse of :func:`render_input` on a message content (used by the scripted server)."""
    start = content.rindex(INPUT_OPEN) + len(INPUT_OPEN)
    end = content.rindex(INPUT_CLOSE)
    return json.loads(content[start:end])


def prompt_versions() -> dict[str, str]:
    """``{operation: version}`` of every prompt module in :mod:`tmem.prompts` (build fingerprints)."""
    import importlib
    import pkgutil

    import tmem.prompts as package

    versions: dict[str, str] = {}
    for info in pkgutil.iter_modules(package.__path__):
        module = importlib.import_module(f"{package.__name__}.{info.name}")
        operation = getattr(module, "OPERATION", None)
        version = getattr(module, "VERSION", None)
        if isinstance(operation, str) and isinstance(version, str):
            versions[operation] = version
    return dict(sorted(versions.items()))

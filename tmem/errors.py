"""Typed errors. Each names what failed and where, so a message alone can be acted on."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any


class TmemError(Exception):
    """Base of every error tmem raises on purpose."""


class IngestError(TmemError):
    """An archive is malformed. Names the file, the record (line or JSON pointer) and the reason."""

    def __init__(self, path: str, record: str, reason: str) -> None:
        self.path = path
        self.record = record
        self.reason = reason
        super().__init__(f"{path}: {record}: {reason}")

    def __reduce__(self) -> tuple[type, tuple[str, str, str]]:
        # Picklable with its fields, so the typed error survives a process boundary (Dask, Prefect results).
        return (type(self), (self.path, self.record, self.reason))


class DatasetError(TmemError):
    """A benchmark file is missing or not shaped as expected. Names the file and the record."""


class ConfigError(TmemError):
    """A setting asks for something this installation cannot do. Names the setting."""


class StoreError(TmemError):
    """The store is missing, locked, or inconsistent."""


@dataclass(frozen=True)
class CallSpend:
    """What a call cost before it failed: the usage ledger records failed calls too."""

    requests: int = 0  # HTTP requests sent, retries and repair re-asks included
    repairs: int = 0  # of those, the adapter's repair re-asks
    prompt_tokens: int = 0
    completion_tokens: int = 0
    estimated: bool = False  # the server sent no usage: characters / 4


class LLMError(TmemError):
    """An LLM call failed. Names the operation and a short description of its input."""

    def __init__(
        self,
        operation: str,
        input_ref: str,
        reason: str,
        raw_output: str | None = None,
        input_digest: str | None = None,
        input_excerpt: str | None = None,
    ) -> None:
        self.operation = operation
        self.input_ref = input_ref
        self.reason = reason
        self.raw_output = raw_output
        self.input_digest = input_digest  # content hash of the prompt's messages (Prompt.input_digest)
        self.input_excerpt = input_excerpt  # the start of the prompt's input block (Prompt.input_excerpt)
        self.spend: CallSpend | None = None  # set by the adapter on the error it raises
        super().__init__(f"LLM operation {operation!r} on {input_ref}: {reason}")

    def __reduce__(self) -> tuple[Any, ...]:
        # Picklable with its fields and any attribute set later (spend, a subclass's own), so the typed
        # error survives a process boundary (Dask, Prefect results).
        args = (self.operation, self.input_ref, self.reason, self.raw_output, self.input_digest, self.input_excerpt)
        return (_rebuild, (type(self), args, dict(self.__dict__)))


def _rebuild(cls: type[LLMError], args: tuple[Any, ...], state: dict[str, Any]) -> LLMError:
    exc = LLMError.__new__(cls)
    LLMError.__init__(exc, *args)
    exc.__dict__.update(state)
    return exc


class LLMTransportError(LLMError):
    """The endpoint kept failing (HTTP 429/5xx, timeouts, connection errors) after all retries."""


class LLMOutputError(LLMError):
    """The model's answer stayed invalid (not JSON, or not the schema) after the bounded repair."""


class LLMTruncatedError(LLMOutputError):
    """The model's answer was cut at the request's completion budget (``finish_reason == "length"``).

    Raised at once, never repaired: asking the same request again is cut again. A construction
    stage answers it by splitting its input (:mod:`tmem.construct.outcome`); ``max_tokens`` is the
    budget the request was sent with.
    """

    def __init__(
        self,
        operation: str,
        input_ref: str,
        reason: str,
        raw_output: str | None = None,
        input_digest: str | None = None,
        input_excerpt: str | None = None,
        *,
        max_tokens: int | None = None,
    ) -> None:
        super().__init__(operation, input_ref, reason, raw_output, input_digest, input_excerpt)
        self.max_tokens = max_tokens


class LLMRequestRejectedError(LLMError):
    """The endpoint refused the request for good (HTTP 4xx other than 408/429): not retried."""

    def __init__(self, operation: str, input_ref: str, reason: str, status_code: int) -> None:
        self.status_code = status_code
        super().__init__(operation, input_ref, reason)

    def __reduce__(self) -> tuple[type, tuple[str, str, str, int]]:  # type: ignore[override]
        return (type(self), (self.operation, self.input_ref, self.reason, self.status_code))


class BatchFormatError(LLMError):
    """A batch result file that is not the documented JSONL (names the file and the line)."""


class BatchEndpointError(TmemError):
    """A Files/Batches request failed after the client's retries (message scrubbed of the API key)."""


class EmbeddingError(TmemError):
    """An embedding model could not be loaded or returned unusable output. Names the model."""

    def __init__(self, model: str, reason: str) -> None:
        self.model = model
        self.reason = reason
        super().__init__(f"embedding model {model!r}: {reason}")


class ValidationFailure(LLMOutputError):
    """The answer parsed but contradicts its input (e.g. an unknown source scene id)."""


class ScopeError(TmemError):
    """A read was attempted without a valid conversation scope, or for an unknown conversation."""


class ForgetError(TmemError):
    """``tmem forget`` refused (an unknown or empty id, unattributable cache rows, another forget
    unfinished); nothing was removed. The message names the id and the reason."""

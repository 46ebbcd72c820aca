"""Typed errors. Each names what failed and where, so a message alone can be acted on."""

from __future__ import annotations


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
        super().__init__(f"LLM operation {operation!r} on {input_ref}: {reason}")

    def __reduce__(self) -> tuple[type, tuple[str, str, str, str | None, str | None, str | None]]:
        return (
            type(self),
            (self.operation, self.input_ref, self.reason, self.raw_output, self.input_digest, self.input_excerpt),
        )


class LLMTransportError(LLMError):
    """The endpoint kept failing (HTTP 429/5xx, timeouts, connection errors) after all retries."""


class LLMOutputError(LLMError):
    """The model's answer stayed invalid (not JSON, or not the schema) after the bounded repair."""


class ValidationFailure(LLMOutputError):
    """The answer parsed but contradicts its input (e.g. an unknown source scene id)."""


class ScopeError(TmemError):
    """A read was attempted without a valid conversation scope, or for an unknown conversation."""


class ForgetError(TmemError):
    """``tmem forget`` refused (an unknown or empty id, unattributable cache rows, another forget
    unfinished); nothing was removed. The message names the id and the reason."""

"""The OpenAI Batch API, as tmem uses it: JSONL request lines, a thin client, and result parsing.

A batch is one uploaded JSONL file (``purpose=batch``) of chat-completions requests, each line
``{"custom_id", "method": "POST", "url": "/v1/chat/completions", "body"}``; ``POST /v1/batches``
starts it with a 24 h completion window; ``GET /v1/batches/{id}`` reports its status; when it is
terminal, its output file holds the answered lines and its error file the failed ones, each
``{"custom_id", "response": {"status_code", "body"}, "error"}``, in any order.

The parsing below is pure; :class:`BatchClient` is the I/O (the ``openai`` client's ``files``
and ``batches`` resources, with the client's own retries on 429/5xx/connection errors).
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any, Final

import openai

from tmem.errors import LLMError, TmemError
from tmem.providers.llm_ledger import TokenUsage

CHAT_URL: Final = "/v1/chat/completions"
COMPLETION_WINDOW: Final = "24h"
TERMINAL_STATUSES = frozenset({"completed", "failed", "expired", "cancelled"})
MAX_CUSTOM_ID = 64


class BatchFormatError(LLMError):
    """A batch result file that is not the documented JSONL (names the file and the line)."""


class BatchEndpointError(TmemError):
    """A Files/Batches request failed after the client's retries (message scrubbed of the API key)."""


@dataclass(frozen=True)
class RequestLine:
    custom_id: str
    body: dict[str, Any]


@dataclass(frozen=True)
class LineResult:
    """What the batch said about one request: an answer (status 200) or an error.

    ``status_code`` is None when no HTTP response exists for the line (the batch expired, was
    cancelled, or could not be followed): the caller treats that as a transport failure.
    """

    custom_id: str
    status_code: int | None
    content: str = ""
    usage: TokenUsage | None = None
    error: str = ""
    batch_id: str = ""  # set when handed to a caller
    finish_reason: str | None = None  # "length": the answer was cut at the request's max_tokens

    @property
    def ok(self) -> bool:
        return self.status_code == 200


@dataclass(frozen=True)
class BatchState:
    batch_id: str
    status: str
    input_file_id: str
    output_file_id: str | None
    error_file_id: str | None
    errors: str  # batch-level errors (a batch that failed validation), joined

    @property
    def terminal(self) -> bool:
        return self.status in TERMINAL_STATUSES


def custom_id_for(operation: str, digest: str) -> str:
    """``<operation>.<digest prefix>``: unique per request body, readable in the provider's console."""
    return f"{operation}.{digest}"[:MAX_CUSTOM_ID]


def encode_lines(lines: list[RequestLine]) -> bytes:
    """The JSONL input file of a batch."""
    rows = [
        json.dumps({"custom_id": line.custom_id, "method": "POST", "url": CHAT_URL, "body": line.body},
                   ensure_ascii=False, separators=(",", ":"))
        for line in lines
    ]
    return ("\n".join(rows) + "\n").encode("utf-8")


def _usage_of(body: dict[str, Any], content: str) -> TokenUsage:
    usage = body.get("usage")
    if isinstance(usage, dict):
        return TokenUsage(int(usage.get("prompt_tokens") or 0), int(usage.get("completion_tokens") or 0))
    return TokenUsage(0, len(content) // 4, estimated=True)  # the request's size is not in the line


def _error_text(body: Any, error: Any) -> str:
    for source in (body.get("error") if isinstance(body, dict) else None, error):
        if isinstance(source, dict):
            code = source.get("code")
            message = str(source.get("message") or "")
            return f"{code}: {message}" if code else message
    return "no error message in the batch result"


def parse_result_line(raw: str, where: str) -> LineResult:
    """One line of an output or error file; ``where`` (file id and line number) names it in errors."""
    try:
        row = json.loads(raw)
        custom_id = str(row["custom_id"])
    except (json.JSONDecodeError, KeyError, TypeError) as exc:
        raise BatchFormatError("batch-result", where, f"not a batch result line: {type(exc).__name__}: {exc}") from exc
    response = row.get("response")
    if not isinstance(response, dict):
        return LineResult(custom_id, None, error=_error_text(None, row.get("error")))
    status = int(response.get("status_code") or 0)
    raw_body = response.get("body")
    body: dict[str, Any] = raw_body if isinstance(raw_body, dict) else {}
    if status != 200:
        return LineResult(custom_id, status, error=_error_text(body, row.get("error")))
    choices = body.get("choices") or []
    if not choices:
        raise BatchFormatError("batch-result", where, "status 200 with no choices")
    content = str((choices[0].get("message") or {}).get("content") or "")
    finish = choices[0].get("finish_reason")
    return LineResult(custom_id, 200, content=content, usage=_usage_of(body, content),
                      finish_reason=str(finish) if finish is not None else None)


def parse_results(text: str, file_id: str) -> dict[str, LineResult]:
    """Every line of an output or error file, by custom id (blank lines skipped)."""
    out: dict[str, LineResult] = {}
    for number, raw in enumerate(text.splitlines(), start=1):
        if raw.strip():
            result = parse_result_line(raw, f"file {file_id} line {number}")
            out[result.custom_id] = result
    return out


class BatchClient:
    """Files and batches of one OpenAI-compatible endpoint (the client retries transient failures)."""

    def __init__(self, base_url: str, api_key: str, *, timeout_s: float, max_retries: int) -> None:
        self._secret = api_key
        self._client = openai.OpenAI(base_url=base_url, api_key=api_key, timeout=timeout_s, max_retries=max_retries)

    @contextmanager
    def _call(self, what: str) -> Iterator[None]:
        try:
            yield
        except openai.APIError as exc:
            failure = exc
        else:
            return
        text = f"{what} failed: {type(failure).__name__}: {failure}"
        scrubbed = text.replace(self._secret, "***") if self._secret else text
        raise BatchEndpointError(scrubbed) from (None if scrubbed != text else failure)

    def submit(self, lines: list[RequestLine], metadata: dict[str, str]) -> tuple[str, str]:
        """Upload the lines and start a batch: (batch id, input file id)."""
        with self._call("upload of the batch input file"):
            uploaded = self._client.files.create(file=("tmem-batch.jsonl", encode_lines(lines)), purpose="batch")
        with self._call(f"creation of a batch over {uploaded.id}"):
            batch = self._client.batches.create(
                input_file_id=uploaded.id, endpoint=CHAT_URL, completion_window=COMPLETION_WINDOW, metadata=metadata
            )
        return batch.id, uploaded.id

    def retrieve(self, batch_id: str) -> BatchState:
        with self._call(f"status of batch {batch_id}"):
            batch = self._client.batches.retrieve(batch_id)
        errors = "; ".join(
            f"line {e.line}: {e.code}: {e.message}" if e.line is not None else f"{e.code}: {e.message}"
            for e in ((batch.errors.data or []) if batch.errors else [])
        )
        return BatchState(batch.id, batch.status, batch.input_file_id, batch.output_file_id, batch.error_file_id, errors)

    def download(self, file_id: str) -> str:
        with self._call(f"download of file {file_id}"):
            return self._client.files.content(file_id).text

    def delete_file(self, file_id: str) -> None:
        with self._call(f"deletion of file {file_id}"):
            self._client.files.delete(file_id)

    def close(self) -> None:
        self._client.close()

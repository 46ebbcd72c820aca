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
from typing import Any, Final

import openai

from tmem.errors import BatchEndpointError, BatchFormatError
from tmem.ports import BatchState, LineResult, RequestLine, TokenUsage
from tmem.settings import Settings

CHAT_URL: Final = "/v1/chat/completions"
COMPLETION_WINDOW: Final = "24h"


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

    def results(self, file_id: str) -> dict[str, LineResult]:
        """Every answered or failed line of a terminal batch's file ``file_id``, by custom id."""
        return parse_results(self.download(file_id), file_id)

    def delete_file(self, file_id: str) -> None:
        with self._call(f"deletion of file {file_id}"):
            self._client.files.delete(file_id)

    def close(self) -> None:
        self._client.close()


def transport_from_settings(settings: Settings) -> BatchClient:
    """The Batch API of the build role's endpoint: the batch transport of provider ``openai``."""
    endpoint = settings.endpoint("build")
    return BatchClient(endpoint.base_url, endpoint.api_key.get_secret_value(), timeout_s=settings.llm_timeout_s,
                       max_retries=settings.llm_max_retries)

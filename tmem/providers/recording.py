"""Replaying a recording of a model's answers through the same ``openai`` code path.

A *recording* is a JSON Lines file, one answered request per line::

    {"operation": "item_extract", "messages": [{"role": ..., "content": ...}, ...],
     "response_format": {...}, "response": {...} | "text", "finish_reason": "stop"}

:class:`ReplayServer` serves it as an OpenAI-compatible endpoint on 127.0.0.1: a request whose
messages and response schema match a recorded one gets the recorded answer (with its finish
reason, and usage estimated at 4 characters a token); any other request is a 404 naming the
operation, so a stale recording fails loudly instead of answering something else. Used by
``make demo`` (a recording of a capable model answering the sample's build and questions) and
by ``bench/real_model.py --replay`` (a rebuild of recorded memory at zero model cost); it is
never a fallback of the product.
"""

from __future__ import annotations

import json
import threading
import time
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any

from tmem.errors import TmemError
from tmem.ids import content_hash

CHARS_PER_TOKEN = 4


class RecordingError(TmemError):
    """A recording file that cannot be read (names the file, the line and the reason)."""


def request_key(messages: Sequence[Mapping[str, Any]], response_format: Mapping[str, Any] | None) -> str:
    """What identifies a request: its messages (role, content) and the schema it asks for."""
    fmt = dict(response_format or {})
    schema = (fmt.get("json_schema") or {}).get("schema") if fmt.get("type") == "json_schema" else fmt.get("schema")
    return content_hash(
        [(str(m.get("role")), str(m.get("content"))) for m in messages], str(fmt.get("type") or ""), schema
    )


@dataclass(frozen=True)
class RecordedAnswer:
    operation: str
    content: str
    finish_reason: str = "stop"


def answer_text(response: Any) -> str:
    """A recorded response as the message content a server sends (JSON documents compactly)."""
    return response if isinstance(response, str) else json.dumps(response, ensure_ascii=False)


def read_recording(path: Path) -> dict[str, RecordedAnswer]:
    """``{request_key: answer}`` of a recording file; a bad line is a :class:`RecordingError`."""
    answers: dict[str, RecordedAnswer] = {}
    try:
        lines = Path(path).read_text(encoding="utf-8").splitlines()
    except OSError as exc:
        raise RecordingError(f"{path}: cannot read ({exc.strerror or exc})") from None
    for number, line in enumerate(lines, start=1):
        if not line.strip():
            continue
        try:
            entry = json.loads(line)
            messages = entry["messages"]
            response = entry["response"]
        except (json.JSONDecodeError, KeyError, TypeError) as exc:
            raise RecordingError(f"{path}: line {number}: not a recorded request ({exc})") from None
        if not isinstance(messages, list) or not all(isinstance(m, dict) for m in messages):
            raise RecordingError(f"{path}: line {number}: messages must be a list of objects")
        key = request_key(messages, entry.get("response_format"))
        answers[key] = RecordedAnswer(
            str(entry.get("operation") or "unknown"), answer_text(response), str(entry.get("finish_reason") or "stop")
        )
    return answers


def write_recording(path: Path, entries: Iterable[Mapping[str, Any]]) -> int:
    """Write recorded requests (dicts as in the module docstring) as JSON Lines; returns how many."""
    out = Path(path)
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = out.with_suffix(out.suffix + ".tmp")
    count = 0
    with tmp.open("w", encoding="utf-8") as fh:
        for entry in entries:
            fh.write(json.dumps(dict(entry), ensure_ascii=False) + "\n")
            count += 1
    tmp.replace(out)
    return count


class ReplayServer:
    """An OpenAI-compatible endpoint answering from a recording (use as a context manager)."""

    def __init__(self, answers: Mapping[str, RecordedAnswer], *, port: int = 0, model: str = "recording") -> None:
        self.answers = dict(answers)
        self.model = model
        self.served = 0
        self.missed: list[str] = []  # operations of requests the recording does not hold
        self._lock = threading.Lock()
        self._httpd = ThreadingHTTPServer(("127.0.0.1", port), _handler(self))
        self._thread = threading.Thread(target=self._httpd.serve_forever, name="tmem-replay", daemon=True)

    @property
    def base_url(self) -> str:
        return f"http://127.0.0.1:{self._httpd.server_address[1]}/v1"

    def __enter__(self) -> ReplayServer:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._httpd.shutdown()
        self._httpd.server_close()
        self._thread.join(timeout=5)

    def answer(self, body: Mapping[str, Any]) -> tuple[int, dict[str, Any]]:
        messages = body.get("messages") or []
        fmt = body.get("response_format")
        found = self.answers.get(request_key(messages, fmt))
        operation = ((fmt or {}).get("json_schema") or {}).get("name") or "unknown"
        if found is None:
            with self._lock:
                self.missed.append(str(operation))
            return 404, {"error": {"message": f"request not in the recording ({operation})", "type": "not_found"}}
        with self._lock:
            self.served += 1
        prompt_chars = sum(len(str(m.get("content", ""))) for m in messages)
        usage = {"prompt_tokens": prompt_chars // CHARS_PER_TOKEN, "completion_tokens": len(found.content) // CHARS_PER_TOKEN}
        usage["total_tokens"] = usage["prompt_tokens"] + usage["completion_tokens"]
        return 200, {
            "id": f"replay-{self.served}", "object": "chat.completion", "created": int(time.time()),
            "model": body.get("model") or self.model,
            "choices": [{"index": 0, "finish_reason": found.finish_reason,
                         "message": {"role": "assistant", "content": found.content}}],
            "usage": usage,
        }


def _handler(server: ReplayServer) -> type[BaseHTTPRequestHandler]:
    class Handler(BaseHTTPRequestHandler):
        protocol_version = "HTTP/1.1"
        disable_nagle_algorithm = True

        def log_message(self, format: str, *args: Any) -> None:
            return

        def _send(self, status: int, payload: dict[str, Any]) -> None:
            data = json.dumps(payload).encode("utf-8")
            self.send_response(status)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(data)))
            self.end_headers()
            self.wfile.write(data)

        def do_GET(self) -> None:
            if self.path.rstrip("/").endswith("/models"):
                self._send(200, {"object": "list", "data": [{"id": server.model, "object": "model", "owned_by": "replay"}]})
            else:
                self._send(404, {"error": {"message": "not found", "type": "not_found"}})

        def do_POST(self) -> None:
            length = int(self.headers.get("Content-Length") or 0)
            raw = self.rfile.read(length) if length else b""
            if not self.path.rstrip("/").endswith("/chat/completions"):
                self._send(404, {"error": {"message": "not found", "type": "not_found"}})
                return
            try:
                body = json.loads(raw or b"{}")
            except json.JSONDecodeError:
                self._send(400, {"error": {"message": "request body is not JSON", "type": "invalid_request_error"}})
                return
            self._send(*server.answer(body))

    return Handler

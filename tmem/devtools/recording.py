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

:class:`RecordingProxy` makes a recording: an endpoint on 127.0.0.1 that forwards each request to
an upstream OpenAI-compatible URL and records its answer (``python -m tmem.demo --record-through``).
"""

from __future__ import annotations

import json
import threading
import time
import urllib.error
import urllib.request
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any, Self

from tmem.devtools.json_http import JsonHandler, error_payload
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


def read_entries(path: Path) -> dict[str, dict[str, Any]]:
    """``{request_key: entry}`` of a recording file, in file order; a bad line is a :class:`RecordingError`."""
    entries: dict[str, dict[str, Any]] = {}
    try:
        lines = Path(path).read_text(encoding="utf-8").splitlines()
    except OSError as exc:
        raise RecordingError(f"{path}: cannot read ({exc.strerror or exc})") from None
    for number, line in enumerate(lines, start=1):
        if not line.strip():
            continue
        try:
            entry = json.loads(line)
            messages, _ = entry["messages"], entry["response"]
        except (json.JSONDecodeError, KeyError, TypeError) as exc:
            raise RecordingError(f"{path}: line {number}: not a recorded request ({exc})") from None
        if not isinstance(messages, list) or not all(isinstance(m, dict) for m in messages):
            raise RecordingError(f"{path}: line {number}: messages must be a list of objects")
        entries[request_key(messages, entry.get("response_format"))] = entry
    return entries


def recorded_answer(entry: Mapping[str, Any]) -> RecordedAnswer:
    return RecordedAnswer(str(entry.get("operation") or "unknown"), answer_text(entry["response"]),
                          str(entry.get("finish_reason") or "stop"))


def read_recording(path: Path) -> dict[str, RecordedAnswer]:
    """``{request_key: answer}`` of a recording file; a bad line is a :class:`RecordingError`."""
    return {key: recorded_answer(entry) for key, entry in read_entries(path).items()}


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

    def __enter__(self) -> Self:
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

    def handle(self, body: Mapping[str, Any], raw: bytes, headers: Mapping[str, str]) -> Reply:
        """The reply to one chat request (``raw``: its body as received; ``headers``: its headers)."""
        return (*self.answer(body), {})


Reply = tuple[int, dict[str, Any], dict[str, str]]  # status, JSON body, extra headers
# Request headers passed on upstream (the adapter names its operation in X-Tmem-Operation); the rest
# (Host, Content-Length, Accept-Encoding: the proxy reads the answer, so it takes it uncompressed) are not.
FORWARDED_HEADERS = ("authorization", "content-type", "x-tmem-operation", "openai-organization", "openai-project")
# Answer headers passed back (a 429's Retry-After is what the client's backoff waits on).
RETURNED_HEADERS = ("retry-after", "retry-after-ms", "x-request-id")


class RecordingProxy(ReplayServer):
    """An endpoint on 127.0.0.1 that forwards chat requests to ``upstream`` and records the answers.

    What is recorded is exactly what a replay serves: a request already answered in this recording
    (same :func:`request_key`) is answered from it, never asked again — also when it arrives while
    the first copy is still upstream (a client that timed out and re-sent). ``seed``: entries of an
    interrupted earlier recording (its journal), answered without asking upstream. Each new answer
    is appended to ``journal`` as it arrives, so a failed run loses no answer that was paid for.
    Failed answers (any status but 200) are passed back as they came and not recorded.
    """

    def __init__(self, upstream: str, *, timeout_s: float, seed: Mapping[str, Mapping[str, Any]] | None = None,
                 journal: Path | None = None, port: int = 0) -> None:
        super().__init__({}, port=port, model="recording-proxy")
        self.upstream = upstream.rstrip("/")
        self.timeout_s = timeout_s
        self.seed = {key: dict(entry) for key, entry in (seed or {}).items()}
        self.journal = journal
        self.entries: list[dict[str, Any]] = []  # this run's recorded requests, in first-request order
        self.forwarded = 0
        self._recorded: set[str] = set()
        self._in_flight: dict[str, threading.Event] = {}

    def handle(self, body: Mapping[str, Any], raw: bytes, headers: Mapping[str, str]) -> Reply:
        key = request_key(body.get("messages") or [], body.get("response_format"))
        while True:
            with self._lock:
                if key in self._recorded:
                    break
                seeded = self.seed.get(key)
                if seeded is not None:
                    self._keep(key, seeded)
                    break
                waiting = self._in_flight.get(key)
                if waiting is None:
                    self._in_flight[key] = threading.Event()
                    break
            waiting.wait(self.timeout_s)  # the same request is upstream: wait for its answer
        if key in self._recorded:
            return (*self.answer(body), {})
        try:
            status, payload, back = self._forward(raw, headers)
            entry = _entry(body, headers, status, payload)
            if entry is not None:
                with self._lock:
                    self.forwarded += 1
                    self._keep(key, entry)
                if self.journal is not None:
                    with self._lock, self.journal.open("a", encoding="utf-8") as fh:
                        fh.write(json.dumps(entry, ensure_ascii=False) + "\n")
            return status, payload, back
        finally:
            with self._lock:
                self._in_flight.pop(key).set()

    def _keep(self, key: str, entry: dict[str, Any]) -> None:  # under self._lock
        self._recorded.add(key)
        self.entries.append(entry)
        self.answers[key] = recorded_answer(entry)

    def _forward(self, raw: bytes, headers: Mapping[str, str]) -> Reply:
        sent = {name: value for name, value in headers.items() if name.lower() in FORWARDED_HEADERS}
        request = urllib.request.Request(f"{self.upstream}/chat/completions", data=raw, method="POST", headers=sent)
        try:
            with urllib.request.urlopen(request, timeout=self.timeout_s) as reply:
                status, data, got = reply.status, reply.read(), reply.headers
        except urllib.error.HTTPError as exc:
            status, data, got = exc.code, exc.read(), exc.headers
        except (urllib.error.URLError, OSError) as exc:
            reason = getattr(exc, "reason", None) or exc
            return 502, {"error": {"message": f"recording proxy: upstream {self.upstream} did not answer ({reason})",
                                   "type": "upstream_unreachable"}}, {}
        try:
            payload = json.loads(data or b"{}")
        except json.JSONDecodeError:
            payload = {"error": {"message": data.decode("utf-8", errors="replace")[:2000], "type": "upstream_error"}}
        if not isinstance(payload, dict):
            payload = {"error": {"message": "upstream answered with a JSON value that is not an object",
                                 "type": "upstream_error"}}
        back = {name: value for name, value in got.items() if name.lower() in RETURNED_HEADERS}
        return status, payload, back


def _entry(body: Mapping[str, Any], headers: Mapping[str, str], status: int,
           payload: Mapping[str, Any]) -> dict[str, Any] | None:
    """The recorded request of a 200 answer with a message content (else None: nothing to replay)."""
    choices = payload.get("choices") if status == 200 else None
    if not isinstance(choices, list) or not choices or not isinstance(choices[0], dict):
        return None
    content = (choices[0].get("message") or {}).get("content")
    if not isinstance(content, str):
        return None
    fmt = body.get("response_format") or {}
    operation = next((v for k, v in headers.items() if k.lower() == "x-tmem-operation"), None)
    return {
        "operation": operation or (fmt.get("json_schema") or {}).get("name") or "unknown",
        "messages": body.get("messages") or [], "response_format": body.get("response_format"),
        "response": _response_value(content), "finish_reason": str(choices[0].get("finish_reason") or "stop"),
        "model": body.get("model"), "max_tokens": body.get("max_completion_tokens") or body.get("max_tokens"),
    }


def _response_value(content: str) -> Any:
    """The answer as a JSON value when it is one written compactly (readable in the file), else the
    exact text: a replay must send the very characters that were answered (a repair quotes them)."""
    try:
        value = json.loads(content)
    except json.JSONDecodeError:
        return content
    return value if isinstance(value, (dict, list)) and answer_text(value) == content else content


def _handler(server: ReplayServer) -> type[BaseHTTPRequestHandler]:
    class Handler(JsonHandler):
        def do_GET(self) -> None:
            if self.path.rstrip("/").endswith("/models"):
                self.send_json(200, {"object": "list", "data": [{"id": server.model, "object": "model", "owned_by": "replay"}]})
            else:
                self.send_json(404, error_payload("not found", "not_found"))

        def do_POST(self) -> None:
            raw = self.read_body()
            if raw is None:
                return
            if not self.path.rstrip("/").endswith("/chat/completions"):
                self.send_json(404, error_payload("not found", "not_found"))
                return
            body = self.json_object(raw)
            if body is not None:
                self.send_json(*server.handle(body, raw, dict(self.headers.items())))

    return Handler

"""The request handler both local OpenAI-compatible servers share (the scripted one, the replay).

Keep-alive HTTP/1.1 without Nagle's delay, no request log, JSON answers written once (a client
that gave up mid-answer closes the connection instead of raising in the server thread), the body
read whole (``None`` when the client died mid-request) and parsed as a JSON object or answered 400.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from http.server import BaseHTTPRequestHandler
from typing import Any


def error_payload(message: str, kind: str) -> dict[str, Any]:
    """An OpenAI-shaped error body."""
    return {"error": {"message": message, "type": kind}}


class JsonHandler(BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"  # keep-alive, as the openai client pools connections
    disable_nagle_algorithm = True  # else headers and body wait on delayed ACKs (~40 ms a call)

    def log_message(self, format: str, *args: Any) -> None:  # quiet: the servers record what they need
        return

    def send_json(self, status: int, payload: dict[str, Any], headers: Mapping[str, str] | None = None) -> None:
        self.send_bytes(status, json.dumps(payload).encode("utf-8"), "application/json", headers)

    def send_bytes(self, status: int, data: bytes, content_type: str, headers: Mapping[str, str] | None = None) -> None:
        try:
            self.send_response(status)
            self.send_header("Content-Type", content_type)
            self.send_header("Content-Length", str(len(data)))
            for name, value in (headers or {}).items():
                self.send_header(name, value)
            self.end_headers()
            self.wfile.write(data)
        except (BrokenPipeError, ConnectionResetError):
            self.close_connection = True  # the client gave up (e.g. a timeout fault)

    def read_body(self) -> bytes | None:
        """The request body; ``None`` (connection closed) when the client died before sending it all."""
        length = int(self.headers.get("Content-Length") or 0)
        raw = self.rfile.read(length) if length else b""
        if len(raw) < length:
            self.close_connection = True
            return None
        return raw

    def json_object(self, raw: bytes) -> dict[str, Any] | None:
        """``raw`` parsed as a JSON object; ``None`` after answering 400 when it is not one."""
        try:
            body = json.loads(raw or b"{}")
        except json.JSONDecodeError as exc:
            self.send_json(400, error_payload(f"request body is not JSON: {exc}", "invalid_request_error"))
            return None
        if not isinstance(body, dict):
            self.send_json(400, error_payload("request body is not a JSON object", "invalid_request_error"))
            return None
        return body

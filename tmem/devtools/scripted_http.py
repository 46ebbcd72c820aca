"""HTTP routing of the scripted OpenAI-compatible server (:mod:`tmem.devtools.scripted_llm`).

Chat completions and models are answered by :class:`~tmem.devtools.scripted_llm.ScriptedLLM`; files
and batches by its :class:`~tmem.devtools.scripted_batch.ScriptedBatches`.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from http.server import BaseHTTPRequestHandler
from typing import Any, Protocol

from tmem.devtools.scripted_batch import ScriptedBatches

OPERATION_HEADER = "X-Tmem-Operation"


class ChatServer(Protocol):
    """What the routes need of the server (:class:`tmem.devtools.scripted_llm.ScriptedLLM`), which
    imports this module: declared here so that the two do not import each other."""

    model: str
    batches: ScriptedBatches

    def handle_chat(
        self, operation: str, body: dict[str, Any], authorization: str
    ) -> tuple[int, dict[str, Any], dict[str, str]]: ...


def make_handler(server: ChatServer) -> type[BaseHTTPRequestHandler]:
    class Handler(BaseHTTPRequestHandler):
        protocol_version = "HTTP/1.1"  # keep-alive, as the openai client pools connections
        disable_nagle_algorithm = True  # else headers and body wait on delayed ACKs (~40 ms a call)

        def log_message(self, format: str, *args: Any) -> None:  # quiet: requests are recorded
            return

        def _send(self, status: int, payload: dict[str, Any], headers: Mapping[str, str] | None = None) -> None:
            data = json.dumps(payload).encode("utf-8")
            try:
                self.send_response(status)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(data)))
                for name, value in (headers or {}).items():
                    self.send_header(name, value)
                self.end_headers()
                self.wfile.write(data)
            except (BrokenPipeError, ConnectionResetError):
                self.close_connection = True  # the client gave up (e.g. a timeout fault)

        def _send_raw(self, status: int, data: bytes) -> None:
            self.send_response(status)
            self.send_header("Content-Type", "application/octet-stream")
            self.send_header("Content-Length", str(len(data)))
            self.end_headers()
            self.wfile.write(data)

        def do_GET(self) -> None:
            path = self.path.rstrip("/")
            if path.startswith("/v1/batches/"):
                self._send(*server.batches.retrieve(path.removeprefix("/v1/batches/")))
            elif path.startswith("/v1/files/") and path.endswith("/content"):
                self._send_raw(*server.batches.content(path.removeprefix("/v1/files/").removesuffix("/content")))
            elif path == "/v1/models":
                model = {"id": server.model, "object": "model", "created": 0, "owned_by": "tmem-scripted"}
                self._send(200, {"object": "list", "data": [model]})
            else:
                self._send(404, {"error": {"message": f"no route {self.path}", "type": "not_found"}})

        def do_DELETE(self) -> None:
            path = self.path.rstrip("/")
            if path.startswith("/v1/files/"):
                self._send(*server.batches.delete(path.removeprefix("/v1/files/")))
            else:
                self._send(404, {"error": {"message": f"no route {self.path}", "type": "not_found"}})

        def do_POST(self) -> None:
            length = int(self.headers.get("Content-Length") or 0)
            raw = self.rfile.read(length) if length else b""
            if len(raw) < length:  # the client died mid-request (a killed build): nothing to answer or record
                self.close_connection = True
                return
            if self.path.rstrip("/") == "/v1/files":
                self._send(*server.batches.upload(self.headers.get("Content-Type") or "", raw))
                return
            if self.path.rstrip("/") not in ("/v1/chat/completions", "/v1/batches"):
                self._send(404, {"error": {"message": f"no route {self.path}", "type": "not_found"}})
                return
            try:
                body = json.loads(raw or b"{}")
            except json.JSONDecodeError as exc:
                self._send(400, {"error": {"message": f"request body is not JSON: {exc}", "type": "invalid_request_error"}})
                return
            if self.path.rstrip("/") == "/v1/batches":
                self._send(*server.batches.create(body))
                return
            fmt_name = ((body.get("response_format") or {}).get("json_schema") or {}).get("name")
            operation = self.headers.get(OPERATION_HEADER) or fmt_name or "unknown"
            status, payload, headers = server.handle_chat(operation, body, self.headers.get("Authorization") or "")
            self._send(status, payload, headers)

    return Handler

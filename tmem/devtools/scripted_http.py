"""HTTP routing of the scripted OpenAI-compatible server (:mod:`tmem.devtools.scripted_llm`).

Chat completions and models are answered by :class:`~tmem.devtools.scripted_llm.ScriptedLLM`; files
and batches by its :class:`~tmem.devtools.scripted_batch.ScriptedBatches`.
"""

from __future__ import annotations

from collections.abc import Mapping
from http.server import BaseHTTPRequestHandler
from typing import Any, Protocol

from tmem.devtools.json_http import JsonHandler
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
    class Handler(JsonHandler):
        def _send(self, status: int, payload: dict[str, Any], headers: Mapping[str, str] | None = None) -> None:
            self.send_json(status, payload, headers)

        def _send_raw(self, status: int, data: bytes) -> None:
            self.send_bytes(status, data, "application/octet-stream")

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
            raw = self.read_body()
            if raw is None:  # the client died mid-request (a killed build): nothing to answer or record
                return
            if self.path.rstrip("/") == "/v1/files":
                self._send(*server.batches.upload(self.headers.get("Content-Type") or "", raw))
                return
            if self.path.rstrip("/") not in ("/v1/chat/completions", "/v1/batches"):
                self._send(404, {"error": {"message": f"no route {self.path}", "type": "not_found"}})
                return
            body = self.json_object(raw)
            if body is None:
                return
            if self.path.rstrip("/") == "/v1/batches":
                self._send(*server.batches.create(body))
                return
            fmt_name = ((body.get("response_format") or {}).get("json_schema") or {}).get("name")
            operation = self.headers.get(OPERATION_HEADER) or fmt_name or "unknown"
            status, payload, headers = server.handle_chat(operation, body, self.headers.get("Authorization") or "")
            self._send(status, payload, headers)

    return Handler

"""The Files and Batches endpoints of the scripted OpenAI-compatible server (tests and benchmarks).

``POST /v1/files`` (multipart, ``purpose=batch``), ``GET /v1/files/{id}/content``, ``DELETE
/v1/files/{id}``, ``POST /v1/batches`` and ``GET /v1/batches/{id}``. A batch reports ``in_progress`` for its first ``in_progress_polls``
retrievals, for at least ``delay_s`` after creation, and while :meth:`ScriptedBatches.hold` is on;
then it completes by running every line through the server's chat handler — the same responders,
recorded requests (``via="batch"``) and scripted faults as the synchronous endpoint — writing
answered lines to an output file and failed ones to an error file. :meth:`fail_lines` scripts
per-line errors on top.
"""

from __future__ import annotations

import email.parser
import json
import threading
import time
from collections import defaultdict, deque
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

# (operation, body) -> (status, JSON body): the chat endpoint, recording the request as a batch line.
ChatRunner = Callable[[str, dict[str, Any]], tuple[int, dict[str, Any]]]
Reply = tuple[int, dict[str, Any]]


@dataclass
class _File:
    file_id: str
    filename: str
    purpose: str
    data: bytes


@dataclass
class _Batch:
    obj: dict[str, Any]
    lines: list[dict[str, Any]]
    polls: int = 0
    created: float = field(default_factory=time.monotonic)


def _error(status: int, message: str) -> Reply:
    return status, {"error": {"message": message, "type": "invalid_request_error", "param": None, "code": None}}


def line_operation(line: dict[str, Any]) -> str:
    """A batch line's operation: the json_schema name, else the custom id's prefix (``op.digest``)."""
    body = line.get("body") or {}
    name = ((body.get("response_format") or {}).get("json_schema") or {}).get("name")
    return str(name or str(line.get("custom_id", "")).partition(".")[0] or "unknown")


class ScriptedBatches:
    def __init__(self, run_chat: ChatRunner, *, in_progress_polls: int = 1, delay_s: float = 0.0) -> None:
        self._run_chat = run_chat
        self.in_progress_polls = in_progress_polls
        self.delay_s = delay_s
        self._lock = threading.Lock()
        self._files: dict[str, _File] = {}
        self._batches: dict[str, _Batch] = {}
        self._line_faults: dict[str | None, deque[tuple[int, str]]] = defaultdict(deque)
        self._held = False
        self._next = 0

    # -- scripting ----------------------------------------------------------------------------
    def hold(self, on: bool = True) -> None:
        """While held, every batch stays ``in_progress`` (a build can be killed with one in flight)."""
        with self._lock:
            self._held = on

    def fail_lines(self, n: int = 1, status: int = 500, operation: str | None = None, message: str = "") -> None:
        """The next ``n`` batch lines of ``operation`` (any if None) go to the error file with ``status``."""
        with self._lock:
            self._line_faults[operation].extend([(status, message or f"scripted batch line error {status}")] * n)

    @property
    def created(self) -> list[dict[str, Any]]:
        """Every batch object created, in order."""
        with self._lock:
            return [dict(b.obj) for b in self._batches.values()]

    def polls_of(self, batch_id: str) -> int:
        """How many times the batch's status was retrieved."""
        with self._lock:
            return self._batches[batch_id].polls

    def lines_of(self, batch_id: str) -> list[dict[str, Any]]:
        with self._lock:
            return list(self._batches[batch_id].lines)

    # -- endpoints ------------------------------------------------------------------------------
    def upload(self, content_type: str, raw: bytes) -> Reply:
        message = email.parser.BytesParser().parsebytes(
            f"Content-Type: {content_type}\r\nMIME-Version: 1.0\r\n\r\n".encode() + raw
        )
        if not message.is_multipart():
            return _error(400, "expected multipart/form-data with fields 'file' and 'purpose'")
        fields: dict[str, tuple[str | None, bytes]] = {}
        for part in message.walk():
            if part.is_multipart():
                continue
            name = part.get_param("name", header="content-disposition")
            payload = part.get_payload(decode=True)
            fields[str(name)] = (part.get_filename(), payload if isinstance(payload, bytes) else b"")
        if "file" not in fields or "purpose" not in fields:
            return _error(400, f"multipart form lacks 'file' or 'purpose' (got {sorted(fields)})")
        filename, data = fields["file"]
        with self._lock:
            file = self._add_file(filename or "upload.jsonl", fields["purpose"][1].decode(), data)
        return 200, self._file_obj(file)

    def create(self, body: dict[str, Any]) -> Reply:
        file_id = str(body.get("input_file_id", ""))
        if body.get("endpoint") != "/v1/chat/completions" or body.get("completion_window") != "24h":
            return _error(400, "endpoint must be /v1/chat/completions and completion_window 24h")
        with self._lock:
            file = self._files.get(file_id)
            if file is None or file.purpose != "batch":
                return _error(400, f"no batch input file {file_id!r}")
            try:
                lines = [json.loads(raw) for raw in file.data.decode("utf-8").splitlines() if raw.strip()]
            except (UnicodeDecodeError, json.JSONDecodeError) as exc:
                return _error(400, f"input file {file_id} is not JSONL: {exc}")
            ids = [line.get("custom_id") for line in lines]
            if len(set(ids)) != len(ids) or None in ids:
                return _error(400, f"input file {file_id}: custom_id missing or repeated")
            self._next += 1
            batch_id = f"batch_scripted_{self._next}"
            obj = {
                "id": batch_id, "object": "batch", "endpoint": body["endpoint"], "errors": None,
                "input_file_id": file_id, "completion_window": "24h", "status": "in_progress",
                "output_file_id": None, "error_file_id": None, "created_at": int(time.time()),
                "request_counts": {"total": len(lines), "completed": 0, "failed": 0},
                "metadata": body.get("metadata"),
            }
            self._batches[batch_id] = _Batch(obj, lines)
        return 200, dict(obj)

    def retrieve(self, batch_id: str) -> Reply:
        with self._lock:
            batch = self._batches.get(batch_id)
            if batch is None:
                return _error(404, f"no batch {batch_id!r}")
            batch.polls += 1
            waiting = (
                self._held or batch.polls <= self.in_progress_polls
                or time.monotonic() - batch.created < self.delay_s
            )
            if waiting or batch.obj["status"] != "in_progress":
                return 200, dict(batch.obj)
            batch.obj["status"] = "finalizing"  # one poll completes it; concurrent polls see finalizing
        self._complete(batch)  # outside the lock: runs the responders
        with self._lock:
            return 200, dict(batch.obj)

    def delete(self, file_id: str) -> Reply:
        with self._lock:
            file = self._files.pop(file_id, None)
        if file is None:
            return _error(404, f"no file {file_id!r}")
        return 200, {"id": file_id, "object": "file", "deleted": True}

    @property
    def file_ids(self) -> list[str]:
        """The files stored now (uploaded inputs and batch outputs not deleted)."""
        with self._lock:
            return list(self._files)

    def content(self, file_id: str) -> tuple[int, bytes]:
        with self._lock:
            file = self._files.get(file_id)
        if file is None:
            return 404, json.dumps({"error": {"message": f"no file {file_id!r}"}}).encode()
        return 200, file.data

    # -- internals --------------------------------------------------------------------------------
    def _complete(self, batch: _Batch) -> None:
        done: list[str] = []
        failed: list[str] = []
        for number, line in enumerate(batch.lines):
            operation = line_operation(line)
            fault = self._line_fault(operation)
            if fault is not None:
                status, payload = _error(*fault)
            else:
                status, payload = self._run_chat(operation, line.get("body") or {})
            row = json.dumps({
                "id": f"{batch.obj['id']}_req_{number}", "custom_id": line["custom_id"],
                "response": {"status_code": status, "request_id": f"req_{number}", "body": payload}, "error": None,
            })
            (done if status == 200 else failed).append(row)
        with self._lock:
            out = self._add_file("output.jsonl", "batch_output", "\n".join(done).encode()) if done else None
            err = self._add_file("errors.jsonl", "batch_output", "\n".join(failed).encode()) if failed else None
            batch.obj.update(
                status="completed", completed_at=int(time.time()), output_file_id=out.file_id if out else None,
                error_file_id=err.file_id if err else None,
                request_counts={"total": len(batch.lines), "completed": len(done), "failed": len(failed)},
            )

    def _line_fault(self, operation: str) -> tuple[int, str] | None:
        with self._lock:
            for key in (operation, None):
                queue = self._line_faults.get(key)
                if queue:
                    return queue.popleft()
        return None

    def _add_file(self, filename: str, purpose: str, data: bytes) -> _File:
        """Under lock."""
        self._next += 1
        file = _File(f"file-scripted-{self._next}", filename, purpose, data)
        self._files[file.file_id] = file
        return file

    def _file_obj(self, file: _File) -> dict[str, Any]:
        return {"id": file.file_id, "object": "file", "bytes": len(file.data), "created_at": int(time.time()),
                "filename": file.filename, "purpose": file.purpose, "status": "processed"}

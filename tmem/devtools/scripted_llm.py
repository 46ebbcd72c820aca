"""A scripted OpenAI-compatible chat server for tests and benchmarks (never a product fallback).

It serves ``POST /v1/chat/completions`` and ``GET /v1/models`` on 127.0.0.1, and the Files and
Batches endpoints of the Batch API (:mod:`tmem.devtools.scripted_batch`, ``server.batches``). The answer's
content comes from a *responder*, ``(operation, request_json) -> content``, chosen by the
request's ``X-Tmem-Operation`` header: first the responders given to :class:`ScriptedLLM`,
then the registry of :mod:`tmem.devtools.responders` (``tmem.devtools.synth`` registers its
deterministic responders there on import), then ``default``. The request's input data is
``request_input(request_json)`` (``parse_input`` of the last user message with an input block).

Faults are injected per request: scripted (``fail_next(kind, n, operation)``) or at random
(``fault_rate`` with ``seed``). Random faults are keyed by ``fault_keying``: ``sequence`` (one RNG
per operation: reproducible given the order of requests of each operation) or ``content`` (the
draw depends on the seed, the request's messages and how many times this exact request was seen:
reproducible whatever the order, so a concurrent build meets the same faults every run; a retry
of the same request draws again). ``fault_counts()`` counts what was injected, by kind. Kinds: ``rate_limit`` (429 + Retry-After), ``server_error``
(500), ``slow``, ``timeout`` (sleep past the client's timeout), ``truncated`` (cut JSON,
finish_reason ``length``), ``invalid`` (JSON that breaks the requested schema), ``unauthorized``
(401 quoting the bearer token back, as some real servers do: tests that keys stay out of errors).

``enforce_max_tokens``: an answer longer than the request's ``max_tokens`` (``max_completion_tokens``),
counted at 4 characters a token as the usage is, is cut there and marked finish_reason ``length`` — as a
hosted model cuts a long answer (and as ``tools/model-bridge`` does).

Run standalone: ``python -m tmem.devtools.scripted_llm --port 8080 [--latency-ms 50]``.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import math
import random
import sys
import threading
from collections import Counter, defaultdict, deque
from collections.abc import Mapping
from dataclasses import dataclass
from http.server import ThreadingHTTPServer
from typing import Any, Literal, get_args

from tmem.devtools.responders import (
    Responder,
    registered_responders,
)
from tmem.devtools.scripted_batch import ScriptedBatches
from tmem.devtools.scripted_http import OPERATION_HEADER as OPERATION_HEADER  # re-exported
from tmem.devtools.scripted_http import make_handler

FaultKind = Literal["rate_limit", "server_error", "slow", "timeout", "truncated", "invalid", "unauthorized"]
FAULT_KINDS: tuple[FaultKind, ...] = get_args(FaultKind)
FaultKeying = Literal["sequence", "content"]

@dataclass(frozen=True)
class RecordedRequest:
    operation: str
    body: dict[str, Any]
    status: int
    fault: FaultKind | None
    content: str | None  # the content sent (None for error responses)
    usage: dict[str, int] | None  # the usage sent (None for errors or when omitted)
    error: str | None = None  # the error message sent, for error responses
    via: str = "chat"  # "chat": POST /v1/chat/completions; "batch": a line of a batch


class _NoResponder(LookupError):
    pass


class ScriptedLLM:
    """The server. Use as a context manager, or ``start()`` / ``stop()``."""

    def __init__(
        self,
        responders: Mapping[str, Responder] | None = None,
        *,
        default: Responder | None = None,
        use_registry: bool = True,
        model: str = "scripted-model",
        host: str = "127.0.0.1",
        port: int = 0,
        latency_ms: float = 0.0,
        fault_rate: float = 0.0,
        fault_kinds: tuple[FaultKind, ...] = ("rate_limit", "server_error", "truncated", "invalid"),
        seed: int = 0,
        fault_keying: FaultKeying = "sequence",
        retry_after_s: float = 0.01,
        slow_s: float = 0.2,
        timeout_sleep_s: float = 2.0,
        reject_json_schema: bool = False,
        omit_usage: bool = False,
        enforce_max_tokens: bool = False,
        batch_in_progress_polls: int = 1,
        batch_delay_s: float = 0.0,
    ) -> None:
        unknown = set(fault_kinds) - set(FAULT_KINDS)
        if unknown:
            raise ValueError(f"unknown fault kinds {sorted(unknown)}; known: {FAULT_KINDS}")
        self.responders = dict(responders or {})
        self.host = host
        self.default = default
        self.use_registry = use_registry
        self.model = model
        self.latency_ms = latency_ms
        self.fault_rate = fault_rate
        self.fault_kinds = fault_kinds
        self.seed = seed
        if fault_keying not in get_args(FaultKeying):
            raise ValueError(f"unknown fault keying {fault_keying!r}; known: {get_args(FaultKeying)}")
        self.fault_keying = fault_keying
        self._seen: dict[str, int] = defaultdict(int)  # request digest -> times seen (content keying)
        self.retry_after_s = retry_after_s
        self.slow_s = slow_s
        self.timeout_sleep_s = timeout_sleep_s
        self.reject_json_schema = reject_json_schema
        self.omit_usage = omit_usage
        self.enforce_max_tokens = enforce_max_tokens
        self._lock = threading.Lock()
        self._stopping = threading.Event()
        self._scripted: dict[str | None, deque[FaultKind]] = defaultdict(deque)
        self._rngs: dict[str, random.Random] = {}
        self._requests: list[RecordedRequest] = []
        self.batches = ScriptedBatches(
            lambda op, body: self.handle_chat(op, body, via="batch")[:2],
            in_progress_polls=batch_in_progress_polls, delay_s=batch_delay_s,
        )
        self._server = _QuietServer((host, port), make_handler(self))
        self._server.daemon_threads = True
        self._thread: threading.Thread | None = None

    # -- lifecycle ---------------------------------------------------------------------------
    @property
    def port(self) -> int:
        return int(self._server.server_address[1])

    @property
    def url(self) -> str:
        """The OpenAI base URL, e.g. ``http://127.0.0.1:54321/v1``."""
        return f"http://{self.host}:{self.port}/v1"

    def start(self) -> ScriptedLLM:
        self._thread = threading.Thread(
            target=self._server.serve_forever, kwargs={"poll_interval": 0.02}, name="scripted-llm", daemon=True
        )
        self._thread.start()
        return self

    def stop(self) -> None:
        self._stopping.set()  # wakes handlers sleeping in slow/timeout faults
        self._server.shutdown()
        self._server.server_close()
        if self._thread is not None:
            self._thread.join(timeout=5)

    def __enter__(self) -> ScriptedLLM:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()

    # -- scripting -----------------------------------------------------------------------------
    def fail_next(self, kind: FaultKind, n: int = 1, operation: str | None = None) -> None:
        """Fail the next ``n`` requests of ``operation`` (any operation if None) with ``kind``."""
        if kind not in FAULT_KINDS:
            raise ValueError(f"unknown fault kind {kind!r}; known: {FAULT_KINDS}")
        with self._lock:
            self._scripted[operation].extend([kind] * n)

    def set_responder(self, operation: str, responder: Responder) -> None:
        with self._lock:
            self.responders[operation] = responder

    @property
    def requests(self) -> list[RecordedRequest]:
        with self._lock:
            return list(self._requests)

    def requests_for(self, operation: str) -> list[RecordedRequest]:
        return [r for r in self.requests if r.operation == operation]

    def fault_counts(self, since: int = 0) -> Counter[str]:
        """Faults injected, by kind, in the requests recorded from index ``since`` on."""
        return Counter(r.fault for r in self.requests[since:] if r.fault is not None)

    def reset(self) -> None:
        """Forget recorded requests and pending scripted faults (random state is kept)."""
        with self._lock:
            self._requests.clear()
            self._scripted.clear()

    # -- request handling (called from handler threads) ----------------------------------------
    def _next_fault(self, operation: str, body: dict[str, Any]) -> FaultKind | None:
        with self._lock:
            for key in (operation, None):
                queue = self._scripted.get(key)
                if queue:
                    return queue.popleft()
            if self.fault_rate <= 0:
                return None
            if self.fault_keying == "content":
                text = json.dumps([operation, body.get("messages")], sort_keys=True, ensure_ascii=False)
                digest = hashlib.sha256(text.encode("utf-8")).hexdigest()
                seen = self._seen[digest]
                self._seen[digest] = seen + 1
                rng = random.Random(f"{self.seed}:{digest}:{seen}")
            else:
                rng = self._rngs.setdefault(operation, random.Random(f"{self.seed}:{operation}"))
            if rng.random() < self.fault_rate:
                return rng.choice(self.fault_kinds)
            return None

    def _responder(self, operation: str) -> Responder:
        with self._lock:
            found = self.responders.get(operation)
        if found is None and self.use_registry:
            found = registered_responders().get(operation)
        found = found or self.default
        if found is None:
            raise _NoResponder(operation)
        return found

    def _record(self, entry: RecordedRequest) -> None:
        with self._lock:
            self._requests.append(entry)

    def _sleep(self, seconds: float) -> None:
        if seconds > 0:
            self._stopping.wait(seconds)

    def handle_chat(
        self, operation: str, body: dict[str, Any], authorization: str = "", via: str = "chat"
    ) -> tuple[int, dict[str, Any], dict[str, str]]:
        """The (status, JSON body, extra headers) answering one chat request (or one batch line, unslept)."""

        def fail(status: int, message: str, param: str | None = None, code: str | None = None) -> dict[str, Any]:
            self._record(RecordedRequest(operation, body, status, fault, None, None, message, via))
            return {"error": {"message": message, "type": "invalid_request_error", "param": param, "code": code}}

        fault: FaultKind | None = None
        fmt = body.get("response_format") or {}
        if self.reject_json_schema and fmt.get("type") == "json_schema":
            return 400, fail(400, "response_format type 'json_schema' is not supported here", "response_format"), {}
        fault = self._next_fault(operation, body)
        if fault == "rate_limit":
            ms = int(self.retry_after_s * 1000)
            headers = {"Retry-After": str(math.ceil(self.retry_after_s)), "retry-after-ms": str(ms)}
            return 429, fail(429, "rate limit reached (scripted)", None, "rate_limit_exceeded"), headers
        if fault == "server_error":
            return 500, fail(500, "internal error (scripted)", None, "server_error"), {}
        if fault == "unauthorized":
            token = authorization.removeprefix("Bearer ")
            return 401, fail(401, f"Incorrect API key provided: {token}", None, "invalid_api_key"), {}
        try:
            content = self._responder(operation)(operation, body)
        except _NoResponder:
            return 400, fail(400, f"no scripted responder for operation {operation!r}"), {}
        except (LookupError, ValueError, TypeError, AttributeError) as exc:
            # A responder bug is not transient: a 400 stops the client at once, with the reason.
            return 400, fail(400, f"responder for {operation!r} failed: {type(exc).__name__}: {exc}"), {}
        finish = "stop"
        if fault == "truncated":
            content, finish = content[: max(1, len(content) // 2)], "length"
        elif fault == "invalid":
            content = _break_schema(content, fmt)
        cap = body.get("max_completion_tokens") or body.get("max_tokens")
        if self.enforce_max_tokens and cap and len(content) > int(cap) * CHARS_PER_TOKEN:
            content, finish = content[: int(cap) * CHARS_PER_TOKEN], "length"
        usage = None if self.omit_usage else _usage(body, content)
        self._record(RecordedRequest(operation, body, 200, fault, content, usage, None, via))  # before any sleep
        if via == "chat":
            delay = {"slow": self.slow_s, "timeout": self.timeout_sleep_s}.get(fault or "", 0.0)
            self._sleep(delay + self.latency_ms / 1000.0)
        reply: dict[str, Any] = {
            "id": f"chatcmpl-scripted-{len(self._requests)}",
            "object": "chat.completion",
            "created": 0,
            "model": body.get("model", self.model),
            "choices": [{"index": 0, "message": {"role": "assistant", "content": content}, "finish_reason": finish}],
        }
        if usage is not None:
            reply["usage"] = usage
        return 200, reply, {}


CHARS_PER_TOKEN = 4


def _usage(body: dict[str, Any], content: str) -> dict[str, int]:
    """Deterministic token counts: ~4 characters per token."""
    prompt_chars = sum(len(str(m.get("content") or "")) for m in body.get("messages", []))
    prompt, completion = max(1, prompt_chars // CHARS_PER_TOKEN), max(1, len(content) // CHARS_PER_TOKEN)
    return {"prompt_tokens": prompt, "completion_tokens": completion, "total_tokens": prompt + completion}


def _break_schema(content: str, fmt: dict[str, Any]) -> str:
    """Valid JSON that violates the schema: drop the required fields (or answer a bare list)."""
    try:
        data = json.loads(content)
    except json.JSONDecodeError:
        return "[]"
    schema = (fmt.get("json_schema") or {}).get("schema") or {}
    required = schema.get("required") or (list(data)[:1] if isinstance(data, dict) else [])
    if not isinstance(data, dict) or not required:
        return "[]"
    return json.dumps({k: v for k, v in data.items() if k not in required})


class _QuietServer(ThreadingHTTPServer):
    """Says nothing when a client vanishes mid-request (a killed build, a timed-out client)."""

    def handle_error(self, request: Any, client_address: Any) -> None:
        if isinstance(sys.exc_info()[1], ConnectionError):
            return
        super().handle_error(request, client_address)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="python -m tmem.devtools.scripted_llm", description=__doc__.split("\n")[0])
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--port", type=int, default=8080)
    parser.add_argument("--model", default="scripted-model")
    parser.add_argument("--latency-ms", type=float, default=0.0)
    parser.add_argument("--fault-rate", type=float, default=0.0)
    parser.add_argument("--fault-kinds", default="rate_limit,server_error,truncated,invalid")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--fault-keying", choices=get_args(FaultKeying), default="sequence")
    parser.add_argument("--reject-json-schema", action="store_true")
    parser.add_argument("--omit-usage", action="store_true")
    parser.add_argument("--enforce-max-tokens", action="store_true",
                        help="cut answers at the request's max_tokens (4 characters a token), finish_reason length")
    parser.add_argument("--batch-in-progress-polls", type=int, default=1, help="polls a batch answers in_progress")
    parser.add_argument("--batch-delay-s", type=float, default=0.0, help="a batch runs at least this long")
    args = parser.parse_args(argv)
    from tmem.devtools import synth  # registers its deterministic responders (tmem.devtools.responders)

    has_synth = bool(synth.RESPONDERS)
    server = ScriptedLLM(
        model=args.model,
        host=args.host,
        port=args.port,
        latency_ms=args.latency_ms,
        fault_rate=args.fault_rate,
        fault_kinds=tuple(k.strip() for k in args.fault_kinds.split(",") if k.strip()),  # type: ignore[arg-type]
        seed=args.seed,
        fault_keying=args.fault_keying,
        reject_json_schema=args.reject_json_schema,
        omit_usage=args.omit_usage,
        enforce_max_tokens=args.enforce_max_tokens,
        batch_in_progress_polls=args.batch_in_progress_polls,
        batch_delay_s=args.batch_delay_s,
    )
    ops = ", ".join(sorted(registered_responders())) or "none"
    print(f"scripted LLM serving {server.url} (responders: {ops}; synth {'loaded' if has_synth else 'absent'})", flush=True)
    server.start()
    try:
        threading.Event().wait()
    except KeyboardInterrupt:
        pass
    finally:
        server.stop()


if __name__ == "__main__":
    main()

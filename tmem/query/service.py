"""The HTTP query service (``tmem serve``): ``GET /health``, ``POST /search``, ``POST /answer``,
and the memory explorer (``GET /`` → ``/explorer/``, data under ``/explorer/api``; tmem.explorer),
``GET /conversations`` and ``POST /conversations/{id}/turns`` (:mod:`tmem.query.turns_api`).

It serves the store's published snapshot through one shared :class:`~tmem.query.memory.Memory`
and switches to a newer snapshot without restarting; every response names the snapshot it was
computed on. Endpoints are plain ``def`` functions, so FastAPI runs them in its thread pool
(scoring is numpy; embedding and the answer model release the GIL or wait on I/O).

Hardening:

* ``conversation_id`` is any string of 1 to :data:`MAX_CONVERSATION_ID_CHARS` characters (422
  otherwise), so every id ingest accepts — quotes, ``%``, ``/``, spaces, any script — is reachable
  in a JSON body; an id the snapshot holds no memory for is 404. Scope never depends on the
  characters: the id is only ever compared as an exact string and passed as a query parameter /
  typed filter (tests/test_isolation.py drives hostile ids through HTTP).
* Errors never leak internals: known failures map to fixed messages (404, 422, 502, 503), any
  other exception to a generic 500; details go to the log. Validation errors do not echo input.
* Optional API key (``TMEM_API_KEY``): ``Authorization: Bearer <key>`` on every endpoint but
  ``/health`` (open for probes) and the explorer's page (which holds no memory).
* Request bodies are limited to ``max_body_bytes`` (413), posted turns to
  :data:`~tmem.query.turns_api.MAX_TURNS_BODY_BYTES`; a query or question longer than
  :data:`MAX_QUERY_CHARS` is 422. A refused post is 422 with the ingest error (record, reason).
* ``/answer`` has a deadline (``TMEM_ANSWER_TIMEOUT_S``): the work runs on a bounded pool of
  :data:`ANSWER_WORKERS` threads and a request still waiting at the deadline gets a clean 504,
  whether the answer model hangs or the pool is busy with hung calls. The abandoned call ends
  by itself at the adapter's own timeout (``TMEM_LLM_TIMEOUT_S``); it cannot be interrupted.
"""

from __future__ import annotations

import hmac
import logging
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from concurrent.futures import TimeoutError as FutureTimeout
from datetime import datetime
from pathlib import Path
from typing import Annotated, Any, Literal

from fastapi import Depends, FastAPI, HTTPException, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from fastapi.security import HTTPAuthorizationCredentials, HTTPBearer
from pydantic import BaseModel, ConfigDict, Field
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from tmem import __version__
from tmem.errors import LLMError, ScopeError, StoreError
from tmem.explorer.routes import PendingTurns, explorer_router
from tmem.ingest.spool import Spool
from tmem.query.limits import MAX_BODY_BYTES, MAX_CONVERSATION_ID_CHARS, MAX_QUERY_CHARS, PRESET_PATTERN
from tmem.query.memory import DEFAULT_REFRESH_MS, Memory, NoSnapshotError
from tmem.query.schemas import AnswerOut, SearchOut, answer_out, search_out
from tmem.query.turns_api import MAX_TURNS_BODY_BYTES, install_turn_routes
from tmem.retrieval.config import UnknownPresetError, preset_names
from tmem.settings import Settings, load_settings

log = logging.getLogger(__name__)

ANSWER_WORKERS = 16


class SearchRequest(BaseModel):
    model_config = ConfigDict(extra="forbid")

    query: str = Field(min_length=1, max_length=MAX_QUERY_CHARS)
    conversation_id: str = Field(min_length=1, max_length=MAX_CONVERSATION_ID_CHARS,
                                 description="The conversation (tenant) to search: its exact id.")
    speaker: str | None = Field(default=None, max_length=200, description="Speaker of the question (picks the persona).")
    preset: str = Field(default="default", pattern=PRESET_PATTERN, description="Retrieval preset, e.g. paper, default.")
    trace: bool = Field(default=False, description="Include the per-stage trace.")
    embed: bool = Field(default=True, description="Embed the query (false: lexical only).")


class AnswerRequest(BaseModel):
    model_config = ConfigDict(extra="forbid")

    question: str = Field(min_length=1, max_length=MAX_QUERY_CHARS)
    conversation_id: str = Field(min_length=1, max_length=MAX_CONVERSATION_ID_CHARS)
    speaker: str | None = Field(default=None, max_length=200)
    preset: str = Field(default="default", pattern=PRESET_PATTERN)
    question_date: datetime | None = Field(default=None, description="When the question is asked (resolves 'last week').")
    include_context: bool = Field(default=False, description="Return the context text sent to the model.")
    trace: bool = False
    embed: bool = True


_BEARER = HTTPBearer(auto_error=False, description="Required when TMEM_API_KEY is set.")


class HealthOut(BaseModel):
    status: Literal["ok", "no_snapshot"]
    snapshot_id: str | None
    conversations: int
    cached_indexes: int
    pending_turns: int = Field(0, description="Posted turns waiting for the next build, all conversations.")


class ErrorOut(BaseModel):
    detail: Any


class _BodyTooLarge(HTTPException):
    def __init__(self, limit: int) -> None:
        super().__init__(status_code=413, detail=f"request body larger than {limit} bytes")


class AnswerTimeoutError(Exception):
    """An /answer request passed its deadline (``TMEM_ANSWER_TIMEOUT_S``)."""


class BodySizeLimit:
    """ASGI middleware: reject bodies over ``limit`` bytes (by Content-Length, or while streaming);
    ``limit_for(path)`` may name a different limit for some paths."""

    def __init__(self, app: ASGIApp, limit: int, limit_for: Callable[[str], int | None] | None = None) -> None:
        self.app = app
        self.default_limit = limit
        self.limit_for = limit_for

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        limit = (self.limit_for(scope.get("path", "")) if self.limit_for is not None else None) or self.default_limit
        await self._limited(scope, receive, send, limit)

    async def _limited(self, scope: Scope, receive: Receive, send: Send, limit: int) -> None:
        for name, value in scope.get("headers", []):
            if name == b"content-length":
                try:
                    declared = int(value)
                except ValueError:
                    declared = limit + 1
                if declared > limit:
                    await _send_json(send, 413, {"detail": f"request body larger than {limit} bytes"})
                    return
        received = 0

        async def limited() -> Message:
            nonlocal received
            message = await receive()
            if message["type"] == "http.request":
                received += len(message.get("body", b""))
                if received > limit:
                    raise _BodyTooLarge(limit)  # FastAPI re-raises HTTPExceptions from body reads
            return message

        await self.app(scope, limited, send)


async def _send_json(send: Send, status: int, body: dict[str, Any]) -> None:
    payload = JSONResponse(body).body
    await send(
        {
            "type": "http.response.start",
            "status": status,
            "headers": [(b"content-type", b"application/json"), (b"content-length", str(len(payload)).encode())],
        }
    )
    await send({"type": "http.response.body", "body": payload})


def _turns_body_limit(path: str) -> int | None:
    """Posted turns may carry a whole session: a larger limit on ``POST /conversations/{id}/turns``."""
    return MAX_TURNS_BODY_BYTES if path.startswith("/conversations/") and path.endswith("/turns") else None


def _error(status: int, detail: str, headers: dict[str, str] | None = None) -> JSONResponse:
    return JSONResponse({"detail": detail}, status_code=status, headers=headers)


def _install_error_handlers(app: FastAPI) -> None:
    async def not_found(request: Request, exc: Exception) -> JSONResponse:
        return _error(404, "conversation not found")

    async def no_snapshot(request: Request, exc: Exception) -> JSONResponse:
        return _error(503, "no memory has been published yet", {"Retry-After": "30"})

    async def store_unavailable(request: Request, exc: Exception) -> JSONResponse:
        log.error("store error on %s %s: %s", request.method, request.url.path, exc)
        return _error(503, "memory store unavailable", {"Retry-After": "5"})

    async def bad_preset(request: Request, exc: Exception) -> JSONResponse:
        return _error(422, f"unknown preset; known: {', '.join(preset_names())} (combine with '+')")

    async def model_failed(request: Request, exc: Exception) -> JSONResponse:
        log.error("answer model failed on %s: %s", request.url.path, exc)
        return _error(502, "the answer model failed")

    async def timed_out(request: Request, exc: Exception) -> JSONResponse:
        log.error("%s passed its deadline: %s", request.url.path, exc)
        return _error(504, "the answer model did not answer in time")

    async def invalid(request: Request, exc: Exception) -> JSONResponse:
        errors = exc.errors() if isinstance(exc, RequestValidationError) else []
        # Location and reason only: never echo the offending input back.
        detail = [{"loc": list(e.get("loc", ())), "msg": str(e.get("msg", "")), "type": str(e.get("type", ""))} for e in errors]
        return JSONResponse({"detail": detail}, status_code=422)

    async def internal(request: Request, exc: Exception) -> JSONResponse:
        log.error("unhandled error on %s %s", request.method, request.url.path, exc_info=exc)
        # Starlette re-raises after this response and uvicorn then drops the connection: say so,
        # so that keep-alive clients open a new one instead of failing on the next request.
        return _error(500, "internal error", {"Connection": "close"})

    app.add_exception_handler(ScopeError, not_found)
    app.add_exception_handler(NoSnapshotError, no_snapshot)
    app.add_exception_handler(StoreError, store_unavailable)
    app.add_exception_handler(UnknownPresetError, bad_preset)
    app.add_exception_handler(LLMError, model_failed)
    app.add_exception_handler(AnswerTimeoutError, timed_out)
    app.add_exception_handler(RequestValidationError, invalid)
    app.add_exception_handler(Exception, internal)


def _auth_dependency(settings: Settings) -> Callable[[HTTPAuthorizationCredentials | None], None]:
    expected = settings.api_key.get_secret_value().encode() if settings.api_key is not None else None

    def require_key(credentials: Annotated[HTTPAuthorizationCredentials | None, Depends(_BEARER)]) -> None:
        if expected is None:
            return
        given = credentials.credentials.encode() if credentials is not None else b""
        if credentials is None or credentials.scheme.lower() != "bearer" or not hmac.compare_digest(given, expected):
            raise HTTPException(401, "missing or invalid API key", headers={"WWW-Authenticate": "Bearer"})

    return require_key


def create_app(
    store: Path | str,
    settings: Settings | None = None,
    *,
    memory: Memory | None = None,
    max_body_bytes: int = MAX_BODY_BYTES,
    refresh_ms: int = DEFAULT_REFRESH_MS,
    pending_turns: PendingTurns | None = None,
) -> FastAPI:
    """The FastAPI app serving ``store`` (raises :class:`StoreError` when it is not a store directory).

    ``pending_turns`` counts, per conversation, the turns posted by a live assistant that no build
    has taken in yet (shown by the explorer as waiting for the next build)."""
    settings = settings or load_settings(store=Path(store))
    mem = memory or Memory.open(store, settings, refresh_ms=refresh_ms)
    app = FastAPI(
        title="tmem query service",
        version=__version__,
        description="Recall and answers over T-Mem memories. Every call is scoped to one conversation.",
    )
    app.state.memory = mem
    spool = Spool(Path(store))
    app.state.spool = spool
    app.add_middleware(BodySizeLimit, limit=max_body_bytes, limit_for=_turns_body_limit)
    _install_error_handlers(app)
    auth = [Depends(_auth_dependency(settings))]
    errors: dict[int | str, dict[str, Any]] = {
        code: {"model": ErrorOut} for code in (401, 404, 413, 422, 502, 503, 504)
    }
    # Answers run here, not on the request's own thread, so that a hung model cannot hold a
    # request past its deadline; the pool is bounded, so hung calls cannot pile up threads.
    # the explorer's "waiting for the next build" badge counts the spool of posted turns by default
    app.include_router(explorer_router(mem, auth, pending_turns=pending_turns or spool.pending_turns))
    answer_pool = ThreadPoolExecutor(max_workers=ANSWER_WORKERS, thread_name_prefix="tmem-answer")
    app.state.answer_pool = answer_pool
    deadline_s = settings.answer_timeout_s

    @app.get("/health", response_model=HealthOut)
    def health() -> JSONResponse:
        pinned = mem.current()
        pending = sum(spool.pending_turns().values())
        if pinned is None:
            body = HealthOut(status="no_snapshot", snapshot_id=None, conversations=0, cached_indexes=0,
                             pending_turns=pending)
            return JSONResponse(body.model_dump(), status_code=503)
        body = HealthOut(
            status="ok",
            snapshot_id=pinned.snapshot_id,
            conversations=len(pinned.info.conversations),
            cached_indexes=mem.cache_stats().size,
            pending_turns=pending,
        )
        return JSONResponse(body.model_dump())

    install_turn_routes(app, mem, spool, auth, errors, max_id_chars=MAX_CONVERSATION_ID_CHARS)

    @app.post("/search", response_model=SearchOut, dependencies=auth, responses=errors)
    def search_endpoint(body: SearchRequest) -> SearchOut:
        started = time.perf_counter()
        pinned = mem.snapshot()  # one snapshot for the whole request
        result = pinned.search(
            body.query, conversation_id=body.conversation_id, speaker=body.speaker, preset=body.preset,
            trace=body.trace, embed=body.embed,
        )
        took = (time.perf_counter() - started) * 1000
        return search_out(result, snapshot_id=pinned.snapshot_id, preset=body.preset, took_ms=took)

    @app.post("/answer", response_model=AnswerOut, dependencies=auth, responses=errors)
    def answer_endpoint(body: AnswerRequest) -> AnswerOut:
        started = time.perf_counter()
        pinned = mem.snapshot()
        future = answer_pool.submit(
            pinned.answer, body.question, conversation_id=body.conversation_id, speaker=body.speaker,
            preset=body.preset, question_date=body.question_date, trace=body.trace, embed=body.embed,
        )
        try:
            answer = future.result(timeout=deadline_s)
        except FutureTimeout:
            future.cancel()  # still queued: never runs; running: finishes at the adapter's timeout
            raise AnswerTimeoutError(f"no answer within {deadline_s:g} s (TMEM_ANSWER_TIMEOUT_S)") from None
        took = (time.perf_counter() - started) * 1000
        return answer_out(answer, preset=body.preset, took_ms=took, include_context=body.include_context)

    return app

"""Turns from a live assistant, and the conversation listing, on the query side.

``POST /conversations/{id}/turns`` and the MCP ``add_turns`` tool validate a batch exactly as
file ingest would (:mod:`tmem.ingest.posted`) and spool what it adds (:mod:`tmem.ingest.spool`):
the answer comes at once, without the builder's lock; the next ``tmem ingest``, ``tmem build`` or
nightly run ingests it. :func:`conversation_rows` lists conversations with their posted turns
still waiting for the next build (``pending_turns``).
"""

from __future__ import annotations

from collections.abc import Callable
from datetime import UTC, datetime
from typing import Any

from fastapi import FastAPI, Request
from fastapi.concurrency import run_in_threadpool
from fastapi.responses import JSONResponse
from pydantic import BaseModel, Field

from tmem.errors import IngestError
from tmem.ingest.archive import ParsedArchive
from tmem.ingest.posted import REQUEST, parse_posted_text
from tmem.ingest.spool import PostResult, Spool
from tmem.query.memory import Memory, MemorySnapshot
from tmem.store.ingest_writer import StoredState

TURNS_PATH = "/conversations/{conversation_id:path}/turns"
MAX_TURNS_BODY_BYTES = 1024 * 1024  # a whole session of turns; other requests keep the service's 64 KiB


class PinnedInput:
    """What one pinned snapshot holds of the ingested input (:class:`tmem.ingest.spool.PublishedInput`)."""

    def __init__(self, pinned: MemorySnapshot | None) -> None:
        self.pinned = pinned

    def published_id(self) -> str | None:
        return self.pinned.snapshot_id if self.pinned is not None else None

    def published_state(self, conversation_id: str) -> StoredState:
        if self.pinned is None:
            return StoredState.empty()
        return self.pinned.reader.stored_state(conversation_id)


def post_turns(memory: Memory, spool: Spool, archive: ParsedArchive, now: datetime) -> PostResult:
    """Spool a validated post, planned on the snapshot the memory serves now."""
    return spool.post(archive, published=PinnedInput(memory.current()), now=now)


class PostOut(BaseModel):
    conversation_id: str
    posted_turns: int = Field(description="Turns in the request.")
    new_turns: int = Field(description="Of them, turns not stored or waiting yet (the others repeat earlier posts).")
    pending_turns: int = Field(description="This conversation's posted turns waiting for the next build.")


class ConversationOut(BaseModel):
    conversation_id: str
    speakers: list[str]
    turns: int = Field(description="Turns in the published memory.")
    built_at: datetime | None = Field(description="When its published memory was built (null: never built).")
    pending_turns: int = Field(description="Posted turns waiting for the next build.")


def conversation_rows(memory: Memory, spool: Spool) -> list[ConversationOut]:
    """Every conversation with published memory or posted turns waiting, ordered by id."""
    pending = spool.pending_turns()
    pinned = memory.current()
    rows = {
        c.conversation_id: ConversationOut(conversation_id=c.conversation_id, speakers=list(c.speakers), turns=c.turns,
                                           built_at=c.built_at, pending_turns=pending.get(c.conversation_id, 0))
        for c in (pinned.conversations() if pinned is not None else ())
    }
    for cid, waiting in pending.items():
        if cid not in rows:
            rows[cid] = ConversationOut(conversation_id=cid, speakers=[], turns=0, built_at=None, pending_turns=waiting)
    return [rows[cid] for cid in sorted(rows)]


def ingest_error_body(exc: IngestError) -> dict[str, Any]:
    """The refusal of a post: the record and the reason, worded as file ingest words them."""
    return {"detail": {"error": str(exc), "record": exc.record, "reason": exc.reason}}


def install_turn_routes(
    app: FastAPI, memory: Memory, spool: Spool, auth: list[Any], errors: dict[int | str, dict[str, Any]],
    clock: Callable[[], datetime] = lambda: datetime.now(UTC), max_id_chars: int = 1024,
) -> None:
    """Add ``POST /conversations/{id}/turns`` and ``GET /conversations`` to the service."""

    async def refused(request: Request, exc: Exception) -> JSONResponse:
        assert isinstance(exc, IngestError)
        return JSONResponse(ingest_error_body(exc), status_code=422)

    app.add_exception_handler(IngestError, refused)

    @app.post(TURNS_PATH, response_model=PostOut, status_code=202, dependencies=auth, responses=errors,
              openapi_extra={"requestBody": {"required": True, "content": {"application/json": {"schema": {
                  "type": "object", "required": ["turns"], "properties": {
                      "speakers": {"type": "array", "items": {"type": "string"}},
                      "turns": {"type": "array", "items": {"type": "object"}}}}}}}})
    async def post_turns_endpoint(conversation_id: str, request: Request) -> PostOut:
        """Hand over turns of a conversation as they happen: validated like a JSON Lines archive
        (docs/ingest-formats.md), spooled at once, ingested by the next build."""
        if not 1 <= len(conversation_id) <= max_id_chars:
            raise IngestError(REQUEST, "conversation id", f"must be 1 to {max_id_chars} characters")
        raw = await request.body()
        try:
            text = raw.decode("utf-8-sig")
        except UnicodeDecodeError as exc:
            raise IngestError(REQUEST, "body", f"not UTF-8 text (byte offset {exc.start})") from None
        archive = await run_in_threadpool(parse_posted_text, conversation_id, text)
        result = await run_in_threadpool(post_turns, memory, spool, archive, clock())
        return PostOut(**result.as_dict())  # type: ignore[arg-type]

    @app.get("/conversations", response_model=list[ConversationOut], dependencies=auth, responses=errors)
    def list_conversations() -> list[ConversationOut]:
        """Conversations with published memory or posted turns waiting for the next build."""
        return conversation_rows(memory, spool)

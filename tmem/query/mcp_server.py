"""``tmem mcp``: the memory as tools of a Model Context Protocol server (the official ``mcp`` SDK).

Tools: ``search_memory``, ``answer_question`` (the answer-role model), ``list_conversations``,
``get_scene``, ``get_item`` and ``add_turns`` (turns handed over as they happen, spooled like
``POST /conversations/{id}/turns``). Every tool that reads memory takes ``conversation_id``, the
exact id of one conversation, and reads nothing else.

Errors are MCP tool errors (``isError`` results) with fixed, clear messages: an unknown
conversation, scene or item, nothing published yet, a failed or late answer model, arguments
outside the input schema (named by field, never echoing the value), a post refused with the
ingest error (record and reason). Anything unexpected is the SDK's generic "Error executing
tool <name>"; its traceback goes to the server's log (stderr), never to the client. Model
errors are not passed on: they may quote an endpoint's reply.

Transports: stdio (the default: an assistant launches ``tmem mcp``), or streamable HTTP on
127.0.0.1 (``--http --port N``), where ``TMEM_API_KEY``, when set, is required as a Bearer token.
"""

from __future__ import annotations

import hmac
import logging
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from concurrent.futures import TimeoutError as FutureTimeout
from contextlib import contextmanager
from datetime import UTC, datetime
from typing import Annotated, Any

from mcp.server.mcpserver import MCPServer
from mcp.server.mcpserver.exceptions import ToolError, UnexpectedToolError
from mcp_types import CallToolResult, InputRequiredResult, ToolAnnotations
from pydantic import BaseModel, Field, ValidationError
from starlette.types import ASGIApp, Receive, Scope, Send

from tmem import __version__
from tmem.errors import IngestError, LLMError, ScopeError, StoreError
from tmem.ingest.posted import parse_posted
from tmem.ingest.spool import Spool
from tmem.query.mcp_detail import ItemDetail, SceneDetail, item_detail, scene_detail
from tmem.query.memory import Memory, MemorySnapshot, NoSnapshotError
from tmem.query.schemas import AnswerOut, SearchOut, answer_out, search_out
from tmem.query.turns_api import ConversationOut, PostOut, conversation_rows, post_turns
from tmem.retrieval.config import UnknownPresetError, preset_names
from tmem.settings import Settings

log = logging.getLogger(__name__)

HOST = "127.0.0.1"
MCP_PATH = "/mcp"
MAX_ID_CHARS = 1024
ConversationId = Annotated[str, Field(min_length=1, max_length=MAX_ID_CHARS, description=(
    "The conversation (tenant) to read: its exact id, as list_conversations names it. Required; "
    "nothing of any other conversation is ever returned."))]
Text = Annotated[str, Field(min_length=1, max_length=4000)]
Speaker = Annotated[str | None, Field(max_length=200, description="Who asks (picks the persona); optional.")]
Preset = Annotated[str, Field(pattern=r"^[a-z0-9_+-]{1,100}$", description="Retrieval preset, e.g. default, paper.")]
ObjectId = Annotated[str, Field(min_length=1, max_length=512)]
READ_ONLY = ToolAnnotations(read_only_hint=True, open_world_hint=False)

INSTRUCTIONS = (
    "Long-term memory of conversations (tmem). Call list_conversations to find a conversation id, "
    "search_memory to recall scenes (raw dialogue with dates) and items (facts with event dates), "
    "get_scene / get_item for one by id, answer_question for a short answer from memory, and "
    "add_turns to hand over a finished session (it joins the memory at the next build)."
)


class ConversationsOut(BaseModel):
    snapshot_id: str | None = Field(description="The published snapshot (null: nothing built yet).")
    conversations: list[ConversationOut]


class TmemMCP(MCPServer[Any]):
    """The SDK's server, with argument-validation errors reported by field and reason only."""

    async def call_tool(self, name: str, arguments: dict[str, Any], context: Any = None,
                        ) -> CallToolResult | InputRequiredResult:
        try:
            return await super().call_tool(name, arguments, context)
        except ToolError as exc:
            cause = exc.__cause__
            if isinstance(exc, UnexpectedToolError) or not isinstance(cause, ValidationError):
                raise
            problems = "; ".join(
                f"{'.'.join(str(p) for p in e['loc']) or '(arguments)'}: {e['msg']}" for e in cause.errors()[:10]
            )
            raise ToolError(f"invalid arguments for {name}: {problems}") from None


@contextmanager
def _tool_errors() -> Iterator[None]:
    """Known failures as fixed tool errors (nothing of the input or of internals in the message)."""
    try:
        yield
    except NoSnapshotError:
        raise ToolError("no memory has been published yet: build it first (tmem build)") from None
    except ScopeError:
        raise ToolError("conversation not found: no published memory for this conversation id") from None
    except UnknownPresetError:
        raise ToolError(f"unknown preset; known: {', '.join(preset_names())} (combine with '+')") from None
    except IngestError as exc:
        raise ToolError(f"turns refused: {exc}") from None
    except LLMError as exc:
        log.error("answer model failed: %s", exc)
        raise ToolError("the answer model failed") from None
    except StoreError as exc:
        log.error("store error: %s", exc)
        raise ToolError("memory store unavailable") from None


def create_mcp_server(memory: Memory, spool: Spool, settings: Settings) -> TmemMCP:
    """The MCP server over ``memory`` (the store's published snapshot) and its spool."""
    server = TmemMCP(name="tmem", title="tmem memory", version=__version__, instructions=INSTRUCTIONS,
                     log_level="WARNING")
    answers = ThreadPoolExecutor(max_workers=4, thread_name_prefix="tmem-mcp-answer")
    deadline_s = settings.answer_timeout_s

    def pinned_for(conversation_id: str) -> MemorySnapshot:
        pinned = memory.snapshot()
        if not pinned.has_conversation(conversation_id):
            raise ScopeError("unknown conversation")
        return pinned

    @server.tool(annotations=READ_ONLY, structured_output=True)
    def search_memory(query: Text, conversation_id: ConversationId, speaker: Speaker = None,
                      preset: Preset = "default", include_turns: bool = True, embed: bool = True) -> SearchOut:
        """Recall what one conversation's memory holds about `query`: the scenes (each with its dates, its
        dialogue when include_turns, and the channels of the cascade that reached it) and the items (facts
        with their event dates, source scenes and channels). embed=false searches lexically only."""
        with _tool_errors():
            started = time.perf_counter()
            pinned = pinned_for(conversation_id)
            result = pinned.search(query, conversation_id=conversation_id, speaker=speaker, preset=preset,
                                   embed=embed)
            out = search_out(result, snapshot_id=pinned.snapshot_id, preset=preset,
                             took_ms=(time.perf_counter() - started) * 1000)
        if not include_turns:
            for scene in out.scenes:
                scene.turns = []
        return out

    @server.tool(annotations=READ_ONLY, structured_output=True)
    def answer_question(question: Text, conversation_id: ConversationId, speaker: Speaker = None,
                        question_date: datetime | None = None, preset: Preset = "default",
                        embed: bool = True) -> AnswerOut:
        """Answer a question from one conversation's memory with the answer-role model (a short answer),
        with the scenes and items it was given. question_date (ISO 8601) resolves 'last week'."""
        with _tool_errors():
            started = time.perf_counter()
            pinned = pinned_for(conversation_id)
            future = answers.submit(pinned.answer, question, conversation_id=conversation_id, speaker=speaker,
                                    preset=preset, question_date=question_date, embed=embed)
            try:
                answer = future.result(timeout=deadline_s)
            except FutureTimeout:
                future.cancel()
                raise ToolError("the answer model did not answer in time") from None
            return answer_out(answer, preset=preset, took_ms=(time.perf_counter() - started) * 1000)

    @server.tool(annotations=READ_ONLY, structured_output=True)
    def list_conversations() -> ConversationsOut:
        """The conversations with published memory or posted turns: id, speakers, turns, when built, and
        pending_turns (posted turns waiting for the next build)."""
        with _tool_errors():
            return ConversationsOut(snapshot_id=memory.snapshot_id, conversations=conversation_rows(memory, spool))

    @server.tool(annotations=READ_ONLY, structured_output=True)
    def get_scene(conversation_id: ConversationId, scene_id: ObjectId) -> SceneDetail:
        """One scene of a conversation by id: title, summary, narrative, dates, its dialogue, its scene and
        horizon triggers, its topics and the items drawn from it."""
        with _tool_errors():
            pinned = pinned_for(conversation_id)
            found = scene_detail(*pinned.reader.read_conversation(conversation_id), scene_id)
        if found is None:
            raise ToolError("scene not found in this conversation")
        return found

    @server.tool(annotations=READ_ONLY, structured_output=True)
    def get_item(conversation_id: ConversationId, item_id: ObjectId) -> ItemDetail:
        """One item (atomic or connected fact) of a conversation by id: content, event date, keywords, topic,
        source scenes, and the entity and bridge triggers that recall it."""
        with _tool_errors():
            pinned = pinned_for(conversation_id)
            memory_, _turns = pinned.reader.read_conversation(conversation_id)
            found = item_detail(memory_, item_id)
        if found is None:
            raise ToolError("item not found in this conversation")
        return found

    @server.tool(annotations=ToolAnnotations(read_only_hint=False, idempotent_hint=True, open_world_hint=False),
                 structured_output=True)
    def add_turns(conversation_id: ConversationId,
                  turns: Annotated[list[dict[str, Any]], Field(description=(
                      "Turn records in conversation order: session_id, turn_id, speaker, text, timestamp (ISO 8601 "
                      "with a UTC offset), optional metadata (object of strings); conversation_id may be left out."))],
                  speakers: Annotated[list[str] | None, Field(description=(
                      "Optional: the conversation's speakers; every turn must then name one."))] = None) -> PostOut:
        """Hand over turns of a conversation as they happen (e.g. a finished session). Validated exactly like
        a tmem JSON Lines archive, idempotent by turn id (repeats add nothing), answered at once; they join
        the memory at the next build (until then they count in pending_turns)."""
        body: dict[str, Any] = {"turns": turns} if speakers is None else {"turns": turns, "speakers": speakers}
        with _tool_errors():
            result = post_turns(memory, spool, parse_posted(conversation_id, body), datetime.now(UTC))
        return PostOut(**result.as_dict())  # type: ignore[arg-type]

    return server


class BearerGuard:
    """ASGI wrapper: every HTTP request needs ``Authorization: Bearer <key>`` (compared in constant time)."""

    def __init__(self, app: ASGIApp, key: str) -> None:
        self.app = app
        self.expected = key.encode()

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] == "http" and not self._authorized(scope):
            body = b'{"error": "missing or invalid API key"}'
            await send({"type": "http.response.start", "status": 401, "headers": [
                (b"content-type", b"application/json"), (b"content-length", str(len(body)).encode()),
                (b"www-authenticate", b"Bearer")]})
            await send({"type": "http.response.body", "body": body})
            return
        await self.app(scope, receive, send)

    def _authorized(self, scope: Scope) -> bool:
        for name, value in scope.get("headers", []):
            if name == b"authorization":
                scheme, _, token = bytes(value).partition(b" ")
                return scheme.lower() == b"bearer" and hmac.compare_digest(token.strip(), self.expected)
        return False


def http_app(server: TmemMCP, settings: Settings) -> ASGIApp:
    """The streamable HTTP app at ``/mcp`` (DNS-rebinding protection for 127.0.0.1), behind the API key if set."""
    app: ASGIApp = server.streamable_http_app(streamable_http_path=MCP_PATH, host=HOST)
    if settings.api_key is not None:
        app = BearerGuard(app, settings.api_key.get_secret_value())
    return app

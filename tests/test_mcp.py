"""``tmem mcp`` through the official SDK's own client (issue 16, point 2): over stdio (the client
spawns ``tmem mcp``) and over streamable HTTP (uvicorn on a loopback port, the API key required).

Scope: every reading tool names one conversation; for crafted ids (quotes, SQL, wildcards, path
pieces, NUL, RTL marks, other scripts) each conversation's tools return its own memory and nothing
of another's. Errors are tool errors with clear messages: no traceback, no echoed secret.
"""

from __future__ import annotations

import json
import os
import socket
import sys
import threading
import time
from collections.abc import AsyncIterator, Callable, Iterator
from contextlib import asynccontextmanager
from pathlib import Path
from typing import Any

import anyio
import httpx
import httpx2
import pytest
import uvicorn
from mcp import Client, StdioServerParameters
from mcp.client.streamable_http import streamable_http_client
from mcp.shared.exceptions import MCPError
from mcp_types import CallToolResult

from tests.query_store import HashEmbedder, build_store, make_conv
from tests.test_isolation import assert_only
from tests.test_posted_turns import NOW, batch, stored_turns
from tests.test_query_memory import scripted_answer
from tests.test_query_service import REPO
from tmem.devtools.scripted_llm import ScriptedLLM
from tmem.ingest.spool import Spool, drain_spool
from tmem.query.mcp_server import create_mcp_server, http_app
from tmem.query.memory import Memory
from tmem.settings import Settings

API_KEY = "tmem-mcp-key-0f3a9c1e5b7d2468"
TOOLS = {"search_memory", "answer_question", "list_conversations", "get_scene", "get_item", "add_turns"}
# Crafted to collide: SQL, quotes, wildcards, path pieces, NUL, RTL / zero-width marks, other scripts.
HOSTILE = ["' OR 1=1 --", "' OR 1=1 --_", "%", "_", "../conv", "a/b\\c", "会话\u202e", "x\x00y", "\u200b", "conv"]


def family_store(path: Path) -> tuple[Path, list[Any]]:
    convs = [make_conv(cid, mark=f"qzx{n}mark", scenes=3, turns_per_scene=2, items_per_scene=2, tag=f"T{n}")
             for n, cid in enumerate(HOSTILE)]
    build_store(path, convs, HashEmbedder())
    return path, convs


@pytest.fixture(scope="module")
def family(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, list[Any]]:
    return family_store(tmp_path_factory.mktemp("mcp") / "store")


def payload(result: CallToolResult) -> dict[str, Any]:
    assert not result.is_error, result.content
    assert result.structured_content is not None
    return result.structured_content


def error_text(result: CallToolResult) -> str:
    assert result.is_error, result.structured_content
    text = " ".join(getattr(c, "text", "") for c in result.content)
    assert "Traceback" not in text and API_KEY not in text
    return text


async def check_scope(client: Client, convs: list[Any], *, embed: bool) -> None:
    """Every conversation, asked with the next one's own words, answers from its own memory only."""
    for x, conv in enumerate(convs):
        other = convs[(x + 1) % len(convs)].memory
        question = f"{other.items[0].content} {other.scenes[0].title}"
        found = payload(await client.call_tool("search_memory", {
            "query": question, "conversation_id": conv.conversation_id, "embed": embed}))
        assert found["conversation_id"] == conv.conversation_id and found["scenes"] and found["items"]
        assert all(s["channels"] and s["start_time"] for s in found["scenes"])
        assert all(i["channels"] for i in found["items"])
        assert_only(x, json.dumps({k: found[k] for k in ("scenes", "items", "personas")}, ensure_ascii=False),
                    "search_memory")
        scene = payload(await client.call_tool("get_scene", {"conversation_id": conv.conversation_id,
                                                             "scene_id": found["scenes"][0]["scene_id"]}))
        assert_only(x, json.dumps(scene, ensure_ascii=False), "get_scene")
        item = payload(await client.call_tool("get_item", {"conversation_id": conv.conversation_id,
                                                           "item_id": found["items"][0]["item_id"]}))
        assert_only(x, json.dumps(item, ensure_ascii=False), "get_item")
        # The other conversation's own ids are not found here.
        for tool, key, value in (("get_scene", "scene_id", other.scenes[0].scene_id),
                                 ("get_item", "item_id", other.items[0].item_id)):
            missing = await client.call_tool(tool, {"conversation_id": conv.conversation_id, key: value})
            assert "not found in this conversation" in error_text(missing)


async def check_malformed(client: Client) -> None:
    cases: list[tuple[str, dict[str, Any], str]] = [
        ("search_memory", {"query": "pottery"}, "conversation_id: Field required"),
        ("search_memory", {"query": "pottery", "conversation_id": ""}, "conversation_id: String should have at least 1"),
        ("search_memory", {"query": "pottery", "conversation_id": "x" * 1025}, "at most 1024 characters"),
        ("search_memory", {"query": [API_KEY], "conversation_id": HOSTILE[0]}, "query: Input should be a valid string"),
        ("search_memory", {"query": "q", "conversation_id": HOSTILE[0], "preset": "../etc"}, "preset: String should match"),
        ("search_memory", {"query": "q", "conversation_id": "no such conversation"}, "conversation not found"),
        ("search_memory", {"query": "q", "conversation_id": HOSTILE[0], "preset": "nope"}, "unknown preset; known:"),
        ("get_item", {"conversation_id": HOSTILE[0], "item_id": 7}, "item_id: Input should be a valid string"),
        ("add_turns", {"conversation_id": "c", "turns": "not a list"}, "turns: Input should be a valid list"),
        ("add_turns", {"conversation_id": "c", "turns": [{"turn_id": "t1"}]},
         "turns refused: request: turns[0]: missing required field 'session_id'"),
        ("answer_question", {"conversation_id": HOSTILE[0], "question": "q", "question_date": "soon"},
         "question_date: Input should be a valid datetime"),
    ]
    for tool, arguments, expected in cases:
        text = error_text(await client.call_tool(tool, arguments))
        assert expected in text, (tool, arguments, text)
    try:
        unknown = await client.call_tool("drop_all_memory", {})
    except MCPError as exc:  # a protocol error is as good as an error result
        assert "Traceback" not in str(exc)
    else:
        assert "drop_all_memory" in error_text(unknown)


# ---- stdio: the client spawns `tmem mcp` -----------------------------------------------------------


def stdio_params(store: Path, **env: str) -> StdioServerParameters:
    return StdioServerParameters(
        command=sys.executable, args=["-m", "tmem", "mcp", "--store", str(store)], cwd=str(store.parent),
        env={"PYTHONPATH": str(REPO), "HF_HUB_OFFLINE": "1", "TMEM_LLM_MAX_RETRIES": "0", **env},
    )


def test_stdio_tools_scope_errors_answers_and_posted_turns(
    family: tuple[Path, list[Any]], scripted_llm_factory: Callable[..., ScriptedLLM]
) -> None:
    store, convs = family
    llm = scripted_llm_factory(responders={"answer": scripted_answer})

    async def session() -> None:
        async with Client(stdio_params(store, TMEM_LLM_BASE_URL=llm.url, TMEM_LLM_API_KEY=API_KEY),
                          read_timeout_seconds=120) as client:
            assert {t.name for t in (await client.list_tools()).tools} == TOOLS
            listed = payload(await client.call_tool("list_conversations", {}))
            assert {c["conversation_id"] for c in listed["conversations"]} == set(HOSTILE)
            await check_scope(client, convs, embed=False)  # lexical: the store's vectors are a test embedder's
            await check_malformed(client)
            answered = payload(await client.call_tool("answer_question", {
                "question": convs[2].memory.items[0].content, "conversation_id": HOSTILE[2], "embed": False}))
            assert answered["answer"] and answered["model"] and answered["items"]
            assert_only(2, json.dumps(answered["items"], ensure_ascii=False), "answer_question")
            added = payload(await client.call_tool("add_turns", {
                "conversation_id": HOSTILE[7], "speakers": ["Ann", "Bob"],
                "turns": batch("live", 3, session="live")}))
            assert added == {"conversation_id": HOSTILE[7], "posted_turns": 3, "new_turns": 3, "pending_turns": 3}
            repeat = payload(await client.call_tool("add_turns", {
                "conversation_id": HOSTILE[7], "turns": batch("live", 3, session="live")}))
            assert repeat["new_turns"] == 0 and repeat["pending_turns"] == 3
            refused = await client.call_tool("add_turns", {"conversation_id": HOSTILE[7], "turns": [
                {**batch("bad", 1)[0], "speaker": "Eve"}], "speakers": ["Ann", "Bob"]})
            assert "unknown speaker 'Eve'" in error_text(refused)
            listed = payload(await client.call_tool("list_conversations", {}))
            pending = {c["conversation_id"]: c["pending_turns"] for c in listed["conversations"]}
            assert pending == {cid: 3 if cid == HOSTILE[7] else 0 for cid in HOSTILE}

    try:
        anyio.run(session)
        assert Spool(store).pending_turns() == {HOSTILE[7]: 3}
        assert llm.requests and API_KEY not in json.dumps([r.body for r in llm.requests])
    finally:
        drain_spool(store, now=NOW)
    assert [t[0] for t in stored_turns(store, HOSTILE[7])][-3:] == ["live0", "live1", "live2"]


def test_stdio_on_a_store_with_nothing_published(tmp_path: Path) -> None:
    store = tmp_path / "empty"
    store.mkdir()

    async def session() -> None:
        async with Client(stdio_params(store), read_timeout_seconds=60) as client:
            empty = payload(await client.call_tool("list_conversations", {}))
            assert empty == {"snapshot_id": None, "conversations": []}
            searched = await client.call_tool("search_memory", {"query": "q", "conversation_id": "c"})
            assert "no memory has been published yet" in error_text(searched)
            added = payload(await client.call_tool("add_turns", {"conversation_id": "c", "turns": batch("t", 2)}))
            assert added["new_turns"] == 2

    anyio.run(session)
    assert Spool(store).pending_turns() == {"c": 2}


# ---- streamable HTTP, behind the API key ---------------------------------------------------------------


class LiveMCP:
    """uvicorn serving the MCP HTTP app (lifespan on: it runs the SDK's session manager) in a thread."""

    def __init__(self, app: Any) -> None:
        self.sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM, socket.IPPROTO_TCP)
        self.sock.bind(("127.0.0.1", 0))
        self.port = int(self.sock.getsockname()[1])
        self.server = uvicorn.Server(uvicorn.Config(app, log_level="warning", access_log=False, lifespan="on"))
        self.thread = threading.Thread(target=self.server.run, kwargs={"sockets": [self.sock]}, daemon=True)

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}/mcp"

    def __enter__(self) -> LiveMCP:
        self.thread.start()
        deadline = time.monotonic() + 20
        while not self.server.started:
            assert time.monotonic() < deadline and self.thread.is_alive(), "uvicorn did not start"
            time.sleep(0.02)
        return self

    def __exit__(self, *exc: object) -> None:
        self.server.should_exit = True
        self.thread.join(timeout=15)
        self.sock.close()


@asynccontextmanager
async def http_client(url: str, key: str | None) -> AsyncIterator[Client]:
    headers = {"Authorization": f"Bearer {key}"} if key is not None else {}
    async with httpx2.AsyncClient(headers=headers, timeout=httpx2.Timeout(30, read=120)) as http:
        async with Client(streamable_http_client(url, http_client=http)) as client:
            yield client


@pytest.fixture
def live_http(family: tuple[Path, list[Any]]) -> Iterator[LiveMCP]:
    store, _ = family
    settings = Settings(store=store, api_key=API_KEY)
    memory = Memory.open(store, settings, embedder=HashEmbedder())
    with LiveMCP(http_app(create_mcp_server(memory, Spool(store), settings), settings)) as live:
        yield live


def test_http_requires_the_api_key(live_http: LiveMCP) -> None:
    init = {"jsonrpc": "2.0", "id": 1, "method": "initialize", "params": {
        "protocolVersion": "2025-06-18", "capabilities": {}, "clientInfo": {"name": "t", "version": "1"}}}
    accept = {"Accept": "application/json, text/event-stream"}
    for headers in ({}, {"Authorization": "Bearer wrong"}, {"Authorization": f"Basic {API_KEY}"},
                    {"Authorization": f"Bearer {API_KEY}x"}, {"X-API-Key": API_KEY}):
        response = httpx.post(live_http.url, json=init, headers=accept | headers, timeout=10)
        assert response.status_code == 401 and response.headers["www-authenticate"] == "Bearer"
        assert API_KEY not in response.text
    ok = httpx.post(live_http.url, json=init, headers=accept | {"Authorization": f"Bearer {API_KEY}"}, timeout=10)
    assert ok.status_code == 200 and API_KEY not in ok.text
    rebound = httpx.post(live_http.url, json=init, timeout=10,
                         headers=accept | {"Authorization": f"Bearer {API_KEY}", "Host": "evil.example"})
    assert rebound.status_code in (400, 403, 421)  # DNS-rebinding protection on 127.0.0.1

    async def refused() -> None:
        async with http_client(live_http.url, "wrong") as client:
            await client.list_tools()

    with pytest.RaisesGroup(pytest.RaisesGroup(MCPError)) as caught:  # the SDK's task groups wrap the 401
        anyio.run(refused)
    assert API_KEY not in repr(caught.value)


def test_http_tools_scope_and_errors(family: tuple[Path, list[Any]], live_http: LiveMCP) -> None:
    store, convs = family

    async def session() -> None:
        async with http_client(live_http.url, API_KEY) as client:
            assert {t.name for t in (await client.list_tools()).tools} == TOOLS
            schema = {t.name: t.input_schema for t in (await client.list_tools()).tools}
            for name in TOOLS - {"list_conversations"}:
                assert "conversation_id" in schema[name]["required"], name
            await check_scope(client, convs, embed=True)  # hybrid: the server embeds with the test embedder
            await check_malformed(client)
            added = payload(await client.call_tool("add_turns", {"conversation_id": HOSTILE[4],
                                                                 "turns": batch("h", 2, session="live")}))
            assert added["new_turns"] == 2 and added["pending_turns"] == 2

    try:
        anyio.run(session)
        assert Spool(store).pending_turns().get(HOSTILE[4]) == 2
    finally:
        for path in (store / "spool" / "pending").rglob("*.jsonl"):
            path.unlink()
    assert os.listdir(store / "spool" / "tmp") == []


def test_internal_failures_are_generic_tool_errors(
    family: tuple[Path, list[Any]], monkeypatch: pytest.MonkeyPatch
) -> None:
    from tmem.errors import StoreError
    from tmem.query.memory import MemorySnapshot

    store, convs = family
    settings = Settings(store=store)
    memory = Memory.open(store, settings, embedder=HashEmbedder())
    secret = f"{API_KEY} at /srv/secret/path"
    failures: list[BaseException] = [RuntimeError(secret), StoreError(secret)]

    def fail(*args: Any, **kwargs: Any) -> Any:
        raise failures.pop(0)

    monkeypatch.setattr(MemorySnapshot, "search", fail)

    async def session() -> list[str]:
        async with Client(create_mcp_server(memory, Spool(store), settings)) as client:
            arguments = {"query": "pottery", "conversation_id": convs[0].conversation_id}
            return [error_text(await client.call_tool("search_memory", arguments)) for _ in range(2)]

    crashed, unavailable = anyio.run(session)
    assert crashed == "Error executing tool search_memory"
    assert unavailable == "Error executing tool search_memory: memory store unavailable"
    assert "/srv/secret" not in crashed + unavailable

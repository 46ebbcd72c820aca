"""The HTTP query service over real HTTP: uvicorn on a free 127.0.0.1 port, httpx as the client."""

from __future__ import annotations

import os
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterator
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import httpx
import numpy as np
import numpy.typing as npt
import pytest
import uvicorn
from fastapi import FastAPI
from pydantic import SecretStr

from tests.query_store import HashEmbedder, build_store, make_conv, publish
from tests.test_query_memory import scripted_answer
from tmem.devtools.scripted_llm import ScriptedLLM
from tmem.query.memory import Memory
from tmem.query.service import MAX_CONVERSATION_ID_CHARS, create_app
from tmem.settings import Settings

REPO = Path(__file__).resolve().parents[1]
LATER = datetime(2026, 1, 6, 9, 0, tzinfo=UTC)


class LiveServer:
    """uvicorn serving ``app`` in a thread, on a socket bound to a free loopback port."""

    def __init__(self, app: FastAPI) -> None:
        # proto=IPPROTO_TCP: asyncio sets TCP_NODELAY only on sockets that say so (else ~40 ms per request)
        self.sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM, socket.IPPROTO_TCP)
        self.sock.bind(("127.0.0.1", 0))
        self.port = int(self.sock.getsockname()[1])
        self.server = uvicorn.Server(uvicorn.Config(app, log_level="warning", access_log=False, lifespan="off"))
        self.thread = threading.Thread(target=self.server.run, kwargs={"sockets": [self.sock]}, daemon=True)

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def start(self) -> LiveServer:
        self.thread.start()
        deadline = time.monotonic() + 10
        while not self.server.started:
            if time.monotonic() > deadline or not self.thread.is_alive():
                raise RuntimeError("uvicorn did not start")
            time.sleep(0.01)
        return self

    def stop(self) -> None:
        self.server.should_exit = True
        self.thread.join(timeout=10)
        self.sock.close()


@pytest.fixture
def serve() -> Iterator[Callable[[FastAPI], LiveServer]]:
    servers: list[LiveServer] = []

    def start(app: FastAPI) -> LiveServer:
        server = LiveServer(app).start()
        servers.append(server)
        return server

    yield start
    for server in servers:
        server.stop()


def two_conversation_store(path: Path) -> Path:
    build_store(path, [make_conv("conv-a", mark="alpha"), make_conv("conv-b", mark="beta")], HashEmbedder())
    return path


@pytest.fixture
def store(tmp_path: Path) -> Path:
    """A store of its own (for tests that publish into it)."""
    return two_conversation_store(tmp_path / "store")


@pytest.fixture(scope="module")
def shared_live(tmp_path_factory: pytest.TempPathFactory) -> Iterator[LiveServer]:
    """One server over one read-only store, shared by the tests that only query."""
    store = two_conversation_store(tmp_path_factory.mktemp("shared") / "store")
    live = LiveServer(app_for(store)).start()
    yield live
    live.stop()


def app_for(store: Path, settings: Settings | None = None, *, refresh_ms: int = 500, **kwargs: Any) -> FastAPI:
    settings = settings or Settings(store=store)
    memory = Memory.open(store, settings, embedder=HashEmbedder(), refresh_ms=refresh_ms)
    return create_app(store, settings, memory=memory, **kwargs)


def test_health_search_and_openapi(shared_live: LiveServer) -> None:
    with httpx.Client(base_url=shared_live.url, timeout=10) as client:
        health = client.get("/health")
        assert health.status_code == 200
        body = health.json()
        assert body["status"] == "ok" and body["conversations"] == 2 and body["snapshot_id"]

        found = client.post("/search", json={"query": "hiking trail boots", "conversation_id": "conv-a", "trace": True})
        assert found.status_code == 200
        result = found.json()
        assert result["snapshot_id"] == body["snapshot_id"] and result["conversation_id"] == "conv-a"
        assert result["mode"] == "hybrid" and result["scenes"][0]["title"].startswith("Hiking trail")
        assert all(s["channels"] for s in result["scenes"]) and all(i["channels"] for i in result["items"])
        assert all("alpha" in s["title"].split() for s in result["scenes"])
        assert all(t["speaker"] in ("Ann", "Bob") for s in result["scenes"] for t in s["turns"])
        assert [s["stage"] for s in result["trace"]["stages"]] == [
            "topic_prefilter", "scene_cue", "scene_selection", "trig_recall", "item_selection",
        ]

        lexical = client.post("/search", json={"query": "hiking", "conversation_id": "conv-b", "embed": False})
        assert lexical.status_code == 200 and lexical.json()["mode"] == "lexical" and lexical.json()["trace"] is None

        schema = client.get("/openapi.json").json()
        assert {"/health", "/search", "/answer"} <= set(schema["paths"])
        scope = schema["components"]["schemas"]["SearchRequest"]["properties"]["conversation_id"]
        assert scope["minLength"] == 1 and scope["maxLength"] == MAX_CONVERSATION_ID_CHARS
        assert "conversation_id" in schema["components"]["schemas"]["SearchRequest"]["required"]
        assert "HTTPBearer" in schema["components"]["securitySchemes"]


def test_answer_over_http(
    store: Path, serve: Callable[[FastAPI], LiveServer], scripted_llm_factory: Callable[..., ScriptedLLM]
) -> None:
    llm = scripted_llm_factory(responders={"answer": scripted_answer})
    settings = Settings(store=store, llm_base_url=llm.url, llm_max_retries=0, llm_timeout_s=5)
    live = serve(app_for(store, settings))
    with httpx.Client(base_url=live.url, timeout=20) as client:
        response = client.post(
            "/answer",
            json={"question": "Which garden fact?", "conversation_id": "conv-b", "include_context": True,
                  "question_date": "2023-06-01T10:00:00Z"},
        )
    assert response.status_code == 200
    body = response.json()
    assert body["items"] and body["answer"] == " ".join(body["items"][0]["content"].split()[:6])
    assert body["context"] and body["context_report"]["tokens_used"] > 0 and body["model"] == "gpt-4o-mini"
    assert all("beta" in s["title"].split() for s in body["scenes"])
    assert llm.requests_for("answer")


def test_unknown_conversation_is_404_and_not_echoed(shared_live: LiveServer) -> None:
    with httpx.Client(base_url=shared_live.url, timeout=10) as client:
        for path, key in (("/search", "query"), ("/answer", "question")):
            response = client.post(path, json={key: "pottery", "conversation_id": "conv-secret-zz"})
            assert response.status_code == 404
            assert response.json() == {"detail": "conversation not found"}


HOSTILE_IDS = [
    "' OR 1=1 --",
    "conv-a' OR '1'='1",
    "%",
    "conv-%",
    "../conv-a",
    "conv-a/../conv-b",
    "conv-a\u0007bell",
    "conv-a\ttab",
    "conv-a\n",
    "conv-a ",
    "x" * 129,
    "",
    "会话",  # allowed characters, unknown conversation: 404
    "_",
    "conv-a;DROP",
]


@pytest.mark.parametrize("hostile", HOSTILE_IDS)
def test_hostile_ids_are_rejected_without_data(shared_live: LiveServer, hostile: str) -> None:
    with httpx.Client(base_url=shared_live.url, timeout=10) as client:
        response = client.post("/search", json={"query": "pottery bowl", "conversation_id": hostile})
    assert response.status_code in (404, 422)
    body = response.json()
    assert set(body) == {"detail"}
    assert "alpha" not in response.text and "beta" not in response.text
    if len(hostile) > 3:
        assert hostile not in response.text  # the input is never echoed back


def test_malformed_requests_are_422(shared_live: LiveServer) -> None:
    with httpx.Client(base_url=shared_live.url, timeout=10) as client:
        assert client.post("/search", json={"query": "pottery"}).status_code == 422  # scope is mandatory
        assert client.post("/search", json={"query": "", "conversation_id": "conv-a"}).status_code == 422
        extra = client.post("/search", json={"query": "x", "conversation_id": "conv-a", "tenant": "conv-b"})
        assert extra.status_code == 422
        bad_preset = client.post("/search", json={"query": "x", "conversation_id": "conv-a", "preset": "nope"})
        assert bad_preset.status_code == 422 and "paper" in bad_preset.json()["detail"]
        broken = client.post("/search", content=b"{not json", headers={"content-type": "application/json"})
        assert broken.status_code == 422


def test_api_key_auth(store: Path, serve: Callable[[FastAPI], LiveServer]) -> None:
    secured = serve(app_for(store, Settings(store=store, api_key=SecretStr("s3cret-key"))))
    open_ = serve(app_for(store))
    query = {"query": "pottery", "conversation_id": "conv-a"}
    with httpx.Client(base_url=secured.url, timeout=10) as client:
        missing = client.post("/search", json=query)
        assert missing.status_code == 401 and missing.headers["www-authenticate"] == "Bearer"
        assert client.post("/search", json=query, headers={"Authorization": "Bearer wrong"}).status_code == 401
        assert client.post("/search", json=query, headers={"Authorization": "Basic s3cret-key"}).status_code == 401
        assert client.post("/answer", json={"question": "x", "conversation_id": "conv-a"}).status_code == 401
        assert client.post("/search", json=query, headers={"Authorization": "Bearer s3cret-key"}).status_code == 200
        assert client.get("/health").status_code == 200
    with httpx.Client(base_url=open_.url, timeout=10) as client:
        assert client.post("/search", json=query).status_code == 200


def test_request_body_size_is_limited(store: Path, serve: Callable[[FastAPI], LiveServer]) -> None:
    live = serve(app_for(store, max_body_bytes=2048))
    big = {"query": "pottery " * 400, "conversation_id": "conv-a"}
    with httpx.Client(base_url=live.url, timeout=10) as client:
        assert client.post("/search", json=big).status_code == 413

        def chunks() -> Iterator[bytes]:  # no Content-Length: the limit applies while streaming
            yield b'{"conversation_id": "conv-a", "query": "'
            for _ in range(50):
                yield b"pottery " * 20
            yield b'"}'

        assert client.post("/search", content=chunks(), headers={"content-type": "application/json"}).status_code == 413
        assert client.post("/search", json={"query": "pottery", "conversation_id": "conv-a"}).status_code == 200


class BrokenEmbedder(HashEmbedder):
    def embed(self, texts: list[str]) -> npt.NDArray[np.float32]:
        raise RuntimeError("disk /srv/secret/path exploded")


def test_internal_errors_are_generic(store: Path, serve: Callable[[FastAPI], LiveServer]) -> None:
    settings = Settings(store=store)
    memory = Memory.open(store, settings, embedder=BrokenEmbedder())
    live = serve(create_app(store, settings, memory=memory))
    with httpx.Client(base_url=live.url, timeout=10) as client:
        response = client.post("/search", json={"query": "pottery", "conversation_id": "conv-a"})
        assert response.status_code == 500
        assert response.json() == {"detail": "internal error"}
        # The lexical path does not embed, so it still works.
        assert client.post("/search", json={"query": "pottery", "conversation_id": "conv-a", "embed": False}).status_code == 200


def test_answer_model_failure_is_502(
    store: Path, serve: Callable[[FastAPI], LiveServer], scripted_llm_factory: Callable[..., ScriptedLLM]
) -> None:
    llm = scripted_llm_factory(responders={"answer": scripted_answer})
    llm.fail_next("server_error", n=5, operation="answer")
    settings = Settings(store=store, llm_base_url=llm.url, llm_max_retries=0, llm_timeout_s=5)
    live = serve(app_for(store, settings))
    with httpx.Client(base_url=live.url, timeout=20) as client:
        response = client.post("/answer", json={"question": "pottery?", "conversation_id": "conv-a"})
    assert response.status_code == 502 and response.json() == {"detail": "the answer model failed"}


def test_an_empty_store_serves_once_something_is_published(tmp_path: Path, serve: Callable[[FastAPI], LiveServer]) -> None:
    store = tmp_path / "store"
    store.mkdir()
    live = serve(app_for(store, refresh_ms=0))
    with httpx.Client(base_url=live.url, timeout=10) as client:
        assert client.get("/health").status_code == 503
        assert client.get("/health").json()["status"] == "no_snapshot"
        assert client.post("/search", json={"query": "pottery", "conversation_id": "conv-a"}).status_code == 503
        build_store(store, [make_conv("conv-a", mark="alpha")], HashEmbedder())
        assert client.get("/health").json()["status"] == "ok"
        assert client.post("/search", json={"query": "pottery", "conversation_id": "conv-a"}).status_code == 200


def test_snapshot_switch_during_queries(store: Path, serve: Callable[[FastAPI], LiveServer]) -> None:
    """Publish a second snapshot while clients query: no errors, and every response comes whole
    from one snapshot (v1 ids and marks, or v2 ids and marks, never a mix)."""
    live = serve(app_for(store, refresh_ms=20))
    with httpx.Client(base_url=live.url, timeout=10) as client:
        first = client.get("/health").json()["snapshot_id"]
    stop = threading.Event()
    responses: list[tuple[int, dict[str, Any]]] = []
    lock = threading.Lock()

    def client_loop(cid: str) -> None:
        with httpx.Client(base_url=live.url, timeout=10) as client:
            while not stop.is_set():
                r = client.post("/search", json={"query": "pottery bowl hiking trail", "conversation_id": cid})
                with lock:
                    responses.append((r.status_code, r.json()))

    threads = [threading.Thread(target=client_loop, args=(cid,)) for cid in ("conv-a", "conv-b", "conv-a")]
    for t in threads:
        t.start()
    time.sleep(0.3)
    second = publish(
        store, [make_conv("conv-a", mark="alpha", tag="v2"), make_conv("conv-b", mark="beta", tag="v2")],
        HashEmbedder(), now=LATER,
    ).snapshot_id
    deadline = time.monotonic() + 15
    while time.monotonic() < deadline:
        with lock:
            seen_second = sum(1 for _, body in responses if body.get("snapshot_id") == second)
        if seen_second >= 20:
            break
        time.sleep(0.05)
    stop.set()
    for t in threads:
        t.join(timeout=10)

    assert responses and all(status == 200 for status, _ in responses), {s for s, _ in responses}
    by_snapshot = {first: 0, second: 0}
    for _, body in responses:
        sid = body["snapshot_id"]
        assert sid in by_snapshot
        by_snapshot[sid] += 1
        tag = "v2" if sid == second else ""
        mark = {"conv-a": "alpha", "conv-b": "beta"}[body["conversation_id"]] + tag
        assert body["scenes"] and body["items"]
        assert all(s["scene_id"].startswith(f"scn{tag}_") and mark in s["title"].split() for s in body["scenes"])
        assert all(i["item_id"].startswith(f"itm{tag}_") and f"{mark} " in i["content"] for i in body["items"])
    print(f"\nresponses per snapshot: {by_snapshot}")
    assert by_snapshot[first] > 0 and by_snapshot[second] >= 20
    # Once switched, the service never goes back to the old snapshot.
    order = [body["snapshot_id"] for _, body in responses]
    assert first not in order[order.index(second) + 3 * len(threads):]


def _free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def test_tmem_serve_command(store: Path) -> None:
    """``tmem serve`` as a real process: health and a lexical search over HTTP."""
    port = _free_port()
    env = {k: v for k, v in os.environ.items() if not k.startswith("TMEM_")}
    env.update({"HF_HUB_OFFLINE": "1", "PYTHONPATH": str(REPO), "TMEM_API_KEY": "k-123"})
    proc = subprocess.Popen(
        [sys.executable, "-m", "tmem", "serve", "--store", str(store), "--port", str(port), "--log-level", "warning"],
        env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
    )
    try:
        deadline = time.monotonic() + 60
        with httpx.Client(base_url=f"http://127.0.0.1:{port}", timeout=5) as client:
            while True:
                try:
                    health = client.get("/health")
                    break
                except httpx.TransportError:
                    if proc.poll() is not None or time.monotonic() > deadline:
                        raise
                    time.sleep(0.1)
            assert health.status_code == 200 and health.json()["conversations"] == 2
            query = {"query": "garden tomatoes", "conversation_id": "conv-a", "embed": False}
            assert client.post("/search", json=query).status_code == 401
            found = client.post("/search", json=query, headers={"Authorization": "Bearer k-123"})
            assert found.status_code == 200
            assert found.json()["scenes"][0]["title"].startswith("Garden tomatoes")
    finally:
        proc.terminate()
        try:
            proc.wait(timeout=10)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
    assert proc.returncode is not None

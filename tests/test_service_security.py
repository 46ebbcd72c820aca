"""Security basics of the HTTP service (issue 8, point 6): API-key auth, request size limits and
the /answer deadline, over real HTTP (uvicorn on a free loopback port, httpx as the client).

No telemetry and no secret in logs, artifacts or stores: ``tests/test_privacy.py``.
"""

from __future__ import annotations

import hmac
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
from fastapi import FastAPI
from pydantic import SecretStr

from tests.test_query_memory import scripted_answer
from tests.test_query_service import LiveServer, app_for, two_conversation_store
from tmem.devtools.scripted_llm import ScriptedLLM
from tmem.query.service import MAX_BODY_BYTES, MAX_QUERY_CHARS
from tmem.settings import Settings, load_settings

API_KEY = "tmem-svc-key-7c41f0e9b2d84a6f"
QUERY = {"query": "pottery bowl", "conversation_id": "conv-a", "embed": False}


@pytest.fixture(scope="module")
def store(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return two_conversation_store(tmp_path_factory.mktemp("security") / "store")


@pytest.fixture
def serve() -> Iterator[Callable[[FastAPI], LiveServer]]:
    servers: list[LiveServer] = []

    def start(app: FastAPI) -> LiveServer:
        servers.append(LiveServer(app).start())
        return servers[-1]

    yield start
    for server in servers:
        server.stop()


# ---- API key ---------------------------------------------------------------------------------


def test_api_key_from_the_environment_guards_search_and_answer_but_not_health(
    store: Path, serve: Callable[[FastAPI], LiveServer], monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("TMEM_API_KEY", API_KEY)
    live = serve(app_for(store, load_settings(store=store)))
    wrong = API_KEY[:-1] + "0"  # same length, last character differs
    attempts: list[dict[str, str]] = [
        {},
        {"Authorization": f"Bearer {wrong}"},
        {"Authorization": "Bearer short"},
        {"Authorization": "Bearer"},
        {"Authorization": f"Basic {API_KEY}"},
        {"Authorization": f"Token {API_KEY}"},
        {"X-API-Key": API_KEY},
    ]
    with httpx.Client(base_url=live.url, timeout=10) as client:
        for headers in attempts:
            for path, body in (("/search", QUERY), ("/answer", {"question": "pottery?", "conversation_id": "conv-a"})):
                response = client.post(path, json=body, headers=headers)
                assert response.status_code == 401, (path, headers)
                assert response.json() == {"detail": "missing or invalid API key"}
                assert response.headers["www-authenticate"] == "Bearer"
                echoed = response.text + " ".join(f"{k}: {v}" for k, v in response.headers.items())
                assert API_KEY not in echoed and wrong not in echoed and "short" not in echoed
        health = client.get("/health")
        assert health.status_code == 200 and API_KEY not in health.text
        ok = client.post("/search", json=QUERY, headers={"Authorization": f"Bearer {API_KEY}"})
        assert ok.status_code == 200 and ok.json()["scenes"]
        assert API_KEY not in ok.text
        schema = client.get("/openapi.json")
        assert schema.status_code == 200 and API_KEY not in schema.text


def test_the_key_is_compared_in_constant_time(
    store: Path, serve: Callable[[FastAPI], LiveServer], monkeypatch: pytest.MonkeyPatch
) -> None:
    """Every check goes through ``hmac.compare_digest`` with the whole presented key, right or wrong."""
    seen: list[tuple[bytes, bytes]] = []
    real = hmac.compare_digest

    def spy(a: Any, b: Any) -> bool:
        seen.append((a, b))
        return real(a, b)

    monkeypatch.setattr(hmac, "compare_digest", spy)
    live = serve(app_for(store, load_settings(store=store, api_key=SecretStr(API_KEY))))
    with httpx.Client(base_url=live.url, timeout=10) as client:
        for key, status in (("x" * 40, 401), (API_KEY[:10], 401), (API_KEY, 200)):
            response = client.post("/search", json=QUERY, headers={"Authorization": f"Bearer {key}"})
            assert response.status_code == status
    assert seen == [(b"x" * 40, API_KEY.encode()), (API_KEY[:10].encode(), API_KEY.encode()),
                    (API_KEY.encode(), API_KEY.encode())]


def test_without_a_key_configured_the_service_is_open(store: Path, serve: Callable[[FastAPI], LiveServer]) -> None:
    live = serve(app_for(store, load_settings(store=store)))
    with httpx.Client(base_url=live.url, timeout=10) as client:
        assert client.post("/search", json=QUERY).status_code == 200
        assert client.post("/search", json=QUERY, headers={"Authorization": "Bearer anything"}).status_code == 200


# ---- request size --------------------------------------------------------------------------


def test_bodies_over_the_default_limit_are_413_with_or_without_content_length(
    store: Path, serve: Callable[[FastAPI], LiveServer]
) -> None:
    live = serve(app_for(store, load_settings(store=store)))
    filler = "pottery " * (MAX_BODY_BYTES // 8 + 16)  # > MAX_BODY_BYTES once in JSON
    with httpx.Client(base_url=live.url, timeout=10) as client:
        declared = client.post("/search", json={"query": filler, "conversation_id": "conv-a"})
        assert declared.status_code == 413
        assert declared.json() == {"detail": f"request body larger than {MAX_BODY_BYTES} bytes"}

        def chunks() -> Iterator[bytes]:
            yield b'{"conversation_id": "conv-a", "query": "'
            for _ in range(MAX_BODY_BYTES // 1024 + 4):
                yield b"p" * 1024
            yield b'"}'

        request = client.build_request("POST", "/search", content=chunks(), headers={"content-type": "application/json"})
        assert "content-length" not in request.headers and request.headers["transfer-encoding"] == "chunked"
        streamed = client.send(request)
        assert streamed.status_code == 413 and "pppp" not in streamed.text
        # The connection pool and the service are fine afterwards.
        assert client.post("/search", json=QUERY).status_code == 200


@pytest.mark.parametrize(
    ("path", "field", "limit"),
    [("/search", "query", MAX_QUERY_CHARS), ("/answer", "question", MAX_QUERY_CHARS), ("/search", "speaker", 200)],
)
def test_an_over_long_field_is_422_without_echo(
    store: Path, serve: Callable[[FastAPI], LiveServer], path: str, field: str, limit: int
) -> None:
    live = serve(app_for(store, load_settings(store=store)))
    key = "question" if path == "/answer" else "query"
    body: dict[str, Any] = {key: "pottery", "conversation_id": "conv-a", "embed": False}
    marker = "zqxj"
    with httpx.Client(base_url=live.url, timeout=10) as client:
        too_long = client.post(path, json={**body, field: marker * (limit // 4) + "z"})  # limit + 1 characters
        assert too_long.status_code == 422
        assert too_long.json()["detail"][0]["loc"] == ["body", field]
        assert marker not in too_long.text
        if path == "/search":
            assert client.post(path, json={**body, field: "z" * limit}).status_code == 200


# ---- /answer deadline ----------------------------------------------------------------------


def test_an_answer_model_that_hangs_gets_a_clean_504_within_the_configured_deadline(
    store: Path, serve: Callable[[FastAPI], LiveServer], scripted_llm_factory: Callable[..., ScriptedLLM],
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    llm = scripted_llm_factory(responders={"answer": scripted_answer}, timeout_sleep_s=60.0)
    monkeypatch.setenv("TMEM_LLM_BASE_URL", llm.url)
    monkeypatch.setenv("TMEM_LLM_TIMEOUT_S", "120")  # the adapter would wait far longer than the deadline
    monkeypatch.setenv("TMEM_LLM_MAX_RETRIES", "0")
    monkeypatch.setenv("TMEM_ANSWER_TIMEOUT_S", "2")
    app = app_for(store, load_settings(store=store))
    app.state.memory.chat_model()  # loaded before the clock starts (importing openai takes seconds on a busy machine)
    live = serve(app)
    question = {"question": "Which pottery fact?", "conversation_id": "conv-a", "embed": False}
    with httpx.Client(base_url=live.url, timeout=90) as client:
        assert client.post("/answer", json=question).status_code == 200
        llm.fail_next("timeout", n=1, operation="answer")  # the next answer call hangs for 60 s
        started = time.monotonic()
        hung = client.post("/answer", json=question)
        waited = time.monotonic() - started
        assert hung.status_code == 504
        assert hung.json() == {"detail": "the answer model did not answer in time"}
        assert 2.0 <= waited < 15.0, waited  # the deadline, not the 60 s hang or the adapter's 120 s
        deadline = time.monotonic() + 10
        while not any(r.fault == "timeout" for r in llm.requests_for("answer")):  # it did reach the model
            assert time.monotonic() < deadline, "the hung answer request never reached the model"
            time.sleep(0.05)
        # The next question is answered: the hung call holds one worker, not the service.
        answered = client.post("/answer", json=question)
        assert answered.status_code == 200 and answered.json()["answer"]
        assert client.get("/health").status_code == 200


# ---- availability while a model loads --------------------------------------------------------


def test_a_lexical_query_does_not_wait_for_the_embedder_to_load(store: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Found by the soak: loading the query embedder held the lock that preset lookups take, so on a
    busy machine every request, lexical ones included, stalled behind a cold model load."""
    import threading

    import tmem.bundle
    from tests.query_store import HashEmbedder
    from tmem.query.memory import Memory

    release, loading = threading.Event(), threading.Event()

    def slow_embedder_for(settings: Settings, con: object, **options: object) -> HashEmbedder:
        loading.set()
        assert release.wait(30), "never released"
        return HashEmbedder()

    monkeypatch.setattr(tmem.bundle, "embedder_for", slow_embedder_for)
    memory = Memory.open(store, load_settings(store=store))
    cold = threading.Thread(target=memory.embed_query, args=("pottery",))
    cold.start()
    try:
        assert loading.wait(10)
        done = threading.Event()

        def lexical() -> None:
            memory.search("pottery bowl", conversation_id="conv-a", preset="paper", embed=False)
            done.set()

        threading.Thread(target=lexical, daemon=True).start()
        assert done.wait(10), "a lexical query waited for the embedder's load"
    finally:
        release.set()
        cold.join(timeout=30)

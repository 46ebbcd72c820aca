"""The scripted OpenAI-compatible server, spoken to over raw HTTP."""

from __future__ import annotations

import json
import subprocess
import sys
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import httpx
import pytest

from tmem.devtools.responders import (
    register_responder,
    registered_responders,
    request_input,
    sequence_responder,
    unregister_responder,
)
from tmem.devtools.scripted_llm import OPERATION_HEADER, ScriptedLLM
from tmem.prompts.base import render_input

SCHEMA = {
    "type": "object",
    "properties": {"name": {"type": "string"}, "age": {"type": "integer"}, "note": {"type": "string"}},
    "required": ["name", "age"],
}


def person(operation: str, body: dict[str, Any]) -> str:
    data = request_input(body)
    return json.dumps({"name": data["name"].title(), "age": data["age"], "note": operation})


def chat_body(name: str = "ada", age: int = 36, fmt: str = "json_schema") -> dict[str, Any]:
    response_format: dict[str, Any] = {"type": "json_object"}
    if fmt == "json_schema":
        response_format = {"type": "json_schema", "json_schema": {"name": "person", "schema": SCHEMA}}
    return {
        "model": "m",
        "messages": [
            {"role": "system", "content": "Describe the person."},
            {"role": "user", "content": "Person:\n" + render_input({"name": name, "age": age})},
        ],
        "response_format": response_format,
    }


def post(
    server: ScriptedLLM, operation: str | None = "person", client: httpx.Client | None = None, **kwargs: Any
) -> httpx.Response:
    headers = {OPERATION_HEADER: operation} if operation else {}
    send = client.post if client else httpx.post
    return send(f"{server.url}/chat/completions", json=chat_body(**kwargs), headers=headers, timeout=10)


@pytest.fixture
def server(scripted_llm_factory: Callable[..., ScriptedLLM]) -> ScriptedLLM:
    return scripted_llm_factory(responders={"person": person})


def test_models_endpoint(server: ScriptedLLM) -> None:
    reply = httpx.get(f"{server.url}/models", timeout=5)
    assert reply.status_code == 200
    assert reply.json()["data"][0]["id"] == "scripted-model"


def test_chat_completion_shape_and_record(server: ScriptedLLM) -> None:
    reply = post(server)
    assert reply.status_code == 200
    body = reply.json()
    assert body["object"] == "chat.completion"
    choice = body["choices"][0]
    assert choice["finish_reason"] == "stop" and choice["message"]["role"] == "assistant"
    assert json.loads(choice["message"]["content"]) == {"name": "Ada", "age": 36, "note": "person"}
    usage = body["usage"]
    assert usage["total_tokens"] == usage["prompt_tokens"] + usage["completion_tokens"] > 0
    [rec] = server.requests
    assert (rec.operation, rec.status, rec.fault, rec.usage) == ("person", 200, None, usage)
    assert rec.body == chat_body()


def test_operation_falls_back_to_schema_name_and_unknown_is_a_400(server: ScriptedLLM) -> None:
    assert post(server, operation=None).status_code == 200  # json_schema.name is "person"
    unknown = post(server, operation="nobody")
    assert unknown.status_code == 400
    assert "nobody" in unknown.json()["error"]["message"]
    assert [r.operation for r in server.requests] == ["person", "nobody"]


def test_responder_errors_are_400s_naming_the_operation(scripted_llm_factory: Callable[..., ScriptedLLM]) -> None:
    def broken(operation: str, body: dict[str, Any]) -> str:
        raise KeyError("missing_field")

    server = scripted_llm_factory(responders={"person": broken})
    reply = post(server)
    assert reply.status_code == 400 and "KeyError" in reply.json()["error"]["message"]


def test_registry_default_and_explicit_precedence(scripted_llm_factory: Callable[..., ScriptedLLM]) -> None:
    register_responder("registry_op", lambda op, body: '{"from": "registry"}')
    try:
        assert "registry_op" in registered_responders()
        plain = scripted_llm_factory(default=lambda op, body: '{"from": "default"}')
        override = scripted_llm_factory(responders={"registry_op": lambda op, body: '{"from": "explicit"}'})
        isolated = scripted_llm_factory(use_registry=False, default=lambda op, body: '{"from": "default"}')

        def answer(server: ScriptedLLM, op: str) -> str:
            return str(json.loads(post(server, op).json()["choices"][0]["message"]["content"])["from"])

        assert answer(plain, "registry_op") == "registry"
        assert answer(plain, "other_op") == "default"
        assert answer(override, "registry_op") == "explicit"
        assert answer(isolated, "registry_op") == "default"
    finally:
        unregister_responder("registry_op")
    assert "registry_op" not in registered_responders()


def test_sequence_responder_and_input_after_repair_message(server: ScriptedLLM) -> None:
    server.set_responder("person", sequence_responder("first", "second"))
    contents = [post(server).json()["choices"][0]["message"]["content"] for _ in range(3)]
    assert contents == ["first", "second", "second"]
    body = chat_body()
    body["messages"] += [{"role": "assistant", "content": "{}"}, {"role": "user", "content": "fix it"}]
    assert request_input(body) == {"name": "ada", "age": 36}  # the repair message carries no input


def test_scripted_faults_are_scoped_by_operation(server: ScriptedLLM) -> None:
    server.set_responder("other", person)
    server.fail_next("server_error", 2, operation="person")
    assert post(server, "other").status_code == 200
    assert [post(server).status_code for _ in range(3)] == [500, 500, 200]
    server.fail_next("rate_limit", 1)  # any operation
    limited = post(server, "other")
    assert limited.status_code == 429
    assert limited.headers["retry-after-ms"] == "10" and limited.headers["Retry-After"] == "1"


def test_truncated_and_invalid_faults(server: ScriptedLLM) -> None:
    server.fail_next("truncated", 1)
    cut = post(server).json()["choices"][0]
    assert cut["finish_reason"] == "length"
    with pytest.raises(json.JSONDecodeError):
        json.loads(cut["message"]["content"])
    server.fail_next("invalid", 2)
    broken = json.loads(post(server).json()["choices"][0]["message"]["content"])
    assert broken == {"note": "person"}  # the schema's required fields are gone
    broken_obj = json.loads(post(server, fmt="json_object").json()["choices"][0]["message"]["content"])
    assert "name" not in broken_obj  # no schema sent: the first field is dropped


def test_slow_fault_and_fixed_latency(scripted_llm_factory: Callable[..., ScriptedLLM]) -> None:
    server = scripted_llm_factory(responders={"person": person}, latency_ms=60, slow_s=0.15)
    start = time.perf_counter()
    assert post(server).status_code == 200
    assert time.perf_counter() - start >= 0.06
    server.fail_next("slow", 1)
    start = time.perf_counter()
    assert post(server).status_code == 200
    assert time.perf_counter() - start >= 0.21


def test_timeout_fault_outlasts_the_client(scripted_llm_factory: Callable[..., ScriptedLLM]) -> None:
    server = scripted_llm_factory(responders={"person": person}, timeout_sleep_s=1.0)
    server.fail_next("timeout", 1)
    with pytest.raises(httpx.ReadTimeout):
        httpx.post(f"{server.url}/chat/completions", json=chat_body(), headers={OPERATION_HEADER: "person"}, timeout=0.2)
    assert post(server).status_code == 200  # the server is still serving
    assert [r.fault for r in server.requests] == ["timeout", None]


def test_reject_json_schema_and_omit_usage(scripted_llm_factory: Callable[..., ScriptedLLM]) -> None:
    server = scripted_llm_factory(responders={"person": person}, reject_json_schema=True, omit_usage=True)
    refused = post(server)
    assert refused.status_code == 400 and refused.json()["error"]["param"] == "response_format"
    accepted = post(server, fmt="json_object")
    assert accepted.status_code == 200 and "usage" not in accepted.json()


def test_unauthorized_fault_quotes_the_token(server: ScriptedLLM) -> None:
    server.fail_next("unauthorized", 1)
    reply = httpx.post(
        f"{server.url}/chat/completions",
        json=chat_body(),
        headers={OPERATION_HEADER: "person", "Authorization": "Bearer sk-quoted"},
        timeout=5,
    )
    assert reply.status_code == 401 and "sk-quoted" in reply.json()["error"]["message"]


def test_random_faults_are_deterministic_per_operation(scripted_llm_factory: Callable[..., ScriptedLLM]) -> None:
    kinds = ("server_error", "truncated", "invalid")

    def run(seed: int, interleave: bool) -> list[str | None]:
        server = scripted_llm_factory(default=person, fault_rate=0.4, fault_kinds=kinds, seed=seed)
        with httpx.Client() as client:  # one keep-alive connection
            for i in range(30):
                post(server, "person", client)
                if interleave and i % 3 == 0:
                    post(server, "noise", client)  # another operation's draws don't shift this one's
        return [r.fault for r in server.requests_for("person")]

    first = run(seed=11, interleave=False)
    assert first == run(seed=11, interleave=True)
    assert first != run(seed=12, interleave=False)
    faulted = [f for f in first if f is not None]
    assert 4 <= len(faulted) <= 20 and set(faulted) <= set(kinds)


def test_content_keyed_faults_do_not_depend_on_request_order(scripted_llm_factory: Callable[..., ScriptedLLM]) -> None:
    kinds = ("server_error", "truncated", "invalid")
    people = [(f"p{i}", i) for i in range(40)]

    def run(seed: int, order: list[tuple[str, int]], repeats: int) -> dict[tuple[str, int], list[str | None]]:
        server = scripted_llm_factory(default=person, fault_rate=0.3, fault_kinds=kinds, seed=seed,
                                      fault_keying="content")
        with httpx.Client() as client:
            for name, age in order:
                for _ in range(repeats):  # the same request again (a retry) draws again
                    post(server, "person", client, name=name, age=age)
        faults: dict[tuple[str, int], list[str | None]] = {}
        for r in server.requests:
            data = request_input(r.body)
            faults.setdefault((data["name"], data["age"]), []).append(r.fault)
        counts = server.fault_counts()
        assert sum(counts.values()) == sum(f is not None for fs in faults.values() for f in fs)
        return faults

    first = run(5, people, repeats=3)
    assert first == run(5, list(reversed(people)), repeats=3)
    assert first != run(6, people, repeats=3)
    draws = [f for fs in first.values() for f in fs]
    assert 10 <= sum(f is not None for f in draws) <= 60 and {f for f in draws if f} <= set(kinds)
    # Repeats of one request are independent draws, not one decision repeated.
    assert any(len(set(fs)) > 1 for fs in first.values())
    with pytest.raises(ValueError, match="unknown fault keying"):
        ScriptedLLM(fault_keying="order")  # type: ignore[arg-type]


def test_unknown_fault_kind_is_refused(server: ScriptedLLM) -> None:
    with pytest.raises(ValueError, match="unknown fault kind"):
        server.fail_next("explode", 1)  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="unknown fault kinds"):
        ScriptedLLM(fault_kinds=("explode",))  # type: ignore[arg-type]


def test_concurrent_requests_are_all_recorded(scripted_llm_factory: Callable[..., ScriptedLLM]) -> None:
    server = scripted_llm_factory(responders={"person": person}, latency_ms=20)
    with ThreadPoolExecutor(max_workers=16) as pool:
        replies = list(pool.map(lambda i: post(server, name=f"p{i}", age=i), range(32)))
    assert all(r.status_code == 200 for r in replies)
    assert sorted(request_input(r.body)["age"] for r in server.requests) == list(range(32))


def test_command_line_serves_until_interrupted() -> None:
    proc = subprocess.Popen(
        [sys.executable, "-m", "tmem.devtools.scripted_llm", "--port", "0", "--latency-ms", "1"],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    try:
        assert proc.stdout is not None
        line = proc.stdout.readline()
        assert line.startswith("scripted LLM serving http://127.0.0.1:"), line + (proc.stderr.read() if proc.stderr else "")
        url = line.split()[3]
        assert httpx.get(f"{url}/models", timeout=5).status_code == 200
        unknown = httpx.post(f"{url}/chat/completions", json=chat_body(), headers={OPERATION_HEADER: "zz"}, timeout=5)
        assert unknown.status_code == 400
    finally:
        proc.terminate()
        proc.wait(timeout=10)

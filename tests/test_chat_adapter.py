"""The real openai client, through OpenAIChatModel and CachedChatModel, against the scripted server."""

from __future__ import annotations

import json
import logging
import random
import threading
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import pytest
from pydantic import BaseModel, Field

from tests.conftest import TEST_API_KEY
from tmem.devtools.responders import request_input, sequence_responder
from tmem.devtools.scripted_llm import ScriptedLLM
from tmem.errors import LLMOutputError, LLMRequestRejectedError, LLMTransportError, LLMTruncatedError
from tmem.llm.response_cache import CachedChatModel, InMemoryResponseCache
from tmem.llm.usage import InMemoryUsageLedger, total_usage
from tmem.prompts.base import Message, Prompt, render_input
from tmem.providers.openai_chat import OPERATION_HEADER, ChatConfig, OpenAIChatModel
from tmem.settings import load_settings
from tmem.store.duck import connect
from tmem.store.llm_cache import DuckResponseCache, DuckUsageLedger

# --- a tiny prompt module, local to this test ---------------------------------------------------

OP = "test_sentences"


class SentencesInput(BaseModel):
    text: str


class Sentences(BaseModel):
    sentences: list[str] = Field(description="Each sentence of the text, trimmed.")
    count: int = Field(description="How many sentences.")


def build_prompt(text: str) -> Prompt[Sentences]:
    return Prompt(
        operation=OP,
        version="t1",
        messages=(
            Message("system", "Split the text into sentences."),
            Message("user", "Text:\n" + render_input(SentencesInput(text=text))),
        ),
        response_model=Sentences,
        input_ref=f"text {text[:24]!r}",
    )


def split(text: str) -> list[str]:
    return [part.strip() for part in text.split(".") if part.strip()]


def sentences_responder(operation: str, body: dict[str, Any]) -> str:
    parts = split(request_input(body)["text"])
    return json.dumps({"sentences": parts, "count": len(parts)})


TEXT = "Alice moved to Lyon. She adopted a dog. It is called Pixel."
EXPECTED = Sentences(sentences=split(TEXT), count=3)


class RecordingSleep:
    """Sleeps for real and remembers the delays asked for."""

    def __init__(self) -> None:
        self.delays: list[float] = []
        self._lock = threading.Lock()

    def __call__(self, seconds: float) -> None:
        with self._lock:
            self.delays.append(seconds)
        time.sleep(seconds)


@pytest.fixture
def server(scripted_llm_factory: Callable[..., ScriptedLLM]) -> ScriptedLLM:
    return scripted_llm_factory(responders={OP: sentences_responder})


def adapter(chat_config: Callable[..., Any], server: ScriptedLLM, **overrides: Any) -> OpenAIChatModel:
    sleep = overrides.pop("sleep", time.sleep)
    return OpenAIChatModel(chat_config(server, **overrides), sleep=sleep, rng=random.Random(7))


# --- the adapter --------------------------------------------------------------------------------


def test_success_sends_json_schema_and_operation(server: ScriptedLLM, chat_config: Callable[..., Any]) -> None:
    model = adapter(chat_config, server)
    done = model.complete_metered(build_prompt(TEXT))
    assert done.value == EXPECTED
    assert done.requests == 1
    [req] = server.requests
    assert req.operation == OP  # routed by the X-Tmem-Operation header
    fmt = req.body["response_format"]
    assert fmt["type"] == "json_schema"
    assert fmt["json_schema"] == {"name": OP, "schema": Sentences.model_json_schema(), "strict": False}
    assert req.body["model"] == "scripted-model"
    assert req.usage is not None
    assert (done.usage.prompt_tokens, done.usage.completion_tokens) == (
        req.usage["prompt_tokens"],
        req.usage["completion_tokens"],
    )
    assert not done.usage.estimated
    assert OPERATION_HEADER == "X-Tmem-Operation"


def test_auto_mode_falls_back_to_json_object_once(
    scripted_llm_factory: Callable[..., ScriptedLLM], chat_config: Callable[..., Any]
) -> None:
    server = scripted_llm_factory(responders={OP: sentences_responder}, reject_json_schema=True)
    model = adapter(chat_config, server)
    assert model.structured_mode == "json_schema"
    assert model.complete(build_prompt(TEXT)) == EXPECTED
    first, second = server.requests
    assert (first.status, first.body["response_format"]["type"]) == (400, "json_schema")
    assert (second.status, second.body["response_format"]) == (200, {"type": "json_object"})
    system, user = second.body["messages"]  # the schema joins the prompt's one system message
    assert system["role"] == "system" and system["content"].startswith("Split the text into sentences.")
    assert json.dumps(Sentences.model_json_schema()) in system["content"]
    assert user == first.body["messages"][1]
    assert model.structured_mode == "json_object"
    # The capability is remembered: the next call goes straight to JSON mode.
    assert model.complete(build_prompt("One. Two.")).count == 2
    assert [r.body["response_format"]["type"] for r in server.requests[2:]] == ["json_object"]


def test_forced_json_schema_mode_raises_on_refusal(
    scripted_llm_factory: Callable[..., ScriptedLLM], chat_config: Callable[..., Any]
) -> None:
    server = scripted_llm_factory(responders={OP: sentences_responder}, reject_json_schema=True)
    model = adapter(chat_config, server, structured_mode="json_schema")
    with pytest.raises(LLMRequestRejectedError) as info:
        model.complete(build_prompt(TEXT))
    assert info.value.status_code == 400
    assert "json_schema" in str(info.value)
    assert len(server.requests) == 1


def test_forced_json_object_mode_never_sends_a_schema_format(
    server: ScriptedLLM, chat_config: Callable[..., Any]
) -> None:
    model = adapter(chat_config, server, structured_mode="json_object")
    assert model.complete(build_prompt(TEXT)) == EXPECTED
    user_only = build_prompt(TEXT).messages[1:]
    assert model.complete(Prompt(OP, "t1", user_only, Sentences, "user only")) == EXPECTED
    with_system, without_system = server.requests
    assert with_system.body["response_format"] == without_system.body["response_format"] == {"type": "json_object"}
    assert len(with_system.body["messages"]) == 2
    inserted, _user = without_system.body["messages"]  # no system message of its own: one is added
    assert inserted["role"] == "system" and "JSON schema" in inserted["content"]


def test_repair_re_ask_fixes_an_invalid_answer(server: ScriptedLLM, chat_config: Callable[..., Any]) -> None:
    bad = json.dumps({"sentences": ["only one"]})  # `count` missing
    server.set_responder(OP, sequence_responder(bad, EXPECTED.model_dump_json()))
    model = adapter(chat_config, server)
    done = model.complete_metered(build_prompt(TEXT))
    assert done.value == EXPECTED
    assert done.requests == 2
    first, second = server.requests
    assert second.body["messages"][-2] == {"role": "assistant", "content": bad}
    repair = second.body["messages"][-1]
    assert repair["role"] == "user" and "count" in repair["content"] and "Field required" in repair["content"]
    sent = [r.usage for r in (first, second) if r.usage]
    assert done.usage.prompt_tokens == sum(u["prompt_tokens"] for u in sent)
    assert done.usage.completion_tokens == sum(u["completion_tokens"] for u in sent)


def test_a_truncated_answer_raises_at_once_without_a_repair(server: ScriptedLLM, chat_config: Callable[..., Any]) -> None:
    # Replaces "truncated JSON is repaired": a cut answer (finish_reason length) is cut again when re-asked.
    server.fail_next("truncated", 1, operation=OP)
    model = adapter(chat_config, server, repair_attempts=2)
    prompt = build_prompt(TEXT)
    with pytest.raises(LLMTruncatedError) as info:
        model.complete(prompt)
    assert [r.fault for r in server.requests] == ["truncated"]
    err = info.value
    assert isinstance(err, LLMOutputError) and err.operation == OP and err.input_ref == prompt.input_ref
    assert err.raw_output == server.requests[0].content and err.input_digest == prompt.input_digest()
    assert err.spend is not None and (err.spend.requests, err.spend.repairs) == (1, 0)


def test_repair_exhausted_raises_output_error_with_raw_output(
    server: ScriptedLLM, chat_config: Callable[..., Any]
) -> None:
    bad = '{"sentences": "not a list", "count": 1}'
    server.set_responder(OP, sequence_responder(bad))
    model = adapter(chat_config, server, repair_attempts=1)
    prompt = build_prompt(TEXT)
    with pytest.raises(LLMOutputError) as info:
        model.complete(prompt)
    err = info.value
    assert err.operation == OP and err.input_ref == prompt.input_ref
    assert err.raw_output == bad
    assert OP in str(err) and "sentences" in str(err)
    assert len(server.requests) == 2


def test_zero_repair_attempts_means_one_request(server: ScriptedLLM, chat_config: Callable[..., Any]) -> None:
    server.set_responder(OP, sequence_responder("not json at all"))
    model = adapter(chat_config, server, repair_attempts=0)
    with pytest.raises(LLMOutputError) as info:
        model.complete(build_prompt(TEXT))
    assert info.value.raw_output == "not json at all"
    assert len(server.requests) == 1


def test_429_honours_retry_after(
    scripted_llm_factory: Callable[..., ScriptedLLM], chat_config: Callable[..., Any]
) -> None:
    server = scripted_llm_factory(responders={OP: sentences_responder}, retry_after_s=0.05)
    server.fail_next("rate_limit", 2, operation=OP)
    sleep = RecordingSleep()
    model = adapter(chat_config, server, sleep=sleep, backoff_s=0.001)
    done = model.complete_metered(build_prompt(TEXT))
    assert done.value == EXPECTED and done.requests == 3
    assert sleep.delays == pytest.approx([0.05, 0.05])  # the server's retry-after-ms, not our 1 ms backoff
    assert [r.status for r in server.requests] == [429, 429, 200]


def test_retry_after_is_capped(
    scripted_llm_factory: Callable[..., ScriptedLLM], chat_config: Callable[..., Any]
) -> None:
    server = scripted_llm_factory(responders={OP: sentences_responder}, retry_after_s=30.0)
    server.fail_next("rate_limit", 1)
    sleep = RecordingSleep()
    model = adapter(chat_config, server, sleep=sleep, retry_after_cap_s=0.02)
    assert model.complete(build_prompt(TEXT)) == EXPECTED
    assert sleep.delays == [0.02]


def test_500s_back_off_exponentially_then_succeed(server: ScriptedLLM, chat_config: Callable[..., Any]) -> None:
    server.fail_next("server_error", 3, operation=OP)
    sleep = RecordingSleep()
    model = adapter(chat_config, server, sleep=sleep, max_retries=3, backoff_s=0.004, backoff_max_s=1.0)
    done = model.complete_metered(build_prompt(TEXT))
    assert done.value == EXPECTED and done.requests == 4
    assert len(sleep.delays) == 3
    for n, delay in enumerate(sleep.delays):  # equal jitter: between half and all of base * 2^n
        assert 0.004 * 2**n * 0.5 <= delay <= 0.004 * 2**n


def test_timeout_then_success(
    scripted_llm_factory: Callable[..., ScriptedLLM], chat_config: Callable[..., Any]
) -> None:
    server = scripted_llm_factory(responders={OP: sentences_responder}, timeout_sleep_s=2.0)
    server.fail_next("timeout", 1, operation=OP)
    model = adapter(chat_config, server, timeout_s=0.3)
    start = time.perf_counter()
    done = model.complete_metered(build_prompt(TEXT))
    assert done.value == EXPECTED and done.requests == 2
    assert time.perf_counter() - start < 1.5  # the client gave up at its timeout, not the server's sleep
    assert [r.fault for r in server.requests] == ["timeout", None]


def test_retries_exhausted_raise_transport_error(server: ScriptedLLM, chat_config: Callable[..., Any]) -> None:
    server.fail_next("server_error", 10)
    model = adapter(chat_config, server, max_retries=2)
    prompt = build_prompt(TEXT)
    with pytest.raises(LLMTransportError) as info:
        model.complete(prompt)
    assert info.value.operation == OP and info.value.input_ref == prompt.input_ref
    assert "HTTP 500" in str(info.value) and "3 time(s)" in str(info.value)
    assert len(server.requests) == 3


def test_connection_refused_is_transient_then_transport_error(
    scripted_llm_factory: Callable[..., ScriptedLLM], chat_config: Callable[..., Any]
) -> None:
    server = scripted_llm_factory()
    server.stop()  # nothing listens on the port any more
    model = adapter(chat_config, server, max_retries=1)
    with pytest.raises(LLMTransportError, match="2 time"):
        model.complete(build_prompt(TEXT))


def test_non_transient_400_raises_at_once(server: ScriptedLLM, chat_config: Callable[..., Any]) -> None:
    prompt = Prompt("no_such_operation", "t1", build_prompt(TEXT).messages, Sentences, "nothing")
    model = adapter(chat_config, server, max_retries=5)
    with pytest.raises(LLMRequestRejectedError) as info:
        model.complete(prompt)
    assert info.value.status_code == 400
    assert "no scripted responder" in str(info.value) and "no_such_operation" in str(info.value)
    assert len(server.requests) == 1


def test_api_key_never_in_errors_or_logs(
    server: ScriptedLLM, chat_config: Callable[..., Any], caplog: pytest.LogCaptureFixture
) -> None:
    server.fail_next("unauthorized", 1)
    model = adapter(chat_config, server)
    caplog.set_level(logging.DEBUG)
    with pytest.raises(LLMRequestRejectedError) as info:
        model.complete(build_prompt(TEXT))
    [req] = server.requests
    assert req.error is not None and TEST_API_KEY in req.error  # the server did quote it back
    assert info.value.status_code == 401
    chain: BaseException | None = info.value
    while chain is not None:
        assert TEST_API_KEY not in str(chain) and TEST_API_KEY not in repr(chain)
        chain = chain.__cause__ or chain.__context__
    assert TEST_API_KEY not in caplog.text
    assert TEST_API_KEY not in repr(model.config)

    server.fail_next("server_error", 10)
    with pytest.raises(LLMTransportError) as transport:
        adapter(chat_config, server, max_retries=1).complete(build_prompt(TEXT))
    assert TEST_API_KEY not in str(transport.value)
    assert TEST_API_KEY not in caplog.text


def test_missing_usage_is_estimated_not_fatal(
    scripted_llm_factory: Callable[..., ScriptedLLM], chat_config: Callable[..., Any]
) -> None:
    server = scripted_llm_factory(responders={OP: sentences_responder}, omit_usage=True)
    ledger = InMemoryUsageLedger()
    cached = CachedChatModel(adapter(chat_config, server), cache=None, ledger=ledger, run_id="r")
    assert cached.complete(build_prompt(TEXT)) == EXPECTED
    [req] = server.requests
    assert req.usage is None
    [row] = ledger.records
    assert row.usage_estimated
    assert req.content is not None
    assert row.completion_tokens == len(req.content) // 4 > 0  # ~4 characters per token
    assert row.prompt_tokens == sum(len(m["content"]) for m in req.body["messages"]) // 4 > 0


def test_config_from_settings_takes_the_role_endpoint() -> None:
    settings = load_settings(
        llm_base_url="http://shared/v1",
        llm_model="shared-model",
        llm_answer_model="answer-model",
        llm_max_retries=2,
        llm_structured_mode="json_object",
    )
    build = ChatConfig.from_settings(settings, "build")
    answer = ChatConfig.from_settings(settings, "answer")
    assert (build.base_url, build.model, build.max_retries, build.structured_mode) == (
        "http://shared/v1",
        "shared-model",
        2,
        "json_object",
    )
    assert answer.model == "answer-model"


# --- caching and the ledger ------------------------------------------------------------------------


def test_cache_hit_sends_no_request_and_is_recorded(server: ScriptedLLM, chat_config: Callable[..., Any]) -> None:
    ledger = InMemoryUsageLedger()
    cached = CachedChatModel(adapter(chat_config, server), cache=InMemoryResponseCache(), ledger=ledger, run_id="run-1")
    assert cached.complete(build_prompt(TEXT)) == EXPECTED
    assert cached.complete(build_prompt(TEXT)) == EXPECTED
    assert len(server.requests) == 1
    miss, hit = ledger.records
    assert (miss.cache_hit, miss.attempts) == (False, 1)
    assert (hit.cache_hit, hit.attempts, hit.prompt_tokens, hit.completion_tokens) == (True, 0, 0, 0)
    summary = ledger.summary("run-1")
    assert summary[OP].calls == 2 and summary[OP].cache_hits == 1 and summary[OP].requests == 1
    assert ledger.summary("other-run") == {}


def test_duck_cache_survives_reopening(
    server: ScriptedLLM, chat_config: Callable[..., Any], tmp_path: Path
) -> None:
    con = connect(tmp_path)
    first = CachedChatModel(
        adapter(chat_config, server), cache=DuckResponseCache(con), ledger=DuckUsageLedger(con), run_id="build-1"
    )
    assert first.complete(build_prompt(TEXT)) == EXPECTED
    con.close()
    con = connect(tmp_path)
    again = CachedChatModel(
        adapter(chat_config, server), cache=DuckResponseCache(con), ledger=DuckUsageLedger(con), run_id="build-2"
    )
    assert again.complete(build_prompt(TEXT)) == EXPECTED
    assert len(server.requests) == 1  # the resumed build made no call
    ledger = DuckUsageLedger(con)
    assert ledger.summary("build-2")[OP].cache_hits == 1
    assert ledger.summary("build-1")[OP].cache_hits == 0
    con.close()


def test_ledger_tokens_match_server_usage(
    server: ScriptedLLM, chat_config: Callable[..., Any], tmp_path: Path
) -> None:
    server.fail_next("invalid", 1, operation=OP)  # one repair: two answers to pay for
    con = connect(tmp_path)
    ledger = DuckUsageLedger(con)
    cached = CachedChatModel(adapter(chat_config, server), cache=DuckResponseCache(con), ledger=ledger, run_id="r")
    for text in (TEXT, "One. Two.", "Solo."):
        cached.complete(build_prompt(text))
    sent = [r.usage for r in server.requests if r.usage]
    summary = ledger.summary("r")[OP]
    assert summary.calls == 3 and summary.requests == 4 and summary.cache_hits == 0
    assert summary.prompt_tokens == sum(u["prompt_tokens"] for u in sent)
    assert summary.completion_tokens == sum(u["completion_tokens"] for u in sent)
    assert summary.latency_ms > 0
    assert total_usage(ledger.summary("r")).prompt_tokens == summary.prompt_tokens
    con.close()


def test_concurrent_calls_share_cache_and_ledger(
    scripted_llm_factory: Callable[..., ScriptedLLM], chat_config: Callable[..., Any], tmp_path: Path
) -> None:
    server = scripted_llm_factory(responders={OP: sentences_responder}, latency_ms=5)
    con = connect(tmp_path)
    ledger = DuckUsageLedger(con)
    cache = DuckResponseCache(con)
    cached = CachedChatModel(adapter(chat_config, server), cache=cache, ledger=ledger, run_id="par")
    texts = [f"Fact {i} about topic {i % 7}. Another line {i}." for i in range(24)]
    work = [text for text in texts for _ in range(2)]  # each prompt twice, side by side: same key in flight

    def call(text: str) -> Sentences:
        return cached.complete(build_prompt(text))

    with ThreadPoolExecutor(max_workers=8) as pool:
        results = list(pool.map(call, work))
    assert results == [Sentences(sentences=split(t), count=len(split(t))) for t in work]
    summary = ledger.summary("par")[OP]
    assert summary.calls == len(work)
    assert summary.calls - summary.cache_hits == len(texts)  # each distinct prompt paid once
    assert len(server.requests) == len(texts)
    assert cache.count() == len(texts)
    con.close()


def test_endpoint_reachable_tells_a_live_server_from_a_closed_port(scripted_llm, chat_config) -> None:
    import socket

    from pydantic import SecretStr

    from tmem.providers.openai_chat import endpoint_reachable

    assert endpoint_reachable(chat_config(scripted_llm), timeout_s=2.0)
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        closed_port = sock.getsockname()[1]
    closed = ChatConfig(base_url=f"http://127.0.0.1:{closed_port}/v1", api_key=SecretStr("k"), model="m")
    assert not endpoint_reachable(closed, timeout_s=2.0)


def test_a_reply_that_is_not_a_chat_completion_is_rejected_by_name(chat_config: Callable[..., Any]) -> None:
    """A 200 whose body is not a JSON object (a proxy's HTML page) is a rejection naming the operation,
    not an empty answer and not a retry."""
    from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
    from types import SimpleNamespace

    seen: list[str] = []

    class Page(BaseHTTPRequestHandler):
        def do_POST(self) -> None:
            seen.append(self.path)
            self.rfile.read(int(self.headers["Content-Length"]))
            body = b"<html>maintenance</html>"
            self.send_response(200)
            self.send_header("Content-Type", "text/html")
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

        def log_message(self, *args: Any) -> None:
            pass

    page = ThreadingHTTPServer(("127.0.0.1", 0), Page)
    threading.Thread(target=page.serve_forever, daemon=True).start()
    try:
        url = f"http://127.0.0.1:{page.server_address[1]}/v1"
        model = OpenAIChatModel(chat_config(SimpleNamespace(url=url), max_retries=3))
        with pytest.raises(LLMRequestRejectedError, match="other than a chat completion") as info:
            model.complete(build_prompt(TEXT))
    finally:
        page.shutdown()
    assert info.value.operation == OP and "maintenance" in str(info.value) and seen == ["/v1/chat/completions"]

"""The Batch API path (issue 7, point 6): the real openai client's files/batches resources, through
BatchingChatModel under CachedChatModel, against the scripted server's batch endpoints."""

from __future__ import annotations

import json
import threading
import time
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import pytest
from pydantic import BaseModel, ValidationError

from tests.conftest import TEST_API_KEY
from tmem.devtools.responders import request_input
from tmem.devtools.scripted_llm import ScriptedLLM
from tmem.errors import BatchEndpointError, BatchFormatError, LLMRequestRejectedError, LLMTransportError
from tmem.llm.batching import BatchConfig, BatchingChatModel
from tmem.llm.response_cache import CachedChatModel, InMemoryResponseCache
from tmem.llm.usage import InMemoryUsageLedger
from tmem.pricing import cost_markdown, estimate_cost, price_table
from tmem.prompts.base import Message, Prompt, render_input
from tmem.providers.openai_batch import BatchClient, parse_results
from tmem.providers.openai_chat import ChatConfig, OpenAIChatModel
from tmem.settings import load_settings
from tmem.store.batch_journal import DuckBatchJournal
from tmem.store.duck import connect
from tmem.store.llm_cache import DuckResponseCache, DuckUsageLedger

BATCHED, SERIAL = "test_upper", "test_serial"


class Text(BaseModel):
    text: str


def prompt(op: str, text: str) -> Prompt[Text]:
    return Prompt(op, "t1", (Message("system", "Upper-case the text."), Message("user", render_input(Text(text=text)))),
                  Text, f"text {text!r}")


def upper(operation: str, body: dict[str, Any]) -> str:
    return json.dumps({"text": request_input(body)["text"].upper()})


@pytest.fixture
def server(scripted_llm_factory: Callable[..., ScriptedLLM]) -> ScriptedLLM:
    return scripted_llm_factory(responders={BATCHED: upper, SERIAL: upper}, use_registry=False)


def batching(server: ScriptedLLM, chat_config: Callable[..., ChatConfig], journal: DuckBatchJournal | None = None,
             **knobs: Any) -> BatchingChatModel:
    config = BatchConfig(operations=frozenset({BATCHED}), **({"linger_s": 0.2, "poll_s": 0.02, "poll_max_s": 0.1}
                                                            | knobs))
    client = BatchClient(server.url, TEST_API_KEY, timeout_s=5.0, max_retries=1)
    return BatchingChatModel(OpenAIChatModel(chat_config(server)), client, config, journal=journal)


def ask_all(chat: Any, prompts: list[Prompt[Text]]) -> list[Any]:
    """Ask concurrently, as a stage's tasks do; each outcome is the answer or the raised exception."""
    def one(p: Prompt[Text]) -> Any:
        try:
            return chat.complete(p)
        except Exception as exc:  # noqa: BLE001 - the test inspects it
            return exc
    with ThreadPoolExecutor(len(prompts)) as pool:
        return list(pool.map(one, prompts))


class Uncached:
    """``complete`` straight on the batching layer (no response cache in front of it)."""

    def __init__(self, chat: BatchingChatModel) -> None:
        self.chat = chat

    def complete(self, p: Prompt[Text]) -> Text:
        return self.chat.complete_metered(p).value


def via(server: ScriptedLLM, kind: str, op: str) -> int:
    return sum(1 for r in server.requests if r.via == kind and r.operation == op)


def test_concurrent_batched_calls_share_one_batch_and_each_caller_gets_its_own_answer(
    server: ScriptedLLM, chat_config: Callable[..., ChatConfig]
) -> None:
    ledger = InMemoryUsageLedger()
    chat = CachedChatModel(batching(server, chat_config, linger_s=1.0), cache=InMemoryResponseCache(), ledger=ledger,
                           run_id="r1")
    words = [f"word {n}" for n in range(8)]

    answers = ask_all(chat, [prompt(BATCHED, w) for w in words] + [prompt(SERIAL, "serial")])

    assert [a.text for a in answers] == [w.upper() for w in words] + ["SERIAL"]
    assert len(server.batches.created) == 1 and server.batches.created[0]["request_counts"]["total"] == 8
    assert via(server, "batch", BATCHED) == 8 and via(server, "chat", BATCHED) == 0
    assert via(server, "chat", SERIAL) == 1 and via(server, "batch", SERIAL) == 0
    rows = {r.operation: r for r in ledger.records}
    assert rows[BATCHED].batch and rows[BATCHED].batch_prompt_tokens == rows[BATCHED].prompt_tokens > 0
    assert not rows[SERIAL].batch and rows[SERIAL].batch_prompt_tokens == 0


def test_calls_waiting_on_a_batch_hold_no_slot_of_the_builds_llm_concurrency(
    scripted_llm_factory: Callable[..., ScriptedLLM], tmp_path: Path
) -> None:
    """The build's chat model (``chat_model_for``) with one call in flight allowed: three persona calls
    wait on a batch the server holds, and a synchronous call still goes through at once."""
    from tmem.bundle import chat_model_for

    server = scripted_llm_factory(responders={"persona": upper, SERIAL: upper}, use_registry=False)
    settings = load_settings(store=tmp_path, llm_base_url=server.url, llm_api_key=TEST_API_KEY, llm_batch="on",
                             llm_batch_stages="persona", llm_concurrency=1, llm_batch_linger_s=0.05,
                             llm_batch_poll_s=0.02, llm_batch_poll_max_s=0.05, llm_backoff_s=0.001)
    con = connect(tmp_path)
    try:
        chat = chat_model_for(settings, "build", con, "r1")
        server.batches.hold()
        with ThreadPoolExecutor(3) as pool:
            waiting = [pool.submit(chat.complete, prompt("persona", f"w{n}")) for n in range(3)]
            deadline = time.monotonic() + 30
            while not server.batches.created and time.monotonic() < deadline:
                time.sleep(0.02)
            assert server.batches.created, "the persona calls never went into a batch"
            assert chat.complete(prompt(SERIAL, "serial")).text == "SERIAL"
            assert not any(f.done() for f in waiting)  # still waiting on the held batch, holding no slot
            server.batches.hold(False)
            assert [f.result(timeout=30).text for f in waiting] == ["W0", "W1", "W2"]
    finally:
        con.close()
    assert via(server, "batch", "persona") == 3 and via(server, "chat", SERIAL) == 1


def test_cached_requests_never_go_into_a_batch_and_max_size_cuts_batches(
    server: ScriptedLLM, chat_config: Callable[..., ChatConfig]
) -> None:
    cache = InMemoryResponseCache()
    inner = batching(server, chat_config, max_size=3, linger_s=5.0)
    chat = CachedChatModel(inner, cache=cache, ledger=None, run_id="r1")
    prompts = [prompt(BATCHED, f"w{n}") for n in range(6)]
    started = time.monotonic()
    ask_all(chat, prompts)
    # Full batches go at once: two of three, long before the 5 s linger.
    assert [b["request_counts"]["total"] for b in server.batches.created] == [3, 3]
    assert time.monotonic() - started < 4.0

    later = batching(server, chat_config)  # a later run, same cache
    again = ask_all(CachedChatModel(later, cache=cache, ledger=None, run_id="r2"), [*prompts, prompt(BATCHED, "new")])

    assert [a.text for a in again] == [f"W{n}" for n in range(6)] + ["NEW"]
    assert [b["request_counts"]["total"] for b in server.batches.created] == [3, 3, 1]  # only the uncached one


def test_per_line_errors_raise_the_typed_errors_of_the_sync_path_and_spare_the_other_lines(
    server: ScriptedLLM, chat_config: Callable[..., ChatConfig]
) -> None:
    chat = CachedChatModel(batching(server, chat_config, linger_s=1.0), cache=InMemoryResponseCache(), ledger=None,
                           run_id="r")
    server.batches.fail_lines(1, status=500)
    server.batches.fail_lines(1, status=400, message="bad request body")

    words = [f"w{n}" for n in range(4)]
    outcomes = ask_all(chat, [prompt(BATCHED, w) for w in words])

    errors = [o for o in outcomes if isinstance(o, Exception)]
    answered = [(w, o.text) for w, o in zip(words, outcomes, strict=True) if not isinstance(o, Exception)]
    assert [text for _, text in answered] == [w.upper() for w, _ in answered]
    assert len(errors) == 2 and len(server.batches.created) == 1
    batch = server.batches.created[0]
    assert batch["output_file_id"] and batch["error_file_id"]
    assert server.batches.file_ids == []  # input, output and error files deleted once collected
    transport = [e for e in errors if isinstance(e, LLMTransportError)]
    rejected = [e for e in errors if isinstance(e, LLMRequestRejectedError)]
    assert len(transport) == len(rejected) == 1
    assert rejected[0].status_code == 400 and "bad request body" in str(rejected[0])
    assert transport[0].operation == BATCHED and "HTTP 500" in str(transport[0])
    assert server.batches.created[0]["id"] in str(transport[0])


def test_a_schema_invalid_batch_answer_is_repaired_synchronously(
    server: ScriptedLLM, chat_config: Callable[..., ChatConfig]
) -> None:
    ledger = InMemoryUsageLedger()
    chat = CachedChatModel(batching(server, chat_config), cache=InMemoryResponseCache(), ledger=ledger, run_id="r")
    server.fail_next("invalid", operation=BATCHED)  # the batch line answers JSON that breaks the schema

    assert chat.complete(prompt(BATCHED, "fix me")).text == "FIX ME"

    assert via(server, "batch", BATCHED) == 1 and via(server, "chat", BATCHED) == 1  # the repair re-ask
    [row] = ledger.records
    assert row.batch and row.attempts == 2
    assert 0 < row.batch_prompt_tokens < row.prompt_tokens  # the repair is billed at the sync price


@pytest.fixture
def store(tmp_path: Path) -> Iterator[Path]:
    yield tmp_path / "store"


def test_a_run_killed_with_a_batch_in_flight_reattaches_instead_of_resubmitting(
    server: ScriptedLLM, chat_config: Callable[..., ChatConfig], store: Path
) -> None:
    words = [f"w{n}" for n in range(5)]
    server.batches.hold()
    con = connect(store)
    first = batching(server, chat_config, journal=DuckBatchJournal(con))
    cached = CachedChatModel(first, cache=DuckResponseCache(con), ledger=DuckUsageLedger(con), run_id="run-1")
    asking = threading.Thread(target=ask_all, args=(cached, [prompt(BATCHED, w) for w in words]))
    asking.start()
    deadline = time.monotonic() + 10
    while not server.batches.created and time.monotonic() < deadline:
        time.sleep(0.02)
    assert len(server.batches.created) == 1
    first.close()  # the process "dies": callers stop waiting, the batch stays in flight at the provider
    asking.join(timeout=10)
    con.close()

    server.batches.hold(False)
    con = connect(store)
    journal = DuckBatchJournal(con)
    second = CachedChatModel(batching(server, chat_config, journal=journal), cache=DuckResponseCache(con),
                             ledger=DuckUsageLedger(con), run_id="run-2")
    answers = ask_all(second, [prompt(BATCHED, w) for w in [*words, "fresh"]])

    assert [a.text for a in answers] == [w.upper() for w in [*words, "fresh"]]
    batches = server.batches.created
    assert len(batches) == 2 and batches[1]["request_counts"]["total"] == 1  # only "fresh" was sent again
    assert via(server, "batch", BATCHED) == 6
    assert [(status, n) for _, status, n in journal.batches()] == [("collected", 5), ("collected", 1)]
    con.close()


def test_answers_of_a_reattached_batch_reach_requests_made_after_it_was_collected(
    server: ScriptedLLM, chat_config: Callable[..., ChatConfig], store: Path
) -> None:
    """The next run may reach a dead run's requests one by one: the first re-attaches and the batch
    is collected before the others are asked. Their answers were collected too, so they are not
    sent (and paid for) again — and each answer is handed out once: a later re-ask is a new request."""
    words = [f"w{n}" for n in range(4)]
    server.batches.hold()
    con = connect(store)
    first = batching(server, chat_config, journal=DuckBatchJournal(con))
    asking = threading.Thread(target=ask_all, args=(Uncached(first), [prompt(BATCHED, w) for w in words]))
    asking.start()
    deadline = time.monotonic() + 10
    while not server.batches.created and time.monotonic() < deadline:
        time.sleep(0.02)
    assert len(server.batches.created) == 1
    first.close()
    asking.join(timeout=10)
    con.close()

    server.batches.hold(False)
    con = connect(store)
    journal = DuckBatchJournal(con)
    second = batching(server, chat_config, journal=journal)  # no response cache: only the batch layer answers
    assert second.complete_metered(prompt(BATCHED, words[0])).value.text == "W0"  # re-attached, then collected
    assert [(status, n) for _, status, n in journal.batches()] == [("collected", 4)]
    later = ask_all(Uncached(second), [prompt(BATCHED, w) for w in words[1:]])
    assert [a.text for a in later] == ["W1", "W2", "W3"]
    assert len(server.batches.created) == 1  # nothing was sent again
    assert via(server, "batch", BATCHED) == 4
    assert second.complete_metered(prompt(BATCHED, words[1])).value.text == "W1"
    assert len(server.batches.created) == 2  # each collected answer is handed out once: this is a new request
    second.close()
    con.close()


def test_scripted_batches_report_in_progress_then_complete(
    scripted_llm_factory: Callable[..., ScriptedLLM], chat_config: Callable[..., ChatConfig]
) -> None:
    server = scripted_llm_factory(responders={BATCHED: upper}, use_registry=False, batch_in_progress_polls=3)
    chat = batching(server, chat_config, linger_s=0.0)
    assert chat.complete_metered(prompt(BATCHED, "slow")).value.text == "SLOW"
    [batch] = server.batches.created
    assert batch["status"] == "completed" and batch["output_file_id"] and batch["error_file_id"] is None


def test_result_files_that_are_not_batch_jsonl_name_the_file_and_line() -> None:
    ok = {"custom_id": "a.1", "response": {"status_code": 200, "body": {"choices": [{"message": {"content": "{}"}}]}}}
    with pytest.raises(BatchFormatError, match="file file-9 line 2"):
        parse_results(json.dumps(ok) + "\n{not json\n", "file-9")
    expired = {"custom_id": "a.2", "response": None, "error": {"code": "batch_expired", "message": "expired"}}
    [result] = parse_results(json.dumps(expired), "file-9").values()
    assert result.status_code is None and "batch_expired" in result.error


def test_batch_stages_must_be_off_the_serial_path(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("TMEM_LLM_BATCH", "on")
    assert load_settings().batch_operations == {"item_extract", "item_triggers", "scene_triggers", "persona"}
    monkeypatch.setenv("TMEM_LLM_BATCH_STAGES", "persona,topic_match")
    with pytest.raises(ValidationError, match="topic_match"):
        load_settings()
    monkeypatch.setenv("TMEM_LLM_BATCH", "off")
    monkeypatch.setenv("TMEM_LLM_BATCH_STAGES", "persona")
    assert load_settings().batch_operations == frozenset()


def test_batch_tokens_are_priced_at_half_the_list_price() -> None:
    table = price_table({"m": {"input": 2.0, "output": 8.0}})
    full = estimate_cost("m", 3_000_000, 1_000_000, table)
    mixed = estimate_cost("m", 3_000_000, 1_000_000, table, batch_prompt_tokens=2_000_000,
                          batch_completion_tokens=1_000_000)
    assert full == pytest.approx(6.0 + 8.0)
    assert mixed == pytest.approx(2.0 + 0.5 * (4.0 + 8.0))
    assert estimate_cost("unpriced", 10, 10, table, batch_prompt_tokens=10) is None
    with pytest.raises(ValueError, match="part of the total"):
        estimate_cost("m", 10, 10, table, batch_prompt_tokens=11)
    report = cost_markdown("m", 3_000_000, 1_000_000, table, batch_prompt_tokens=2_000_000,
                           batch_completion_tokens=1_000_000)
    assert "$8.0000" in report and "Batch API" in report


def test_batch_endpoint_errors_are_typed_and_never_quote_the_api_key(server: ScriptedLLM) -> None:
    client = BatchClient(server.url, TEST_API_KEY, timeout_s=5.0, max_retries=0)
    # The server's 404 quotes the requested id back, which here contains the key.
    with pytest.raises(BatchEndpointError, match="status of batch") as caught:
        client.retrieve(f"batch-{TEST_API_KEY}")
    assert TEST_API_KEY not in str(caught.value) and "***" in str(caught.value)
    assert caught.value.__cause__ is None


def test_tmem_build_refuses_batching_with_the_embedded_model(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    import io

    from tmem.cli import run as cli_run
    from tmem.cli.base import CliContext

    monkeypatch.setenv("TMEM_LLM_BATCH", "on")
    monkeypatch.setenv("TMEM_LLM_PROVIDER", "local")
    out, err = io.StringIO(), io.StringIO()
    assert cli_run(["build", "--store", str(tmp_path / "store")], CliContext(stdout=out, stderr=err)) == 2
    assert "TMEM_LLM_BATCH=on needs" in err.getvalue() and out.getvalue() == ""
    assert not (tmp_path / "store").exists()  # nothing written

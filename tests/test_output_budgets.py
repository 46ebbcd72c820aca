"""Per-operation output budgets and truncation through the real openai client (issue 13, point 3).

The scripted server runs with ``enforce_max_tokens``: an answer longer than the request's
``max_tokens`` (4 characters a token) is cut there with ``finish_reason == "length"``, as a hosted
model (and the model bridge) does. The old adapter sent one 2,048-token cap for everything and
"repaired" a cut answer by re-asking the same request.
"""

from __future__ import annotations

import importlib
import json
import pkgutil
import random
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
from pydantic import BaseModel, Field, ValidationError

import tmem.prompts
from tests.fakes import dialogue
from tmem.devtools.responders import request_input, sequence_responder
from tmem.devtools.scripted_llm import ScriptedLLM
from tmem.errors import LLMOutputError, LLMTruncatedError
from tmem.llm.response_cache import CachedChatModel, InMemoryResponseCache
from tmem.llm.usage import InMemoryUsageLedger
from tmem.ports import TokenUsage
from tmem.prompts import persona as persona_prompt
from tmem.prompts.base import Message, Prompt, render_input
from tmem.prompts.budgets import DEFAULT_BUDGETS, FALLBACK_BUDGET, budget_for
from tmem.prompts.common import dialogue_blocks
from tmem.providers.llama_cpp import local_profile_env
from tmem.providers.openai_batch import parse_result_line
from tmem.providers.openai_chat import ChatConfig, OpenAIChatModel
from tmem.settings import Settings, load_settings
from tmem.store.duck import connect
from tmem.store.llm_cache import DuckUsageLedger

OP = "test_words"


class WordsInput(BaseModel):
    text: str


class Words(BaseModel):
    words: list[str] = Field(description="Every word of the text.")


def prompt(text: str, max_tokens: int | None = None, operation: str = OP, reask: bool = False) -> Prompt[Words]:
    return Prompt(operation, "t1", (Message("system", "List the words."),
                                     Message("user", "Text:\n" + render_input(WordsInput(text=text)))),
                  Words, f"text of {len(text)} characters", max_tokens=max_tokens, checked_reask=reask)


def words_responder(operation: str, body: dict[str, Any]) -> str:
    return json.dumps({"words": request_input(body)["text"].split()})


LONG = " ".join(f"word{n:04d}" for n in range(200))  # ~2,600 characters of answer: ~650 tokens


@pytest.fixture
def server(scripted_llm_factory: Callable[..., ScriptedLLM]) -> ScriptedLLM:
    return scripted_llm_factory(responders={op: words_responder for op in (OP, "persona", "item_extract")},
                                enforce_max_tokens=True)


def adapter(chat_config: Callable[..., Any], server: ScriptedLLM, **overrides: Any) -> OpenAIChatModel:
    return OpenAIChatModel(chat_config(server, **overrides), rng=random.Random(3))


def test_every_prompt_module_has_a_budget_and_assemble_puts_it_on_the_prompt() -> None:
    names = [m.name for m in pkgutil.iter_modules(tmem.prompts.__path__) if m.name not in {"base", "common", "budgets", "operations"}]
    operations = {importlib.import_module(f"tmem.prompts.{n}").OPERATION for n in names}
    assert operations == set(DEFAULT_BUDGETS)
    assert DEFAULT_BUDGETS["item_extract"] == 4096 > 2048  # the cap whole-conversation answers ran past
    assert budget_for("an_unmeasured_operation") == FALLBACK_BUDGET
    payload = persona_prompt.PersonaInput(conversation_id="c", speaker="Ana", turns=dialogue_blocks(dialogue()[:2]))
    built = persona_prompt.build(payload)
    assert (built.max_tokens, built.checked_reask) == (DEFAULT_BUDGETS["persona"], False)
    reasked = persona_prompt.build(payload, feedback="the profile is empty")
    assert reasked.checked_reask
    # A budget is no part of the cache key: a valid answer is valid whatever the cap.
    assert prompt("a b", max_tokens=64).cache_key("m") == prompt("a b", max_tokens=4096).cache_key("m")


def test_each_request_carries_its_operations_budget_overrides_and_the_ceiling(
    server: ScriptedLLM, chat_config: Callable[..., Any]
) -> None:
    adapter(chat_config, server).complete(prompt("a b", max_tokens=3072))
    adapter(chat_config, server).complete(prompt("a b"))  # no budget on the prompt: the fallback
    adapter(chat_config, server, output_budgets=(("persona", 5000),)).complete(
        prompt("a b", max_tokens=3072, operation="persona"))
    adapter(chat_config, server, max_tokens=640).complete(prompt("a b", max_tokens=3072))  # the ceiling
    adapter(chat_config, server, max_tokens=640, output_budgets=(("item_extract", 6000),)).complete(
        prompt("a b", max_tokens=4096, operation="item_extract"))
    assert [r.body["max_tokens"] for r in server.requests] == [3072, FALLBACK_BUDGET, 5000, 640, 640]


def test_an_answer_cut_at_max_tokens_raises_truncated_at_once_and_is_recorded_not_cached(
    server: ScriptedLLM, chat_config: Callable[..., Any]
) -> None:
    cache, ledger = InMemoryResponseCache(), InMemoryUsageLedger()
    chat = CachedChatModel(adapter(chat_config, server, repair_attempts=2), cache=cache, ledger=ledger, run_id="r1")
    cut = prompt(LONG, max_tokens=100)
    with pytest.raises(LLMTruncatedError) as info:
        chat.complete(cut)
    [request] = server.requests  # no repair re-ask of a cut answer
    assert request.body["max_tokens"] == 100 and request.content is not None and len(request.content) == 400
    err = info.value
    assert isinstance(err, LLMOutputError) and (err.operation, err.input_ref, err.max_tokens) == (
        OP, cut.input_ref, 100)
    assert "budget of 100 tokens" in err.reason and err.raw_output == request.content
    assert err.input_digest == cut.input_digest() and err.input_excerpt == cut.input_excerpt()
    [row] = ledger.records
    assert (row.truncated, row.output_error, row.cache_hit, row.attempts, row.repairs) == (True, True, False, 1, 0)
    assert row.completion_tokens == 100  # what the cut answer cost
    assert cache.entries == {}
    # The same prompt with a budget that fits: one request, valid, cached; then any budget hits the cache.
    assert chat.complete(prompt(LONG, max_tokens=1000)).words == LONG.split()
    assert chat.complete(prompt(LONG, max_tokens=100)).words == LONG.split()
    assert len(server.requests) == 2
    summary = ledger.summary("r1")[OP]
    assert (summary.calls, summary.cache_hits, summary.truncations, summary.output_errors) == (3, 1, 1, 1)


def test_repairs_checked_reasks_and_truncations_are_queryable_per_run_and_operation(
    scripted_llm_factory: Callable[..., ScriptedLLM], chat_config: Callable[..., Any], tmp_path: Path
) -> None:
    bad, good = json.dumps({"words": "not a list"}), json.dumps({"words": ["ok"]})
    server = scripted_llm_factory(responders={OP: sequence_responder(bad, good, good, LONG)}, enforce_max_tokens=True)
    con = connect(tmp_path / "store")
    try:
        chat = CachedChatModel(adapter(chat_config, server), cache=None, ledger=DuckUsageLedger(con), run_id="r9")
        chat.complete(prompt("x"))  # invalid, repaired: 2 requests, 1 repair
        chat.complete(prompt("y", reask=True))  # a construction stage's checked re-ask
        with pytest.raises(LLMTruncatedError):
            chat.complete(prompt("z", max_tokens=64))  # the long answer, cut
        summary = DuckUsageLedger(con).summary("r9")[OP]
        assert (summary.calls, summary.requests, summary.repairs, summary.checked_reasks, summary.truncations,
                summary.output_errors) == (3, 4, 1, 1, 1, 1)
        rows = con.execute("SELECT repairs, checked_reask, truncated, output_error FROM llm_usage WHERE run_id = 'r9' "
                           "ORDER BY recorded_at").fetchall()
        assert rows == [(1, False, False, False), (0, True, False, False), (0, False, True, True)]
    finally:
        con.close()


def test_a_batch_line_cut_at_max_tokens_raises_truncated_without_a_request(
    server: ScriptedLLM, chat_config: Callable[..., Any]
) -> None:
    body = {"choices": [{"message": {"content": '{"words": ["a", "b'}, "finish_reason": "length"}],
            "usage": {"prompt_tokens": 10, "completion_tokens": 8}}
    line = parse_result_line(json.dumps({"custom_id": "c1", "response": {"status_code": 200, "body": body}}), "f:1")
    assert line.finish_reason == "length"
    model = adapter(chat_config, server)
    with pytest.raises(LLMTruncatedError) as info:
        model.complete_metered(prompt("a b", max_tokens=8), (line.content, line.usage or TokenUsage(), line.finish_reason))
    assert server.requests == [] and info.value.spend is not None and info.value.spend.completion_tokens == 8


def test_output_budget_settings_are_validated_and_reach_the_adapter(monkeypatch: pytest.MonkeyPatch) -> None:
    for name in ("TMEM_LLM_MAX_TOKENS", "TMEM_LLM_OUTPUT_BUDGETS"):
        monkeypatch.delenv(name, raising=False)
    plain = load_settings()
    assert plain.llm_max_tokens is None and plain.output_budgets == {}
    monkeypatch.setenv("TMEM_LLM_OUTPUT_BUDGETS", "item_extract=6000, persona=2000")
    monkeypatch.setenv("TMEM_LLM_MAX_TOKENS", "5000")
    config = ChatConfig.from_settings(load_settings(), "build")
    assert (config.max_tokens, dict(config.output_budgets)) == (5000, {"item_extract": 6000, "persona": 2000})
    assert config.max_tokens_for(prompt("a", max_tokens=4096, operation="item_extract")) == 5000
    assert config.max_tokens_for(prompt("a", max_tokens=3072, operation="persona")) == 2000
    for bad, says in [("item_extrac=6000", "unknown operation 'item_extrac'"), ("persona", "not operation=tokens"),
                      ("persona=lots", "not a whole number"), ("persona=10", "below the minimum"),
                      ("persona=100,persona=200", "given twice")]:
        monkeypatch.setenv("TMEM_LLM_OUTPUT_BUDGETS", bad)
        with pytest.raises(ValidationError, match="TMEM_LLM_OUTPUT_BUDGETS") as caught:
            load_settings()
        assert says in str(caught.value)
    # The embedded local model's profile still caps every operation at 640 tokens.
    monkeypatch.delenv("TMEM_LLM_OUTPUT_BUDGETS")
    monkeypatch.delenv("TMEM_LLM_MAX_TOKENS")
    profile = local_profile_env(Settings())
    assert profile["TMEM_LLM_MAX_TOKENS"] == "640"
    monkeypatch.setenv("TMEM_LLM_MAX_TOKENS", profile["TMEM_LLM_MAX_TOKENS"])
    local = ChatConfig.from_settings(load_settings(), "build")
    assert {local.max_tokens_for(prompt("a", max_tokens=b, operation=op)) for op, b in DEFAULT_BUDGETS.items()} == {640}

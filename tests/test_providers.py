"""A provider that is not OpenAI-compatible is one module plus one registration
(tmem/providers/registry.py): here a toy chat adapter and a toy embedder, registered by a test,
serve the chat model and the embedder the edge builds — under the same call layer (response
cache, usage ledger, in-flight bound, embedding cache) as the built-in providers."""

from __future__ import annotations

import hashlib
import json
from collections.abc import Iterator
from typing import TypeVar

import numpy as np
import numpy.typing as npt
import pytest
from pydantic import BaseModel

from tmem.bundle import chat_model_for, embedder_for
from tmem.errors import ConfigError
from tmem.llm.bounded import BoundedChatModel
from tmem.ports import Completion, TokenUsage
from tmem.prompts.base import Message, Prompt, parse_input, render_input
from tmem.providers import registry
from tmem.settings import Role, Settings, load_settings
from tmem.store.duck import connect
from tmem.store.llm_cache import DuckUsageLedger

R = TypeVar("R", bound=BaseModel)
OP = "toy_upper"


class Text(BaseModel):
    text: str


def prompt(text: str) -> Prompt[Text]:
    return Prompt(OP, "t1", (Message("system", "Upper-case the text."), Message("user", render_input(Text(text=text)))),
                  Text, f"text {text!r}")


class UpperCaseAdapter:
    """A chat adapter that speaks no HTTP at all: it upper-cases the input and reports what it cost."""

    def __init__(self, settings: Settings, role: Role) -> None:
        self._model = f"toy-{settings.endpoint(role).model}"
        self.calls: list[str] = []

    @property
    def model_name(self) -> str:
        return self._model

    def complete_metered(self, prompt: Prompt[R]) -> Completion[R]:
        self.calls.append(prompt.operation)
        data = parse_input(prompt.messages[-1].content)
        value = prompt.response_model.model_validate_json(json.dumps({"text": data["text"].upper()}))
        return Completion(value, TokenUsage(prompt_tokens=3, completion_tokens=2), requests=1)


class HashEmbedder:
    """Vectors from a hash of the text: deterministic, unit length, no model."""

    def __init__(self) -> None:
        self.texts: list[str] = []

    model_name = "toy-hash"
    dim = 8
    max_input_tokens = None

    def embed(self, texts: list[str]) -> npt.NDArray[np.float32]:
        self.texts += texts
        rows = [np.frombuffer(hashlib.sha256(t.encode()).digest()[: self.dim], dtype=np.uint8) for t in texts]
        out = np.array(rows, dtype=np.float32).reshape(len(texts), self.dim) + 1.0
        return (out / np.linalg.norm(out, axis=1, keepdims=True)).astype(np.float32)


@pytest.fixture
def toy(monkeypatch: pytest.MonkeyPatch) -> Iterator[dict[str, list]]:
    monkeypatch.setattr(registry, "CHAT_PROVIDERS", dict(registry.CHAT_PROVIDERS))
    monkeypatch.setattr(registry, "EMBEDDING_PROVIDERS", dict(registry.EMBEDDING_PROVIDERS))
    made: dict[str, list] = {"chat": [], "embed": []}

    def adapter(settings: Settings, role: Role) -> UpperCaseAdapter:
        made["chat"].append(UpperCaseAdapter(settings, role))
        return made["chat"][-1]

    def embedder(settings: Settings, threads: int) -> HashEmbedder:
        made["embed"].append(HashEmbedder())
        return made["embed"][-1]

    registry.register_chat_provider("toy", registry.ChatProvider(adapter))
    registry.register_embedding_provider("toy-hash", embedder)
    yield made


def test_a_registered_chat_provider_serves_the_role_under_the_call_layer(tmp_path, toy) -> None:
    settings = load_settings(store=tmp_path, llm_provider="toy", llm_model="m1")
    con = connect(tmp_path)
    chat = chat_model_for(settings, "build", con, "run-1")
    assert isinstance(chat, BoundedChatModel) and chat.model_name == "toy-m1"
    assert chat.complete(prompt("abc")).text == "ABC"
    assert chat.complete(prompt("abc")).text == "ABC"  # answered from the response cache
    [adapter] = toy["chat"]
    assert adapter.calls == [OP]
    usage = DuckUsageLedger(con).summary("run-1")[OP]
    assert (usage.calls, usage.cache_hits, usage.requests, usage.prompt_tokens) == (2, 1, 1, 3)


def test_a_registered_embedder_is_cached_by_content(tmp_path, toy) -> None:
    settings = load_settings(store=tmp_path, embedding_provider="toy-hash")
    embedder = embedder_for(settings, connect(tmp_path))
    first = embedder.embed(["alpha", "beta"])
    again = embedder.embed(["beta", "alpha"])
    assert first.shape == (2, 8) and np.allclose(first[::-1], again)
    [inner] = toy["embed"]
    assert inner.texts == ["alpha", "beta"]


def test_an_unknown_provider_names_its_setting_and_the_known_ones(tmp_path) -> None:
    with pytest.raises(ConfigError, match=r"TMEM_LLM_PROVIDER='nope'.*openai, local"):
        chat_model_for(load_settings(store=tmp_path, llm_provider="nope"), "build", None, "r")
    with pytest.raises(ConfigError, match=r"TMEM_EMBEDDING_PROVIDER='nope'.*sentence-transformers"):
        embedder_for(load_settings(store=tmp_path, embedding_provider="nope"), None)


def test_batching_asks_for_a_provider_with_a_batch_endpoint(tmp_path, toy) -> None:
    settings = load_settings(store=tmp_path, llm_provider="toy", llm_batch="on")
    with pytest.raises(ConfigError, match="has no batch endpoint"):
        chat_model_for(settings, "build", None, "r")

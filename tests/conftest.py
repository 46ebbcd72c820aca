"""Shared fixtures: environment isolation, the scripted LLM server, and a fast chat config."""

from __future__ import annotations

import os
from collections.abc import Callable, Iterator
from typing import TYPE_CHECKING, Any

import pytest
from pydantic import SecretStr

from tmem.devtools.scripted_llm import ScriptedLLM

if TYPE_CHECKING:
    from tmem.providers.openai_chat import ChatConfig

# Process-wide defaults for anything a test may start (HF models, Prefect).
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
os.environ.setdefault("PREFECT_SERVER_ANALYTICS_ENABLED", "false")
os.environ.setdefault("DO_NOT_TRACK", "1")

TEST_API_KEY = "sk-test-0123456789abcdef"


@pytest.fixture(autouse=True)
def _isolated_env(monkeypatch: pytest.MonkeyPatch) -> None:
    """Tests never see the developer's TMEM_* or OPENAI_* variables."""
    for name in list(os.environ):
        if name.startswith(("TMEM_", "OPENAI_")):
            monkeypatch.delenv(name, raising=False)


@pytest.fixture
def scripted_llm_factory() -> Iterator[Callable[..., ScriptedLLM]]:
    """``make(**kwargs) -> ScriptedLLM``: a started server (kwargs as :class:`ScriptedLLM`), stopped after the test."""
    servers: list[ScriptedLLM] = []

    def make(**kwargs: Any) -> ScriptedLLM:
        server = ScriptedLLM(**kwargs).start()
        servers.append(server)
        return server

    yield make
    for server in servers:
        server.stop()


@pytest.fixture
def scripted_llm(scripted_llm_factory: Callable[..., ScriptedLLM]) -> ScriptedLLM:
    """A started server with the registered responders; add more with ``set_responder``."""
    return scripted_llm_factory()


@pytest.fixture
def chat_config() -> Callable[..., ChatConfig]:
    """``make(server, **overrides) -> ChatConfig`` pointing at a scripted server, with tiny delays."""

    from tmem.providers.openai_chat import ChatConfig  # imported here: `import openai` costs ~0.4 s

    def make(server: ScriptedLLM, **overrides: Any) -> ChatConfig:
        knobs: dict[str, Any] = {
            "base_url": server.url,
            "api_key": SecretStr(TEST_API_KEY),
            "model": "scripted-model",
            "timeout_s": 5.0,
            "max_retries": 3,
            "backoff_s": 0.001,
            "backoff_max_s": 0.01,
            "retry_after_cap_s": 1.0,
        }
        knobs.update(overrides)
        return ChatConfig(**knobs)

    return make


@pytest.fixture(scope="session")
def prefect_harness(tmp_path_factory: pytest.TempPathFactory) -> Iterator[None]:
    """One temporary Prefect API (SQLite) for the whole session; Prefect's home in a temp dir."""
    home = tmp_path_factory.mktemp("prefect-home")
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("PREFECT_HOME", str(home))
        mp.setenv("PREFECT_SERVER_ANALYTICS_ENABLED", "false")
        mp.setenv("DO_NOT_TRACK", "1")
        from prefect.testing.utilities import prefect_test_harness

        with prefect_test_harness(server_startup_timeout=90):
            yield
            drain_or_drop_prefect_workers()


def drain_or_drop_prefect_workers(timeout_s: float = 120.0) -> None:
    """Drain Prefect's log and event workers within ``timeout_s``; a worker still holding work for a server
    that is gone (one a test started and stopped) is dropped and named on stderr, so the harness's own
    unbounded drain at exit cannot wait forever."""
    import sys

    from prefect.events.worker import EventsWorker
    from prefect.logging.handlers import APILogWorker

    stuck = 0
    for worker in (APILogWorker, EventsWorker):
        result = worker.drain_all(timeout=timeout_s, at_exit=False)
        if isinstance(result, tuple):
            stuck += len(result[1])
    if stuck:
        print(f"prefect_harness: {stuck} Prefect worker(s) still busy after {timeout_s:.0f} s; dropped", file=sys.stderr)
        for worker in (APILogWorker, EventsWorker):
            with worker._instance_lock:
                worker._instances.clear()

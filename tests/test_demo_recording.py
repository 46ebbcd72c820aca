"""The recording ``make demo`` replays: its manifest's validity, the choice of backend, the proxy.

* the **shipped** recording (``examples/sample_recording.jsonl``) must match this checkout: a prompt
  version changed without the recording being renewed fails here;
* a stale or missing recording is one line naming what changed, and the demo falls back to the
  embedded model (its launcher stubbed: no model runs here); a matching one is replayed;
* the recording proxy forwards through the real ``openai`` adapter to the scripted server and
  records exactly what a replay serves.

The replayed demo end to end, as a process: tests/test_demo_replay.py.
"""

from __future__ import annotations

import json
import re
import threading
from collections.abc import Iterator
from contextlib import ExitStack, contextmanager
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import pytest
from pydantic import SecretStr

from tests.conftest import TEST_API_KEY
from tmem.demo import SAMPLE, SAMPLE_QUESTIONS
from tmem.demo_backends import BackendRequest, open_backend
from tmem.demo_recording import (
    SAMPLE_RECORDING,
    check_recording,
    current_validity,
    demo_operations,
    file_digest,
    manifest_path,
    write_manifest,
)
from tmem.devtools import synth
from tmem.devtools.recording import (
    RecordingProxy,
    ReplayServer,
    answer_text,
    read_entries,
    read_recording,
    request_key,
    write_recording,
)
from tmem.devtools.responders import request_input
from tmem.devtools.scripted_llm import ScriptedLLM
from tmem.errors import LLMError
from tmem.prompts import item_extract, topic_create
from tmem.prompts.base import prompt_versions
from tmem.providers.llama_cpp import LocalServer
from tmem.providers.openai_chat import ChatConfig, OpenAIChatModel
from tmem.settings import Settings, load_settings

QUESTIONS = [(q.text, q.speaker) for q in SAMPLE_QUESTIONS]
KEYWORDS = [f"k{i}" for i in range(topic_create.MIN_KEYWORDS)]
NOT_SHIPPED = (
    "no recording ships yet (examples/sample_recording.jsonl + .json): `make demo` falls back to the embedded "
    "model. Record one before this lands: python -m tmem.demo --record-through URL (README, 'make demo')"
)


# --- the shipped recording ------------------------------------------------------------------------


def _shipped_manifest() -> dict[str, Any]:
    if not SAMPLE_RECORDING.exists() and not manifest_path(SAMPLE_RECORDING).exists():
        pytest.skip(NOT_SHIPPED)
    assert SAMPLE_RECORDING.exists(), "a manifest ships without its recording (examples/sample_recording.jsonl)"
    return dict(json.loads(manifest_path(SAMPLE_RECORDING).read_text(encoding="utf-8")))


def test_the_shipped_recording_answers_the_current_prompt_versions() -> None:
    manifest = _shipped_manifest()
    recorded = manifest["prompt_versions"]
    current = prompt_versions()
    changed = {op: f"{recorded.get(op)} -> {current.get(op)}" for op in demo_operations()
               if recorded.get(op) != current.get(op)}
    assert not changed, (
        f"prompt versions changed since the shipped recording was made ({changed}): `make demo` no longer replays "
        "it. Renew it: python -m tmem.demo --record-through URL (README, 'make demo')")


def test_the_shipped_recording_matches_this_checkout_and_is_real() -> None:
    manifest = _shipped_manifest()
    check = check_recording(SAMPLE_RECORDING, current_validity(SAMPLE, QUESTIONS, load_settings()))
    assert check.usable, f"make demo would say: {check.line}"
    # A capable model's answers, never the scripted development server's (its answers are derived from the
    # request, so the synth responders reproduce each of them: none may match).
    assert not any("scripted" in str(model) for model in manifest["models"].values()), manifest["models"]
    scripted = [entry["operation"] for entry in read_entries(SAMPLE_RECORDING).values()
                if answer_text(entry["response"]) == synth.RESPONDERS[entry["operation"]](entry["operation"], entry)]
    assert not scripted, f"{len(scripted)} recorded answers are the scripted server's: {scripted[:5]}"
    assert manifest["build"]["status"] == "completed" and manifest["calls"]["answer"] == len(SAMPLE_QUESTIONS)
    assert f"{manifest['calls']['build']} build calls, {len(SAMPLE_QUESTIONS)} answers" in manifest["label"]


# --- manifests: what makes a recording stale ---------------------------------------------------


def _recording(tmp_path: Path, settings: Settings, archive: Path = SAMPLE) -> Path:
    """A one-request recording with a manifest made for ``archive`` and ``settings`` now."""
    scene = topic_create.SceneView(date="2024-03-04", title="t", summary="s", narrative="n")
    prompt = topic_create.build(topic_create.CreateInput(conversation_id="c", scene_ref="S1", scene=scene))
    body = OpenAIChatModel(ChatConfig(base_url="http://unused/v1", api_key=SecretStr("k"), model="m")).request_body(prompt)
    entries = [{"operation": "topic_create", "messages": body["messages"], "response_format": body["response_format"],
                "response": {"title": "t", "keywords": KEYWORDS}}]
    path = tmp_path / "sample_recording.jsonl"
    write_recording(path, entries)
    write_manifest(path, entries, current_validity(archive, QUESTIONS, settings), source="a test",
                   models={"build": "capable", "answer": "capable"}, build={"status": "completed"},
                   recorded_at=datetime(2025, 1, 2, tzinfo=UTC))
    return path


def test_a_manifest_made_now_matches_and_names_its_label(tmp_path: Path) -> None:
    path = _recording(tmp_path, load_settings())
    check = check_recording(path, current_validity(SAMPLE, QUESTIONS, load_settings()))
    assert check.usable and check.answers is not None and len(check.answers) == 1
    assert check.label == "answers recorded from a test on 2025-01-02; 1 build calls, 0 answers"
    assert check.models == {"build": "capable", "answer": "capable"}


def test_a_prompt_version_bump_makes_the_recording_stale(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    path = _recording(tmp_path, load_settings())
    old = item_extract.VERSION
    monkeypatch.setattr(item_extract, "VERSION", "99")
    check = check_recording(path, current_validity(SAMPLE, QUESTIONS, load_settings()))
    assert not check.usable and check.line == f"recording is stale: item_extract prompt v{old} → v99"


@pytest.mark.parametrize(("changed", "reason"), [
    ({"segment_window": 8}, "segment_window 16 → 8"),
    ({"k_scenes": 3}, "retrieval.k_scenes 5 → 3"),
    ({"answer_reasoning": "on"}, "answer_reasoning off → on"),
    ({"llm_structured_mode": "json_object"}, "llm_structured_mode auto → json_object"),
    ({"embedding_model": "other-encoder"}, "embedding_model all-MiniLM-L6-v2 → other-encoder"),
])
def test_a_setting_that_changes_the_requests_makes_it_stale(tmp_path: Path, changed: dict[str, Any],
                                                            reason: str) -> None:
    path = _recording(tmp_path, load_settings())
    check = check_recording(path, current_validity(SAMPLE, QUESTIONS, load_settings(**changed)))
    assert not check.usable and check.line == f"recording is stale: {reason}"


def test_settings_that_change_no_request_leave_it_valid(tmp_path: Path) -> None:
    path = _recording(tmp_path, load_settings())
    other = load_settings(llm_timeout_s=5000, llm_concurrency=1, llm_max_tokens=640, llm_model="another")
    assert check_recording(path, current_validity(SAMPLE, QUESTIONS, other)).usable


def test_a_changed_archive_questions_or_recording_file_make_it_stale(tmp_path: Path) -> None:
    archive = tmp_path / "sample_archive.jsonl"
    archive.write_bytes(SAMPLE.read_bytes())
    path = _recording(tmp_path, load_settings(), archive)
    archive.write_bytes(SAMPLE.read_bytes().replace(b"shellfish", b"peanut"))
    check = check_recording(path, current_validity(archive, QUESTIONS, load_settings()))
    assert check.line == "recording is stale: sample_archive.jsonl changed since it was recorded"

    path = _recording(tmp_path, load_settings())
    check = check_recording(path, current_validity(SAMPLE, QUESTIONS[:3], load_settings()))
    assert check.line == "recording is stale: the demo's questions changed"

    with path.open("a", encoding="utf-8") as fh:
        fh.write("\n")
    check = check_recording(path, current_validity(SAMPLE, QUESTIONS, load_settings()))
    assert check.line == "recording is stale: sample_recording.jsonl is not the file its manifest describes"


def test_many_changes_still_fit_one_line(tmp_path: Path) -> None:
    path = _recording(tmp_path, load_settings())
    changed = load_settings(segment_window=8, topic_batch=5, trigger_batch=1, scene_trigger_batch=1, k_items=3,
                            k_cue=2)
    line = check_recording(path, current_validity(SAMPLE, QUESTIONS, changed)).line
    assert "\n" not in line and line.endswith(" and 2 more") and line.count("→") == 4


def test_a_missing_recording_or_manifest_is_named(tmp_path: Path) -> None:
    current = current_validity(SAMPLE, QUESTIONS, load_settings())
    check = check_recording(tmp_path / "sample_recording.jsonl", current)
    assert not check.usable and check.line.startswith("no recording of a capable model ships with this checkout")
    path = _recording(tmp_path, load_settings())
    manifest_path(path).unlink()
    assert check_recording(path, current).line.endswith("sample_recording.json is missing")
    manifest_path(path).write_text("{not json", encoding="utf-8")
    assert "is unreadable" in check_recording(path, current).line


# --- the choice of backend ------------------------------------------------------------------


class StubLauncher:
    """Stands in for the embedded model's launcher: records that it was asked, starts nothing."""

    def __init__(self, tmp_path: Path) -> None:
        self.calls = 0
        self.log = tmp_path / "local-llm.log"

    @contextmanager
    def __call__(self, settings: Settings) -> Iterator[LocalServer]:
        self.calls += 1
        yield LocalServer(base_url="http://127.0.0.1:9/v1", model="stub-embedded", pid=0, log_path=self.log)


def _choose(tmp_path: Path, settings: Settings, recording: Path, capsys: pytest.CaptureFixture[str],
            launcher: StubLauncher) -> tuple[Any, str]:
    request = BackendRequest(recording=recording, current=current_validity(SAMPLE, QUESTIONS, settings),
                             store=tmp_path / "store")
    with ExitStack() as stack:
        backend = open_backend(stack, settings, request, launcher)
        out = capsys.readouterr().out
    return backend, out


def test_a_stale_recording_is_one_line_and_the_embedded_model_is_chosen(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    path = _recording(tmp_path, load_settings())
    old = item_extract.VERSION
    monkeypatch.setattr(item_extract, "VERSION", "99")
    launcher = StubLauncher(tmp_path)
    backend, out = _choose(tmp_path, load_settings(), path, capsys, launcher)
    assert backend.kind == "embedded" and backend.base_url == "http://127.0.0.1:9/v1" and launcher.calls == 1
    assert backend.replay is None
    stale = [line for line in out.splitlines() if line.startswith("Note:")]
    assert stale == [f"Note: recording is stale: item_extract prompt v{old} → v99; falling back to the embedded "
                     "model (to record one: python -m tmem.demo --record-through URL)."]
    assert "tiny model that proves the pipeline, not the quality" in out and "A RECORDING" not in out


def test_no_shipped_recording_is_one_line_too(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    launcher = StubLauncher(tmp_path)
    backend, out = _choose(tmp_path, load_settings(), tmp_path / "none.jsonl", capsys, launcher)
    assert backend.kind == "embedded" and launcher.calls == 1
    assert [line for line in out.splitlines() if line.startswith("Note:")] == [
        f"Note: no recording of a capable model ships with this checkout ({tmp_path / 'none.jsonl'}); falling back "
        "to the embedded model (to record one: python -m tmem.demo --record-through URL)."]


def test_a_matching_recording_is_replayed_and_labelled(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    path = _recording(tmp_path, load_settings())
    launcher = StubLauncher(tmp_path)
    backend, out = _choose(tmp_path, load_settings(), path, capsys, launcher)
    assert backend.kind == "replay" and launcher.calls == 0 and backend.replay is not None
    assert backend.model == "capable" and backend.env["TMEM_LLM_PROVIDER"] == "openai"
    assert out.splitlines()[0] == ("A RECORDING of a capable model, replayed — not live answers: answers recorded "
                                   "from a test on 2025-01-02; 1 build calls, 0 answers.")


def test_an_endpoint_or_the_local_provider_set_by_the_user_wins_over_the_recording(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], scripted_llm: ScriptedLLM
) -> None:
    path = _recording(tmp_path, load_settings())
    launcher = StubLauncher(tmp_path)
    backend, out = _choose(tmp_path, load_settings(llm_base_url=scripted_llm.url), path, capsys, launcher)
    assert backend.kind == "endpoint" and backend.base_url == scripted_llm.url and "recording" not in out.lower()
    backend, out = _choose(tmp_path, load_settings(llm_provider="local"), path, capsys, launcher)
    assert backend.kind == "embedded" and launcher.calls == 1 and "recording" not in out.lower()


# --- the recording proxy ----------------------------------------------------------------------


def _prompt(title: str) -> Any:
    scene = topic_create.SceneView(date="2024-03-04", title=title, summary="s", narrative="n")
    return topic_create.build(topic_create.CreateInput(conversation_id="c", scene_ref="S1", scene=scene))


def _title_responder(operation: str, body: dict[str, Any]) -> str:
    title = request_input(body)["scene"]["title"]
    return json.dumps({"title": f"About {title}", "keywords": KEYWORDS})


@pytest.fixture
def upstream(scripted_llm: ScriptedLLM) -> ScriptedLLM:
    scripted_llm.set_responder("topic_create", _title_responder)
    return scripted_llm


def _adapter(base_url: str) -> OpenAIChatModel:
    return OpenAIChatModel(ChatConfig(base_url=base_url, api_key=SecretStr(TEST_API_KEY), model="m", max_retries=2,
                                      backoff_s=0.001, repair_attempts=0))


def test_the_proxy_records_what_a_replay_then_serves(tmp_path: Path, upstream: ScriptedLLM) -> None:
    journal = tmp_path / "rec.partial.jsonl"
    upstream.fail_next("rate_limit", n=1)  # passed back to the client (which retries), never recorded
    with RecordingProxy(upstream.url, timeout_s=30, journal=journal) as proxy:
        chat = _adapter(proxy.base_url)
        first = chat.complete(_prompt("Ana's pottery class"))
        again = chat.complete(_prompt("Ana's pottery class"))  # answered from the recording, not forwarded
        other = chat.complete(_prompt("Ben's promotion"))
    assert [r.status for r in upstream.requests] == [429, 200, 200]
    assert proxy.forwarded == 2 and len(proxy.entries) == 2 and again == first
    assert {e["operation"] for e in proxy.entries} == {"topic_create"}
    assert upstream.requests[1].body["messages"] == proxy.entries[0]["messages"]  # forwarded as sent
    assert len(read_entries(journal)) == 2  # each answer kept as it arrived

    path = tmp_path / "rec.jsonl"
    write_recording(path, proxy.entries)
    with ReplayServer(read_recording(path)) as replay:
        chat = _adapter(replay.base_url)
        assert chat.complete(_prompt("Ana's pottery class")) == first
        assert chat.complete(_prompt("Ben's promotion")) == other
        with pytest.raises(LLMError, match=r"not in the recording \(topic_create\)"):
            chat.complete(_prompt("Something never asked"))


def test_the_proxy_keeps_the_exact_answer_text(tmp_path: Path, scripted_llm: ScriptedLLM) -> None:
    spaced = '{ "title": "Pottery",  "keywords": ' + json.dumps(KEYWORDS) + " }"  # not compact: kept as answered
    scripted_llm.set_responder("topic_create", lambda op, body: spaced)
    with RecordingProxy(scripted_llm.url, timeout_s=30) as proxy:
        _adapter(proxy.base_url).complete(_prompt("t"))
    assert proxy.entries[0]["response"] == spaced
    path = tmp_path / "rec.jsonl"
    write_recording(path, proxy.entries)
    assert [a.content for a in read_recording(path).values()] == [spaced]


def test_the_proxy_answers_a_seeded_or_concurrent_request_once(tmp_path: Path, upstream: ScriptedLLM) -> None:
    prompt = _prompt("seeded")
    body = _adapter("http://unused/v1").request_body(prompt)
    key = request_key(body["messages"], body["response_format"])
    seed = {key: {"operation": "topic_create", "messages": body["messages"],
                  "response_format": body["response_format"], "response": {"title": "Seeded", "keywords": KEYWORDS}}}
    upstream.latency_ms = 300  # both copies of the next request arrive while the first is upstream
    with RecordingProxy(upstream.url, timeout_s=30, seed=seed) as proxy:
        assert _adapter(proxy.base_url).complete(prompt).title == "Seeded"
        results: list[Any] = []
        threads = [threading.Thread(target=lambda: results.append(_adapter(proxy.base_url).complete(_prompt("twice"))))
                   for _ in range(2)]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join()
    assert len(upstream.requests) == 1 and proxy.forwarded == 1 and len(results) == 2 and results[0] == results[1]
    assert [e["operation"] for e in proxy.entries] == ["topic_create", "topic_create"]


def test_an_unreachable_upstream_is_a_clear_error(tmp_path: Path) -> None:
    with RecordingProxy("http://127.0.0.1:9/v1", timeout_s=5) as proxy:
        chat = OpenAIChatModel(ChatConfig(base_url=proxy.base_url, api_key=SecretStr("k"), model="m", max_retries=0))
        with pytest.raises(LLMError, match=re.escape("upstream http://127.0.0.1:9/v1 did not answer")):
            chat.complete(_prompt("t"))
    assert proxy.entries == []


def test_digests_are_of_the_bytes(tmp_path: Path) -> None:
    one, two = tmp_path / "a", tmp_path / "b"
    one.write_bytes(b"x")
    two.write_bytes(b"x\n")
    assert file_digest(one) != file_digest(two) and file_digest(one).startswith("sha256:")

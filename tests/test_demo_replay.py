"""``make demo``'s replay path end to end, as processes: record, replay, and a request gone missing.

1. ``python -m tmem.demo --record-through URL`` records the sample's build and questions through the
   recording proxy — here against the scripted development server, into a temporary directory (a
   scripted recording never ships: tests/test_demo_recording.py checks the shipped one);
2. with the scripted server stopped and nothing configured, the demo replays that recording: it
   prints the label, the same answers as the recorded run, and every connection of every process
   (tests/netguard) goes to loopback — Prefect's temporary server and the replay — none to the
   server it was recorded from, and no embedded model is started;
3. a recording that lacks one request although its manifest matches is an error naming the
   operation, never a fallback.
"""

from __future__ import annotations

import ipaddress
import json
import os
import socket
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from tests.paths import REPO
from tmem.demo import SAMPLE_QUESTIONS
from tmem.demo_recording import file_digest, manifest_path
from tmem.devtools import synth
from tmem.devtools.recording import read_entries, write_recording
from tmem.devtools.scripted_llm import ScriptedLLM

pytestmark = [pytest.mark.slow, pytest.mark.prefect, pytest.mark.timeout(1800)]

GUARD = REPO / "tests" / "netguard"


def _demo(args: list[str], env: dict[str, str]) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "tmem.demo", *args], capture_output=True, text=True, timeout=900,
                          env=env, cwd=REPO, check=False)


def _env(tmp: Path, **extra: str) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith(("TMEM_", "PREFECT_", "OPENAI_", "NETGUARD_"))}
    env.update({"PYTHONPATH": str(REPO), "HF_HUB_OFFLINE": "1", "PREFECT_HOME": str(tmp / "prefect-home"), **extra})
    return env


def _answers(out: str) -> list[str]:
    return [line.split("answer:", 1)[1].strip() for line in out.splitlines() if line.strip().startswith("answer:")]


def _guard_events(directory: Path) -> list[dict[str, Any]]:
    return [json.loads(line) for path in sorted(directory.glob("*.jsonl")) for line in path.read_text().splitlines()]


def _loopback(event: dict[str, Any]) -> bool:
    if event["family"] == socket.AF_UNIX:
        return True
    host = event["address"][0]
    return host == "localhost" or ipaddress.ip_address(host).is_loopback


def test_the_demo_records_then_replays_with_no_other_model(tmp_path: Path) -> None:
    recording = tmp_path / "sample_recording.jsonl"
    with ScriptedLLM(responders=dict(synth.RESPONDERS)) as upstream:
        recorded = _demo(["--record-through", upstream.url, "--recording", str(recording),
                          "--store", str(tmp_path / "record-store")],
                         _env(tmp_path, TMEM_LLM_API_KEY="upstream-key", TMEM_LLM_MODEL="capable-test-model"))
        asked_upstream = len(upstream.requests)
        port = upstream.port
    assert recorded.returncode == 0, recorded.stderr[-3000:]
    assert "RECORDING: every request goes to" in recorded.stdout and "Recorded: answers recorded from" in recorded.stdout
    entries = list(read_entries(recording).values())
    assert len(entries) == asked_upstream  # every request recorded once (the synth answers are all valid)
    assert sum(e["operation"] == "answer" for e in entries) == len(SAMPLE_QUESTIONS)
    manifest = json.loads(manifest_path(recording).read_text())
    assert manifest["models"] == {"build": "capable-test-model", "answer": "capable-test-model"}
    assert manifest["calls"]["build"] == asked_upstream - len(SAMPLE_QUESTIONS)
    assert not recording.with_suffix(".partial.jsonl").exists()  # the journal is removed once written

    guard = tmp_path / "netguard"
    guard.mkdir()
    replayed = _demo(["--recording", str(recording), "--store", str(tmp_path / "replay-store")],
                     _env(tmp_path, PYTHONPATH=f"{GUARD}{os.pathsep}{REPO}", NETGUARD_DIR=str(guard)))
    assert replayed.returncode == 0, replayed.stderr[-3000:]
    out = replayed.stdout
    assert out.startswith(f"A RECORDING of a capable model, replayed — not live answers: {manifest['label']}.")
    assert f"This was a RECORDING of a capable model, replayed: {len(entries)} requests answered from it" in out
    assert f"{manifest['calls']['build']} LLM calls, 0 cache hits" in out
    assert _answers(out) == _answers(recorded.stdout) and len(_answers(out)) == len(SAMPLE_QUESTIONS)
    assert "tmem serve --store" in out and "http://127.0.0.1:8000/" in out
    assert "Embedded model" not in out and "first answer after" in out
    events = _guard_events(guard)
    connects = [e for e in events if e["event"] == "connect"]
    assert connects and all(_loopback(e) for e in connects), [e for e in connects if not _loopback(e)]
    assert not [e for e in connects if e["family"] != socket.AF_UNIX and e["address"][1] == port]  # recorded-from
    started = [" ".join(map(str, e.get("argv") or [])) for e in events if e["event"] == "start"]
    assert started and not [argv for argv in started if "local_server" in argv or "llama" in argv]

    # The same recording without the first question's answer, its manifest otherwise matching: an error that
    # names the operation (the build comes from the replay store's cache; no model is asked instead).
    first_answer = next(e for e in entries if e["operation"] == "answer" and SAMPLE_QUESTIONS[0].text in json.dumps(e))
    write_recording(recording, [e for e in entries if e is not first_answer])
    manifest["recording_digest"] = file_digest(recording)
    manifest_path(recording).write_text(json.dumps(manifest), encoding="utf-8")
    missing = _demo(["--recording", str(recording), "--store", str(tmp_path / "replay-store")], _env(tmp_path))
    assert missing.returncode == 1, missing.stdout[-3000:]
    assert "error: the recording holds no answer for 1 request(s) (answer ×1), although its manifest matches" \
        in missing.stderr
    assert "Embedded model" not in missing.stdout and "answer:" not in missing.stdout

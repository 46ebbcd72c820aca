"""``make demo``'s job (``python -m tmem.demo``) end to end, as a process.

The dry run drives the whole main job — ingest the shipped sample, build with the Prefect flow,
answer the four sample questions — against tmem's scripted development server, and checks what
the user is shown: the labelling, every answer with the recalled scenes/items and their channels,
and the closing instructions. (The embedded model's own path is covered by
tests/test_local_llm.py, including a real generation.)
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from tmem.demo import SAMPLE_QUESTIONS

REPO = Path(__file__).resolve().parents[1]

pytestmark = [pytest.mark.slow, pytest.mark.prefect]


def _demo(args: list[str], store: Path) -> subprocess.CompletedProcess[str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith(("TMEM_", "PREFECT_"))}
    env.update({"PYTHONPATH": str(REPO), "HF_HUB_OFFLINE": "1"})
    return subprocess.run(
        [sys.executable, "-m", "tmem.demo", "--store", str(store), *args],
        capture_output=True, text=True, timeout=600, env=env, cwd=REPO, check=False,
    )


def test_dry_run_demo_ingests_builds_and_explains_every_answer(tmp_path: Path) -> None:
    done = _demo(["--dry-run"], tmp_path / "store")
    assert done.returncode == 0, done.stderr[-3000:]
    out = done.stdout
    assert "DRY RUN" in out and "prove the pipeline, not the quality" in out
    assert "1. ingest sample_archive.jsonl" in out and "32 turns (32 new)" in out
    assert "2. build memory with the Prefect flow" in out and "completed in" in out
    for n, question in enumerate(SAMPLE_QUESTIONS, 1):
        assert f"[{n}] {question.text}" in out
    answers = [line for line in out.splitlines() if line.strip().startswith("answer:")]
    assert len(answers) == len(SAMPLE_QUESTIONS) and all(len(a.split("answer:", 1)[1].strip()) > 0 for a in answers)
    recalled = [line for line in out.splitlines() if line.strip().startswith(("scene ", "item "))]
    assert recalled and all(" via " in line for line in recalled)
    assert "Prefect UI" in out and "TMEM_LLM_BASE_URL" in out and "This was a DRY RUN" in out

    # A second run on the same store re-ingests nothing and rebuilds from the response cache.
    again = _demo(["--dry-run"], tmp_path / "store")
    assert again.returncode == 0, again.stderr[-3000:]
    assert "(0 new)" in again.stdout and "0 LLM calls" in again.stdout


def test_demo_on_a_missing_archive_or_conversation_is_a_clear_error(tmp_path: Path) -> None:
    done = _demo(["--dry-run", "--archive", str(tmp_path / "nope.jsonl")], tmp_path / "store")
    assert done.returncode == 2 and "archive" in done.stderr and "not found" in done.stderr
    assert not (tmp_path / "store").exists()
    done = _demo(["--dry-run", "--conversation", "no-such-conversation"], tmp_path / "store2")
    assert done.returncode == 2 and "no-such-conversation" in done.stderr

"""Batched construction under the Prefect flow (issue 7, point 6).

The same LoCoMo slice is built twice against one deterministic scripted server, with
``TMEM_LLM_BATCH`` off and on. "Same memory" is :mod:`tmem.store.memory_image`, as in
tests/test_flow_incremental.py. With batching on, the requests of the batched operations reach the
server only as batch lines — exactly the requests the synchronous build sent — while segmentation
and topic admission stay synchronous; the cost estimate prices the batched tokens at 50 %.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
from collections import Counter
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest

from tests.flow_helpers import ingest_slice, published, set_llm_env, wait_for
from tests.paths import REPO
from tmem.devtools.scripted_llm import RecordedRequest, ScriptedLLM
from tmem.pricing import estimate_cost
from tmem.prompts.operations import BATCHABLE_OPERATIONS
from tmem.store.duck import connect
from tmem.store.memory_image import diff_images, memory_image

pytestmark = [pytest.mark.prefect, pytest.mark.slow]

CONV = "conv-30"
SERIAL_OPERATIONS = {"scene_boundaries", "scene_pack", "topic_match", "topic_create"}


@dataclass
class Build:
    store: Path
    summary: dict[str, Any]
    requests: list[RecordedRequest]


@dataclass
class Pair:
    server: ScriptedLLM
    off: Build
    on: Build
    env: dict[str, str]  # the TMEM_* settings of the batched build (tests see none: conftest isolates them)


@pytest.fixture(scope="module")
def pair(prefect_harness: None, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Pair]:
    from tmem.flows.build_memory import build_memory

    root = tmp_path_factory.mktemp("batch")
    server = ScriptedLLM().start()

    def run(name: str, mp: pytest.MonkeyPatch, **env: str) -> Build:
        set_llm_env(mp, server, **env)
        store = root / name
        ingest_slice(store, root / f"{name}.json", {CONV: 1})
        before = len(server.requests)
        summary: dict[str, Any] = build_memory(store=str(store), label=name)
        assert summary["status"] == "completed", summary["failures"]
        return Build(store, summary, server.requests[before:])

    try:
        with pytest.MonkeyPatch.context() as mp:
            for name in [n for n in os.environ if n.startswith(("TMEM_", "OPENAI_"))]:
                mp.delenv(name)
            off = run("batch-off", mp)
            on = run("batch-on", mp, TMEM_LLM_BATCH="on", TMEM_LLM_BATCH_LINGER_S="0.3",
                     TMEM_LLM_BATCH_POLL_S="0.05", TMEM_LLM_BATCH_POLL_MAX_S="0.2")
            yield Pair(server, off, on, {k: v for k, v in os.environ.items() if k.startswith("TMEM_")})
    finally:
        server.stop()


def bodies(requests: list[RecordedRequest], via: str) -> Counter[tuple[str, str]]:
    return Counter((r.operation, repr(r.body["messages"])) for r in requests if r.via == via)


def test_a_batched_build_publishes_the_same_memory_as_a_synchronous_one(pair: Pair) -> None:
    off, on = memory_image(published(pair.off.store), CONV), memory_image(published(pair.on.store), CONV)
    assert diff_images(on, off) == []
    assert on.rows["items"] and on.rows["item_triggers"] and on.rows["scene_triggers"] and on.rows["personas"]


def test_batched_operations_went_through_batches_and_the_serial_path_stayed_synchronous(pair: Pair) -> None:
    sync_off, sync_on, batched_on = (bodies(pair.off.requests, "chat"), bodies(pair.on.requests, "chat"),
                                     bodies(pair.on.requests, "batch"))
    assert bodies(pair.off.requests, "batch") == Counter()
    # Every request of a batchable operation was sent once, as a batch line; the same requests as without batching.
    assert batched_on == Counter({k: n for k, n in sync_off.items() if k[0] in BATCHABLE_OPERATIONS})
    assert {op for op, _ in batched_on} == set(BATCHABLE_OPERATIONS)
    assert sync_on == Counter({k: n for k, n in sync_off.items() if k[0] in SERIAL_OPERATIONS})
    lines = sum(b["request_counts"]["total"] for b in pair.server.batches.created)
    assert lines == sum(batched_on.values()) == pair.on.summary["batch_calls"]
    con = connect(pair.on.store, read_only=True)
    try:
        journal = con.execute("SELECT status, sum(requests) FROM llm_batches GROUP BY status").fetchall()
    finally:
        con.close()
    assert journal == [("collected", lines)]


def test_the_cost_estimate_prices_batched_tokens_at_half(pair: Pair) -> None:
    off, on = pair.off.summary, pair.on.summary
    assert (on["llm_calls"], on["prompt_tokens"], on["completion_tokens"]) == (
        off["llm_calls"], off["prompt_tokens"], off["completion_tokens"])
    assert off["batch_calls"] == 0 and 0 < on["batch_prompt_tokens"] < on["prompt_tokens"]
    sync_part = estimate_cost(on["model"], on["prompt_tokens"] - on["batch_prompt_tokens"],
                              on["completion_tokens"] - on["batch_completion_tokens"])
    batch_part = estimate_cost(on["model"], on["batch_prompt_tokens"], on["batch_completion_tokens"])
    assert sync_part is not None and batch_part is not None
    assert on["cost_usd"] == pytest.approx(sync_part + 0.5 * batch_part)
    assert off["cost_usd"] == pytest.approx(sync_part + batch_part)


def test_a_build_killed_with_a_batch_in_flight_reattaches_to_it_on_the_next_run(pair: Pair, tmp_path: Path) -> None:
    """``python -m tmem build`` SIGKILLed once its first batch is submitted and journalled (polled);
    the next run collects that batch instead of sending its requests again, and publishes the same memory."""
    from prefect.settings import get_current_settings

    store = tmp_path / "killed"
    ingest_slice(store, tmp_path / "killed.json", {CONV: 1})
    env = dict(os.environ) | pair.env | {
        "PREFECT_API_URL": str(get_current_settings().api.url), "PREFECT_LOGGING_LEVEL": "WARNING",
        "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1", "PYTHONPATH": str(REPO),
    }
    command = [sys.executable, "-m", "tmem", "build", "--store", str(store), "--json"]
    batches = pair.server.batches
    seen = len(batches.created)
    batches.hold()
    try:
        with (tmp_path / "killed.log").open("w") as log:
            proc = subprocess.Popen(command, cwd=REPO, env=env, stdout=log, stderr=subprocess.STDOUT,
                                    start_new_session=True)
            try:
                first = wait_for(
                    lambda: next((b["id"] for b in batches.created[seen:] if batches.polls_of(b["id"]) > 0), None),
                    timeout_s=300, what="a submitted and polled batch",
                )
            finally:
                os.killpg(proc.pid, signal.SIGKILL)
                proc.wait(timeout=30)
    finally:
        batches.hold(False)
    first_ids = {line["custom_id"] for line in batches.lines_of(first)}

    done = subprocess.run(command, cwd=REPO, env=env, capture_output=True, text=True, timeout=900, check=False)

    assert done.returncode == 0, done.stderr[-3000:]
    later = [b["id"] for b in batches.created[seen:] if b["id"] != first]
    resent = [cid for b in later for line in batches.lines_of(b) if (cid := line["custom_id"]) in first_ids]
    assert resent == []
    assert batches.created[[b["id"] for b in batches.created].index(first)]["status"] == "completed"
    assert diff_images(memory_image(published(store), CONV), memory_image(published(pair.on.store), CONV)) == []

"""The operations flows under the Prefect harness: nightly rebuild and chunked, resumable backfill.

Small LoCoMo slices against the scripted LLM (synth responders).
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any
from uuid import UUID

import pytest

from tests.flow_helpers import build, ingest_slice, published, set_llm_env
from tests.paths import LOCOMO10
from tmem.devtools.scripted_llm import ScriptedLLM
from tmem.store.duck import connect
from tmem.store.memory_image import diff_images, memory_image
from tmem.store.snapshot.published import list_snapshots

pytestmark = [pytest.mark.prefect, pytest.mark.slow]

A, B = "conv-26", "conv-30"


def _artifact(flow_run_id: UUID, key: str) -> str:
    from prefect.client.orchestration import get_client
    from prefect.client.schemas.filters import ArtifactFilter, ArtifactFilterFlowRunId, ArtifactFilterKey

    with get_client(sync_client=True) as client:
        found = client.read_artifacts(artifact_filter=ArtifactFilter(
            key=ArtifactFilterKey(any_=[key]), flow_run_id=ArtifactFilterFlowRunId(any_=[flow_run_id])))
    assert len(found) == 1, f"{key}: {found}"
    return str(found[0].data)


def test_nightly_rebuild_picks_up_exactly_the_changed_conversations_then_prunes_and_cleans(
    prefect_harness: None, scripted_llm: ScriptedLLM, monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    from tmem.flows.nightly_rebuild import nightly_rebuild

    store = tmp_path / "store"
    set_llm_env(monkeypatch, scripted_llm)
    ingest_slice(store, tmp_path / "s1.json", {A: 1, B: 1})
    assert build(store)["status"] == "completed"
    before = published(store)
    a_before = memory_image(before, A)
    ingest_slice(store, tmp_path / "s2.json", {A: 1, B: 2})  # only B gains a session

    state = nightly_rebuild(store=str(store), keep_snapshots=1, lance_margin_s=1.0, return_state=True)

    assert state.is_completed(), state.message
    result: dict[str, Any] = state.result()
    assert result["changed"] == [B]
    assert result["build"]["conversations_built"] == [B]
    after = published(store)
    assert after.snapshot_id == result["build"]["snapshot_id"] != before.snapshot_id
    assert set(after.conversations) == {A, B}
    assert diff_images(memory_image(after, A), a_before) == []  # A untouched, still published
    # Pruning kept one snapshot (the current one); Lance kept its pinned version and dropped older ones.
    assert result["pruned"] == [before.snapshot_id]
    assert list_snapshots(store) == [after.snapshot_id]
    [vectors] = result["vectors"]
    assert vectors["pinned"] == [after.lance_versions["vectors"]] and vectors["removed"] > 0
    assert memory_image(after, B).vector_keys["vectors"]  # the pinned version still reads
    report = _artifact(state.state_details.flow_run_id, "tmem-nightly-report")
    assert "**Changed conversations:** 1 (conv-30)" in report and "| vectors |" in report

    # Nothing changed since: no build, no new snapshot, no LLM request.
    requests = len(scripted_llm.requests)
    again: dict[str, Any] = nightly_rebuild(store=str(store), keep_snapshots=1, lance_margin_s=1.0)
    assert again["changed"] == [] and again["build"] is None
    assert published(store).snapshot_id == after.snapshot_id
    assert len(scripted_llm.requests) == requests


def _split_locomo(out: Path, sessions: int) -> list[Path]:
    """locomo10.json as one file per conversation, each trimmed to its first ``sessions`` sessions."""
    files = []
    for sample in json.loads(LOCOMO10.read_text(encoding="utf-8")):
        conv = sample["conversation"]
        keep = {"speaker_a": conv["speaker_a"], "speaker_b": conv["speaker_b"]}
        for n in range(1, sessions + 1):
            keep[f"session_{n}_date_time"] = conv[f"session_{n}_date_time"]
            keep[f"session_{n}"] = conv[f"session_{n}"]
        path = out / f"{sample['sample_id']}.json"
        path.write_text(json.dumps([{"sample_id": sample["sample_id"], "conversation": keep, "qa": []}]))
        files.append(path)
    return sorted(files)


def _chunk_runs(parent: UUID) -> dict[str, str]:
    """Name -> state of the backfill-chunk subflow runs of one backfill run."""
    from prefect.client.orchestration import get_client
    from prefect.client.schemas.filters import FlowRunFilter, FlowRunFilterParentFlowRunId

    with get_client(sync_client=True) as client:
        children = client.read_flow_runs(flow_run_filter=FlowRunFilter(
            parent_flow_run_id=FlowRunFilterParentFlowRunId(any_=[parent])))
    return {r.name: str(r.state_name) for r in children if r.name.startswith("backfill-chunk/")}


def test_backfill_of_locomo10_in_chunks_resumes_after_a_failed_chunk_without_redoing_finished_ones(
    prefect_harness: None, scripted_llm: ScriptedLLM, monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    from tmem.flows.backfill import backfill

    store, archives = tmp_path / "store", tmp_path / "archives"
    archives.mkdir()
    set_llm_env(monkeypatch, scripted_llm)
    files = _split_locomo(archives, sessions=1)
    assert len(files) == 10
    good = files[5].read_text()
    files[5].write_text(good[: len(good) // 2])  # chunk 2 of 3 holds a truncated archive

    first = backfill(store=str(store), glob=str(archives / "*.json"), chunk_size=4, chunk_retries=0,
                     label="locomo10", return_state=True)

    assert first.is_failed()
    assert "chunks [2] of 3 failed" in str(first.message)
    assert _chunk_runs(first.state_details.flow_run_id) == {
        "backfill-chunk/1-of-3": "Completed", "backfill-chunk/2-of-3": "Failed", "backfill-chunk/3-of-3": "Completed"}
    done = {f.stem for f in files[:4] + files[8:]}
    assert set(published(store).conversations) == done  # chunk 2 wrote nothing (one transaction per chunk)
    requests_first = len(scripted_llm.requests)

    files[5].write_text(good)
    second = backfill(store=str(store), glob=str(archives / "*.json"), chunk_size=4, chunk_retries=0,
                      label="locomo10", return_state=True)

    assert second.is_completed(), second.message
    chunks: list[dict[str, Any]] = second.result()
    assert [(c["number"], c["skipped"]) for c in chunks] == [(1, True), (2, False), (3, True)]
    assert chunks[1]["built"] == sorted(f.stem for f in files[4:8])
    assert chunks[0]["new_turns"] == chunks[2]["new_turns"] == 0 and chunks[1]["new_turns"] > 0
    assert set(published(store).conversations) == {f.stem for f in files}
    # The resumed run asked only for chunk 2's conversations: the LLM calls of its one build.
    assert len(scripted_llm.requests) - requests_first == chunks[1]["llm_calls"] > 0
    con = connect(store, read_only=True)
    try:
        assert con.execute("SELECT count(DISTINCT conversation_id) FROM scenes").fetchone() == (10,)
    finally:
        con.close()

"""Build runs and quarantine in the explorer after real builds (the Prefect flow, the scripted
server): the snapshot carries the builder's records as they stood at its publish, so the
explorer shows them without ever opening ``work.duckdb``.

Build 1 quarantines conv-30 (segmentation answers stay schema-invalid) and publishes the others;
build 2, with a sane model, builds conv-30 and clears the quarantine.
"""

from __future__ import annotations

from pathlib import Path

import pytest
from fastapi.testclient import TestClient

import tmem.devtools.synth as synth
from tests.flow_helpers import build, ingest_slice, published, set_llm_env
from tests.test_faults import BROKEN, CONVERSATIONS, INVALID_ANSWER, _boundaries_invalid_for
from tmem.devtools.scripted_llm import ScriptedLLM
from tmem.query.memory import Memory
from tmem.query.service import create_app
from tmem.settings import Settings

pytestmark = [pytest.mark.prefect, pytest.mark.slow, pytest.mark.timeout(900)]


def test_runs_and_quarantine_of_real_builds_reach_the_explorer(
    prefect_harness: None, scripted_llm: ScriptedLLM, monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    store = tmp_path / "store"
    set_llm_env(monkeypatch, scripted_llm)
    ingest_slice(store, tmp_path / "s1.json", dict.fromkeys(CONVERSATIONS, 1))
    scripted_llm.set_responder("scene_boundaries", _boundaries_invalid_for(BROKEN))
    first = build(store)
    assert first["status"] == "partial" and first["quarantined"] == [BROKEN]

    settings = Settings(store=store)
    client = TestClient(create_app(store, settings, memory=Memory.open(store, settings, refresh_ms=0), refresh_ms=0))
    overview = client.get("/explorer/api/overview").json()
    assert overview["snapshot"]["snapshot_id"] == first["snapshot_id"] == published(store).snapshot_id
    assert sorted(r["conversation_id"] for r in overview["conversations"]) == sorted(set(CONVERSATIONS) - {BROKEN})
    assert all(r["run_id"] == first["run_id"] and r["scenes"] > 0 for r in overview["conversations"])
    assert overview["quarantine_active"] == 1
    [run] = client.get("/explorer/api/runs").json()["runs"]
    # The publishing run, as recorded at its publish: still running, its figures not final yet.
    assert (run["run_id"], run["status"], run["published_current"]) == (first["run_id"], "running", True)
    assert run["conversations_requested"] == len(CONVERSATIONS)
    [record] = client.get("/explorer/api/quarantine").json()["records"]
    assert (record["conversation_id"], record["state"], record["published"], record["run_id"]) == (
        BROKEN, "active", False, first["run_id"])
    [detail] = client.post("/explorer/api/conversation/quarantine", json={"conversation_id": BROKEN}).json()["records"]
    assert detail["raw_output"] == INVALID_ANSWER and detail["operation"] == "scene_boundaries"

    scripted_llm.set_responder("scene_boundaries", synth.scene_boundaries)
    second = build(store, [BROKEN])
    assert second["status"] == "completed"

    overview = client.get("/explorer/api/overview").json()
    assert overview["snapshot"]["snapshot_id"] == second["snapshot_id"] and overview["quarantine_active"] == 0
    rows = {r["conversation_id"]: r for r in overview["conversations"]}
    assert set(rows) == set(CONVERSATIONS) and rows[BROKEN]["run_id"] == second["run_id"]
    assert rows[BROKEN]["quarantined"] is False
    runs = {r["run_id"]: r for r in client.get("/explorer/api/runs").json()["runs"]}
    done = runs[first["run_id"]]  # finished after its publish: final in this later snapshot
    assert (done["status"], done["snapshot_id"], done["published_current"]) == ("partial", first["snapshot_id"], False)
    assert done["llm_calls"] == first["llm_calls"] > 0
    assert [(f["conversation_id"], f["quarantined"]) for f in done["failures"]] == [(BROKEN, True)]
    assert runs[second["run_id"]]["published_current"] is True
    [cleared] = client.get("/explorer/api/quarantine").json()["records"]
    assert (cleared["state"], cleared["cleared_by_run"], cleared["published"]) == ("cleared", second["run_id"], True)

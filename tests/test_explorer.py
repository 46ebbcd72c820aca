"""The memory explorer's data API (``/explorer/api``) through FastAPI's TestClient: what each
endpoint reads from the published snapshot, scope (exact ids, hostile ids), errors and the key.

The page itself is tested in a real browser (tests/test_explorer_browser.py); its assets and
packaging in tests/test_explorer_assets.py; run records from a real build in
tests/test_explorer_build.py.
"""

from __future__ import annotations

import json
import re
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

import duckdb
import pytest
from fastapi.testclient import TestClient
from pydantic import SecretStr

from tests.explorer_store import HOSTILE, LATE_TURNS, RAW_OUTPUT, ExplorerStore, build_explorer_store
from tests.query_store import HashEmbedder, make_conv, publish
from tests.test_query_service import HOSTILE_IDS
from tmem.explorer.routes import NO_RECORDS_NOTE
from tmem.query.memory import Memory
from tmem.query.service import MAX_CONVERSATION_ID_CHARS, create_app
from tmem.retrieval.context import estimate_tokens
from tmem.settings import Settings

API_KEY = "explorer-key-5b1e0c9d7a"
CHANNELS = {"lexical", "dense", "dialogue", "scene_trigger", "horizon", "entity_bridge"}
MARK = re.compile(r"\b(?:alpha|beta|qzx\d+mark|qmark)\b")
BRIDGE_QUERY = "planning a weekend of summit"  # a bridge trigger of the hiking items, word for word


@pytest.fixture(scope="module")
def es(tmp_path_factory: pytest.TempPathFactory) -> ExplorerStore:
    return build_explorer_store(tmp_path_factory.mktemp("explorer") / "store")


def client_for(store: Path, *, api_key: str | None = None, pending: Callable[[], Mapping[str, int]] | None = None,
               refresh_ms: int = 500) -> TestClient:
    settings = Settings(store=store, api_key=SecretStr(api_key) if api_key else None)
    memory = Memory.open(store, settings, embedder=HashEmbedder(), refresh_ms=refresh_ms)
    return TestClient(create_app(store, settings, memory=memory, refresh_ms=refresh_ms, pending_turns=pending))


@pytest.fixture(scope="module")
def client(es: ExplorerStore) -> TestClient:
    return client_for(es.path)


def marks(payload: Any) -> set[str]:
    return set(MARK.findall(json.dumps(payload, ensure_ascii=False)))


def test_overview_lists_published_conversations_with_counts_last_build_and_waiting_turns(
    es: ExplorerStore, client: TestClient
) -> None:
    body = client.get("/explorer/api/overview").json()
    assert body["snapshot"]["snapshot_id"] == es.info.snapshot_id
    rows = {r["conversation_id"]: r for r in body["conversations"]}
    assert set(rows) == set(es.convs)  # conv-q was never built: not listed
    for cid, conv in es.convs.items():
        row, memory = rows[cid], conv.memory
        assert (row["scenes"], row["topics"], row["items"], row["personas"]) == (
            len(memory.scenes), len(memory.topics), len(memory.items), len(memory.personas))
        assert row["atomic_items"] == sum(i.kind == "atomic" for i in memory.items)
        assert row["connected_items"] == sum(i.kind == "connected" for i in memory.items)
        assert row["entity_triggers"] == sum(len(t.entities) for t in memory.item_triggers)
        assert row["bridge_triggers"] == sum(len(t.bridges) for t in memory.item_triggers)
        assert row["horizon_triggers"] == sum(1 for t in memory.scene_triggers for v in t.horizons.values() if v)
        assert row["run_id"] == "run-test" and row["built_at"] == "2026-01-05T09:00:00Z"
        assert row["first_turn_at"] == conv.turns[0].event_time.isoformat().replace("+00:00", "Z")
        assert row["pending_turns"] == 0 and row["quarantined"] is False
    assert rows["conv-b"]["unbuilt_turns"] == LATE_TURNS and rows["conv-b"]["turns"] == len(es.convs["conv-b"].turns) + 2
    assert rows["conv-a"]["unbuilt_turns"] == 0
    assert "default" in body["presets"] and body["defaults"]["trigger_gate"] == 0.85
    assert body["quarantine_active"] == 1  # conv-q, unpublished


def test_pending_turns_come_from_the_hook(es: ExplorerStore) -> None:
    counts = {"conv-a": 3, "not-published": 9}
    rows = {r["conversation_id"]: r for r in client_for(es.path, pending=lambda: counts)
            .get("/explorer/api/overview").json()["conversations"]}
    assert rows["conv-a"]["pending_turns"] == 3 and rows["conv-b"]["pending_turns"] == 0
    assert "not-published" not in rows


@pytest.mark.parametrize("cid", ["conv-a", "conv-b", *HOSTILE])
def test_a_conversation_opens_by_its_exact_id_with_its_own_memory_only(
    es: ExplorerStore, client: TestClient, cid: str
) -> None:
    response = client.post("/explorer/api/conversation", json={"conversation_id": cid})
    assert response.status_code == 200
    body = response.json()
    memory = es.convs[cid].memory
    assert body["conversation"]["conversation_id"] == cid and marks(body) == {es.mark(cid)}
    assert [s["scene_id"] for s in body["scenes"]] == [s.scene_id for s in sorted(memory.scenes, key=lambda s: s.seq)]
    assert {t["topic_id"]: t["scene_ids"] for t in body["topics"]} == {t.topic_id: list(t.scene_ids) for t in memory.topics}
    items = {i["item_id"]: i for i in body["items"]}
    assert set(items) == {i.item_id for i in memory.items}
    for trig in memory.item_triggers:
        assert items[trig.item_id]["entities"] == list(trig.entities)
        assert items[trig.item_id]["bridges"] == [b.model_dump() for b in trig.bridges]
    scenes = {s["scene_id"]: s for s in body["scenes"]}
    for st in memory.scene_triggers:
        assert scenes[st.scene_id]["triggers"]["emotion"] == st.emotion
        assert scenes[st.scene_id]["horizons"] == st.horizons
    first = memory.scenes[0]
    assert scenes[first.scene_id]["item_ids"] == [i.item_id for i in memory.items if first.scene_id in i.source_scene_ids]
    assert scenes[first.scene_id]["turn_count"] == len(first.turn_ids)
    assert [p["speaker"] for p in body["personas"]] == [p.speaker for p in memory.personas]


def test_turns_are_read_on_demand_per_scene_and_scoped(es: ExplorerStore, client: TestClient) -> None:
    scene = es.convs["conv-a"].memory.scenes[2]
    body = client.post("/explorer/api/turns", json={"conversation_id": "conv-a", "scene_id": scene.scene_id}).json()
    assert [t["turn_id"] for t in body["turns"]] == list(scene.turn_ids)
    assert all("alpha" in t["text"] for t in body["turns"])
    near_miss = "conv-a "  # its scene ids equal conv-a's (same generator): its own turns come back
    other = client.post("/explorer/api/turns", json={"conversation_id": near_miss, "scene_id": "scn_1"}).json()
    assert other["turns"] and all(es.mark(near_miss) in t["text"] for t in other["turns"])
    missing = client.post("/explorer/api/turns", json={"conversation_id": "conv-a", "scene_id": "scn_999"})
    assert missing.status_code == 404 and missing.json() == {"detail": "scene not found"}


def test_explain_draws_every_stage_and_matches_search(es: ExplorerStore, client: TestClient) -> None:
    query = {"conversation_id": "conv-a", "query": BRIDGE_QUERY}
    body = client.post("/explorer/api/explain", json=query).json()
    searched = client.post("/search", json=query).json()
    assert [s["scene_id"] for s in body["scenes"]] == [s["scene_id"] for s in searched["scenes"]]
    assert [i["item_id"] for i in body["items"]] == [i["item_id"] for i in searched["items"]]
    assert [s["stage"] for s in body["stages"]] == ["topic_prefilter", "scene_cue", "scene_selection", "trig_recall",
                                                    "item_selection"]
    stages = {s["stage"]: s for s in body["stages"]}
    assert stages["scene_cue"]["lists"] == ["dialogue", "scene_trigger", "horizon"]
    assert stages["item_selection"]["limits"] == {"lexical": 15, "dense": 15, "entity_bridge": 10}
    reached = {ch for s in body["stages"] for c in s["candidates"] for ch in c["channels"]}
    reached |= {ch for hit in body["scenes"] + body["items"] for ch in hit["channels"]}
    assert reached == CHANNELS
    memory = es.convs["conv-a"].memory
    labels = {s.scene_id: s.title for s in memory.scenes} | {i.item_id: i.content for i in memory.items} | {
        t.topic_id: t.title for t in memory.topics}
    assert all(c["label"] == labels[c["id"]] for s in body["stages"] for c in s["candidates"])
    assert marks(body["stages"]) == {"alpha"}
    gate = body["gate"]
    hiking = {i.item_id for i in memory.items if i.item_id.startswith("itm_1_")}
    # the default gate is standardised: τ is the cosine this query's distribution required (the trace's threshold)
    assert gate["rule"] == "robust_z" and gate["tau"] == pytest.approx(stages["trig_recall"]["threshold"])
    assert gate["passed"] == len(hiking) and gate["best"] == pytest.approx(1.0) and gate["tau"] < 1.0
    assert set(stages["trig_recall"]["selected"]) == hiking
    assert all("entity_bridge" in i["channels"] for i in body["items"] if i["item_id"] in hiking)
    context = body["context"]
    assert context["report"]["scenes_kept"] == len(body["scenes"]) and context["report"]["scenes_dropped"] == 0
    for unit in context["units"]:
        assert unit["in_context"] and unit["tokens"] > 0
    assert all(s["title"] in context["text"] for s in body["scenes"])
    assert sum(u["tokens"] for u in context["units"] if u["kind"] != "persona") >= context["report"]["tokens_used"] - 20


def test_explain_reports_what_a_small_budget_dropped_and_the_lexical_mode(client: TestClient) -> None:
    body = client.post("/explorer/api/explain", json={"conversation_id": "conv-b", "query": "garden tomatoes seeds",
                                                      "budget_tokens": 150}).json()
    report, units = body["context"]["report"], body["context"]["units"]
    kept = [u for u in units if u["kind"] != "persona" and u["in_context"]]
    assert report["scenes_dropped"] + report["items_dropped"] > 0
    assert len(kept) == report["scenes_kept"] + report["items_kept"]
    whole = [u for u in kept if u["kind"] == "item" or u["turns_in_context"] == u["turns"]]
    assert sum(u["tokens"] for u in whole) <= report["budget"] and report["tokens_used"] <= 150
    assert report["turns_kept"] == sum(u["turns_in_context"] or 0 for u in kept if u["kind"] == "scene")
    assert all((u["label"] in body["context"]["text"]) == u["in_context"] for u in units if u["kind"] == "scene")
    assert estimate_tokens(body["context"]["text"]) == report["total_tokens"]

    lexical = client.post("/explorer/api/explain", json={"conversation_id": "conv-b", "query": "garden tomatoes",
                                                         "embed": False}).json()
    assert lexical["mode"] == "lexical" and lexical["gate"] is None
    assert [s["stage"] for s in lexical["stages"]] == ["topic_prefilter", "scene_selection", "item_selection"]
    assert {ch for s in lexical["stages"] for c in s["candidates"] for ch in c["channels"]} == {"lexical"}


def test_runs_and_quarantine_come_from_the_snapshot(es: ExplorerStore, client: TestClient) -> None:
    runs = client.get("/explorer/api/runs").json()
    assert runs["recorded"] is True and runs["snapshot_id"] == es.info.snapshot_id
    by_id = {r["run_id"]: r for r in runs["runs"]}
    assert list(by_id) == ["run-test", "run-old", "run-older"]  # newest first
    publishing = by_id["run-test"]
    assert (publishing["status"], publishing["published_current"], publishing["snapshot_id"]) == (
        "running", True, es.info.snapshot_id)
    old = by_id["run-old"]
    assert (old["status"], old["llm_calls"], old["prompt_tokens"], old["only_changed"]) == ("partial", 12, 3400, True)
    assert [(f["conversation_id"], f["quarantined"]) for f in old["failures"]] == [("conv-q", True)]
    assert [s["snapshot_id"] for s in runs["snapshots"] if s["current"]] == [es.info.snapshot_id]

    records = client.get("/explorer/api/quarantine").json()["records"]
    assert [(q["conversation_id"], q["state"], q["published"]) for q in records] == [
        ("conv-q", "active", False), ("conv-b", "cleared", True)]
    assert not {"raw_output", "input_excerpt"} & set(records[0])  # details only on the conversation's own page
    detail = client.post("/explorer/api/conversation/quarantine", json={"conversation_id": "conv-q"}).json()
    [record] = detail["records"]
    assert (record["raw_output"], record["input_digest"], record["published"]) == (RAW_OUTPUT, "d" * 64, False)
    assert client.post("/explorer/api/conversation/quarantine", json={"conversation_id": "conv-a"}).json()["records"] == []
    assert client.post("/explorer/api/conversation", json={"conversation_id": "conv-q"}).status_code == 404
    unknown = client.post("/explorer/api/conversation/quarantine", json={"conversation_id": "conv-q "})
    assert unknown.status_code == 404


def test_a_snapshot_published_before_records_were_copied_says_so(tmp_path: Path) -> None:
    store = build_explorer_store(tmp_path / "store", hostile=False)
    con = duckdb.connect(str(store.info.memory_db))
    con.execute("DROP TABLE build_runs")
    con.execute("DROP TABLE quarantine")
    con.close()
    client = client_for(store.path)
    runs = client.get("/explorer/api/runs").json()
    assert (runs["recorded"], runs["runs"], runs["note"]) == (False, [], NO_RECORDS_NOTE)
    assert client.get("/explorer/api/quarantine").json()["records"] == []
    assert len(client.get("/explorer/api/overview").json()["conversations"]) == 2


def test_the_explorer_follows_a_new_snapshot(tmp_path: Path) -> None:
    store = build_explorer_store(tmp_path / "store", hostile=False)
    client = client_for(store.path, refresh_ms=0)
    assert client.get("/explorer/api/overview").json()["snapshot"]["snapshot_id"] == store.info.snapshot_id
    second = publish(store.path, [make_conv("conv-a", mark="alpha", tag="v2", scenes=4)], HashEmbedder())
    body = client.get("/explorer/api/overview").json()
    rows = {r["conversation_id"]: r for r in body["conversations"]}
    assert body["snapshot"]["snapshot_id"] == second.snapshot_id and rows["conv-a"]["scenes"] == 4
    scenes = client.post("/explorer/api/conversation", json={"conversation_id": "conv-a"}).json()["scenes"]
    assert all(s["scene_id"].startswith("scnv2_") for s in scenes)


ENDPOINTS: list[tuple[str, str, dict[str, Any] | None]] = [
    ("GET", "/explorer/api/overview", None),
    ("GET", "/explorer/api/runs", None),
    ("GET", "/explorer/api/quarantine", None),
    ("POST", "/explorer/api/conversation", {"conversation_id": "conv-a"}),
    ("POST", "/explorer/api/turns", {"conversation_id": "conv-a", "scene_id": "scn_0"}),
    ("POST", "/explorer/api/explain", {"conversation_id": "conv-a", "query": "pottery"}),
    ("POST", "/explorer/api/conversation/quarantine", {"conversation_id": "conv-a"}),
]
SCOPED = [(path, body) for method, path, body in ENDPOINTS if body is not None]


def test_the_api_key_guards_every_data_endpoint_but_not_the_page(es: ExplorerStore) -> None:
    client = client_for(es.path, api_key=API_KEY)
    for headers in ({}, {"Authorization": "Bearer wrong"}, {"Authorization": f"Basic {API_KEY}"}, {"X-API-Key": API_KEY}):
        for method, path, body in ENDPOINTS:
            response = client.request(method, path, json=body, headers=headers)
            assert response.status_code == 401, (path, headers)
            assert response.json() == {"detail": "missing or invalid API key"} and API_KEY not in response.text
    for method, path, body in ENDPOINTS:
        ok = client.request(method, path, json=body, headers={"Authorization": f"Bearer {API_KEY}"})
        assert ok.status_code == 200, path
        assert ok.headers["cache-control"] == "no-store" and API_KEY not in ok.text
    assert client.get("/explorer/").status_code == 200 and client.get("/explorer/assets/app.js").status_code == 200
    assert client.get("/", follow_redirects=False).headers["location"] == "/explorer/"


@pytest.mark.parametrize("hostile", [i for i in HOSTILE_IDS if i not in HOSTILE])  # HOSTILE: published here
def test_hostile_or_unknown_ids_get_404_or_422_without_data_or_echo(client: TestClient, hostile: str) -> None:
    for path, body in SCOPED:
        response = client.post(path, json=body | {"conversation_id": hostile})
        assert response.status_code in (404, 422), (path, response.status_code)
        assert set(response.json()) == {"detail"} and not marks(response.json())
        if len(hostile) > 3:
            assert hostile not in response.text


def test_malformed_requests_are_422(client: TestClient) -> None:
    too_long = "x" * (MAX_CONVERSATION_ID_CHARS + 1)
    for path, body in SCOPED:
        assert client.post(path, json={k: v for k, v in body.items() if k != "conversation_id"}).status_code == 422
        assert client.post(path, json=body | {"conversation_id": ""}).status_code == 422
        assert client.post(path, json=body | {"conversation_id": too_long}).status_code == 422
        assert client.post(path, json=body | {"tenant": "conv-b"}).status_code == 422
    explain = "/explorer/api/explain"
    assert client.post(explain, json={"conversation_id": "conv-a", "query": ""}).status_code == 422
    bad = client.post(explain, json={"conversation_id": "conv-a", "query": "x", "preset": "nope"})
    assert bad.status_code == 422 and "paper" in bad.json()["detail"]
    assert client.post(explain, json={"conversation_id": "conv-a", "query": "x", "budget_tokens": -1}).status_code == 422


def test_before_the_first_publish_the_data_is_503_and_the_page_loads(tmp_path: Path) -> None:
    store = tmp_path / "empty"
    store.mkdir()
    client = client_for(store)
    assert client.get("/explorer/").status_code == 200
    for method, path, body in ENDPOINTS:
        response = client.request(method, path, json=body)
        assert response.status_code == 503 and response.json() == {"detail": "no memory has been published yet"}

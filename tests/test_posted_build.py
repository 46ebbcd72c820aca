"""Posted turns and the builder (issue 16, point 3), under Prefect's test harness.

While a build runs (it holds ``work.duckdb``: no other process can open it), turns posted over
HTTP and through the MCP ``add_turns`` tool are accepted at once and wait in the spool; the next
build (``only_changed``, as ``tmem build --changed`` runs it) drains them and publishes a memory
that holds them; so does the nightly flow, which drains before it looks for changed conversations.
"""

from __future__ import annotations

import os
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any

import anyio
import httpx
import pytest
from mcp import Client

from tests.flow_helpers import ingest_slice, published, set_llm_env, snapshot_memory, wait_for
from tests.query_store import HashEmbedder
from tests.test_posted_turns import T0, turns_url
from tests.test_query_service import REPO, LiveServer, app_for
from tmem.devtools.scripted_llm import ScriptedLLM
from tmem.ingest.spool import Spool
from tmem.query.mcp_server import create_mcp_server
from tmem.query.memory import Memory
from tmem.settings import Settings

pytestmark = [pytest.mark.prefect, pytest.mark.slow]

BUSY, LIVE = "conv-26", "conv-30"  # conv-30 is Jon and Gina
OPEN_WORK_DB = "import sys; from pathlib import Path; from tmem.store.duck import connect; connect(Path(sys.argv[1]), read_only=True)"


def live_turns(prefix: str, start_s: int, session: str) -> list[dict[str, Any]]:
    lines = ["Gina, I finally signed the lease for the dance studio downtown.",
             "Jon, that is wonderful news, when do the first classes start?",
             "Next Monday; I booked a salsa teacher from Madrid for the opening."]
    return [{"session_id": session, "turn_id": f"{prefix}{k}", "speaker": ("Jon", "Gina")[k % 2], "text": text,
             "timestamp": T0.replace(second=start_s + k).isoformat()} for k, text in enumerate(lines)]


def test_turns_posted_during_a_build_are_accepted_at_once_and_built_by_the_next(
    prefect_harness: None, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from tmem.flows.build_memory import build_memory

    store = tmp_path / "store"
    ingest_slice(store, tmp_path / "slice.json", {BUSY: 1, LIVE: 1})
    server = ScriptedLLM(latency_ms=150).start()
    set_llm_env(monkeypatch, server)
    results: dict[str, Any] = {}
    builder = threading.Thread(target=lambda: results.update(first=build_memory(store=str(store), label="busy")))
    settings = Settings(store=store)
    memory = Memory.open(store, settings, embedder=HashEmbedder(), refresh_ms=0)
    live = LiveServer(app_for(store, settings)).start()
    try:
        builder.start()
        wait_for(lambda: True if server.requests else None, timeout_s=120, what="the build's first LLM call")
        # The builder holds the working database: another process cannot even open it read-only.
        env = {**os.environ, "PYTHONPATH": str(REPO)}
        probe = subprocess.run([sys.executable, "-c", OPEN_WORK_DB, str(store)], env=env, capture_output=True,
                               text=True, timeout=120)
        assert probe.returncode != 0 and "lock" in probe.stderr.lower(), probe.stderr[-500:]
        assert builder.is_alive()
        with httpx.Client(base_url=live.url, timeout=10) as client:
            started = time.perf_counter()
            posted = client.post(turns_url(LIVE), json={"turns": live_turns("web", 0, "live-1")})
            took = time.perf_counter() - started
        assert posted.status_code == 202 and posted.json()["new_turns"] == 3
        assert took < 5.0, f"the post waited {took:.1f} s"

        async def add_over_mcp() -> dict[str, Any]:
            async with Client(create_mcp_server(memory, Spool(store), settings)) as client:
                result = await client.call_tool("add_turns", {"conversation_id": LIVE,
                                                              "turns": live_turns("mcp", 10, "live-1")})
                assert not result.is_error, result.content
                return result.structured_content or {}

        added = anyio.run(add_over_mcp)
        assert added["new_turns"] == 3 and added["pending_turns"] == 6
        builder.join(timeout=600)
        assert results["first"]["status"] == "completed", results["first"]["failures"]
        first = published(store)
        posted_ids = {f"web{k}" for k in range(3)} | {f"mcp{k}" for k in range(3)}
        built_turns = {t for s in snapshot_memory(first, LIVE).scenes for t in s.turn_ids}
        assert not posted_ids & built_turns  # posted after the build had read its input
        with httpx.Client(base_url=live.url, timeout=10) as client:
            listing = {c["conversation_id"]: c for c in client.get("/conversations").json()}
        assert listing[LIVE]["pending_turns"] == 6 and listing[BUSY]["pending_turns"] == 0

        second = build_memory(store=str(store), only_changed=True, label="changed")
        assert second["status"] == "completed", second["failures"]
        assert second["spool"]["files"] == 2 and second["spool"]["new_turns"] == 6
        assert second["conversations_built"] == [LIVE]
        rebuilt = snapshot_memory(published(store), LIVE)
        assert posted_ids <= {t for s in rebuilt.scenes for t in s.turn_ids}
        assert Spool(store).pending_turns() == {}
        with httpx.Client(base_url=live.url, timeout=10) as client:
            wait_for(lambda: True if client.get("/health").json()["snapshot_id"] == published(store).snapshot_id
                     else None, timeout_s=10, what="the service to follow the new snapshot")
            found = client.post("/search", json={"query": "salsa teacher from Madrid dance studio lease",
                                                 "conversation_id": LIVE, "embed": False}).json()
            listing = {c["conversation_id"]: c for c in client.get("/conversations").json()}
        assert any(t["turn_id"] in posted_ids for s in found["scenes"] for t in s["turns"])
        assert listing[LIVE]["pending_turns"] == 0

        # The nightly flow drains before it looks for changes: a conversation changed only by a post is rebuilt.
        from tmem.flows.nightly_rebuild import nightly_rebuild

        with httpx.Client(base_url=live.url, timeout=10) as client:
            late = client.post(turns_url(LIVE), json={"turns": live_turns("late", 20, "live-2")})
        assert late.status_code == 202 and late.json()["pending_turns"] == 3
        nightly = nightly_rebuild(store=str(store), label="posted")
        assert nightly["changed"] == [LIVE] and nightly["build"]["status"] == "completed"
        nightly_memory = snapshot_memory(published(store), LIVE)
        assert {"late0", "late1", "late2"} <= {t for s in nightly_memory.scenes for t in s.turn_ids}
        assert Spool(store).pending_turns() == {}
    finally:
        live.stop()
        builder.join(timeout=600)
        server.stop()

"""Helpers for the flow tests (tests/test_flow_build.py): small LoCoMo slices, builds, snapshot reads.

Nothing here imports Prefect at import time: the harness fixture sets ``PREFECT_HOME`` first.
"""

from __future__ import annotations

import io
import json
import time
from collections.abc import Callable, Iterable, Mapping
from datetime import UTC, datetime
from pathlib import Path
from typing import Any, TypeVar

import duckdb
import pytest

import tmem.devtools.synth as synth  # registers the deterministic responders
from tests.paths import LOCOMO10
from tmem.cli import run as cli_run
from tmem.cli.base import CliContext
from tmem.devtools.responders import Responder, request_input
from tmem.devtools.scripted_llm import ScriptedLLM
from tmem.domain import ConversationMemory
from tmem.ingest import ingest_archives
from tmem.store.duck import connect
from tmem.store.lance import ConversationVectors, VectorStore
from tmem.store.lance_location import VECTOR_TABLE
from tmem.store.memory_rows import read_memory
from tmem.store.runs import RunRecord, list_runs
from tmem.store.snapshot.published import SnapshotInfo, current_snapshot

T = TypeVar("T")

INGEST_NOW = datetime(2024, 1, 1, 12, 0, tzinfo=UTC)  # record time of every test ingest
EMBED_DIM = 384  # the shipped all-MiniLM-L6-v2
# conv-26 is Caroline and Melanie, conv-30 is Jon and Gina.
SPEAKERS = {"conv-26": frozenset({"Caroline", "Melanie"}), "conv-30": frozenset({"Jon", "Gina"})}
# Every vector view DESIGN.md §3 asks for, as (owner_kind, view).
ALL_VIEWS = frozenset({
    ("topic", "summary"), ("scene", "summary"), ("scene", "dlg"), ("scene", "scn"), ("scene", "hor"),
    ("item", "content"), ("item", "con"), ("item", "brg"), ("item", "joint"),
})
COUNT_KEYS = (
    "conversations", "sessions", "turns", "scenes", "topics", "items", "atomic_items", "connected_items",
    "entity_triggers", "bridge_triggers", "scene_triggers", "horizon_triggers", "personas", "llm_calls",
    "llm_cache_hits",
)


def write_locomo_slice(path: Path, sessions: Mapping[str, int]) -> Path:
    """A LoCoMo file holding sessions 1..n of each named conversation of locomo10.json (no QA)."""
    samples = {s["sample_id"]: s for s in json.loads(LOCOMO10.read_text(encoding="utf-8"))}
    out: list[dict[str, Any]] = []
    for cid, count in sessions.items():
        full = samples[cid]["conversation"]
        conversation: dict[str, Any] = {"speaker_a": full["speaker_a"], "speaker_b": full["speaker_b"]}
        for n in range(1, count + 1):
            conversation[f"session_{n}_date_time"] = full[f"session_{n}_date_time"]
            conversation[f"session_{n}"] = full[f"session_{n}"]
        out.append({"sample_id": cid, "conversation": conversation, "qa": []})
    path.write_text(json.dumps(out, ensure_ascii=False), encoding="utf-8")
    return path


def ingest_slice(store: Path, archive: Path, sessions: Mapping[str, int]) -> None:
    ingest_archives([write_locomo_slice(archive, sessions)], store, now=INGEST_NOW)


def set_llm_env(mp: pytest.MonkeyPatch, server: ScriptedLLM, **extra: str) -> None:
    """Point the build role at the scripted server with quick adapter retries (``extra`` wins)."""
    env = {"TMEM_LLM_BASE_URL": server.url, "TMEM_LLM_API_KEY": "sk-test", "TMEM_LLM_BACKOFF_S": "0.01",
           "TMEM_LLM_TIMEOUT_S": "30", **extra}
    for key, value in env.items():
        mp.setenv(key, value)


def build(store: Path, conversation_ids: list[str] | None = None) -> dict[str, Any]:
    """Run the ``build-memory`` flow in this process (tasks in threads) and return its summary."""
    from tmem.flows.build_memory import build_memory  # after the harness fixture configured Prefect

    label = ",".join(conversation_ids) if conversation_ids else "all"
    result: dict[str, Any] = build_memory(store=str(store), conversation_ids=conversation_ids, label=label)
    return result


def cli_json(argv: list[str]) -> dict[str, Any]:
    """Run a ``tmem ... --json`` command in-process; its stdout parsed (exit code must be 0)."""
    out, err = io.StringIO(), io.StringIO()
    code = cli_run(argv, CliContext(stdout=out, stderr=err))
    assert code == 0, f"tmem {' '.join(argv)} exited {code}: {err.getvalue()}"
    parsed: dict[str, Any] = json.loads(out.getvalue())
    return parsed


def published(store: Path) -> SnapshotInfo:
    info = current_snapshot(store)
    assert info is not None, f"{store}: nothing published"
    return info


def snapshot_memory(info: SnapshotInfo, conversation_id: str) -> ConversationMemory:
    con = duckdb.connect(str(info.memory_db), read_only=True)
    con.execute("SET TimeZone = 'UTC'")
    try:
        return read_memory(con, conversation_id)
    finally:
        con.close()


def snapshot_vectors(info: SnapshotInfo, conversation_id: str) -> ConversationVectors:
    """The conversation's vector rows at the Lance version the snapshot pins."""
    store = VectorStore(info.lance_uri, dim=EMBED_DIM)
    return store.load_conversation(VECTOR_TABLE, conversation_id, version=info.lance_versions[VECTOR_TABLE])


def views_of(vectors: ConversationVectors) -> set[tuple[str, str]]:
    frame = vectors.to_polars()
    return set(zip(frame["owner_kind"].to_list(), frame["view"].to_list(), strict=True))


def build_run(store: Path, run_id: str) -> RunRecord:
    con = connect(store, read_only=True)
    try:
        runs = {r.run_id: r for r in list_runs(con, limit=100)}
    finally:
        con.close()
    assert run_id in runs, f"build_runs has no row for {run_id}: {sorted(runs)}"
    return runs[run_id]


def ledger_rows(store: Path, run_id: str) -> list[tuple[str, bool]]:
    """(operation, cache_hit) of every usage-ledger row of one run."""
    con = connect(store, read_only=True)
    try:
        rows = con.execute("SELECT operation, cache_hit FROM llm_usage WHERE run_id = ?", [run_id]).fetchall()
    finally:
        con.close()
    return [(str(op), bool(hit)) for op, hit in rows]


def dialogue_speakers(request_json: dict[str, Any]) -> set[str]:
    """Speakers in an ``item_extract`` request's input (its conversation id is not rendered)."""
    data = request_input(request_json)
    return {
        str(turn.get("speaker")) for scene in data["scenes"] for block in scene["dialogue"] for turn in block["turns"]
    }


def item_extract_citing_missing_scene(speakers: Iterable[str]) -> Responder:
    """synth's ``item_extract``, except that for dialogue of ``speakers`` every item cites scene ``S999``."""
    targets = frozenset(speakers)

    def respond(operation: str, request_json: dict[str, Any]) -> str:
        content = synth.item_extract(operation, request_json)
        if not dialogue_speakers(request_json) & targets:
            return content
        answer = json.loads(content)
        for item in answer["items"]:
            item["sources"] = ["S999"]
        return json.dumps(answer)

    return respond


def boundary_speakers(request_json: dict[str, Any]) -> set[str]:
    """Speakers in a ``scene_boundaries`` request's turns (open scene and new turns)."""
    data = request_input(request_json)
    return {str(t["speaker"]) for key in ("open_scene", "new_turns") for block in data[key] for t in block["turns"]}


def boundaries_closing_at_a_missing_turn(speakers: Iterable[str]) -> Responder:
    """synth's ``scene_boundaries``, except that for dialogue of ``speakers`` every scene closes at turn
    ``D999:1``, which is not among the new turns (a check rejects it; segmentation is the spine)."""
    targets = frozenset(speakers)

    def respond(operation: str, request_json: dict[str, Any]) -> str:
        content = synth.scene_boundaries(operation, request_json)
        if not boundary_speakers(request_json) & targets:
            return content
        answer = json.loads(content)
        for scene in answer["closed"]:
            scene["last_turn"] = "D999:1"
        return json.dumps(answer)

    return respond


def report_artifact(run_id: str) -> str:
    """The ``tmem-build-report`` markdown artifact of the build-memory flow run ``run_id``."""
    from uuid import UUID

    from prefect.client.orchestration import get_client
    from prefect.client.schemas.filters import ArtifactFilter, ArtifactFilterFlowRunId, ArtifactFilterKey

    with get_client(sync_client=True) as client:
        artifacts = client.read_artifacts(artifact_filter=ArtifactFilter(
            key=ArtifactFilterKey(any_=["tmem-build-report"]),
            flow_run_id=ArtifactFilterFlowRunId(any_=[UUID(run_id)]),
        ))
    assert len(artifacts) == 1
    return str(artifacts[0].data)


def wait_for(probe: Callable[[], T | None], timeout_s: float = 15.0, what: str = "condition") -> T:
    """Poll ``probe`` until it returns a non-None value (Prefect records task states via events, async)."""
    deadline = time.monotonic() + timeout_s
    while True:
        found = probe()
        if found is not None:
            return found
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {timeout_s} s waiting for {what}")
        time.sleep(0.25)


def work_memory(store: Path, conversation_id: str) -> ConversationMemory:
    """The conversation's memory in the builder's working database."""
    con = connect(store, read_only=True)
    try:
        return read_memory(con, conversation_id)
    finally:
        con.close()

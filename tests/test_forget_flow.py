"""Forget, end to end (issue 17, "Done means"): three conversations built by the Prefect flow
against the scripted server — one of them grown and rebuilt, so it has stale cache rows and two
snapshots — then one forgotten. Every file under the store, PREFECT_HOME and the Prefect test
server's database is scanned for marker strings planted in its turns (raw bytes, base64 result
files, zlib streams, DuckDB values): none is left, while each kind of place held some before. The
other conversations' search results, memory images, image bytes, cache rows and task results are
unchanged; a query for the forgotten id is a ScopeError / 404.

Kill-and-resume: ``python -m tmem forget`` is SIGKILLed at the start of each of its seven steps
and at two points inside steps, then run again; every store ends in the state of a forget that was
never killed, and no reader ever sees a snapshot that holds the conversation partly.

Prefect's results are persisted by default here (``PREFECT_RESULTS_PERSIST_BY_DEFAULT``), so the
flows' own results (whole conversation builds) land in Prefect's local storage under PREFECT_HOME.
"""

from __future__ import annotations

import json
import os
import queue
import shutil
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import duckdb
import numpy as np
import pytest
from fastapi.testclient import TestClient

from tests.flow_helpers import build, cli_json, set_llm_env
from tests.forget_helpers import find_strings, image_bytes, owned_cache, tree_bytes, work_rows
from tests.paths import REPO
from tmem.devtools.scripted_llm import ScriptedLLM
from tmem.errors import IngestError, ScopeError, StoreError
from tmem.ids import conversation_partition
from tmem.ingest.load import ingest_archives
from tmem.query.memory import Memory
from tmem.query.service import create_app
from tmem.settings import Settings
from tmem.store.duck import connect
from tmem.store.lance import VectorStore
from tmem.store.memory_image import diff_images, memory_image
from tmem.store.snapshot.published import CURRENT, MANIFEST, SNAPSHOTS, current_snapshot, list_snapshots

pytestmark = pytest.mark.prefect

GONE, KEPT = "alpha ' conv/QZ7", ("beta-conv", "gamma-conv")
IDS = (GONE, *KEPT)
WORDS = "pottery support group painting camping hiking adoption counselling beach kids music guitar".split()
STEPS = ("work", "files", "vectors", "snapshot", "prune", "vector-versions", "rewrite")
NOW = datetime(2026, 3, 1, 9, 0, tzinfo=UTC)


def marker(c: int, n: int) -> str:
    return f"QZX{c}MARK{n:03d}"


def archive_lines(sessions: int) -> list[dict[str, Any]]:
    """Sessions 1..``sessions`` of alpha and gamma, session 1 of beta; every turn carries a marker."""
    lines: list[dict[str, Any]] = []
    for c, cid in enumerate(IDS):
        speakers = [f"Ann{c}", f"Bob{c}"]
        lines.append({"kind": "conversation", "conversation_id": cid, "speakers": speakers})
        for s in range(sessions if c != 1 else 1):
            for t in range(8):
                n = s * 8 + t
                words = " ".join(WORDS[int(i)] for i in np.random.default_rng([3, c, n]).integers(0, len(WORDS), 9))
                lines.append({"conversation_id": cid, "session_id": f"2024-05-0{s + 1}", "turn_id": f"t{n}",
                              "speaker": speakers[t % 2], "text": f"{words} {marker(c, n)} {words[:20]}",
                              "timestamp": f"2024-05-0{s + 1}T09:{t:02d}:00+00:00"})
    return lines


def write_archive(path: Path, sessions: int) -> Path:
    path.write_text("".join(json.dumps(r, ensure_ascii=False) + "\n" for r in archive_lines(sessions)), encoding="utf-8")
    return path


GONE_MARKERS = [marker(0, n) for n in range(16)]


@dataclass(frozen=True)
class Built:
    root: Path
    template: Path  # store/ and storage/ (Prefect's local result storage) as built
    server: ScriptedLLM
    home: Path  # PREFECT_HOME
    storage: Path  # PREFECT_LOCAL_STORAGE_PATH during the builds and forgets
    server_db: Path  # the directory of the Prefect test server's SQLite database


def restore(built: Built, store: Path, storage: Path) -> None:
    for target, name in ((store, "store"), (storage, "storage")):
        if target.exists():
            shutil.rmtree(target)
        shutil.copytree(built.template / name, target)


@pytest.fixture(scope="module")
def built(prefect_harness: None, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Built]:
    from prefect.settings import (
        PREFECT_LOCAL_STORAGE_PATH,
        PREFECT_RESULTS_PERSIST_BY_DEFAULT,
        PREFECT_SERVER_DATABASE_CONNECTION_URL,
        temporary_settings,
    )

    root = tmp_path_factory.mktemp("forget-flow")
    store = root / "store"
    home = Path(os.environ["PREFECT_HOME"])
    storage = home / "storage"
    server_db = Path(str(PREFECT_SERVER_DATABASE_CONNECTION_URL.value()).split("///", 1)[1]).parent
    server = ScriptedLLM().start()
    try:
        with pytest.MonkeyPatch.context() as mp, temporary_settings(
            updates={PREFECT_RESULTS_PERSIST_BY_DEFAULT: True, PREFECT_LOCAL_STORAGE_PATH: storage}
        ):
            for name in [n for n in os.environ if n.startswith(("TMEM_", "OPENAI_"))]:
                mp.delenv(name)
            set_llm_env(mp, server)
            ingest_archives([write_archive(root / "s1.jsonl", 1)], store, now=NOW)
            first = build(store)
            ingest_archives([write_archive(root / "s2.jsonl", 2)], store, now=NOW)
            second = build(store, [GONE, KEPT[1]])
            assert first["status"] == second["status"] == "completed", (first["failures"], second["failures"])
        (root / "template").mkdir()
        shutil.copytree(store, root / "template" / "store")
        shutil.copytree(storage, root / "template" / "storage")
        yield Built(root, root / "template", server, home, storage, server_db)
    finally:
        server.stop()


def query_vector() -> np.ndarray:
    v = np.random.default_rng(5).standard_normal(384).astype(np.float32)
    return v / np.linalg.norm(v)


def others_state(store: Path) -> dict[str, Any]:
    info = current_snapshot(store)
    assert info is not None
    memory = Memory.open(store, Settings(store=store))
    out: dict[str, Any] = {}
    for cid in KEPT:
        result = memory.search("pottery and the support group", conversation_id=cid, query_vector=query_vector())
        out[cid] = {
            "search": result,
            "image": image_bytes(info.path, cid),
            "work": work_rows(store, cid),
            "cache": owned_cache(store, cid),
            "results": tree_bytes(store / "prefect" / "results" / conversation_partition(cid)),
        }
    return out


def test_forget_erases_every_trace_and_leaves_the_others_byte_identical(built: Built, monkeypatch: pytest.MonkeyPatch) -> None:
    from prefect.settings import PREFECT_LOCAL_STORAGE_PATH, temporary_settings

    store = built.root / "main" / "store"
    restore(built, store, built.storage)  # Prefect's local storage is PREFECT_HOME's own
    roots = [store, built.home, built.server_db]
    before_hits = find_strings(roots, GONE_MARKERS)
    kinds = {"work.duckdb", "memory.duckdb", "conversation_images.bin", ".lance", "/prefect/results/", "/storage/"}
    assert {k for k in kinds if any(k in p for p in before_hits)} == kinds, sorted(before_hits)
    assert len(list_snapshots(store)) == 2
    before = current_snapshot(store)
    assert before is not None
    others = others_state(store)
    images = {cid: memory_image(before, cid) for cid in KEPT}

    with temporary_settings(updates={PREFECT_LOCAL_STORAGE_PATH: built.storage}):
        dry = cli_json(["forget", "--store", str(store), f"--conversation={GONE}", "--dry-run", "--json"])
        assert find_strings(roots, GONE_MARKERS) == before_hits  # a dry run removes nothing
        report = cli_json(["forget", "--store", str(store), f"--conversation={GONE}", "--json"])

    assert dry["would_remove"]["work"]["rows"]["turns"] == 16 and dry["would_remove"]["vector_rows"]["vectors"] > 0
    steps = report["steps"]
    assert steps["work"]["rows"]["turns"] == 16 and steps["work"]["llm_cache"] > 0
    assert steps["files"]["prefect_partition_files"] > 0 and steps["files"]["prefect_legacy_results"] > 0
    assert steps["vectors"]["vectors"]["rows_removed"] == dry["would_remove"]["vector_rows"]["vectors"]
    assert len(steps["prune"]["removed"]) == 2
    assert find_strings(roots, GONE_MARKERS) == {}
    assert find_strings([store], [GONE]) == {}  # not even the id: the tombstone holds a digest
    after = current_snapshot(store)
    assert after is not None and sorted(after.conversations) == sorted(KEPT) and list_snapshots(store) == [after.snapshot_id]
    assert others_state(store) == others
    for cid in KEPT:
        assert diff_images(images[cid], memory_image(after, cid)) == []
    memory = Memory.open(store, Settings(store=store))
    with pytest.raises(ScopeError):
        memory.search("pottery", conversation_id=GONE, query_vector=query_vector())
    client = TestClient(create_app(store, Settings(store=store), memory=memory))
    assert client.post("/search", json={"query": "pottery", "conversation_id": GONE, "embed": False}).status_code == 404
    assert client.post("/search", json={"query": "pottery", "conversation_id": KEPT[0], "embed": False}).status_code == 200
    again = cli_json(["ingest", str(write_archive(built.root / "again.jsonl", 2)), "--store", str(store), "--json",
                      "--allow-forgotten"])
    assert again["new_turns"] == 16  # readmitted explicitly: only the forgotten conversation's turns are new


# ---- kill and resume ------------------------------------------------------------------------------


def final_state(store: Path, storage: Path) -> dict[str, Any]:
    """What a finished forget leaves, minus what differs by time (snapshot ids, tombstone times) or by
    physical layout (Lance row addresses, hence image source keys)."""
    info = current_snapshot(store)
    assert info is not None
    con = duckdb.connect(str(info.memory_db), read_only=True)
    try:
        snapshot_rows = {t: sorted(repr(r) for r in con.execute(f'SELECT * FROM "{t}"').fetchall())
                         for (t,) in con.execute("SELECT table_name FROM duckdb_tables() WHERE table_name <> "
                                                 "'conversation_images'").fetchall()}
    finally:
        con.close()
    work = connect(store, read_only=True)
    try:
        tables = [str(r[0]) for r in work.execute("SELECT table_name FROM duckdb_tables()").fetchall()]
        work_dump = {t: sorted(repr(r) for r in work.execute(f'SELECT * FROM "{t}"').fetchall())
                     for t in tables if t not in {"forget_tombstones", "schema_migrations"}}
        stones = work.execute("SELECT count(*) FROM forget_tombstones WHERE finished_at IS NOT NULL").fetchone()
    finally:
        work.close()
    vectors = VectorStore(info.lance_uri, 384)
    lance = {cid: vectors.load_conversation("vectors", cid, version=info.lance_versions["vectors"]) for cid in IDS}
    return {
        "conversations": sorted(info.conversations), "snapshots": len(list_snapshots(store)),
        "snapshot_rows": snapshot_rows, "images": {cid: image_bytes(info.path, cid) for cid in KEPT},
        "work": work_dump, "tombstones": stones,
        "lance": {cid: (v.meta.to_pylist(), v.vectors.tobytes()) for cid, v in lance.items()},
        # how many versions the table keeps (one: the forgotten rows' versions are gone), not their numbers:
        # a forget resumed after a kill inside its vector rewrite commits a version or two more on the way
        "lance_versions": len(vectors.list_versions("vectors")),
        "prefect": tree_bytes(store / "prefect"), "storage": tree_bytes(storage),
        "exchange": tree_bytes(store / "exchange"), "markers": find_strings([store, storage], GONE_MARKERS),
    }


def assert_current_is_whole(store: Path) -> None:
    """The snapshot CURRENT names is complete and holds the forgotten conversation wholly or not at
    all. (A read that fails because CURRENT moved on meanwhile, and the forget removed the snapshot
    it had named, is a reader of a retired snapshot, not of a half-forgotten one: checked again.)"""
    name = (store / CURRENT).read_text().strip()
    try:
        _check_whole(store, name)
    except (OSError, duckdb.Error, StoreError):
        if (store / CURRENT).read_text().strip() == name:
            raise


def _check_whole(store: Path, name: str) -> None:
    manifest = json.loads((store / SNAPSHOTS / name / MANIFEST).read_text())
    con = duckdb.connect(str(store / SNAPSHOTS / name / "memory.duckdb"), read_only=True)
    try:
        counts = {t: con.execute(f'SELECT count(*) FROM "{t}" WHERE conversation_id = ?', [GONE]).fetchone()
                  for t in ("turns", "scenes", "items", "memory_builds", "conversation_images")}
    finally:
        con.close()
    listed = GONE in manifest["conversations"]
    assert all((n[0] > 0) == listed for n in counts.values() if n is not None), (name, listed, counts)
    version = manifest["lance_versions"]["vectors"]
    rows = VectorStore(manifest["lance_uri"], 384).load_conversation("vectors", GONE, version=version)
    assert (len(rows) > 0) == listed, (name, version, len(rows))


def run_forget(store: Path, storage: Path, args: list[str], kill_at: str | None = None, delay_s: float = 0.0) -> int | None:
    """``python -m tmem forget``; with ``kill_at``, SIGKILLed ``delay_s`` after it announces that step."""
    env = {**os.environ, "PREFECT_LOCAL_STORAGE_PATH": str(storage), "PYTHONPATH": str(REPO)}
    proc = subprocess.Popen([sys.executable, "-m", "tmem", "forget", "--store", str(store), *args],
                            cwd=REPO, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True,
                            start_new_session=True)
    lines: queue.Queue[str] = queue.Queue()
    assert proc.stderr is not None
    reader = threading.Thread(target=lambda: [lines.put(line) for line in proc.stderr], daemon=True)  # type: ignore[union-attr]
    reader.start()
    seen: list[str] = []
    deadline: float | None = None
    try:
        while proc.poll() is None:
            assert_current_is_whole(store)
            while not lines.empty():
                seen.append(lines.get())
                if kill_at is not None and deadline is None and seen[-1].rstrip().endswith(f" {kill_at}"):
                    deadline = time.monotonic() + delay_s
            if deadline is not None and time.monotonic() >= deadline:
                os.killpg(proc.pid, signal.SIGKILL)
                proc.wait(timeout=30)
                return None
            time.sleep(0.002)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait(timeout=30)
    reader.join(timeout=5)
    while not lines.empty():
        seen.append(lines.get())
    assert_current_is_whole(store)
    assert proc.returncode == 0, "".join(seen)
    return proc.returncode


@pytest.mark.slow  # ~20 runs of `python -m tmem forget`
def test_a_forget_killed_at_any_step_resumes_to_the_same_final_state(built: Built) -> None:
    ref_store, ref_storage = built.root / "ref" / "store", built.root / "ref" / "storage"
    restore(built, ref_store, ref_storage)
    assert run_forget(ref_store, ref_storage, [f"--conversation={GONE}"]) == 0
    reference = final_state(ref_store, ref_storage)
    assert reference["markers"] == {} and reference["conversations"] == sorted(KEPT) and reference["snapshots"] == 1
    points = [(step, 0.0) for step in STEPS] + [("vectors", 0.15), ("snapshot", 0.05)]
    killed = 0
    for n, (step, delay) in enumerate(points):
        store, storage = built.root / f"kill{n}" / "store", built.root / f"kill{n}" / "storage"
        restore(built, store, storage)
        code = run_forget(store, storage, [f"--conversation={GONE}"], kill_at=step, delay_s=delay)
        if code is None:
            con = connect(store, read_only=True)
            pending = con.execute("SELECT step FROM forget_jobs").fetchall()
            con.close()
            if not pending:  # the kill landed after the last step had committed: that forget was over
                state = final_state(store, storage)
                differing = sorted(k for k in reference if state[k] != reference[k])
                assert not differing, f"killed after {step} finished: {differing} differ from a forget never killed"
                continue
            killed += 1
            assert len(pending) == 1, f"killed at {step}: the job must still be recorded"
            if step == "vectors":  # while a forget is unfinished, builds and its re-ingest are refused
                with pytest.raises(StoreError, match="unfinished; run `tmem forget --resume`"):
                    build(store)
                with pytest.raises(IngestError, match="is being forgotten"):
                    ingest_archives([write_archive(built.root / f"k{n}.jsonl", 2)], store, now=NOW)
        resume = ["--resume"] if n % 2 else [f"--conversation={GONE}"]
        assert run_forget(store, storage, resume) == 0
        state = final_state(store, storage)
        differing = sorted(k for k in reference if state[k] != reference[k])
        assert not differing, f"killed at {step} (+{delay} s): {differing} differ from a forget never killed"
    assert killed >= 5, f"only {killed} of {len(points)} runs were killed before they finished"

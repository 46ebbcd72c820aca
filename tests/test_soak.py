"""Soak: concurrent reads while two new snapshots are published (issue 8, point 5).

``tmem serve`` runs as a real process (uvicorn, a free 127.0.0.1 port, ``--refresh-ms 50``).
Four threads of this test process and a second OS process (``python -m tests.soak_client``, two
threads) post ``/search`` requests over two conversations — one in ten embedded (hybrid), the
rest lexical — while two new snapshots are published. Two variants:

* ``test_soak_while_two_publishes_switch_snapshots`` (fast, the one to watch): the store is
  built by ``tests/query_store.py`` with MiniLM vectors, and the two new snapshots go through
  the real publish path (``tmem.store.snapshot.publish_snapshot`` after ``replace_memories`` and
  a Lance replace, as the builder does), each with its own ids and titles for both
  conversations.
* ``test_soak_while_two_real_rebuilds_publish``: the first snapshot is built by the Prefect flow
  (conv-30 sessions 1-2, conv-26 session 1) against the scripted LLM server, and the two new
  ones by **real builds**, ``python -m tmem build --changed`` processes, after ingesting session
  3 of conv-30, then session 2 of conv-26. Its length is that of two builds (40-60 s each on
  an idle 2-core machine, minutes when it is shared).

Asserted in both: every response is 200; every response names the snapshot it came from, one
of the three; every scene, item, cited scene and turn id in it exists for that conversation in
that snapshot's ``memory.duckdb``; each snapshot answered at least one request, and responses of
the second and third snapshots returned ids that another snapshot lacks (so the check can fail).
The figures (queries, errors, duration, latency p50/p95) are printed (``pytest -s``).
"""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import threading
import time
from collections import Counter
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from datetime import datetime, timedelta
from pathlib import Path

import duckdb
import httpx
import numpy as np
import pytest

from tests.flow_helpers import build, ingest_slice, published, set_llm_env
from tests.paths import LOCOMO10, REPO
from tests.query_store import THEMES, build_store, make_conv, publish
from tests.soak_client import Observation, query_loop
from tmem.devtools.scripted_llm import ScriptedLLM
from tmem.providers.sentence_transformer import SentenceTransformerEmbedder
from tmem.store.snapshot.published import SnapshotInfo, current_snapshot

pytestmark = [pytest.mark.slow]

BUILT = ("conv-30", "conv-26")  # the real-build variant
SLICES: tuple[dict[str, int], ...] = (
    {"conv-30": 2, "conv-26": 1},  # the first snapshot, built before serving
    {"conv-30": 3, "conv-26": 1},  # rebuild 1: conv-30 grows
    {"conv-30": 3, "conv-26": 2},  # rebuild 2: conv-26 grows
)
PUBLISHED = ("conv-a", "conv-b")  # the publish variant
MARKS = {"conv-a": "alpha", "conv-b": "beta"}
MIN_QUERIES = 2000
IN_PROCESS_THREADS = 4
SECOND_PROCESS_THREADS = 2
INTERVAL_S = 0.04  # per client thread: <= 25 requests/s each, ~150/s in all (leaves CPU to builds)
BUILD_TIMEOUT_S = 600.0  # generous: on a shared 2-core machine a build can take minutes
DEADLINE_S = 900.0
Plan = list[dict[str, object]]


@dataclass(frozen=True)
class SnapshotIds:
    """Per conversation, the ids one snapshot holds."""

    scenes: dict[str, frozenset[str]]
    items: dict[str, frozenset[str]]
    turns: dict[str, frozenset[str]]


def snapshot_ids(info: SnapshotInfo, conversations: tuple[str, ...]) -> SnapshotIds:
    con = duckdb.connect(str(info.memory_db), read_only=True)
    try:
        def ids(table: str, column: str) -> dict[str, frozenset[str]]:
            rows = con.execute(f"SELECT conversation_id, {column} FROM {table}").fetchall()
            return {cid: frozenset(str(r[1]) for r in rows if r[0] == cid) for cid in conversations}

        return SnapshotIds(ids("scenes", "scene_id"), ids("items", "item_id"), ids("turns", "turn_id"))
    finally:
        con.close()


def interleave(questions: dict[str, list[str]]) -> Plan:
    """The questions of every conversation, interleaved; every tenth request embedded."""
    plan: Plan = []
    for n in range(max(len(q) for q in questions.values())):
        for cid, qs in questions.items():
            plan.append({"conversation_id": cid, "query": qs[n % len(qs)], "embed": len(plan) % 10 == 0})
    return plan


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def base_env(root: Path) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith(("TMEM_", "OPENAI_"))}
    env.update({"HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1", "PYTHONPATH": str(REPO),
                "PREFECT_HOME": str(root / "prefect-home"), "PREFECT_LOGGING_LEVEL": "WARNING"})
    return env


def percentile(values: list[float], q: float) -> float:
    return float(np.percentile(np.asarray(values), q))


class Soak:
    """The service process, the clients and their observations."""

    def __init__(self, root: Path, store: Path, plan: Plan) -> None:
        self.root = root
        self.store = store
        self.plan = plan
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.observations: list[Observation] = []
        self.lock = threading.Lock()
        self.stop = threading.Event()
        self.server_log = root / "serve.log"

    def sink(self, obs: Observation) -> None:
        with self.lock:
            self.observations.append(obs)

    def count(self, snapshot_id: str | None = None) -> int:
        with self.lock:
            return sum(1 for o in self.observations if snapshot_id is None or o.snapshot_id == snapshot_id)

    def start_server(self) -> subprocess.Popen[bytes]:
        argv = [sys.executable, "-m", "tmem", "serve", "--store", str(self.store), "--port", str(self.port),
                "--refresh-ms", "50", "--log-level", "warning", "--no-access-log"]
        with self.server_log.open("wb") as log:
            proc = subprocess.Popen(argv, env=base_env(self.root), stdout=log, stderr=subprocess.STDOUT)
        deadline = time.monotonic() + 300  # it loads the embedding model before it listens
        while True:
            try:
                if httpx.get(f"{self.url}/health", timeout=2).status_code == 200:
                    return proc
            except httpx.TransportError:
                pass
            assert proc.poll() is None, f"tmem serve exited: {self.server_log.read_text()}"
            assert time.monotonic() < deadline, "tmem serve did not answer /health within 300 s"
            time.sleep(0.1)

    def wait_serving(self, snapshot_id: str, timeout_s: float = 60.0) -> None:
        """Until some response came from ``snapshot_id``."""
        deadline = time.monotonic() + timeout_s
        while self.count(snapshot_id) == 0:
            assert time.monotonic() < deadline, f"no response from snapshot {snapshot_id} within {timeout_s} s"
            time.sleep(0.05)

    def run(self, first: SnapshotInfo, publishers: list[Callable[[], SnapshotInfo]]) -> tuple[list[SnapshotInfo], list[Observation], float]:
        """Serve, query from 4 threads and a second process, run ``publishers`` one after the
        other (each must publish a new snapshot, and be served, before the next); stop once
        :data:`MIN_QUERIES` responses came back. Returns the snapshots, every response, the seconds."""
        plan_file, stop_file, other_out = self.root / "plan.json", self.root / "stop", self.root / "second.jsonl"
        plan_file.write_text(json.dumps(self.plan), encoding="utf-8")
        snapshots = [first]
        server = self.start_server()
        started = time.monotonic()
        other: subprocess.Popen[bytes] | None = None
        threads: list[threading.Thread] = []
        try:
            other = subprocess.Popen(
                [sys.executable, "-m", "tests.soak_client", "--url", self.url, "--plan", str(plan_file),
                 "--out", str(other_out), "--stop", str(stop_file), "--threads", str(SECOND_PROCESS_THREADS),
                 "--interval-s", str(INTERVAL_S)],
                cwd=REPO, env=base_env(self.root),
            )
            threads = [
                threading.Thread(target=query_loop, args=(self.url, self.plan, 31 * i, f"thread-{i}", self.stop.is_set,
                                                          self.sink), kwargs={"interval_s": INTERVAL_S})
                for i in range(IN_PROCESS_THREADS)
            ]
            for t in threads:
                t.start()
            self.wait_serving(first.snapshot_id)
            for publish_next in publishers:
                info = publish_next()
                assert info.snapshot_id != snapshots[-1].snapshot_id, "nothing new was published"
                snapshots.append(info)
                self.wait_serving(info.snapshot_id)
            while self.count() < MIN_QUERIES:  # in-process alone reaches the minimum; the other process adds more
                assert time.monotonic() - started < DEADLINE_S, f"only {self.count()} responses in {DEADLINE_S} s"
                time.sleep(0.05)
        finally:
            self.stop.set()
            stop_file.touch()
            for t in threads:
                t.join(timeout=30)
            if other is not None:
                try:
                    other.wait(timeout=60)
                except subprocess.TimeoutExpired:
                    other.kill()
                    other.wait()
            server.terminate()
            try:
                server.wait(timeout=10)
            except subprocess.TimeoutExpired:
                server.kill()
                server.wait()
        duration = time.monotonic() - started
        assert other.returncode == 0
        from_other = [Observation.from_dict(json.loads(line)) for line in other_out.read_text().splitlines()]
        assert from_other, "the second process served nothing"
        served_log = self.server_log.read_text()
        assert "Traceback" not in served_log and "ERROR" not in served_log, served_log[-2000:]
        return snapshots, self.observations + from_other, duration


def check(snapshots: list[SnapshotInfo], observations: list[Observation], duration: float,
          conversations: tuple[str, ...]) -> None:
    errors = [o for o in observations if o.status != 200]
    latencies = [o.latency_ms for o in observations]
    per_snapshot = Counter(o.snapshot_id for o in observations)
    print(f"\nsoak: {len(observations)} queries ({sum(o.source.startswith('process') for o in observations)} from "
          f"the second process) in {duration:.1f} s, {len(errors)} errors; latency p50 {percentile(latencies, 50):.1f} ms, "
          f"p95 {percentile(latencies, 95):.1f} ms; per snapshot {[per_snapshot[s.snapshot_id] for s in snapshots]}")
    assert len(observations) >= MIN_QUERIES
    assert errors == [], f"{len(errors)} errors, first: {errors[:3]}"
    ids = {info.snapshot_id: snapshot_ids(info, conversations) for info in snapshots}
    assert len(ids) == 3
    discriminating = Counter[str]()
    for obs in observations:
        assert obs.snapshot_id in ids, f"response names snapshot {obs.snapshot_id!r}, not one published"
        held = ids[obs.snapshot_id]
        cid = obs.conversation_id
        assert set(obs.scene_ids) <= held.scenes[cid], (obs, set(obs.scene_ids) - held.scenes[cid])
        assert set(obs.source_scene_ids) <= held.scenes[cid], obs
        assert set(obs.item_ids) <= held.items[cid], (obs, set(obs.item_ids) - held.items[cid])
        assert set(obs.turn_ids) <= held.turns[cid], obs
        others = [v for k, v in ids.items() if k != obs.snapshot_id]
        if any(not set(obs.scene_ids) <= o.scenes[cid] or not set(obs.item_ids) <= o.items[cid] for o in others):
            discriminating[obs.snapshot_id] += 1
    assert all(per_snapshot[info.snapshot_id] > 0 for info in snapshots), per_snapshot
    # Responses of the new snapshots carried ids that another snapshot lacks (the check has teeth).
    assert discriminating[snapshots[1].snapshot_id] > 0 and discriminating[snapshots[2].snapshot_id] > 0, discriminating


# ---- variant 1: publishes through the real publish path --------------------------------------------


def test_soak_while_two_publishes_switch_snapshots(tmp_path: Path) -> None:
    store = tmp_path / "store"
    embedder = SentenceTransformerEmbedder()  # the service embeds queries with the same model
    first = build_store(store, [make_conv(cid, mark=MARKS[cid]) for cid in PUBLISHED], embedder)

    def publisher(n: int) -> Callable[[], SnapshotInfo]:
        later = first_time + timedelta(hours=n)
        return lambda: publish(store, [make_conv(cid, mark=MARKS[cid], tag=f"v{n + 1}") for cid in PUBLISHED],
                               embedder, now=later)

    first_time = datetime.fromisoformat(first.created_at)
    questions = {cid: [f"{' '.join(theme[:3])} {MARKS[cid]}" for theme in THEMES] + ["what happened on the weekend"]
                 for cid in PUBLISHED}
    soak = Soak(tmp_path, store, interleave(questions))
    snapshots, observations, duration = soak.run(first, [publisher(1), publisher(2)])
    check(snapshots, observations, duration, PUBLISHED)


# ---- variant 2: real builds ------------------------------------------------------------------


@pytest.fixture
def first_build(prefect_harness: None, tmp_path: Path) -> Iterator[tuple[Path, dict[str, str]]]:
    """The store with its first snapshot (the flow, in this process) and the env of the build processes."""
    from prefect.settings import get_current_settings

    store = tmp_path / "store"
    server = ScriptedLLM().start()
    try:
        with pytest.MonkeyPatch.context() as mp:
            set_llm_env(mp, server)
            ingest_slice(store, tmp_path / "slice-0.json", SLICES[0])
            assert build(store)["status"] == "completed"
            llm_env = {k: v for k, v in os.environ.items() if k.startswith("TMEM_")}
        yield store, {**base_env(tmp_path), **llm_env, "PREFECT_API_URL": str(get_current_settings().api.url)}
    finally:
        server.stop()


def run_build(env: dict[str, str], store: Path, log: Path) -> dict[str, object]:
    """``python -m tmem build --changed --json``; its summary. Fails with the log's tail (pytest's tmp dirs rotate)."""
    out = log.with_suffix(".json")
    with log.open("w") as err, out.open("w") as stdout:
        proc = subprocess.Popen([sys.executable, "-m", "tmem", "build", "--store", str(store), "--changed", "--json"],
                                cwd=REPO, env=env, stdout=stdout, stderr=err)
        try:
            code = proc.wait(timeout=BUILD_TIMEOUT_S)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
            raise AssertionError(f"build still running after {BUILD_TIMEOUT_S} s: {log.read_text()[-3000:]}") from None
    assert code == 0, f"build exited {code}: {log.read_text()[-3000:]}"
    summary: dict[str, object] = json.loads(out.read_text())
    return summary


@pytest.mark.prefect
@pytest.mark.timeout(1500)  # two real builds: ~3 min on an idle machine, far more on a shared one
def test_soak_while_two_real_rebuilds_publish(first_build: tuple[Path, dict[str, str]], tmp_path: Path) -> None:
    store, build_env = first_build
    builds: list[dict[str, object]] = []

    def rebuild(n: int) -> Callable[[], SnapshotInfo]:
        def run() -> SnapshotInfo:
            ingest_slice(store, tmp_path / f"slice-{n}.json", SLICES[n])  # while the service reads
            builds.append(run_build(build_env, store, tmp_path / f"build-{n}.log"))
            info = current_snapshot(store)
            assert info is not None
            return info

        return run

    samples = {s["sample_id"]: s for s in json.loads(LOCOMO10.read_text(encoding="utf-8"))}
    questions = {cid: [str(q["question"]) for q in samples[cid]["qa"][:60]] for cid in BUILT}
    soak = Soak(tmp_path, store, interleave(questions))
    snapshots, observations, duration = soak.run(published(store), [rebuild(1), rebuild(2)])
    assert [b["conversations_built"] for b in builds] == [["conv-30"], ["conv-26"]]
    check(snapshots, observations, duration, BUILT)

"""Store helpers of the operations flows, without Prefect: interrupted runs, unpublished builds,
leftover temporary snapshots, and Lance cleanup that keeps every version a snapshot pins."""

from __future__ import annotations

import json
import time
from datetime import UTC, datetime, timedelta
from pathlib import Path

import pytest

from tests.factories import sample_memory
from tests.test_lance import DIM, rows_for
from tmem.store.duck import connect
from tmem.store.lance import VectorStore
from tmem.store.maintenance import optimize_vectors, pinned_versions
from tmem.store.memory_rows import record_memory_build, replace_memories
from tmem.store.runs import close_interrupted_runs, list_runs, start_run
from tmem.store.snapshot.published import (
    SNAPSHOTS,
    current_snapshot,
    list_snapshots,
    prune_snapshots,
    publish_snapshot,
    unpublished_conversations,
)

NOW = datetime(2026, 11, 29, 12, 0, tzinfo=UTC)
TABLE = "vectors"


def test_runs_left_running_by_another_process_are_marked_interrupted(tmp_path: Path) -> None:
    con = connect(tmp_path)
    start_run(con, "dead", {"pid": 111}, NOW)
    start_run(con, "legacy", {}, NOW)  # recorded before runs carried a pid
    start_run(con, "alive", {"pid": 222}, NOW)
    assert close_interrupted_runs(con, current_pid=222, at=NOW + timedelta(hours=1)) == ["dead", "legacy"]
    status = {r.run_id: (r.status, r.finished_at) for r in list_runs(con)}
    assert status["dead"] == ("interrupted", NOW + timedelta(hours=1))
    assert status["alive"] == ("running", None)
    assert close_interrupted_runs(con, current_pid=222, at=NOW) == []


def test_a_build_recorded_but_not_published_is_reported_until_a_snapshot_holds_it(tmp_path: Path) -> None:
    con = connect(tmp_path)
    replace_memories(con, [sample_memory("conv-a"), sample_memory("conv-b", tag="b")])
    record_memory_build(con, "conv-a", "build-a1", "run1", 5, NOW)
    assert unpublished_conversations(con, tmp_path) == ["conv-a"]  # nothing published yet
    publish_snapshot(con, tmp_path, lance_uri="lance", lance_versions={}, now=NOW)
    assert unpublished_conversations(con, tmp_path) == []
    # A later build records its result, then dies before its snapshot: readers still see build-a1.
    record_memory_build(con, "conv-a", "build-a2", "run2", 9, NOW)
    record_memory_build(con, "conv-b", "build-b1", "run2", 3, NOW)
    assert unpublished_conversations(con, tmp_path) == ["conv-a", "conv-b"]


def test_publish_removes_temporary_snapshots_left_by_a_killed_publish(tmp_path: Path) -> None:
    con = connect(tmp_path)
    replace_memories(con, [sample_memory("conv-a")])
    first = publish_snapshot(con, tmp_path, lance_uri="lance", lance_versions={}, now=NOW)
    leftover = tmp_path / SNAPSHOTS / ".20261129T999999000000Z-deadbeef.tmp"
    leftover.mkdir()
    (leftover / "memory.duckdb").write_bytes(b"half a file")
    assert list_snapshots(tmp_path) == [first.snapshot_id]  # never listed, never current
    second = publish_snapshot(con, tmp_path, lance_uri="lance", lance_versions={}, now=NOW + timedelta(minutes=1))
    assert not leftover.exists()
    assert current_snapshot(tmp_path) == second


@pytest.mark.filterwarnings("ignore:optimize")
def test_lance_cleanup_keeps_exactly_what_retained_snapshots_pin(tmp_path: Path) -> None:
    con = connect(tmp_path)
    replace_memories(con, [sample_memory("conv-a")])
    uri = str(tmp_path / "lance")
    vectors = VectorStore(uri, dim=DIM)
    published: list[tuple[str, int]] = []
    for seed in range(4):
        version = vectors.replace_conversation(TABLE, "conv-a", rows_for("conv-a", 3, seed=seed))
        info = publish_snapshot(con, tmp_path, lance_uri=uri, lance_versions={TABLE: version},
                                now=NOW + timedelta(minutes=seed))
        published.append((info.snapshot_id, version))
        time.sleep(1.0)  # Lance cleans by age: space the versions out (wider than the margin below)
    assert prune_snapshots(tmp_path, keep=2) == [published[0][0], published[1][0]]
    assert pinned_versions(tmp_path) == {TABLE: {published[2][1], published[3][1]}}

    done = optimize_vectors(tmp_path, uri, now=datetime.now(UTC), margin=timedelta(seconds=0.5))

    [report] = done
    assert report.pinned == (published[2][1], published[3][1])
    assert published[0][1] in report.removed and published[1][1] in report.removed
    for _, version in published[2:]:  # every retained snapshot still reads its own rows
        assert len(vectors.load_conversation(TABLE, "conv-a", version=version)) == 3
    manifest = json.loads((tmp_path / SNAPSHOTS / published[2][0] / "manifest.json").read_text())
    assert manifest["lance_versions"] == {TABLE: published[2][1]}

"""Property tests: hostile and malformed archives end in a clean ingest or one clean error, never a
traceback, and a refused archive writes nothing (issue 8, point 3).

Cases come from tests/hostile_archives.py. The library entry point (:func:`ingest_archives`) takes
most of them; ``tmem ingest`` as a process takes a smaller sample. Runs are derandomized and use
no example database, so CI sees the same cases every time.
"""

from __future__ import annotations

import subprocess
import sys
from collections import Counter
from datetime import UTC, datetime
from pathlib import Path

import pytest
from hypothesis import HealthCheck, given, settings

from tests.hostile_archives import JSONL_MUTATIONS, LOCOMO_MUTATIONS, Case, jsonl_cases, locomo_cases
from tests.ingest_helpers import ingest_counts, query
from tmem.errors import IngestError
from tmem.ingest import ingest_archives

NOW = datetime(2025, 1, 1, tzinfo=UTC)
EXAMPLES_PER_MUTATION = 5  # library: 5 cases for each of the 59 mutations
CLI_EXAMPLES = 6  # per format (a process each, ~1-2 s)
MAX_MESSAGE = 600  # an error names file, record and reason; echoed values are cut, so it stays short

HOSTILE = settings(
    max_examples=EXAMPLES_PER_MUTATION,
    deadline=None,
    derandomize=True,
    database=None,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large, HealthCheck.large_base_example],
)


class Workdir:
    """A fresh directory per example under the test's tmp_path (Hypothesis reuses the fixture)."""

    def __init__(self, root: Path) -> None:
        self.root = root
        self.n = 0

    def next(self) -> Path:
        self.n += 1
        path = self.root / f"case{self.n}"
        path.mkdir()
        return path


def write_case(case: Case, where: Path) -> Path:
    archive = where / f"archive{case.suffix}"
    archive.write_bytes(case.data)
    return archive


def stored_texts(store: Path) -> dict[tuple[str, str], str]:
    return {(c, t): text for c, t, text in query(store, "SELECT conversation_id, turn_id, text FROM turns")}


def check_library(case: Case, where: Path) -> str:
    """Ingest one case through the library; returns "ok" or "error" after checking the invariants."""
    archive = write_case(case, where)
    store = where / "store"
    try:
        report = ingest_archives([archive], store, now=NOW)
    except IngestError as exc:
        assert case.expect != "ok", f"{case.mutation}: a valid archive was refused: {exc}"
        assert exc.path == str(archive)
        assert exc.record and exc.reason
        message = str(exc)
        assert message.startswith(f"{archive}: {exc.record}: ")
        assert "\n" not in message and len(message) < len(str(archive)) + MAX_MESSAGE, message[:300]
        # Validation precedes the store: a refused archive leaves not even an empty store behind.
        assert not store.exists()
        return "error"
    assert case.expect != "error", f"{case.mutation}: a malformed archive was accepted ({report})"
    if case.expect == "ok":
        assert stored_texts(store) == case.texts  # every character kept: NUL, RTL, zero-width, 1 MB turns
    assert report.new_turns == ingest_counts(store)["turns"] > 0
    again = ingest_archives([archive], store, now=NOW)  # idempotent, whatever the characters
    assert again.new_turns == 0 and again.new_conversations == 0 and again.updated_conversations == 0
    return "ok"


MUTATIONS = [("jsonl", m) for m in sorted(JSONL_MUTATIONS)] + [("locomo", m) for m in sorted(LOCOMO_MUTATIONS)]
GENERATED: Counter[str] = Counter()  # cases per format, reported by the last test of the module


@pytest.mark.parametrize(("fmt", "mutation"), MUTATIONS, ids=[f"{f}-{m}" for f, m in MUTATIONS])
def test_hostile_archives_through_the_library(fmt: str, mutation: str, tmp_path: Path) -> None:
    workdir = Workdir(tmp_path)
    outcomes: Counter[str] = Counter()
    cases = jsonl_cases(mutation) if fmt == "jsonl" else locomo_cases(mutation)

    @HOSTILE
    @given(case=cases)
    def check(case: Case) -> None:
        outcomes[check_library(case, workdir.next())] += 1

    check()
    GENERATED[fmt] += sum(outcomes.values())
    assert sum(outcomes.values()) >= EXAMPLES_PER_MUTATION  # no case was filtered away
    if (JSONL_MUTATIONS if fmt == "jsonl" else LOCOMO_MUTATIONS)[mutation] is None:
        assert set(outcomes) <= {"ok", "error"}


CLI = settings(HOSTILE, max_examples=CLI_EXAMPLES)


def check_cli(case: Case, where: Path) -> str:
    archive = write_case(case, where)
    store = where / "store"
    result = subprocess.run(
        [sys.executable, "-m", "tmem", "ingest", str(archive), "--store", str(store)],
        capture_output=True, text=True, encoding="utf-8", errors="replace", timeout=120, check=False,
    )
    assert "Traceback" not in result.stderr, result.stderr[-2000:]
    if result.returncode == 2:
        assert case.expect != "ok", f"{case.mutation}: {result.stderr}"
        assert result.stdout == ""
        lines = result.stderr.splitlines()
        assert len(lines) == 1 and lines[0].startswith(f"error: {archive}: "), result.stderr[:500]
        assert not store.exists() or ingest_counts(store) == {"conversations": 0, "sessions": 0, "turns": 0, "qa": 0}
        return "error"
    assert result.returncode == 0, (result.returncode, result.stderr[-2000:])
    assert case.expect != "error", f"{case.mutation}: accepted"
    assert result.stderr == ""
    if case.expect == "ok":
        assert stored_texts(store) == case.texts
    return "ok"


@pytest.mark.parametrize("fmt", ["jsonl", "locomo"])
def test_hostile_archives_through_the_cli(fmt: str, tmp_path: Path) -> None:
    workdir = Workdir(tmp_path)
    cases = jsonl_cases() if fmt == "jsonl" else locomo_cases()
    outcomes: Counter[str] = Counter()

    @CLI
    @given(case=cases)
    def check(case: Case) -> None:
        outcomes[check_cli(case, workdir.next())] += 1

    check()
    GENERATED[f"cli-{fmt}"] += sum(outcomes.values())
    assert sum(outcomes.values()) >= CLI_EXAMPLES and outcomes["error"] >= 1


def test_hostile_case_count() -> None:
    """Runs last in the module: prints how many hostile cases the properties generated."""
    print(f"\nhostile ingest cases generated: {dict(GENERATED)} (total {sum(GENERATED.values())})")
    expected = {"jsonl": len(JSONL_MUTATIONS) * EXAMPLES_PER_MUTATION, "locomo": len(LOCOMO_MUTATIONS) * EXAMPLES_PER_MUTATION}
    for fmt, count in GENERATED.items():  # (only the parts that ran, when the module is filtered with -k)
        assert count >= expected.get(fmt, CLI_EXAMPLES)

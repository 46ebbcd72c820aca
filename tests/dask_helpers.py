"""A Dask worker plugin recording every ``duckdb.connect`` a worker process makes (tests/test_flow_dask.py)."""

from __future__ import annotations

import os
import threading
from typing import Any

import duckdb
from distributed.diagnostics.plugin import WorkerPlugin

_lock = threading.Lock()
_connects: list[tuple[int, str, bool]] = []  # (pid, database, read_only) in this process


class RecordDuckDBConnects(WorkerPlugin):
    """Wraps ``duckdb.connect`` in each worker process so the test can ask who opened what."""

    name = "tmem-record-duckdb-connects"

    def setup(self, worker: Any) -> None:
        original = duckdb.connect
        if getattr(original, "tmem_recording", False):
            return

        def recording(database: Any = ":memory:", read_only: bool = False, **kwargs: Any) -> Any:
            with _lock:
                _connects.append((os.getpid(), str(database), bool(read_only)))
            return original(database, read_only=read_only, **kwargs)

        recording.tmem_recording = True  # type: ignore[attr-defined]
        duckdb.connect = recording


def recorded_connects() -> list[tuple[int, str, bool]]:
    """Run on every worker with ``client.run``."""
    with _lock:
        return list(_connects)

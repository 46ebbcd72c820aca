"""The Prefect edges of a build run: its progress artifact, and Prefect's own local result storage.

:class:`BuildProgress` keeps the ``tmem-build-progress`` artifact (conversations done of total,
updated as they finish) and writes the ``tmem.build.progress`` log records ``tmem build`` prints.
"""

from __future__ import annotations

import logging
import time
from pathlib import Path
from typing import Any
from uuid import UUID

from prefect.artifacts import create_progress_artifact, update_progress_artifact

# One record per finished conversation (``tmem build`` shows them as progress); extra fields
# ``conversation_id``, ``done``, ``total``, ``ok``.
progress_log = logging.getLogger("tmem.build.progress")
PROGRESS_KEY = "tmem-build-progress"


class BuildProgress:
    """Conversations done of total: a log record each, and the progress artifact, updated at most
    every ``every_s`` seconds or ``every_pct`` percent (and at the end)."""

    def __init__(self, label: str, total: int, *, every_s: float = 5.0, every_pct: float = 2.0) -> None:
        self.total, self.done, self.failed = total, 0, 0
        self.label = label
        self._every_s, self._every_pct = every_s, every_pct
        self._shown_at, self._shown_pct = time.monotonic(), 0.0
        created: Any = create_progress_artifact(progress=0.0 if total else 100.0, key=PROGRESS_KEY,
                                                description=self._describe())
        self.artifact_id: UUID = created

    def _describe(self) -> str:
        failed = f", {self.failed} failed" if self.failed else ""
        return f"tmem build {self.label}: {self.done} of {self.total} conversations done{failed}"

    def conversation_done(self, conversation_id: str, ok: bool) -> None:
        self.done += 1
        self.failed += 0 if ok else 1
        progress_log.info("%s %s (%d/%d)", conversation_id, "built" if ok else "FAILED", self.done, self.total,
                          extra={"conversation_id": conversation_id, "done": self.done, "total": self.total, "ok": ok})
        pct = 100.0 * self.done / max(1, self.total)
        now = time.monotonic()
        if self.done == self.total or pct - self._shown_pct >= self._every_pct or now - self._shown_at >= self._every_s:
            update_progress_artifact(self.artifact_id, progress=pct, description=self._describe())
            self._shown_at, self._shown_pct = now, pct


def prefect_local_result_dirs() -> list[Path]:
    """Prefect's own local result storage (``PREFECT_LOCAL_STORAGE_PATH``, by default under
    ``PREFECT_HOME``): where results of tasks and flows without a result storage of their own go when
    ``PREFECT_RESULTS_PERSIST_BY_DEFAULT`` is on. ``tmem forget`` scans it for the conversation's."""
    from prefect.settings import PREFECT_LOCAL_STORAGE_PATH

    path: Any = PREFECT_LOCAL_STORAGE_PATH.value()
    return [Path(path)] if path else []

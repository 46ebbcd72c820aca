"""Store maintenance for the nightly flow: Lance compaction and version cleanup that never
removes a version a retained snapshot pins.

Order matters: prune old snapshots first (:func:`tmem.store.snapshot.prune_snapshots`), then
clean Lance versions. LanceDB deletes versions by age (``cleanup_older_than``), so the window
is computed from the oldest version any remaining snapshot pins: every version at least as new
as it survives, plus ``margin`` for the clock gap between this process and Lance's own "now".
"""

from __future__ import annotations

from dataclasses import dataclass
from datetime import UTC, datetime, timedelta
from pathlib import Path

import lancedb

from tmem.errors import StoreError
from tmem.store.lance import VectorStore
from tmem.store.snapshot.published import list_snapshots, read_snapshot

DEFAULT_MARGIN = timedelta(minutes=5)


@dataclass(frozen=True)
class VectorMaintenance:
    table: str
    pinned: tuple[int, ...]  # versions pinned by retained snapshots
    versions_before: tuple[int, ...]
    versions_after: tuple[int, ...]
    keep_newer_than_s: float

    @property
    def removed(self) -> tuple[int, ...]:
        return tuple(v for v in self.versions_before if v not in self.versions_after)


def pinned_versions(store: Path) -> dict[str, set[int]]:
    """Lance table -> versions pinned by the snapshots still on disk."""
    pinned: dict[str, set[int]] = {}
    for snapshot_id in list_snapshots(store):
        for table, version in read_snapshot(store, snapshot_id).lance_versions.items():
            pinned.setdefault(table, set()).add(version)
    return pinned


def _version_times(handle: lancedb.table.Table) -> dict[int, datetime]:
    # LanceDB reports naive local times; astimezone() reads a naive value as local time.
    return {int(v["version"]): v["timestamp"].astimezone(UTC) for v in handle.list_versions()}


def optimize_vectors(
    store: Path, lance_uri: str, *, now: datetime, margin: timedelta = DEFAULT_MARGIN
) -> list[VectorMaintenance]:
    """Compact every Lance table under ``lance_uri`` and delete versions no retained snapshot needs.

    Raises StoreError if a pinned version is missing afterwards (it would break its readers).
    """
    if margin < timedelta(0):
        raise ValueError("margin must be >= 0")
    pinned = pinned_versions(store)
    db = lancedb.connect(lance_uri)
    out: list[VectorMaintenance] = []
    for table in sorted(db.list_tables().tables):
        handle = db.open_table(table)
        times = _version_times(handle)
        keep = pinned.get(table, set())
        missing = sorted(keep - set(times))
        if missing:
            raise StoreError(f"{lance_uri}/{table}: versions {missing} pinned by snapshots are already gone")
        oldest = min((times[v] for v in keep), default=now)
        # Lance cuts at ITS clock when it cleans, after compaction: measure the age as late as we can.
        window = max(max(now, datetime.now(UTC)) - oldest, timedelta(0)) + margin
        dim = handle.schema.field("vector").type.list_size
        VectorStore(lance_uri, dim=dim).optimize(table, keep_newer_than=window)
        after = _version_times(db.open_table(table))
        lost = sorted(keep - set(after))
        if lost:
            raise StoreError(f"{lance_uri}/{table}: optimize removed pinned versions {lost}")
        out.append(VectorMaintenance(table, tuple(sorted(keep)), tuple(sorted(times)), tuple(sorted(after)),
                                     window.total_seconds()))
    return out

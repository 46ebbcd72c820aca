"""Per-process dependency bundles for Prefect tasks.

Tasks receive plain values (store path, run id) so they stay serialisable; the bundle they
need is built once per process and run, and shared by the task threads of that process.
"""

from __future__ import annotations

import sys
import threading
from pathlib import Path

from prefect.cache_policies import INPUTS, CachePolicy

from tmem.bundle import BuildBundle, open_build_bundle, open_worker_bundle
from tmem.ids import content_hash
from tmem.providers.journal import JournalBatch
from tmem.settings import load_settings
from tmem.store.exchange import exchange_path

_lock = threading.Lock()
_bundles: dict[tuple[str, str], BuildBundle] = {}


def bundle(store: str, run_id: str) -> BuildBundle:
    """The run's bundle in this process. On a Dask worker it never opens the working database:
    it reads the run's exchange file read-only and journals its writes (see :mod:`tasks.scaleout`)."""
    key = (str(Path(store).resolve()), run_id)
    with _lock:
        found = _bundles.get(key)
        if found is None:
            settings = load_settings(store=Path(store))
            if in_dask_worker():
                found = open_worker_bundle(settings, run_id, exchange_path(Path(store), run_id))
            else:
                found = open_build_bundle(settings, run_id)
            _bundles[key] = found
        return found


def in_dask_worker() -> bool:
    if "distributed" not in sys.modules:  # never imported: certainly not a Dask worker
        return False
    from distributed import get_worker

    try:
        get_worker()
    except ValueError:
        return False
    return True


def drain_journal(store: str, run_id: str) -> JournalBatch | None:
    """What this process's bundle journaled since the last drain (None: it writes the store itself)."""
    key = (str(Path(store).resolve()), run_id)
    with _lock:
        found = _bundles.get(key)
    if found is None or found.journal is None:
        return None
    return found.journal.drain()


def finish_worker_run(store: str, run_id: str) -> JournalBatch | None:
    """Run on each Dask worker when the flow ends: the journal's remainder (e.g. from a failed
    conversation), then the bundle is dropped (its read-only exchange connection closed)."""
    left = drain_journal(store, run_id)
    release(store, run_id)
    return left


def release(store: str, run_id: str) -> None:
    """Drop the bundle of a finished run (closes its database connection)."""
    key = (str(Path(store).resolve()), run_id)
    with _lock:
        found = _bundles.pop(key, None)
    if found is not None:
        found.con.close()


def content_cache(store: str) -> CachePolicy:
    """Cache keyed by the task's content inputs only (not store path, run id or bundle).

    Keys and results live under the store, so deleting a store also forgets its cache. Prefect's
    cache records name their result files by absolute path, so the keys are kept per absolute
    store location: a moved or copied store misses (and recomputes from the LLM response cache,
    at no LLM cost) instead of failing on a result path outside its own directory.
    """
    policy = INPUTS - "store" - "run_id"
    root = Path(store).resolve()
    return policy.configure(key_storage=root / "prefect" / "cache-keys" / content_hash(str(root))[:16])


def result_storage(store: str) -> Path:
    return Path(store) / "prefect" / "results"

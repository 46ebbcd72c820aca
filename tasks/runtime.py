"""Per-process dependency bundles for Prefect tasks.

Tasks receive plain values (store path, run id) so they stay serialisable; the bundle they
need is built once per process and run, and shared by the task threads of that process.
"""

from __future__ import annotations

import threading
from pathlib import Path

from prefect.cache_policies import INPUTS, CachePolicy

from tmem.bundle import BuildBundle, open_build_bundle
from tmem.ids import content_hash
from tmem.settings import load_settings

_lock = threading.Lock()
_bundles: dict[tuple[str, str], BuildBundle] = {}


def bundle(store: str, run_id: str) -> BuildBundle:
    key = (str(Path(store).resolve()), run_id)
    with _lock:
        found = _bundles.get(key)
        if found is None:
            found = open_build_bundle(load_settings(store=Path(store)), run_id)
            _bundles[key] = found
        return found


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

"""Per-process dependency bundles for Prefect tasks.

Tasks receive plain values (store path, run id) so they stay serialisable; the bundle they
need is built once per process and run, and shared by the task threads of that process.
"""

from __future__ import annotations

import sys
import threading
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from prefect.cache_policies import CachePolicy
from pydantic import BaseModel

from tmem.bundle import BuildBundle, open_build_bundle, open_worker_bundle
from tmem.ids import content_hash, conversation_partition
from tmem.providers.journal import JournalBatch
from tmem.settings import load_settings
from tmem.store.exchange import exchange_path

if TYPE_CHECKING:
    from prefect.context import TaskRunContext

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


CACHE_KEY_VERSION = 1  # bump when the key's encoding changes (old entries then simply miss)


def _plain(value: Any) -> Any:
    """The JSON form of a task input: pydantic models by ``model_dump(mode="json")``, containers
    element by element. Anything else is a :class:`TypeError` (a key must never depend on ``repr``)."""
    if value is None or isinstance(value, str | int | float | bool):
        return value
    if isinstance(value, BaseModel):
        return value.model_dump(mode="json")
    if isinstance(value, list | tuple):
        return [_plain(v) for v in value]
    if isinstance(value, dict):
        return {str(k): _plain(v) for k, v in value.items()}
    raise TypeError(f"cannot key a task input of type {type(value).__name__}")


@dataclass
class ContentInputs(CachePolicy):
    """Prefect cache key of a build task: the task's name and its content inputs (every argument
    but the store path and run id), sha256 over their JSON form.

    Unlike Prefect's ``INPUTS`` the key names the task, so two tasks called with equal arguments
    never share an entry; and pydantic inputs are encoded by ``model_dump`` rather than Prefect's
    generic JSON encoder, which looks its encoder up by import name on every call (~11 % of the
    samples of a warm locomo10 rebuild under py-spy, contending on the import lock).
    """

    exclude: tuple[str, ...] = ("store", "run_id")

    def compute_key(
        self, task_ctx: TaskRunContext, inputs: dict[str, Any], flow_parameters: dict[str, Any], **kwargs: Any
    ) -> str | None:
        if not inputs:
            return None
        content = {k: _plain(v) for k, v in sorted(inputs.items()) if k not in self.exclude}
        return content_hash("prefect-task", CACHE_KEY_VERSION, task_ctx.task.name, content)


def content_cache(store: str, conversation_id: str | None = None) -> CachePolicy:
    """Cache keyed by the task's name and content inputs (:class:`ContentInputs`).

    Keys and results live under the store, so deleting a store also forgets its cache. Prefect's
    cache records name their result files by absolute path, so the keys are kept per absolute
    store location: a moved or copied store misses (and recomputes from the LLM response cache,
    at no LLM cost) instead of failing on a result path outside its own directory. A
    conversation's tasks keep theirs in a directory of their own (:func:`tmem.ids.conversation_partition`),
    which ``tmem forget`` deletes whole.
    """
    root = Path(store).resolve()
    keys = root / "prefect" / "cache-keys" / content_hash(str(root))[:16]
    return ContentInputs().configure(key_storage=keys / conversation_partition(conversation_id) if conversation_id else keys)


def result_storage(store: str, conversation_id: str | None = None) -> Path:
    """Where task results are written: per conversation when the task builds one (see :func:`content_cache`)."""
    root = Path(store) / "prefect" / "results"
    return root / conversation_partition(conversation_id) if conversation_id else root


def prefect_local_result_dirs() -> list[Path]:
    """Prefect's own local result storage (``PREFECT_LOCAL_STORAGE_PATH``, by default under
    ``PREFECT_HOME``): where results of tasks and flows without a result storage of their own go when
    ``PREFECT_RESULTS_PERSIST_BY_DEFAULT`` is on. ``tmem forget`` scans it for the conversation's."""
    from prefect.settings import PREFECT_LOCAL_STORAGE_PATH

    path = PREFECT_LOCAL_STORAGE_PATH.value()
    return [Path(path)] if path else []

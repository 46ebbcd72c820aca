"""The Dask task runner of ``build-memory``: Prefect's, with its cluster started ahead of first use.

Prefect's :class:`~prefect_dask.DaskTaskRunner` creates its client, and with it a local cluster, the
first time something asks for ``client``: in a build, when the flow exports the run's exchange file,
after it has opened the store, its model clients and its encoder and drained the spool. Only then did
the worker processes start, and each imported the build's modules (the flow, the task, the runtime,
the caches: ~4.5 s of one core, more on a loaded machine) when its first task run arrived, before
any conversation asked the LLM anything.

:meth:`BuildDaskTaskRunner.start_ahead` (the flow's first step) creates the client in a thread, so
the cluster starts while the flow opens its store, and a local cluster's workers import those
modules as they start (:data:`WORKER_PRELOAD`, Dask's worker ``preload``) rather than inside their
first task run. Whoever asks for ``client`` next waits for that thread and gets its client, or the
exception that stopped it (a cluster that could not start fails the flow as it did on first use).
"""

from __future__ import annotations

import contextvars
import threading
from typing import Any

from prefect_dask import DaskTaskRunner
from prefect_dask.client import PrefectDaskClient

# What a worker imports to build conversations (tests/test_scaleout.py checks none of it pulls in LanceDB
# or a model library): unpickling the flow run's context around every task run imports the flow's module.
WORKER_PRELOAD = (
    "tmem.flows.build_memory", "tmem.tasks.build", "tmem.build.runtime", "tmem.llm.journal", "tmem.llm.response_cache",
    "tmem.llm.embed_service", "tmem.store.exchange", "tmem.store.llm_cache", "tmem.providers.registry",
)


class BuildDaskTaskRunner(DaskTaskRunner):  # type: ignore[misc]
    """A :class:`DaskTaskRunner` whose client (and cluster) can be started in the background."""

    _starting: threading.Thread | None = None
    _start_error: BaseException | None = None

    def start_ahead(self) -> None:
        """Begin creating the client in a thread (the caller's context copied: Prefect's settings and
        flow run); a no-op once it exists or is on its way."""
        if self._client is not None or self._starting is not None:
            return
        context = contextvars.copy_context()
        self._starting = threading.Thread(target=context.run, args=(self._start,), name="tmem-dask-start", daemon=True)
        self._starting.start()

    def _start(self) -> None:
        try:
            super().client  # noqa: B018 -- Prefect's property makes the client and cluster
        except BaseException as exc:  # noqa: BLE001 -- not lost: raised to whoever asks for the client next
            self._start_error = exc

    def _wait_for_start(self) -> None:
        starting = self._starting
        if starting is not None and starting is not threading.current_thread():
            starting.join()
            self._starting = None

    @property
    def client(self) -> PrefectDaskClient:
        self._wait_for_start()
        if self._start_error is not None:
            raise self._start_error
        return super().client  # type: ignore[no-any-return]

    def __exit__(self, *args: Any) -> None:
        self._wait_for_start()  # a client made after the exit stack closed would be left open
        super().__exit__(*args)

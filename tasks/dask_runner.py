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

Its client (:class:`BuildDaskClient`) sends each Prefect task run to the workers with two changes,
both about what a task run costs before its conversations start:

- **One Prefect API client per worker process** (:class:`ApiClientPerProcess`). Prefect's task engine
  on a worker makes two new API clients for every task run (one to hydrate the flow run's context,
  one for the run itself), and each loads certifi's CA bundle into a new TLS context whatever the
  API's scheme: 19 % of the workers' CPU in a profile of a 200-conversation Dask nightly (py-spy).
  The task run now finds the process's client in Prefect's own client context
  (``SyncClientContext``) and uses it for both, as the task runs of Prefect's thread pool share their
  flow's; the client is made under the task run's settings, and another is made for a run whose
  settings name another API (or for another settings dump: a dump is compared as sent, a build sends
  the settings model). One per thread was not enough: a worker runs as many threads as it has LLM
  calls in flight (32 in the archive benchmark), each holding a client for about two task runs.
- **No content hash of each submission** (``pure=False``): every task run is unique (its task run
  id is in what is sent), so Dask's ``tokenize`` of the task, its parameters and the flow run's
  context (~20 ms of the flow per unit) bought nothing; the key is the task's name and a UUID.
"""

from __future__ import annotations

import contextvars
import threading
from collections.abc import Callable, Mapping
from contextlib import nullcontext
from typing import Any

from distributed import Client
from prefect.context import SettingsContext, SyncClientContext
from prefect_dask import DaskTaskRunner
from prefect_dask.client import PrefectDaskClient

# What a worker imports to build conversations (tests/test_scaleout.py checks none of it pulls in LanceDB
# or a model library): unpickling the flow run's context around every task run imports the flow's module.
WORKER_PRELOAD = (
    "tmem.flows.build_memory", "tmem.tasks.build", "tmem.build.runtime", "tmem.llm.journal", "tmem.llm.response_cache",
    "tmem.llm.embed_service", "tmem.store.exchange", "tmem.store.llm_cache", "tmem.providers.registry",
    "tmem.tasks.dask_runner",
)

_clients: list[tuple[object, SyncClientContext]] = []  # this process's API clients: (what each was made for, it)
_clients_lock = threading.Lock()


def _made_for(settings_context: Mapping[str, Any] | None) -> object:
    """What a task run's API client is made from, comparable without building Prefect's settings again:
    the API and how it is reached, when the run was sent the settings model itself (a build sends it,
    :func:`tmem.tasks.build.settings_serialized_once`); else the settings dump (or nothing) as it is."""
    settings = settings_context.get("settings") if settings_context else None
    api = getattr(settings, "api", None)
    if api is None:
        return settings_context
    secret = [v.get_secret_value() if v is not None else None for v in (api.key, api.auth_string)]
    return (api.url, *secret, api.tls_insecure_skip_verify, api.ssl_cert_file)


def process_api_client(serialized_context: Mapping[str, Any]) -> SyncClientContext:
    """This process's Prefect client context for a task run sent with ``serialized_context``: the one made
    for an earlier task run, on any thread, from the same API settings (:func:`_made_for`) and still open;
    else a new one, made under the run's settings and opened as Prefect opens a task run's (the server's
    version checked once). A client for another API is kept beside it, open: another thread may be using
    it (a worker serves one build's API, rarely more; they close as the worker exits)."""
    settings = serialized_context.get("settings_context")
    target = _made_for(settings)
    with _clients_lock:  # one client made per API, not one per thread that asks at once
        for made_for, held in _clients:
            if made_for == target and not held.client._closed:
                return held
        with SettingsContext(**settings) if settings else nullcontext():
            # get_client() hands back the client of a client context already current (the last task run's,
            # if its context outlived it): none is current while the new one is made
            current = SyncClientContext.__var__.set(None)  # type: ignore[arg-type]
            try:
                made = SyncClientContext()
                made.__enter__()  # open for the process's life: no task run exits it
            finally:
                SyncClientContext.__var__.reset(current)
        _clients[:] = [(f, c) for f, c in _clients if f != target] + [(target, made)]
        return made


class ApiClientPerProcess:
    """A Prefect task run sent to a Dask worker (prefect-dask's wrapper around ``run_task_sync``), run with
    the worker process's API client as Prefect's current client context (:func:`process_api_client`): the
    task engine's ``SyncClientContext.get_or_create()`` and its context hydration then use it instead of
    making two clients of their own."""

    def __init__(self, run: Callable[..., Any]) -> None:
        self.run = run
        self.__name__ = getattr(run, "__name__", "task-run")  # Dask names the run's key after it

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        client = process_api_client(kwargs.get("context") or {})
        token = SyncClientContext.__var__.set(client)
        try:
            return self.run(*args, **kwargs)
        finally:
            SyncClientContext.__var__.reset(token)


class _TaskRunSubmissions(Client):  # type: ignore[misc]
    """Below :class:`PrefectDaskClient` in :class:`BuildDaskClient`'s MRO: what prefect-dask submits for a
    task run (its wrapper, with the run's id and serialised context) goes to Dask wrapped in
    :class:`ApiClientPerProcess` and with ``pure=False``; anything else as it was given."""

    def submit(self, func: Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
        if "task_run_id" in kwargs and "context" in kwargs:
            func, kwargs["pure"] = ApiClientPerProcess(func), False
        return super().submit(func, *args, **kwargs)


class BuildDaskClient(PrefectDaskClient, _TaskRunSubmissions):  # type: ignore[misc]
    """prefect-dask's client, its task runs submitted by :class:`_TaskRunSubmissions`."""


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
        client = super().client
        if type(client) is PrefectDaskClient:
            # prefect-dask makes its client inside this property; the same object, given our submit
            # (a subclass adding no state), rather than a copy of the property's sixty lines
            client.__class__ = BuildDaskClient
        return client  # type: ignore[no-any-return]

    def __exit__(self, *args: Any) -> None:
        self._wait_for_start()  # a client made after the exit stack closed would be left open
        super().__exit__(*args)

"""The build's encoder, shared with the build's other processes on the same machine.

On the thread pool a build has one embedding queue (:class:`~tmem.llm.embed_queue.CoalescingEmbedder`)
and one set of encoder children, and every conversation's texts meet in its calls. A local Dask
cluster runs the conversations in worker processes; each worker with an encoder of its own saw only
its share of the texts, in smaller calls, on cores the other workers' encoders also wanted: a Dask
nightly of 1,000 conversations spent 842 core-seconds in its encoders against 616 on the thread pool
for the same texts (``bench/nightly_scale.py``), and each worker loaded its own model copies.

:class:`EmbeddingService` serves the publisher's queue on a Unix socket in a private temporary
directory (mode 0700, a 32-byte key checked by :mod:`multiprocessing.connection`); the run's exchange
file names it, with the machine it is on (:mod:`tmem.store.exchange`). A worker on that machine
embeds through :class:`RemoteEmbedder` — its texts join the one queue, which looks them up in the
working database's embedding cache and stores what it embeds — and a worker elsewhere embeds with
an encoder of its own. A request is ``(op, texts)``: ``model`` (the model's name, answered at once),
``info`` (its name, dimension and input limit: these wait for the encoder to have loaded the model),
``embed`` (the rows) or ``prefetch`` (queued, answered at once); the reply ``("ok", value)`` or
``("error", reason)``, which the worker raises as :class:`~tmem.errors.EmbeddingError`.

A worker opens its :class:`RemoteEmbedder` with a ``model`` request (the service answers, and serves
the model the worker's settings name) and asks ``info`` only when a conversation first needs the
model's dimension or input limit, after its first LLM answers: the encoder children load the model
(seconds, more while a cluster starts) while the first conversations wait for the LLM, as they do on
the thread pool, rather than before any conversation starts.
"""

from __future__ import annotations

import logging
import secrets
import shutil
import socket
import tempfile
import threading
from multiprocessing import AuthenticationError
from multiprocessing.connection import Client, Connection, Listener
from pathlib import Path
from typing import Any

import numpy as np
import numpy.typing as npt

from tmem.errors import EmbeddingError
from tmem.llm.embed_queue import CoalescingEmbedder
from tmem.ports import ServiceAddress

log = logging.getLogger(__name__)


MAX_SOCKET_PATH = 100  # a Unix socket's path holds at most 107 bytes on Linux (sun_path)


def _socket_dir() -> Path:
    """A new private directory (mode 0700: this user's processes only) for the socket: under the
    temporary directory, or ``/tmp`` when that one's path is too long for a socket's."""
    made = Path(tempfile.mkdtemp(prefix="tmem-encoder-"))
    if len(str(made / "encoder.sock").encode()) <= MAX_SOCKET_PATH:
        return made
    made.rmdir()
    return Path(tempfile.mkdtemp(prefix="tmem-encoder-", dir="/tmp"))


class EmbeddingService:
    """Serves ``queue`` to the build's processes on this machine until :meth:`close`."""

    def __init__(self, queue: CoalescingEmbedder) -> None:
        self.queue = queue
        self._dir = _socket_dir()
        key = secrets.token_bytes(32)
        self.address = ServiceAddress(socket.gethostname(), str(self._dir / "encoder.sock"), key.hex())
        self._listener = Listener(self.address.address, family="AF_UNIX", authkey=key)
        self._closed = False
        self._thread = threading.Thread(target=self._accept, name="tmem-encoder-service", daemon=True)
        self._thread.start()

    def _accept(self) -> None:
        while True:
            try:
                conn = self._listener.accept()
            except AuthenticationError as exc:  # a process without the key: refused, the service goes on
                log.warning("the build's encoder service refused a connection: %s", exc)
                continue
            except OSError:
                if self._closed:
                    return
                raise
            if self._closed:
                conn.close()
                return
            threading.Thread(target=self._serve, args=(conn,), name="tmem-encoder-request", daemon=True).start()

    def _serve(self, conn: Connection) -> None:
        with conn:
            while True:
                try:
                    op, texts = conn.recv()
                except (EOFError, OSError):
                    return  # the worker closed its end
                conn.send(self._answer(op, texts))

    def _answer(self, op: str, texts: list[str]) -> tuple[str, Any]:
        try:
            if op == "embed":
                return "ok", self.queue.embed(texts)
            if op == "prefetch":
                self.queue.prefetch(texts)
                return "ok", None
            if op == "model":
                return "ok", self.queue.model_name
            if op == "info":
                return "ok", (self.queue.model_name, self.queue.dim, self.queue.max_input_tokens)
            return "error", f"unknown request {op!r}"
        except EmbeddingError as exc:
            return "error", exc.reason
        except Exception as exc:  # noqa: BLE001 -- sent to the worker, which raises it (e.g. the queue closed)
            log.warning("the build's encoder service failed a %s request of %d texts: %s", op, len(texts), exc)
            return "error", f"{type(exc).__name__}: {exc}"

    def close(self) -> None:
        """Stop accepting, wake the accepting thread, remove the socket's directory."""
        if self._closed:
            return
        self._closed = True
        try:
            Client(self.address.address, family="AF_UNIX", authkey=bytes.fromhex(self.address.authkey)).close()
        except OSError:
            pass  # nothing listens any more: the accepting thread has ended
        self._thread.join(timeout=5)
        self._listener.close()
        shutil.rmtree(self._dir, ignore_errors=True)


class RemoteEmbedder:
    """An :class:`~tmem.ports.Embedder` whose texts go to the build's :class:`EmbeddingService`
    (one connection per request: a conversation makes two, its prefetch and its embedding).

    Opening it checks that the service answers and serves ``model_name`` without waiting for the
    model to load; :attr:`dim` and :attr:`max_input_tokens` are asked once, on first use."""

    def __init__(self, served: ServiceAddress, model_name: str) -> None:
        self.served = served
        self._model = model_name
        name = self._call("model", [])
        if name != model_name:
            raise EmbeddingError(model_name, f"the build's encoder service at {served.address} serves {name!r}")
        self._facts: tuple[int, int | None] | None = None
        self._facts_lock = threading.Lock()

    @property
    def model_name(self) -> str:
        return self._model

    @property
    def dim(self) -> int:
        return self._model_facts()[0]

    @property
    def max_input_tokens(self) -> int | None:
        return self._model_facts()[1]

    def _model_facts(self) -> tuple[int, int | None]:
        """The served model's dimension and input limit, asked once (the first asker waits for the load)."""
        with self._facts_lock:
            if self._facts is None:
                _name, dim, max_tokens = self._call("info", [])
                self._facts = (int(dim), int(max_tokens) if max_tokens else None)
            return self._facts

    def embed(self, texts: list[str]) -> npt.NDArray[np.float32]:
        if not texts:
            return np.zeros((0, self.dim), dtype=np.float32)
        rows: npt.NDArray[np.float32] = self._call("embed", list(texts))
        return rows

    def prefetch(self, texts: list[str]) -> None:
        """Queue ``texts`` on the service's queue without waiting for their rows."""
        if texts:
            self._call("prefetch", list(texts))

    def _call(self, op: str, texts: list[str]) -> Any:
        where = f"the build's encoder service at {self.served.address}"
        try:
            with Client(self.served.address, family="AF_UNIX", authkey=bytes.fromhex(self.served.authkey)) as conn:
                conn.send((op, texts))
                status, value = conn.recv()
        except (OSError, EOFError, AuthenticationError) as exc:
            raise EmbeddingError(self._model, f"{where} did not answer a {op} request of {len(texts)} texts "
                                              f"({type(exc).__name__}: {exc})") from exc
        if status != "ok":
            raise EmbeddingError(self._model, f"{where}: {value}")
        return value

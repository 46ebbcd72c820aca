"""The build's sentence-transformers encoder in a process of its own.

A build embeds from one thread (:mod:`tmem.llm.embed_queue`) while dozens of others run the
conversations' LLM calls, cache writes and Prefect bookkeeping. The model's forward pass is a few
hundred small torch calls per batch, each one giving up the GIL and taking it back; with the other
threads holding it in turn (5 ms switch interval) the encoder waits at every step. At 1,000
synthetic conversations the nightly's texts took 871 s inside the build against 407 s embedded alone
afterwards (``bench/results/nightly_scale-threads-postgres-1000.json``), and the nightly was 2.3x
its embedding time. In a child process the encoder has a GIL of its own: the build process only
sends texts and receives rows over a pipe (a 2,048-text call is 3 MB of float32).

One child per model configuration and parent process, started on first use (``spawn``: the
parent runs threads, and a forked child would inherit their locks) and reused by every build the
process runs, so a test session or a long-lived worker pays the ~6 s torch import once. The child
ends when the parent closes the pipe (at exit, or when the parent dies: its ``recv`` sees the end
of the pipe), so a killed build leaves no encoder behind. An error in the child (the model cannot
load, an encode fails) is raised in the caller as :class:`~tmem.errors.EmbeddingError` with the
child's message; a child that died is named with its exit code, and the next call starts a new one.

Off by default (``TMEM_EMBEDDING_PROCESS=on``): on this 2-core machine the nightly of 1,000
conversations went from 946 s (2.33x the texts' embedding time alone) to 815 s (2.23x), the texts
still taking 2.0x their alone time inside the build: the cores, not the GIL, are what the
encoder shares with the build's own work (~0.7 core for 10,870 LLM calls' client, validation,
cache and ledger writes). It separates the two where the build process has cores to spare.
"""

from __future__ import annotations

import atexit
import multiprocessing as mp
import threading
from dataclasses import dataclass
from multiprocessing.connection import Connection
from typing import Any

import numpy as np
import numpy.typing as npt

from tmem.errors import EmbeddingError


@dataclass(frozen=True)
class EncoderSpec:
    """What the child builds its :class:`SentenceTransformerEmbedder` from (picklable)."""

    model: str
    batch_size: int = 64
    device: str = "cpu"
    threads: int = 0


def _serve(conn: Connection, spec: EncoderSpec) -> None:
    """The child: load the model, say its width and input limit, then embed until the pipe closes."""
    from tmem.providers.sentence_transformer import SentenceTransformerEmbedder

    try:
        embedder = SentenceTransformerEmbedder(
            spec.model, batch_size=spec.batch_size, device=spec.device, threads=spec.threads
        )
        conn.send(("ready", {"dim": embedder.dim, "max_input_tokens": embedder.max_input_tokens}))
    except BaseException as exc:  # noqa: BLE001 -- not swallowed: sent to the parent, which raises it
        conn.send(("error", exc.reason if isinstance(exc, EmbeddingError) else f"{type(exc).__name__}: {exc}"))
        return
    while True:
        try:
            texts = conn.recv()
        except (EOFError, OSError):
            return
        if texts is None:
            return
        try:
            conn.send(("rows", embedder.embed(texts)))
        except BaseException as exc:  # noqa: BLE001 -- not swallowed: sent to the parent, which raises it
            conn.send(("error", exc.reason if isinstance(exc, EmbeddingError) else f"{type(exc).__name__}: {exc}"))


class EncoderProcess:
    """An :class:`~tmem.ports.Embedder` whose model runs in a child process (see the module).

    Calls are serialised (the build's embedding queue makes one at a time anyway)."""

    def __init__(self, spec: EncoderSpec, *, start_timeout_s: float = 600.0) -> None:
        self.spec = spec
        self.start_timeout_s = start_timeout_s
        self._lock = threading.Lock()
        self._conn: Connection | None = None
        self._process: Any = None
        self._info: dict[str, Any] | None = None

    @property
    def model_name(self) -> str:
        return self.spec.model

    @property
    def dim(self) -> int:
        return int(self._started()["dim"])

    @property
    def max_input_tokens(self) -> int | None:
        value = self._started()["max_input_tokens"]
        return int(value) if value else None

    @property
    def pid(self) -> int | None:
        """The child's process id while one runs."""
        return self._process.pid if self._process is not None and self._process.is_alive() else None

    def embed(self, texts: list[str]) -> npt.NDArray[np.float32]:
        if not texts:
            return np.zeros((0, self.dim), dtype=np.float32)
        with self._lock:
            conn = self._start_locked()
            try:
                conn.send(list(texts))
            except (OSError, EOFError):
                raise self._died() from None
            kind, payload = self._receive(conn, timeout=None)
        if kind == "error":
            raise EmbeddingError(self.spec.model, f"in the encoder process: {payload}")
        rows = np.asarray(payload, dtype=np.float32)
        if rows.shape != (len(texts), self.dim):
            raise EmbeddingError(self.spec.model, f"returned shape {rows.shape} for {len(texts)} texts")
        return rows

    def close(self) -> None:
        """End the child (it also ends by itself when this process exits)."""
        with self._lock:
            conn, process = self._conn, self._process
            self._conn = self._process = None
            if conn is not None:
                try:
                    conn.send(None)
                except (OSError, EOFError):
                    pass  # already gone: nothing to stop
                conn.close()
            if process is not None:
                process.join(10)
                if process.is_alive():
                    process.terminate()
                    process.join(5)

    def _started(self) -> dict[str, Any]:
        if self._info is not None:  # the same spec: the same width and limit in any child
            return self._info
        with self._lock:
            self._start_locked()
            assert self._info is not None
            return self._info

    def _start_locked(self) -> Connection:
        if self._conn is not None and self._process is not None and self._process.is_alive():
            return self._conn
        if self._conn is not None:  # died between calls: say so, the next call starts anew
            raise self._died()
        context = mp.get_context("spawn")
        parent, child = context.Pipe()
        process = context.Process(target=_serve, args=(child, self.spec), name="tmem-encoder", daemon=True)
        process.start()
        child.close()
        self._conn, self._process = parent, process
        kind, payload = self._receive(parent, timeout=self.start_timeout_s)
        if kind != "ready":
            self._conn = self._process = None
            parent.close()
            process.join(5)
            raise EmbeddingError(self.spec.model, f"the encoder process could not start: {payload}")
        self._info = payload
        return parent

    def _receive(self, conn: Connection, *, timeout: float | None) -> tuple[str, Any]:
        try:
            if timeout is not None and not conn.poll(timeout):
                raise EmbeddingError(self.spec.model, f"the encoder process did not start within {timeout:.0f} s")
            kind, payload = conn.recv()
        except (EOFError, OSError):
            raise self._died() from None
        return str(kind), payload

    def _died(self) -> EmbeddingError:
        """The error naming the child's end; forgets the child so the next call starts a new one."""
        process, conn = self._process, self._conn
        self._conn = self._process = None
        if conn is not None:
            conn.close()
        if process is not None:
            process.join(5)
        code = None if process is None else process.exitcode
        return EmbeddingError(self.spec.model, f"the encoder process ended (exit code {code}); the next call starts a new one")


_SHARED: dict[EncoderSpec, EncoderProcess] = {}
_SHARED_LOCK = threading.Lock()


def shared_encoder(spec: EncoderSpec) -> EncoderProcess:
    """This process's encoder child for ``spec``, created on first use, ended at exit."""
    with _SHARED_LOCK:
        found = _SHARED.get(spec)
        if found is None:
            found = _SHARED[spec] = EncoderProcess(spec)
        return found


@atexit.register
def _close_shared() -> None:
    for encoder in list(_SHARED.values()):
        encoder.close()

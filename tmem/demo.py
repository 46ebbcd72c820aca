"""`make demo`: tmem's main job on a small archive, end to end.

Ingest the sample archive shipped in ``examples/``, build its memory with the Prefect flow,
then answer a handful of questions — one of them associative: its answer shares no words
with the question — printing for each the answer, the recalled scenes and items, and the
channel that reached them.

The build and answer models are whatever ``TMEM_LLM_*`` points to. When no endpoint answers,
the demo says so and runs as a labelled **dry run** against tmem's scripted development
server, whose answers are derived mechanically from the input: it proves the pipeline, not
the quality of a memory.
"""

from __future__ import annotations

import argparse
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

from tmem.settings import Settings, apply_process_defaults, load_settings

if TYPE_CHECKING:
    from tmem.query.memory import Answer

SAMPLE = Path(__file__).resolve().parents[1] / "examples" / "sample_archive.jsonl"
CONVERSATION = "demo-ana-ben"


@dataclass(frozen=True)
class DemoQuestion:
    text: str
    speaker: str | None
    why: str


QUESTIONS: tuple[DemoQuestion, ...] = (
    DemoQuestion("When did Ben get promoted to team lead?", "Ben", "temporal: the date comes from the session"),
    DemoQuestion("What did the physio say about Ana's knee?", "Ana", "single fact"),
    DemoQuestion("Is the Harbour Oyster Bar a good pick for Friday's team celebration?", "Ben",
                 "associative: the answer (a shellfish allergy mentioned six weeks earlier) shares no words with it"),
    DemoQuestion("What is Ana training for, and how is it going?", "Ana", "connects several sessions"),
)


def endpoint_answers(settings: Settings) -> bool:
    """True when the build endpoint lists its models within a few seconds."""
    from tmem.providers.chat import ChatConfig, endpoint_reachable

    return endpoint_reachable(ChatConfig.from_settings(settings, "build"), timeout_s=3.0)


def _print_answer(n: int, q: DemoQuestion, ans: Answer) -> None:
    print(f"\n[{n}] {q.text}    ({q.why})")
    print(f"    answer: {ans.answer}")
    for scene in ans.scenes[:3]:
        print(f"    scene  {scene.start_time:%d %b %Y}  {scene.title[:60]:<60}  via {', '.join(scene.channels)}")
    for item in ans.items[:4]:
        when = f"{item.event_time:%d %b %Y}" if item.event_time else "undated"
        print(f"    item   {when:<11}  {item.content[:60]:<60}  via {', '.join(item.channels)}")
    report = ans.context.report
    print(f"    context: {report.tokens_used} of {report.budget} tokens")


def run(store: Path, dry_run: bool) -> int:
    apply_process_defaults()
    settings = load_settings(store=store)
    server = None
    if not dry_run and not endpoint_answers(settings):
        print(f"No LLM endpoint answers at {settings.endpoint('build').base_url}.")
        print("Running a DRY RUN instead: tmem's scripted development server stands in for the model.")
        dry_run = True
    if dry_run:
        from tmem.devtools import synth  # registers the scripted responders
        from tmem.devtools.scripted_llm import ScriptedLLM

        server = ScriptedLLM(responders=dict(synth.RESPONDERS)).start()
        settings = load_settings(store=store, llm_base_url=server.url, llm_model="scripted-dry-run")
        print(f"DRY RUN: answers come from the scripted development server at {server.url} — they are derived")
        print("mechanically from the input and prove the pipeline, not the quality of a memory.\n")
    try:
        return _run(settings, dry_run)
    finally:
        if server is not None:
            server.stop()


def _run(settings: Settings, dry_run: bool) -> int:
    import os
    from datetime import UTC, datetime

    from tmem.ingest import ingest_archives

    store = Path(settings.store)
    print(f"1. ingest {SAMPLE.name} into {store}")
    report = ingest_archives([SAMPLE], store, now=datetime.now(UTC))
    print(f"   {report.conversations} conversation, {report.sessions} sessions, {report.turns} turns "
          f"({report.new_turns} new)")

    # The flow reads its settings from the environment: hand over the demo's endpoint.
    os.environ["TMEM_STORE"] = str(store)
    os.environ["TMEM_LLM_BASE_URL"] = settings.llm_base_url
    os.environ["TMEM_LLM_MODEL"] = settings.llm_model
    print("2. build memory with the Prefect flow (a local temporary Prefect server starts first)")
    from flows.build_memory import build_memory

    started = time.perf_counter()
    summary = build_memory(store=str(store), conversation_ids=[CONVERSATION], label="demo")
    print(f"   {summary['status']} in {time.perf_counter() - started:.1f} s: {summary['scenes']} scenes, "
          f"{summary['topics']} topics, {summary['items']} items ({summary['connected_items']} connected), "
          f"{summary['entity_triggers'] + summary['bridge_triggers']} item triggers, "
          f"{summary['horizon_triggers']} horizon sentences, {summary['personas']} personas; "
          f"{summary['llm_calls']} LLM calls, {summary['llm_cache_hits']} cache hits")
    if summary["status"] != "completed":
        for failure in summary["failures"]:
            print(f"   FAILED {failure['conversation_id']}: {failure['message']}", file=sys.stderr)
        return 1

    print("3. ask")
    from tmem.query.memory import Memory

    memory = Memory.open(store, settings)
    for n, q in enumerate(QUESTIONS, 1):
        _print_answer(n, q, memory.answer(q.text, conversation_id=CONVERSATION, speaker=q.speaker))

    print("\nNext:")
    print("  * Prefect UI: run `prefect server start` in another shell, then re-run the build with")
    print("    PREFECT_API_URL=http://127.0.0.1:4200/api; runs, task retries and build reports appear there.")
    print("  * A real model, two variables away:")
    print("      export TMEM_LLM_BASE_URL=https://api.openai.com/v1 TMEM_LLM_API_KEY=sk-...   # or vLLM/Ollama/llama.cpp")
    print("      export TMEM_LLM_MODEL=gpt-4o-mini && make demo")
    if dry_run:
        print("  * This was a dry run: the memory above was built from scripted answers.")
    return 0


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m tmem.demo", description=__doc__.split("\n")[0])
    parser.add_argument("--store", type=Path, default=Path("./tmem-demo-store"))
    parser.add_argument("--dry-run", action="store_true", help="use the scripted development server")
    args = parser.parse_args(argv)
    return run(args.store, args.dry_run)


if __name__ == "__main__":
    raise SystemExit(main())

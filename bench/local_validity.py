"""How useful is the embedded model? Per-operation validity of its answers on one LoCoMo conversation.

Runs tmem's construction pipeline (the library stages the Prefect flow wraps, in the flow's order
and with the knobs ``tasks/build.py`` passes: segment -> admit topics -> items per topic -> item
triggers -> scene triggers -> persona per speaker) on the first ``--sessions`` sessions of one
LoCoMo conversation, with the embedded model started by tmem exactly as the demo starts it (its
local profile applied), then asks ``--questions`` of the conversation's QA items whose evidence
lies in those sessions, with their evidence turns as context (the ``answer`` operation alone).
The stages run one after the other, unlike the flow, so that each call is recorded in order; a
stage whose answer is rejected for good is recorded and the run goes on with what it has.

A *call* is one ``ChatModel.complete`` (the adapter's own repair re-ask, if any, is inside it;
``requests`` counts HTTP requests). Each call is classified:

* **valid**: the adapter returned a schema-valid answer, and the stage accepted it (it was not
  followed by the stage's re-ask with a rejection reason, nor ended the stage with a rejection);
* **non-empty**: the answer holds something: >= 1 item / entry / cue / topic / packed scene.
  The two *decision* operations may answer "nothing" on purpose, and that counts as non-empty:
  ``scene_boundaries`` (no scene closes in this window) and ``topic_match`` (no listed topic
  fits); how often they did is reported as ``empty_decisions``;
* **grounded**, with *content stems* = lower-cased words of >= 3 letters, not stop words and not
  the speakers' names, cut to their first 6 letters:
  - scene_boundaries / scene_pack: every described scene's title shares >= 1 content stem with
    the dialogue of the request, and its narrative >= 2;
  - topic_create: the title shares >= 1 content stem with the scene (title, summary, narrative)
    and >= 3 keywords have a content stem in it; topic_match: every admitted topic's title +
    keywords share >= 1 content stem with the scene, and a proposed topic is grounded as above;
  - item_extract: every item's content shares >= 2 content stems with its source scene's dialogue;
  - item_triggers: every answer's rationales share >= 1 content stem with the item, and no
    bridge situation repeats the item's content;
  - scene_triggers: >= 3 of situation/object/event/emotion share >= 1 content stem with the
    scene's title + narrative;
  - persona: >= half of all entries share >= 1 content stem with the speaker's turns;
  - answer: the answer is "Not mentioned" or shares >= 1 content stem with the evidence given.

``valid_grounded_share`` = calls that are valid, non-empty and grounded / calls.

    HF_HUB_OFFLINE=1 python bench/local_validity.py [--sessions 2] [--conversation conv-26]
        [--model smollm2|gemma3-270m|PATH.gguf] [--questions 10] [--out bench/results/local_validity.json]
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import re
import sys
import tempfile
import time
from collections import defaultdict
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from pydantic import BaseModel

from tmem.construct import admit_topics, extract_items, item_triggers, persona, scene_triggers, segment
from tmem.domain import Conversation, Turn
from tmem.errors import LLMError, ValidationFailure
from tmem.ingest.locomo import read_locomo
from tmem.prompts import answer as answer_prompt
from tmem.prompts.base import Prompt, parse_input
from tmem.prompts.common import FEEDBACK_NOTE
from tmem.providers.llama_cpp import LOCAL_PROFILE, local_profile_env, local_server_for, resolve_model
from tmem.providers.openai_chat import ChatConfig, OpenAIChatModel
from tmem.settings import load_settings

REPO = Path(__file__).resolve().parents[1]
DEFAULT_LOCOMO = REPO.parent / "shared" / "datasets" / "locomo" / "locomo10.json"
DEFAULT_OUT = REPO / "bench" / "results" / "local_validity.json"
OPERATIONS = ("scene_boundaries", "scene_pack", "topic_match", "topic_create", "item_extract", "item_triggers",
              "scene_triggers", "persona", "answer")
FEEDBACK_MARK = FEEDBACK_NOTE.split("{", 1)[0].strip()
STOP = frozenset(
    "the and for that this with was were are has have had not but you your they them their she her his him "
    "from what when where which who will would can could should about there here then than just also very "
    "into out over some any all our ours its it's i'm i've don't didn't really been being did does doing "
    "get got going like one two yeah yes okay sure thanks thank know think much more most well too".split()
)


def stems(text: str, names: frozenset[str]) -> set[str]:
    return {w[:6] for w in re.findall(r"[a-z][a-z']{2,}", text.lower()) if w not in STOP and w not in names}


@dataclass
class Call:
    operation: str
    input_ref: str
    data: Any
    feedback: bool
    seconds: float
    requests: int = 0
    completion_tokens: int = 0
    answer: BaseModel | None = None
    error: str | None = None
    rejected: bool = False


@dataclass
class Recorder:
    """A ChatModel that records every call (prompt input, answer or error) in order."""

    inner: OpenAIChatModel
    calls: list[Call] = field(default_factory=list)

    @property
    def model_name(self) -> str:
        return self.inner.model_name

    def complete(self, prompt: Prompt[Any]) -> Any:
        user = prompt.messages[-1].content
        call = Call(prompt.operation, prompt.input_ref, parse_input(user), FEEDBACK_MARK in user, 0.0)
        if call.feedback and self.calls and self.calls[-1].operation == prompt.operation:
            self.calls[-1].rejected = True  # the stage re-asks right after rejecting
        self.calls.append(call)
        started = time.perf_counter()
        try:
            done = self.inner.complete_metered(prompt)
        except LLMError as exc:
            call.error = f"{type(exc).__name__}: {exc.reason[:300]}"
            raise
        finally:
            call.seconds = time.perf_counter() - started
        call.requests, call.completion_tokens = done.requests, done.usage.completion_tokens
        call.answer = done.value
        return done.value


def _run_stage(recorder: Recorder, failures: list[str], name: str, fn: Any, *args: Any, **kwargs: Any) -> Any:
    try:
        return fn(*args, **kwargs)
    except LLMError as exc:
        if isinstance(exc, ValidationFailure) and recorder.calls:
            recorder.calls[-1].rejected = True
        failures.append(f"{name}: {type(exc).__name__}: {exc}"[:400])
        print(f"  stage {name} failed: {type(exc).__name__}: {exc.reason[:160]}", flush=True)
        return None


def _dialogue_text(blocks: list[dict[str, Any]]) -> str:
    return " ".join(t["text"] for b in blocks for t in b.get("turns", []))


def _shares(text: str, source: set[str], names: frozenset[str], at_least: int = 1) -> bool:
    return len(stems(text, names) & source) >= at_least


def judge(call: Call, names: frozenset[str]) -> tuple[bool, bool, bool]:
    """(non_empty, grounded, empty_decision) of a valid call; see the module docstring."""
    a: Any = call.answer
    d: Any = call.data
    op = call.operation
    if op == "scene_boundaries":
        source = stems(_dialogue_text(d["open_scene"] + d["new_turns"]), names)
        ok = all(_shares(s.title, source, names) and _shares(s.narrative, source, names, 2) for s in a.closed)
        return True, ok, not a.closed
    if op == "scene_pack":
        by_ref = {s["ref"]: stems(_dialogue_text(s["dialogue"]), names) for s in d["scenes"]}
        ok = all(_shares(s.title, by_ref.get(s.ref, set()), names)
                 and _shares(s.narrative, by_ref.get(s.ref, set()), names, 2) for s in a.scenes)
        return bool(a.scenes), ok, False
    if op in ("topic_create", "topic_match"):
        scene = stems(" ".join(d["scene"].values()), names)

        def topic_ok(title: str, keywords: list[str]) -> bool:
            return _shares(title, scene, names) and sum(_shares(k, scene, names) for k in keywords) >= 3

        if op == "topic_create":
            return bool(a.keywords), topic_ok(a.title, a.keywords), False
        labels = {t["ref"]: f"{t['title']} {' '.join(t['keywords'])}" for t in d["topics"]}
        ok = all(_shares(labels.get(x.ref, ""), scene, names) for x in a.admitted)
        if a.new_topic is not None:
            ok = ok and topic_ok(a.new_topic.title, a.new_topic.keywords)
        return True, ok, not a.admitted and a.new_topic is None
    if op == "item_extract":
        by_ref = {s["ref"]: stems(_dialogue_text(s["dialogue"]), names) for s in d["scenes"]}
        ok = all(_shares(i.content, set().union(*(by_ref.get(r, set()) for r in i.sources)), names, 2)
                 for i in a.items)
        return bool(a.items), ok, False
    if op == "item_triggers":
        contents = {i["ref"]: i["content"] for i in d["items"]}
        ok = all(
            all(_shares(b.rationale, stems(contents.get(x.ref, ""), names), names) for b in x.bridges)
            and all(b.situation.strip().lower() != contents.get(x.ref, "").strip().lower() for b in x.bridges)
            for x in a.items
        )
        return all(x.entities and x.bridges for x in a.items) and bool(a.items), ok, False
    if op == "scene_triggers":
        by_ref = {s["ref"]: stems(f"{s['title']} {s['narrative']}", names) for s in d["scenes"]}
        ok = all(
            sum(_shares(getattr(x, f), by_ref.get(x.ref, set()), names) for f in ("situation", "object", "event",
                                                                                   "emotion")) >= 3
            for x in a.scenes
        )
        return bool(a.scenes), ok, False
    if op == "persona":
        source = stems(_dialogue_text(d["turns"]), names)
        entries = [*a.identity, *a.preferences, *a.traits, *a.relations, *(e.fact for e in a.timeline)]
        grounded = sum(_shares(e, source, names) for e in entries)
        return bool(entries), bool(entries) and grounded * 2 >= len(entries), False
    if op == "answer":
        text = a.answer.strip()
        ok = text.lower().startswith("not mentioned") or _shares(text, stems(d["context"], names), names)
        return bool(text), ok, False
    return True, True, False


def _answer_calls(chat: Recorder, conv: Conversation, turns: list[Turn], limit: int, failures: list[str]) -> None:
    by_id = {t.turn_id: t for t in turns}
    asked = 0
    for qa in conv.qa:
        if asked >= limit:
            break
        evidence = [by_id[e] for e in qa.evidence if e in by_id]
        if not qa.answer or not evidence or len(evidence) != len(qa.evidence):
            continue
        context = "\n".join(f"[{t.event_time:%Y-%m-%d}] {t.speaker}: {t.text}" for t in evidence)
        payload = answer_prompt.AnswerInput(conversation_id=conv.conversation_id, question=qa.question,
                                            context=context)
        _run_stage(chat, failures, f"answer {asked}", chat.complete, answer_prompt.build(payload))
        asked += 1


def run(args: argparse.Namespace) -> dict[str, Any]:
    archive = read_locomo(args.locomo)
    conv = next(c for c in archive.conversations if c.conversation_id == args.conversation)
    sessions = [s.session_id for s in conv.sessions][: args.sessions]
    turns = [t for t in conv.turns if t.session_id in sessions]
    names = frozenset(s.lower() for s in conv.speakers)
    store = Path(tempfile.mkdtemp(prefix="tmem-local-validity-"))
    base = load_settings(store=store, local_model=args.model)
    os.environ.update(local_profile_env(base))  # the demo's profile, unless the caller set a value
    settings = load_settings(store=store, local_model=args.model)
    model = resolve_model(args.model)
    failures: list[str] = []
    started = time.perf_counter()
    with local_server_for(settings) as server:
        config = ChatConfig.from_settings(settings.model_copy(update={"llm_base_url": server.base_url,
                                                                      "llm_model": server.model}), "build")
        chat = Recorder(OpenAIChatModel(config))
        print(f"{server.model}: {len(turns)} turns of {conv.conversation_id} sessions {sessions}", flush=True)
        cid = conv.conversation_id
        scenes = _run_stage(chat, failures, "segment", segment, cid, turns, chat, window=settings.segment_window) or []
        print(f"  {len(scenes)} scenes", flush=True)
        pool = _run_stage(chat, failures, "topics", admit_topics, cid, scenes, chat, batch=settings.topic_batch)
        topics = list(pool.topics) if pool else []
        print(f"  {len(topics)} topics", flush=True)
        by_turn = {t.turn_id: t for t in turns}
        by_scene = {s.scene_id: s for s in scenes}
        items = []
        for topic in topics:
            found = _run_stage(chat, failures, f"items {topic.title[:30]}", extract_items, cid, topic,
                               [by_scene[s] for s in topic.scene_ids], by_turn, chat)
            items.extend(found or [])
        print(f"  {len(items)} items", flush=True)
        for n in range(0, len(items), settings.trigger_batch):
            _run_stage(chat, failures, f"item triggers {n}", item_triggers, cid, items[n : n + settings.trigger_batch],
                       chat, batch=settings.trigger_batch)
        for n in range(0, len(scenes), settings.scene_trigger_batch):
            _run_stage(chat, failures, f"scene triggers {n}", scene_triggers, cid,
                       scenes[n : n + settings.scene_trigger_batch], by_turn, chat, batch=settings.scene_trigger_batch)
        for speaker in conv.speakers:
            _run_stage(chat, failures, f"persona {speaker}", persona, cid, speaker, turns, chat)
        _answer_calls(chat, conv, turns, args.questions, failures)
    if args.dump:
        with args.dump.open("w") as out:
            for call in chat.calls:
                verdict = judge(call, names) if call.answer is not None and not call.rejected else None
                out.write(json.dumps({"operation": call.operation, "input_ref": call.input_ref, "input": call.data,
                                      "answer": call.answer.model_dump() if call.answer else None,
                                      "error": call.error, "rejected": call.rejected, "verdict": verdict}) + "\n")
    return _report(args, chat.calls, names, failures, time.perf_counter() - started, model.path, server.model,
                   len(turns), len(scenes), len(topics), len(items), sessions)


def _report(args: argparse.Namespace, calls: list[Call], names: frozenset[str], failures: list[str],
            seconds: float, gguf: Path, alias: str, n_turns: int, n_scenes: int, n_topics: int, n_items: int,
            sessions: list[str]) -> dict[str, Any]:
    ops: dict[str, dict[str, Any]] = defaultdict(lambda: defaultdict(float))
    examples: dict[str, list[str]] = defaultdict(list)
    for call in calls:
        o = ops[call.operation]
        o["calls"] += 1
        o["requests"] += call.requests
        o["seconds"] += call.seconds
        o["completion_tokens"] += call.completion_tokens
        if call.answer is None:
            o["invalid_schema_or_transport"] += 1
            continue
        if call.rejected:
            o["rejected_by_stage"] += 1
            continue
        o["valid"] += 1
        non_empty, grounded, empty_decision = judge(call, names)
        o["non_empty"] += non_empty
        o["empty_decisions"] += empty_decision
        o["valid_grounded"] += non_empty and grounded
        if len(examples[call.operation]) < 2:
            examples[call.operation].append(call.answer.model_dump_json()[:400])
    table = {}
    for op in [*OPERATIONS, *sorted(set(ops) - set(OPERATIONS))]:
        if op not in ops:
            continue
        o = ops[op]
        calls_n = int(o["calls"])
        table[op] = {
            "calls": calls_n,
            "requests": int(o["requests"]),
            "invalid_schema_or_transport": int(o["invalid_schema_or_transport"]),
            "rejected_by_stage": int(o["rejected_by_stage"]),
            "valid": int(o["valid"]),
            "non_empty": int(o["non_empty"]),
            "empty_decisions": int(o["empty_decisions"]),
            "valid_grounded": int(o["valid_grounded"]),
            "valid_grounded_share": round(o["valid_grounded"] / calls_n, 3) if calls_n else 0.0,
            "mean_seconds": round(o["seconds"] / calls_n, 2) if calls_n else 0.0,
            "mean_completion_tokens": round(o["completion_tokens"] / calls_n, 1) if calls_n else 0.0,
        }
    total = sum(v["calls"] for v in table.values())
    return {
        "model": alias,
        "gguf": gguf.name,
        "scope": f"LoCoMo {args.conversation}, sessions 1-{len(sessions)} ({n_turns} turns)",
        "profile": LOCAL_PROFILE,
        "structure": {"scenes": n_scenes, "topics": n_topics, "items": n_items},
        "operations": table,
        "overall_valid_grounded_share": round(sum(v["valid_grounded"] for v in table.values()) / total, 3)
        if total else 0.0,
        "stage_failures": failures,
        "examples": dict(examples),
        "seconds": round(seconds, 1),
        "machine": {"cpus": os.cpu_count(), "python": sys.version.split()[0], "platform": platform.platform(),
                    "load_average": os.getloadavg()},
        "measured_at": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--locomo", type=Path, default=DEFAULT_LOCOMO)
    parser.add_argument("--conversation", default="conv-26")
    parser.add_argument("--sessions", type=int, default=2)
    parser.add_argument("--model", default="smollm2")
    parser.add_argument("--questions", type=int, default=10)
    parser.add_argument("--out", type=Path, default=DEFAULT_OUT)
    parser.add_argument("--dump", type=Path, help="also write every call (input, answer, verdict) as JSON Lines")
    args = parser.parse_args()
    result = run(args)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(result, indent=1) + "\n")
    print(json.dumps({op: v["valid_grounded_share"] for op, v in result["operations"].items()}, indent=1))
    print(f"wrote {args.out} in {result['seconds']} s")


if __name__ == "__main__":
    main()

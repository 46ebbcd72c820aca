"""The resumable QA runner: recall, answer, judge — every output saved as it is produced.

For each question of a run (one configuration, one :class:`~tmem.eval.run_folder.RunFolder`):

1. recall and render the context with :class:`tmem.query.memory.Memory` (the configuration's
   preset and budgets), on the published snapshot;
2. answer with the answer-role model: :mod:`tmem.prompts.answer` (LoCoMo, a short answer) or
   :mod:`tmem.prompts.memory_reply` (LoCoMo-Plus, a reply to the trigger), or a protocol text
   (``--answer-prompt FILE``);
3. judge it ``judge_runs`` times with the judge-role model (:mod:`tmem.eval.judge`).

A question already answered (``answers.jsonl``) is not answered again; a judge run already
recorded is not repeated; a failed call (typed :class:`~tmem.errors.LLMError`) is written to
``errors.jsonl`` and retried by the next run. Input tokens per question (the whole answer prompt,
context included) are estimated like the context (characters / 4) and saved with the answer.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Iterable, Mapping, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import asdict, dataclass, field
from datetime import datetime
from typing import Any, Literal

import numpy as np
import numpy.typing as npt

from tmem.errors import LLMError, StoreError
from tmem.eval.ablations import EvalConfig
from tmem.eval.examples import QAExample
from tmem.eval.judge import JudgeSetup, judge_answer
from tmem.eval.prompt_files import FileAnswer, PromptTemplate
from tmem.eval.run_folder import RunFolder
from tmem.ports import ChatModel
from tmem.prompts import answer as answer_prompt
from tmem.prompts import memory_reply
from tmem.prompts.base import Message, Prompt
from tmem.prompts.common import when
from tmem.query.memory import Memory, QueryContext
from tmem.retrieval.context import estimate_tokens

log = logging.getLogger(__name__)

FILE_ANSWER_OPERATION = "answer_file"
CONTEXT_NAMES = frozenset({"context", "memories", "memory_context"})
Vector = npt.NDArray[np.float32]


class NotBuiltError(StoreError):
    """Questions name conversations that the published snapshot holds no memory for."""


@dataclass(frozen=True)
class AnswerSetup:
    """Which answer prompt to use: ours (no template) or a protocol file sent as ``role``."""

    template: PromptTemplate | None = None
    role: Literal["system", "user"] = "user"
    positional: tuple[str, ...] = ()
    reasoning: bool = False  # tmem's answer prompt with its short reasoning field first

    def identity(self) -> dict[str, Any]:
        if self.template is None:
            return {"kind": "tmem", "reasoning": self.reasoning,
                    "versions": {answer_prompt.OPERATION: answer_prompt.VERSION, memory_reply.OPERATION: memory_reply.VERSION}}
        return {"kind": "file", "path": self.template.path, "sha256": self.template.sha256, "role": self.role,
                "positional": list(self.positional)}


@dataclass(frozen=True)
class RunOptions:
    judge_runs: int = 1
    answer: AnswerSetup = field(default_factory=AnswerSetup)
    judge: JudgeSetup = field(default_factory=JudgeSetup)
    budget_tokens: int | None = None  # context budget (default: settings)
    workers: int = 4  # questions in flight (the chat models bound LLM concurrency themselves)
    embed: bool = True  # False: lexical-only recall (no query embedder)


@dataclass(frozen=True)
class RunTally:
    """What one pass over a run did."""

    config: str
    questions: int
    answered: int
    judged: int
    answers_reused: int
    judgements_reused: int
    failures: int


def prompt_input_tokens(prompt: Prompt[Any]) -> int:
    """Estimated input tokens of a prompt: every message, characters / 4 (as the context report)."""
    return sum(estimate_tokens(m.content) for m in prompt.messages)


def _speakers(example: QAExample, speakers: Sequence[str]) -> tuple[str, str]:
    """(who speaks, who replies): the question's speaker first when known."""
    first = example.speaker or (speakers[0] if speakers else "")
    others = [s for s in speakers if s != first]
    return first, (others[0] if others else "")


def answer_values(example: QAExample, context: str, speakers: Sequence[str]) -> dict[str, str]:
    """What a protocol answer text may ask for, under the names the known texts use."""
    speaker_a, speaker_b = _speakers(example, speakers)
    return {
        "question": example.question, "trigger": example.question, "context": context, "memories": context,
        "memory_context": context, "question_date": example.question_date or "", "speaker": speaker_a,
        "speaker_a": speaker_a, "speaker_b": speaker_b, "conversation_id": example.conversation_id,
    }


def _question_date(example: QAExample) -> str | None:
    return when(datetime.fromisoformat(example.question_date)) if example.question_date else None


def answer_request(
    example: QAExample, context: str, speakers: Sequence[str], setup: AnswerSetup
) -> Prompt[Any]:
    """The answer-role prompt for ``example`` with its recalled ``context``."""
    if setup.template is not None:
        text = setup.template.fill(answer_values(example, context, speakers), setup.positional)
        if not setup.template.names & CONTEXT_NAMES:  # LoCoMo's QA prompt reads "based on the above context"
            text = f"{context}\n\n{text}"
        return Prompt(
            operation=FILE_ANSWER_OPERATION, version=setup.template.version,
            messages=(Message(setup.role, text),), response_model=FileAnswer,
            input_ref=f"{example.conversation_id} {example.qid} answer",
        )
    if example.dataset == "locomo-plus":
        speaker, respondent = _speakers(example, speakers)
        return memory_reply.build(
            memory_reply.MemoryReplyInput(
                conversation_id=example.conversation_id, qid=example.qid, speaker=speaker or None,
                respondent=respondent or None, message_date=_question_date(example),
                latest_message=example.question, context=context,
            )
        )
    return answer_prompt.build(
        answer_prompt.AnswerInput(
            conversation_id=example.conversation_id, question=example.question,
            question_date=_question_date(example), context=context,
        ),
        reasoning=setup.reasoning,
    )


def answer_text(response: Any) -> str:
    if isinstance(response, answer_prompt.AnswerResponse | FileAnswer):
        return response.answer.strip()
    if isinstance(response, memory_reply.MemoryReplyResponse):
        return response.reply.strip()
    raise TypeError(f"not an answer response: {type(response).__name__}")


def context_record(example: QAExample, recalled: QueryContext, config: EvalConfig) -> dict[str, Any]:
    report = recalled.context.report
    return {
        "qid": example.qid, "config": config.name, "conversation_id": example.conversation_id,
        "snapshot_id": recalled.snapshot_id, "mode": recalled.result.mode, "text": recalled.context.text,
        "report": asdict(report),
        "scenes": [{"scene_id": s.scene_id, "turn_ids": [t.turn_id for t in s.turns], "channels": list(s.channels)}
                   for s in recalled.result.scenes],
        "items": [{"item_id": i.item_id, "source_scene_ids": list(i.source_scene_ids), "channels": list(i.channels)}
                  for i in recalled.result.items],
    }


class QARunner:
    """Runs the questions of one configuration into one run folder (thread-safe, resumable)."""

    def __init__(
        self,
        memory: Memory,
        answer_chat: ChatModel,
        judge_chat: ChatModel,
        options: RunOptions,
        *,
        vectors: Mapping[str, Vector] | None = None,
        progress: Callable[[str], None] | None = None,
    ) -> None:
        self.memory = memory
        self.answer_chat = answer_chat
        self.judge_chat = judge_chat
        self.options = options
        self.vectors = dict(vectors or {})
        self._progress = progress or (lambda line: log.info("%s", line))
        self._evidence: dict[tuple[str, str], dict[str, str]] = {}  # (snapshot, conversation) → turn id → line
        self._speakers: dict[str, dict[str, tuple[str, ...]]] = {}  # snapshot → conversation → speakers

    def manifest(self, dataset: str, config: EvalConfig) -> dict[str, Any]:
        """The identity of a run (checked on resume) and what it ran with."""
        settings = config.settings(self.memory.settings)
        return {
            "dataset": dataset, "config": config.as_dict(),
            "answer_prompt": self.options.answer.identity(), "judge_prompt": self.options.judge.identity(),
            "answer_model": self.answer_chat.model_name, "judge_model": self.judge_chat.model_name,
            "judge_runs": self.options.judge_runs, "retrieval": config.retrieval(self.memory.settings).model_dump(),
            "budget_tokens": self.options.budget_tokens or settings.context_token_budget,
            "store": str(self.memory.store), "embed": self.options.embed,
        }

    def require_built(self, examples: Iterable[QAExample]) -> None:
        """Raise :class:`NotBuiltError` naming every conversation the snapshot lacks."""
        snapshot = self.memory.snapshot()
        missing = sorted({e.conversation_id for e in examples if not snapshot.has_conversation(e.conversation_id)})
        if missing:
            shown = ", ".join(missing[:10]) + (f" and {len(missing) - 10} more" if len(missing) > 10 else "")
            raise NotBuiltError(
                f"{self.memory.store}: snapshot {snapshot.snapshot_id} holds no memory for {shown}; "
                "build them first (`tmem build`, or pass --build to `tmem eval`)"
            )

    def run(self, examples: Sequence[QAExample], folder: RunFolder, config: EvalConfig) -> RunTally:
        """Answer and judge every question not done yet; returns what this pass did."""
        if self.options.judge_runs < 1:
            raise ValueError(f"judge_runs must be ≥ 1, got {self.options.judge_runs}")
        examples = folder.add_examples(examples)
        self.require_built(examples)
        done = folder.answered()
        todo = [e for e in examples if e.qid not in done]
        self._progress(f"[{config.name}] {len(examples)} questions: {len(done)} answered before, {len(todo)} to answer")
        answered = self._map(lambda e: self._answer(e, folder, config), todo)
        answers = folder.answered()
        judged = folder.judged()
        jobs = [
            (e, run) for e in examples if e.qid in answers
            for run in range(1, self.options.judge_runs + 1) if (e.qid, run) not in judged
        ]
        self._progress(f"[{config.name}] {len(jobs)} judge calls to make ({len(judged)} recorded before)")
        verdicts = self._map(lambda job: self._judge(job[0], str(answers[job[0].qid]["answer"]), job[1], folder), jobs)
        return RunTally(
            config=config.name, questions=len(examples), answered=sum(answered), judged=sum(verdicts),
            answers_reused=len(done), judgements_reused=len(judged),
            failures=answered.count(False) + verdicts.count(False),
        )

    def _map(self, fn: Callable[[Any], bool], jobs: Sequence[Any]) -> list[bool]:
        if not jobs:
            return []
        if self.options.workers <= 1:
            return [fn(job) for job in jobs]
        with ThreadPoolExecutor(max_workers=self.options.workers, thread_name_prefix="tmem-eval") as pool:
            return list(pool.map(fn, jobs))

    def _answer(self, example: QAExample, folder: RunFolder, config: EvalConfig) -> bool:
        started = time.perf_counter()
        snapshot = self.memory.snapshot()
        recalled = snapshot.context(
            example.question, conversation_id=example.conversation_id, speaker=example.speaker,
            preset=config.preset, budget_tokens=self.options.budget_tokens,
            query_vector=self.vectors.get(example.qid), embed=self.options.embed,
        )
        speakers = self._conversation_speakers(snapshot, example.conversation_id)
        prompt = answer_request(example, recalled.context.text, speakers, self.options.answer)
        try:
            response = self.answer_chat.complete(prompt)
        except LLMError as exc:
            self._failed(folder, example, "answer", None, exc)
            return False
        folder.append("contexts", context_record(example, recalled, config))
        folder.append("answers", {
            "qid": example.qid, "config": config.name, "conversation_id": example.conversation_id,
            "answer": answer_text(response), "model": self.answer_chat.model_name, "operation": prompt.operation,
            "prompt_version": prompt.version, "input_tokens": prompt_input_tokens(prompt),
            "context_tokens": recalled.context.report.total_tokens, "snapshot_id": recalled.snapshot_id,
            "seconds": round(time.perf_counter() - started, 4),
        })
        return True

    def _judge(self, example: QAExample, answer: str, run: int, folder: RunFolder) -> bool:
        evidence = self._evidence_text(example)
        try:
            verdict = judge_answer(self.judge_chat, example, answer, run, self.options.judge, evidence)
        except LLMError as exc:
            self._failed(folder, example, "judge", run, exc)
            return False
        folder.append("judgements", verdict.record())
        return True

    def _failed(self, folder: RunFolder, example: QAExample, stage: str, run: int | None, exc: LLMError) -> None:
        log.warning("%s of %s failed: %s", stage, example.qid, exc)
        folder.append("errors", {"qid": example.qid, "stage": stage, "run": run, "error_type": type(exc).__name__,
                                 "message": str(exc)})

    def _conversation_speakers(self, snapshot: Any, conversation_id: str) -> tuple[str, ...]:
        if snapshot.snapshot_id not in self._speakers:
            self._speakers[snapshot.snapshot_id] = {c.conversation_id: tuple(c.speakers) for c in snapshot.conversations()}
        return self._speakers[snapshot.snapshot_id].get(conversation_id, ())

    def _evidence_text(self, example: QAExample) -> str:
        """The evidence turns as ``Speaker: text`` lines (LoCoMo-Plus: the cue), from the snapshot."""
        snapshot = self.memory.snapshot()
        key = (snapshot.snapshot_id, example.conversation_id)
        turns = self._evidence.get(key)
        if turns is None:
            index = snapshot.index(example.conversation_id, vectors=False)
            turns = {t.turn_id: f"{t.speaker}: {t.text}" for scene in index.scenes.turns for t in scene}
            self._evidence[key] = turns
        lines = [turns[tid] for tid in example.evidence if tid in turns]
        if lines:
            return "\n".join(lines)
        return example.extra.get("cue_dialogue", "") or "; ".join(example.evidence)


def embed_questions(memory: Memory, examples: Sequence[QAExample], batch: int = 64) -> dict[str, Vector]:
    """Query vectors of the questions, embedded in batches (shared by every configuration)."""
    out: dict[str, Vector] = {}
    embedder = memory.embedder()
    for start in range(0, len(examples), batch):
        chunk = examples[start : start + batch]
        vectors = embedder.embed([e.question for e in chunk])
        out.update({e.qid: vectors[i] for i, e in enumerate(chunk)})
    return out

"""LLM-as-judge: grade one answer, one judge run at a time.

* LoCoMo questions → :mod:`tmem.prompts.judge_locomo` (CORRECT/WRONG against the reference).
* LoCoMo-Plus cognitive items → :mod:`tmem.prompts.judge_memory_awareness` (binary: does the
  reply draw on the cue?).
* ``--judge-prompt FILE`` replaces both with a protocol text (:mod:`tmem.eval.prompt_files`),
  sent verbatim as the user message (with ``--judge-system-prompt FILE`` as the system message);
  its label is read as correct 1 / partial 0.5 / wrong 0.

N judge runs of one answer must be N calls even with the response cache on: our prompts carry
the run number in their input; a protocol text is sent unchanged and the run number goes into
the prompt version instead (part of the cache key, never sent).
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from tmem.eval.examples import QAExample
from tmem.eval.prompt_files import LABEL_SCORES, FileJudgement, PromptTemplate
from tmem.ports import ChatModel
from tmem.prompts import judge_locomo, judge_memory_awareness
from tmem.prompts.base import Message, Prompt

FILE_JUDGE_OPERATION = "judge_file"
SCORES = {"CORRECT": 1.0, "WRONG": 0.0}


@dataclass(frozen=True)
class JudgeSetup:
    """Which judge prompt to use: ours (no template) or a protocol file."""

    template: PromptTemplate | None = None
    system: PromptTemplate | None = None
    positional: tuple[str, ...] = ()

    def identity(self) -> dict[str, Any]:
        """What the run's manifest records (and checks on resume)."""
        if self.template is None:
            return {"kind": "tmem", "versions": {judge_locomo.OPERATION: judge_locomo.VERSION,
                                                 judge_memory_awareness.OPERATION: judge_memory_awareness.VERSION}}
        return {
            "kind": "file", "path": self.template.path, "sha256": self.template.sha256,
            "system_path": self.system.path if self.system else None,
            "system_sha256": self.system.sha256 if self.system else None, "positional": list(self.positional),
        }


@dataclass(frozen=True)
class Judgement:
    qid: str
    run: int
    label: str  # correct | partial | wrong
    score: float
    reasoning: str | None
    model: str
    operation: str
    prompt_version: str

    def record(self) -> dict[str, Any]:
        return {
            "qid": self.qid, "run": self.run, "label": self.label, "score": self.score,
            "reasoning": self.reasoning, "model": self.model, "operation": self.operation,
            "prompt_version": self.prompt_version,
        }


def judge_values(example: QAExample, answer: str, evidence: str) -> dict[str, str]:
    """What a protocol judge text may ask for, under the names the known texts use."""
    return {
        "question": example.question, "trigger": example.question, "category": example.category,
        "gold_answer": example.answer, "gold": example.answer, "reference_answer": example.answer,
        "answer": answer, "generated_answer": answer, "response": answer, "pred": answer, "prediction": answer,
        "evidence": evidence,
    }


def judge_prompt(example: QAExample, answer: str, run: int, setup: JudgeSetup, evidence: str) -> Prompt[Any]:
    """The prompt of judge run ``run`` (1-based) for ``answer`` to ``example``."""
    if run < 1:
        raise ValueError(f"judge runs are numbered from 1, got {run}")
    if setup.template is not None:
        values = judge_values(example, answer, evidence)
        messages = []
        if setup.system is not None:
            messages.append(Message("system", setup.system.fill(values)))
        messages.append(Message("user", setup.template.fill(values, setup.positional)))
        system_version = f"+{setup.system.version}" if setup.system is not None else ""
        return Prompt(
            operation=FILE_JUDGE_OPERATION,
            version=f"{setup.template.version}{system_version}#run{run}",
            messages=tuple(messages),
            response_model=FileJudgement,
            input_ref=f"{example.conversation_id} {example.qid} judge run {run}",
        )
    if example.dataset == "locomo-plus":
        return judge_memory_awareness.build(
            judge_memory_awareness.JudgeAwarenessInput(
                conversation_id=example.conversation_id, qid=example.qid, earlier_exchange=evidence,
                later_message=example.question, reply=answer, judge_run=run,
            )
        )
    return judge_locomo.build(
        judge_locomo.JudgeLocomoInput(
            conversation_id=example.conversation_id, qid=example.qid, question=example.question,
            reference_answer=example.answer, candidate_answer=answer, judge_run=run,
        )
    )


def read_verdict(response: Any) -> tuple[str, float, str | None]:
    """(label, score, reasoning) of a validated judge response of any of the three prompts."""
    if isinstance(response, FileJudgement):
        return response.label, LABEL_SCORES[response.label], response.reason
    if isinstance(response, judge_locomo.JudgeLocomoResponse | judge_memory_awareness.JudgeAwarenessResponse):
        return response.label.lower(), SCORES[response.label], response.reasoning
    raise TypeError(f"not a judge response: {type(response).__name__}")


def judge_answer(
    chat: ChatModel, example: QAExample, answer: str, run: int, setup: JudgeSetup, evidence: str
) -> Judgement:
    """One judge call (raises the chat model's typed LLMError when it fails)."""
    prompt = judge_prompt(example, answer, run, setup, evidence)
    label, score, reasoning = read_verdict(chat.complete(prompt))
    return Judgement(example.qid, run, label, score, reasoning, chat.model_name, prompt.operation, prompt.version)


def mean_score(judgements: Mapping[int, float]) -> float | None:
    """The mean over judge runs (None when no run is recorded)."""
    return sum(judgements.values()) / len(judgements) if judgements else None

"""Grading a short answer to a LoCoMo question against its reference answer: CORRECT or WRONG.

The grading is lenient on form and strict on substance, as LLM-judge accuracy on LoCoMo is
usually reported: a longer answer that names the same thing, or the same date written another
way, is correct; an answer about something else, or one that declines to answer, is wrong.
``judge_run`` numbers independent gradings of the same answer so that N runs are N calls (and N
cache entries), whose scores are averaged.
"""

from __future__ import annotations

from typing import Literal

from pydantic import BaseModel, Field

from tmem.prompts.base import Prompt
from tmem.prompts.common import assemble

OPERATION = "judge_locomo"
VERSION = "3"


class JudgeLocomoInput(BaseModel):
    conversation_id: str = Field(exclude=True)
    qid: str = Field(exclude=True)
    question: str
    reference_answer: str
    candidate_answer: str
    judge_run: int = Field(ge=1, description="Which independent grading this is (1, 2, ...).")


class JudgeLocomoResponse(BaseModel):
    reasoning: str = Field(
        description="One sentence: what the reference answer names and whether the candidate names the same thing."
    )
    label: Literal["CORRECT", "WRONG"] = Field(
        description=(
            "CORRECT when the candidate answer refers to the same thing as the reference answer, even if "
            "it is longer, worded differently, or gives a date in another format or as a relative phrase "
            "that lands on the same day, month or year; WRONG when it names something else, contradicts "
            "the reference, misses its point, or says the information is not available. Two rules decide "
            "the close cases. Lists: CORRECT when the candidate names at least half of the reference's "
            "items and nothing that contradicts it; WRONG when it names fewer or adds an item that contradicts "
            "the reference or the question. An item or detail the reference does not mention, and does not "
            "contradict, neither helps nor hurts: you cannot check it, so judge by what you can. Dates: "
            "one day off is CORRECT when both clearly point to the same event (the same weekend, 'last "
            "Saturday' read from a nearby day); a different week, month or year is WRONG, and so is a "
            "month or year when the reference names a different one."
        )
    )


SYSTEM = (
    "You grade answers to questions about a long chat between two people. Each question has a short "
    "reference answer written by a person who read the whole chat. Judge only whether the candidate "
    "answer agrees with the reference answer; do not judge style, length or spelling."
)

TASK = "Grade the candidate answer of the input against its reference answer."

EXAMPLE = {"reasoning": "Both name the same pottery class in July 2023.", "label": "CORRECT"}


def build(payload: JudgeLocomoInput, feedback: str | None = None) -> Prompt[JudgeLocomoResponse]:
    return assemble(
        operation=OPERATION,
        version=VERSION,
        system=SYSTEM,
        response_model=JudgeLocomoResponse,
        example=EXAMPLE,
        task=TASK,
        payload=payload,
        input_ref=f"{payload.conversation_id} {payload.qid} judge run {payload.judge_run}",
        feedback=feedback,
    )

"""Grading a reply for memory awareness (LoCoMo-Plus cognitive items): does it draw on the cue?

A LoCoMo-Plus item pairs an earlier exchange (the cue) with a later message (the trigger) that
is related to it by cause, state, goal or value rather than by shared words. There is no
reference answer: a reply is CORRECT when it shows, openly or implicitly, that the speaker
remembers the cue and lets it shape the reply; WRONG when it could have been written without
the cue. ``judge_run`` numbers independent gradings, as in :mod:`tmem.prompts.judge_locomo`.
"""

from __future__ import annotations

from typing import Literal

from pydantic import BaseModel, Field

from tmem.prompts.base import Prompt
from tmem.prompts.common import assemble

OPERATION = "judge_memory_awareness"
VERSION = "1"


class JudgeAwarenessInput(BaseModel):
    conversation_id: str = Field(exclude=True)
    qid: str = Field(exclude=True)
    earlier_exchange: str = Field(description="The cue: what was said earlier in the chat.")
    later_message: str = Field(description="The trigger: the message the reply answers.")
    reply: str
    judge_run: int = Field(ge=1, description="Which independent grading this is (1, 2, ...).")


class JudgeAwarenessResponse(BaseModel):
    reasoning: str = Field(
        description="One sentence: which part of the earlier exchange the reply uses, or that it uses none."
    )
    label: Literal["CORRECT", "WRONG"] = Field(
        description=(
            "CORRECT when the reply mentions, adapts to or clearly takes into account something from the "
            "earlier exchange (a plan, a fear, a constraint, a preference, an event); WRONG when the reply "
            "is generic, ignores the earlier exchange, or contradicts it."
        )
    )


SYSTEM = (
    "You check whether a conversational reply shows memory of an earlier exchange. The earlier "
    "exchange and the later message are linked by meaning, not by shared words, so look for the "
    "link itself: a reply that only answers the later message on its own terms does not count."
)

TASK = "Decide whether the reply of the input draws on the earlier exchange."

EXAMPLE = {"reasoning": "The reply recalls the knee injury from the earlier exchange.", "label": "CORRECT"}


def build(payload: JudgeAwarenessInput, feedback: str | None = None) -> Prompt[JudgeAwarenessResponse]:
    return assemble(
        operation=OPERATION,
        version=VERSION,
        system=SYSTEM,
        response_model=JudgeAwarenessResponse,
        example=EXAMPLE,
        task=TASK,
        payload=payload,
        input_ref=f"{payload.conversation_id} {payload.qid} judge run {payload.judge_run}",
        feedback=feedback,
    )

"""Replying in the chat from recalled memory (LoCoMo-Plus cognitive items).

A LoCoMo-Plus item is not a question with a short answer: the last message of the chat (the
trigger) calls for a reply from the other speaker, and a good reply shows that they remember
what was said earlier (the cue), although the two share few words. The context is the same
recalled memory the short-answer prompt (:mod:`tmem.prompts.answer`) receives.
"""

from __future__ import annotations

from pydantic import BaseModel, Field

from tmem.prompts.base import Prompt
from tmem.prompts.common import assemble

OPERATION = "memory_reply"
VERSION = "2"


class MemoryReplyInput(BaseModel):
    conversation_id: str = Field(exclude=True)
    qid: str = Field(exclude=True)
    speaker: str | None = Field(default=None, description="Who wrote the latest message.")
    respondent: str | None = Field(default=None, description="Whom you reply as.")
    message_date: str | None = Field(default=None, description="When the latest message was written, if known.")
    latest_message: str
    context: str = Field(exclude=True)  # sent as plain text before the input block


class MemoryReplyResponse(BaseModel):
    reply: str = Field(
        min_length=1,
        description=(
            "Your reply, in one to three sentences, as the respondent would write it in this chat. When "
            "something in the recalled memory bears on the latest message (an earlier plan, worry, habit, "
            "preference or event), say how, in your own words; never contradict the memory."
        ),
    )


SYSTEM = (
    "You continue a long-running chat between two people, replying as one of them to the other's "
    "latest message. You do not see the whole chat, only what was recalled from it for this message: "
    "dated excerpts of the dialogue, facts with the dates on which they happened, and short profiles "
    "of the speakers. A friend with a good memory connects the latest message to what they know."
)

TASK = "Reply to the latest message of the input, drawing on its context."

EXAMPLE = {"reply": "Is this about the half-marathon you were training for? Don't push that knee too hard."}


def build(payload: MemoryReplyInput, feedback: str | None = None) -> Prompt[MemoryReplyResponse]:
    return assemble(
        operation=OPERATION,
        version=VERSION,
        system=SYSTEM,
        response_model=MemoryReplyResponse,
        example=EXAMPLE,
        task=TASK,
        payload=payload,
        input_ref=f"{payload.conversation_id} {payload.qid} reply",
        feedback=feedback,
        context=payload.context,
    )

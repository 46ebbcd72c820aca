"""Answering a question from recalled memory: a short answer, grounded in the context given.

The context is what :func:`tmem.retrieval.context.format_context` renders: dated excerpts of
the conversation, facts with the dates they happened, and speaker profiles. Answers are kept
short on purpose (LoCoMo's reference answers are a few words, and token F1 punishes padding).
"""

from __future__ import annotations

from pydantic import BaseModel, Field

from tmem.prompts.base import Prompt
from tmem.prompts.common import assemble

OPERATION = "answer"
VERSION = "1"


class AnswerInput(BaseModel):
    conversation_id: str = Field(exclude=True)
    question: str
    question_date: str | None = Field(
        default=None, description="When the question is asked (e.g. '2023-10-02 Mon'), if known."
    )
    context: str


class AnswerResponse(BaseModel):
    answer: str = Field(
        min_length=1,
        description=(
            "The answer alone, as briefly as the question allows: for a factual question a name, number, "
            "date or short phrase of at most about six words, not a sentence. Give dates as absolute "
            "dates (e.g. '7 May 2023'), working out words like 'yesterday' or 'last week' from the date "
            "of the excerpt or fact that uses them. When the question asks for a judgement, give your "
            "best short judgement from the memory. When the memory holds nothing that answers it, "
            "answer 'Not mentioned'."
        ),
    )


SYSTEM = (
    "You answer questions about a long-running chat between two people. You do not see the whole "
    "chat, only what was recalled from it for this question: dated excerpts of the dialogue, facts "
    "with the dates on which they happened, and short profiles of the speakers. Rely on that "
    "material; when excerpts disagree, prefer the most recent one."
)

TASK = "Answer the question of the input from its context."

EXAMPLE = {"answer": "7 May 2023"}


def build(payload: AnswerInput, feedback: str | None = None) -> Prompt[AnswerResponse]:
    question = payload.question if len(payload.question) <= 60 else payload.question[:57] + "..."
    return assemble(
        operation=OPERATION,
        version=VERSION,
        system=SYSTEM,
        response_model=AnswerResponse,
        example=EXAMPLE,
        task=TASK,
        payload=payload,
        input_ref=f"{payload.conversation_id} question {question!r}",
        feedback=feedback,
    )

"""Answering a question from recalled memory: a short answer, grounded in the context given.

The context is what :func:`tmem.retrieval.context.format_context` renders: dated excerpts of
the conversation, facts with the dates they happened, and speaker profiles; it is sent as plain
text. Answers are kept short on purpose (LoCoMo's reference answers are a few words, and token
F1 punishes padding); an optional short reasoning field comes before the answer
(``TMEM_ANSWER_REASONING``), the answer itself stays short.
"""

from __future__ import annotations

from pydantic import BaseModel, Field

from tmem.prompts.base import Prompt
from tmem.prompts.common import assemble

OPERATION = "answer"
VERSION = "2"


class AnswerInput(BaseModel):
    conversation_id: str = Field(exclude=True)
    question: str
    question_date: str | None = Field(
        default=None, description="When the question is asked (e.g. '2023-10-02 Mon'), if known."
    )
    context: str = Field(exclude=True)  # sent as plain text before the input block, not inside it


ANSWER_HELP = (
    "The answer alone, as briefly as the question allows: a name, number, date or short phrase, not a "
    "sentence; a question asking for several things (which activities, what books) gets all of them the "
    "memory holds, separated by commas. Give dates as absolute dates (e.g. '7 May 2023'), working out "
    "words like 'yesterday' or 'last week' from the date of the excerpt or fact that uses them, and no "
    "more precisely than the memory knows ('May 2023', 'the week before 9 June 2023'). When the question "
    "asks for a judgement, give your best short judgement from the memory. When the memory holds "
    "nothing that answers it, answer 'Not mentioned'."
)


class AnswerResponse(BaseModel):
    answer: str = Field(min_length=1, description=ANSWER_HELP)


class _Reasoning(BaseModel):
    reasoning: str = Field(
        description="At most two short sentences: which excerpts or facts answer the question, with their dates."
    )


class ReasonedAnswerResponse(AnswerResponse, _Reasoning):
    """``reasoning`` first (the model reasons before it answers), then the same short ``answer``."""


SYSTEM = (
    "You answer questions about a long-running chat between two people. You do not see the whole "
    "chat, only what was recalled from it for this question: dated excerpts of the dialogue, facts "
    "with the dates on which they happened ('around' marks a date known only approximately, 'said on' "
    "the day a fact was told), and short profiles of the speakers. Rely on that material. When "
    "excerpts disagree, answer for the time the question asks about: the latest state for a question "
    "about now, the state at that time for a question about an earlier event."
)

TASK = "Answer the question of the input from the recalled context."

EXAMPLE = {"answer": "7 May 2023"}
REASONED_EXAMPLE = {"reasoning": "The 8 May 2023 excerpt says she went 'yesterday'.", "answer": "7 May 2023"}


def build(payload: AnswerInput, feedback: str | None = None, *, reasoning: bool = False) -> Prompt[AnswerResponse]:
    """The answer request; ``reasoning`` asks for a short reasoning field before the (still short) answer."""
    question = payload.question if len(payload.question) <= 60 else payload.question[:57] + "..."
    return assemble(
        operation=OPERATION,
        version=VERSION + ("r" if reasoning else ""),
        system=SYSTEM,
        response_model=ReasonedAnswerResponse if reasoning else AnswerResponse,
        example=REASONED_EXAMPLE if reasoning else EXAMPLE,
        task=TASK,
        payload=payload,
        input_ref=f"{payload.conversation_id} question {question!r}",
        feedback=feedback,
        context=payload.context,
    )

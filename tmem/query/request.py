"""One recall request: what to look for, in which conversation, and how.

Every way in — the Python API (:class:`tmem.query.memory.Memory`), HTTP, MCP, the CLI, the
explorer and the evaluation — calls ``search``, ``context`` or ``answer`` with the same keywords
(:class:`RecallOptions`, declared once); each call makes one :class:`Recall`, and the stages behind
it (``search_for``, ``context_for``, ``answer_for`` of a pinned snapshot) pass that value on whole.
The conversation id is checked here, once, when the request is made (scope is mandatory: DESIGN
§4); whether the snapshot holds memory for it is the snapshot's to say.
"""

from __future__ import annotations

from dataclasses import dataclass
from datetime import datetime
from typing import TypedDict

import numpy.typing as npt

from tmem.errors import ScopeError


class RecallOptions(TypedDict, total=False):
    """The keywords of a recall besides the text and the conversation (see :class:`Recall`)."""

    speaker: str | None
    preset: str
    budget_tokens: int | None
    question_date: datetime | None
    trace: bool
    query_vector: npt.ArrayLike | None
    embed: bool


@dataclass(frozen=True)
class Recall:
    """A query (or a question to answer) about one conversation's memory."""

    text: str
    conversation_id: str
    speaker: str | None = None  # whose persona and words weigh first (None: both speakers)
    preset: str = "default"  # a retrieval preset name (tmem.retrieval.config)
    budget_tokens: int | None = None  # of the rendered context; None: TMEM_CONTEXT_TOKEN_BUDGET
    question_date: datetime | None = None  # when the question is asked (answers only)
    trace: bool = False  # keep the cascade's stage-by-stage trace
    query_vector: npt.ArrayLike | None = None  # the query embedded already (no embedder is loaded)
    embed: bool = True  # False: lexical only

    def __post_init__(self) -> None:
        if not isinstance(self.conversation_id, str) or not self.conversation_id:
            raise ScopeError(f"a query needs a conversation id, got {self.conversation_id!r}")

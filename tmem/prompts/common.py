"""Pieces shared by the prompt modules: dialogue rendering, the field guide, message assembly.

Every operation module keeps its own prose; this module only holds the few sentences that
are the same for every operation (how to answer, how a rejected answer is reported back),
so that they are written once.
"""

from __future__ import annotations

import json
from collections.abc import Iterable
from datetime import datetime
from typing import Any, TypeVar, get_args, get_origin

from pydantic import BaseModel

from tmem.domain import ItemTime, Turn
from tmem.prompts.base import Message, Prompt, render_input
from tmem.prompts.budgets import budget_for

R = TypeVar("R", bound=BaseModel)


class DialogueTurn(BaseModel):
    id: str
    speaker: str | None = None
    text: str


class DialogueBlock(BaseModel):
    """Consecutive turns of one session, under the session's date."""

    session: str | None = None
    date: str
    turns: list[DialogueTurn]


def when(moment: datetime) -> str:
    """Dates as the models read them: ISO date, weekday (to resolve "last Friday"), clock time."""
    return moment.strftime("%Y-%m-%d %a %H:%M")


def iso_date(moment: datetime) -> str:
    return moment.strftime("%Y-%m-%d")


def iso_when(time: ItemTime) -> str | None:
    """An item's time as the models write it (item_extract's ``when``): ``2023-05-07``, ``2023-05``,
    ``2023`` or ``2023-05-01/2023-05-07``; the day it was said, for a time taken from its turn."""
    if time.start is None:
        return None
    if time.granularity == "span" and time.end is not None:
        return f"{iso_date(time.start)}/{iso_date(time.end)}"
    if time.granularity == "month":
        return time.start.strftime("%Y-%m")
    if time.granularity == "year":
        return time.start.strftime("%Y")
    return iso_date(time.start)


def dialogue_blocks(
    turns: Iterable[Turn], *, with_session: bool = True, with_speaker: bool = True
) -> list[DialogueBlock]:
    """Group turns (already in conversation order) into per-session blocks dated by their first turn."""
    blocks: list[DialogueBlock] = []
    current: str | None = None
    for turn in turns:
        if not blocks or turn.session_id != current:
            current = turn.session_id
            blocks.append(
                DialogueBlock(session=turn.session_id if with_session else None, date=when(turn.event_time), turns=[])
            )
        blocks[-1].turns.append(
            DialogueTurn(id=turn.turn_id, speaker=turn.speaker if with_speaker else None, text=turn.text)
        )
    return blocks


def compact(payload: BaseModel) -> dict[str, Any]:
    """The payload as JSON data without null fields (fewer tokens, nothing lost)."""
    return payload.model_dump(mode="json", exclude_none=True)


def _inner_models(annotation: Any) -> list[type[BaseModel]]:
    if isinstance(annotation, type) and issubclass(annotation, BaseModel):
        return [annotation]
    found: list[type[BaseModel]] = []
    if get_origin(annotation) is not None:  # list[...], X | None, dict[...]
        for arg in get_args(annotation):
            found.extend(_inner_models(arg))
    return found


def field_guide(model: type[BaseModel], indent: str = "") -> str:
    """One line per field of the response model (its description), nested models indented.

    The descriptions are the instructions; printing them keeps servers without JSON-schema
    support (JSON mode only) as well informed as those that receive the schema.
    """
    lines: list[str] = []
    for name, info in model.model_fields.items():
        lines.append(f"{indent}- {name}: {info.description or ''}".rstrip())
        for inner in _inner_models(info.annotation):
            lines.append(field_guide(inner, indent + "  "))
    return "\n".join(lines)


ANSWER_RULES = (
    "Answer with a single JSON object and nothing else. State nothing about the speakers that the "
    "input does not support: no invented people, dates or events. Keep each field as short as its "
    "description allows."
)

EXAMPLE_HEADER = "Example of the shape (made-up content):"

CONTEXT_OPEN = "<context>"
CONTEXT_CLOSE = "</context>"


def parse_context(content: str) -> str:
    """The plain-text context block of a user message ("" when it has none; used by the scripted server)."""
    if CONTEXT_OPEN not in content:
        return ""
    start = content.index(CONTEXT_OPEN) + len(CONTEXT_OPEN)
    return content[start : content.index(CONTEXT_CLOSE, start)].strip("\n")

FEEDBACK_NOTE = "A previous answer to this same request was rejected: {reason} Answer again and fix that."


def assemble(
    *,
    operation: str,
    version: str,
    system: str,
    response_model: type[R],
    example: dict[str, Any],
    task: str,
    payload: BaseModel | dict[str, Any],
    input_ref: str,
    feedback: str | None,
    context: str | None = None,
) -> Prompt[R]:
    """System message (role, rules, field guide, one example) and user message (task, the recalled
    ``context`` as plain text between ``<context>`` tags when given — readable, not a JSON-escaped
    string — then the input block).

    The prompt carries the operation's completion-token budget (:mod:`tmem.prompts.budgets`) and
    whether it is a checked re-ask (``feedback`` given)."""
    system_text = "\n\n".join(
        [
            system,
            ANSWER_RULES,
            "Fields of the answer:\n" + field_guide(response_model),
            EXAMPLE_HEADER + "\n" + json.dumps(example, ensure_ascii=False),
        ]
    )
    data = compact(payload) if isinstance(payload, BaseModel) else payload
    parts = [task]
    if feedback:
        parts.append(FEEDBACK_NOTE.format(reason=feedback))
    if context is not None:
        parts.append(f"{CONTEXT_OPEN}\n{context}\n{CONTEXT_CLOSE}")
    parts.append(render_input(data))
    return Prompt(
        operation=operation,
        version=version,
        messages=(Message("system", system_text), Message("user", "\n\n".join(parts))),
        response_model=response_model,
        input_ref=input_ref,
        max_tokens=budget_for(operation),
        checked_reask=feedback is not None,
    )

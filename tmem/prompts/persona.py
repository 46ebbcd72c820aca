"""Persona of one speaker, folded chunk by chunk over the speaker's turns.

The first chunk starts from nothing; each further chunk gets the persona so far and returns
the whole updated persona, so the input stays bounded however long the conversation is.
"""

from __future__ import annotations

from pydantic import BaseModel, Field

from tmem.prompts.base import Prompt
from tmem.prompts.common import DialogueBlock, assemble

OPERATION = "persona"
VERSION = "3"
MAX_ENTRIES = 12  # stated in the descriptions; longer lists are clipped by tmem/construct/persona.py


class TimelineEntry(BaseModel):
    fact: str = Field(min_length=1, description="A standing fact about the speaker's life (job, home, family, status).")
    since: str | None = Field(
        default=None,
        description=(
            "When it became true, as precisely as the turns tell and no more: YYYY-MM-DD, YYYY-MM or YYYY "
            "('four years ago' said in 2023 → 2019), resolved from the turn dates; else null."
        ),
    )


def _list_help(what: str) -> str:
    return f"Up to {MAX_ENTRIES} short phrases: {what}."


class PersonaDraft(BaseModel):
    identity: list[str] = Field(
        description=_list_help("who the speaker is: age, origin, job, roles")
    )
    preferences: list[str] = Field(
        description=_list_help("likes, dislikes, hobbies, favourite things")
    )
    traits: list[str] = Field(
        description=_list_help("character traits, values and attitudes, each with a hint of evidence"),
    )
    relations: list[str] = Field(
        description=_list_help("people in the speaker's life and how they relate, with names")
    )
    timeline: list[TimelineEntry] = Field(
        description="Standing facts in the order they became true."
    )


class PersonaInput(BaseModel):
    conversation_id: str = Field(exclude=True)
    speaker: str
    persona_so_far: PersonaDraft | None = None
    turns: list[DialogueBlock]


SYSTEM = (
    "You write the profile of one speaker of a long chat from what that speaker said. Keep what "
    "stays true over time and leave out passing events. When a profile so far is given, return the "
    "whole profile updated with the new turns: keep what still holds, correct what changed, add "
    "what is new, and stay within the size limits by dropping the least telling entries. When "
    "the speaker's own words contradict each other, keep the later statement and say so in the "
    "entry (e.g. 'vegetarian (said otherwise on 2023-05-03)'); a passing doubt does not remove "
    "what still holds. Name people as the chat names them, without pronouns it does not use."
)

TASK = "Write the profile of the speaker from these turns."

EXAMPLE = {
    "identity": ["nurse in Leeds", "about 30 years old"],
    "preferences": ["loves hiking", "dislikes crowded cafés"],
    "traits": ["patient: calms worried patients"],
    "relations": ["married to Sam", "close to her sister Ruth"],
    "timeline": [{"fact": "works night shifts at St James's hospital", "since": "2021-09"}],
}


def build(payload: PersonaInput, feedback: str | None = None) -> Prompt[PersonaDraft]:
    ids = [turn.id for block in payload.turns for turn in block.turns]
    span = f"{ids[0]}..{ids[-1]}" if ids else "no turns"
    folded = " (folding)" if payload.persona_so_far is not None else ""
    return assemble(
        operation=OPERATION,
        version=VERSION,
        system=SYSTEM,
        response_model=PersonaDraft,
        example=EXAMPLE,
        task=TASK,
        payload=payload,
        input_ref=f"{payload.conversation_id} speaker {payload.speaker!r} turns {span}{folded}",
        feedback=feedback,
    )

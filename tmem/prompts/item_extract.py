"""Item extraction for one topic: atomic items (one scene) and connected items (several scenes)."""

from __future__ import annotations

from typing import Literal

from pydantic import BaseModel, Field

from tmem.prompts.base import Prompt
from tmem.prompts.common import DialogueBlock, assemble

OPERATION = "item_extract"
VERSION = "1"


class TopicScene(BaseModel):
    ref: str
    title: str
    dialogue: list[DialogueBlock]


class ExtractInput(BaseModel):
    conversation_id: str = Field(exclude=True)
    topic_id: str = Field(exclude=True)
    topic: str
    scenes: list[TopicScene]


class ExtractedItem(BaseModel):
    kind: Literal["atomic", "connected"] = Field(
        description="atomic: a fact from one scene. connected: a link that needs two or more scenes together."
    )
    content: str = Field(
        min_length=1,
        description=(
            "One self-contained sentence in the third person with full names, no pronouns without "
            "a referent, and the absolute date when one is known."
        ),
    )
    sources: list[str] = Field(
        min_length=1, description="Refs of the source scenes: exactly one for atomic, two or more for connected."
    )
    date: str | None = Field(
        default=None,
        description=(
            "When it happened as YYYY-MM-DD, resolved from the turn dates (e.g. 'yesterday' said on "
            "2023-05-08 gives 2023-05-07); null when the dialogue does not tell."
        ),
    )
    keywords: list[str] = Field(description="Two to six keywords of the fact.")


class ExtractResponse(BaseModel):
    items: list[ExtractedItem] = Field(
        description="The facts worth remembering about this topic: atomic items first, then connected ones."
    )


SYSTEM = (
    "You distil memories from a long chat between two people. The input is one topic and its "
    "scenes, each with dated dialogue. Write the facts someone would need later to answer "
    "questions about the speakers: events, plans, decisions, possessions, people, places, "
    "feelings and their reasons. An atomic item states one fact from one scene. A connected item "
    "states what only several scenes show together: a change over time, a cause and its "
    "consequence, a plan and its outcome, a repeated habit. Every item names its source scenes. "
    "Skip greetings and small talk; do not repeat the same fact twice."
)

TASK = "Extract the atomic and connected items of this topic."

EXAMPLE = {
    "items": [
        {
            "kind": "atomic",
            "content": "Ana signed up for a pottery class on 2 March 2022.",
            "sources": ["S1"],
            "date": "2022-03-02",
            "keywords": ["Ana", "pottery class"],
        },
        {
            "kind": "connected",
            "content": "Ana's pottery class, begun in March 2022, led to her first sold bowl in June 2022.",
            "sources": ["S1", "S3"],
            "date": "2022-06-10",
            "keywords": ["Ana", "pottery", "bowl sale"],
        },
    ]
}


def build(payload: ExtractInput, feedback: str | None = None) -> Prompt[ExtractResponse]:
    return assemble(
        operation=OPERATION,
        version=VERSION,
        system=SYSTEM,
        response_model=ExtractResponse,
        example=EXAMPLE,
        task=TASK,
        payload=payload,
        input_ref=f"{payload.conversation_id} topic {payload.topic_id} ({len(payload.scenes)} scenes)",
        feedback=feedback,
    )

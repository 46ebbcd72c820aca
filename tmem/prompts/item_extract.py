"""Item extraction for one topic: atomic items (one scene) and connected items (several scenes)."""

from __future__ import annotations

from typing import Literal

from pydantic import BaseModel, Field

from tmem.prompts.base import Prompt
from tmem.prompts.common import DialogueBlock, assemble

OPERATION = "item_extract"
VERSION = "3"


class TopicScene(BaseModel):
    ref: str
    title: str
    other_topics: list[str] | None = Field(
        default=None, description="Titles of the other topics this scene also belongs to (omitted when none)."
    )
    dialogue: list[DialogueBlock]


class ExtractInput(BaseModel):
    conversation_id: str = Field(exclude=True)
    topic_id: str = Field(exclude=True)
    topic: str
    scenes: list[TopicScene]


WHEN_HELP = (
    "When it happened (or began to hold), resolved from the date of the turn that says it, as precisely "
    "as the dialogue allows and no more: a day YYYY-MM-DD ('yesterday' said on 2023-05-08 → 2023-05-07), "
    "a month YYYY-MM ('last month'), a year YYYY ('two years ago'), or a span START/END of two days "
    "('last week' said on Mon 2023-05-08 → 2023-05-01/2023-05-07; 'from 10 to 27 June'); the turn's own "
    "day when the fact happens that day ('this morning', 'today', or plainly news of the day). Never make "
    "up a day the dialogue does not give: null when the dialogue does not say when it happened (the day "
    "it was said is kept from said_in)."
)


class ExtractedItem(BaseModel):
    kind: Literal["atomic", "connected"] = Field(
        description="atomic: a fact from one scene. connected: a link that needs two or more scenes together."
    )
    content: str = Field(
        min_length=1,
        description=(
            "One self-contained sentence in the third person naming people as the chat names them, no "
            "pronoun without its referent, and the time when one is known."
        ),
    )
    sources: list[str] = Field(
        min_length=1, description="Refs of the source scenes: exactly one for atomic, two or more for connected."
    )
    said_in: str | None = Field(
        default=None, description="Id of the turn that states the fact (e.g. 'D3:7'); for a connected item, the latest."
    )
    when: str | None = Field(default=None, description=WHEN_HELP)
    when_phrase: str = Field(
        default="",
        description="The dialogue's own words that place it in time ('last week', 'a few weeks before the "
        "wedding'); empty when it is the day of the turn or no time is given.",
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
    "states only what several scenes show together: a change over time, a cause and its "
    "consequence, a plan and its outcome, a repeated habit; it never restates one atomic item. "
    "Every item names its source scenes and the turn that says it. A scene may also belong to "
    "other topics (listed with it): its facts about those are extracted with them, not here; "
    "extract every other fact worth remembering. Time matters: a fact is dated by when it "
    "happened, resolved from the date of the turn that says it (a fact said on the last day of a "
    "long scene is dated from that day), at the precision the dialogue gives. Skip greetings and "
    "small talk; state each fact once."
)

TASK = "Extract the atomic and connected items of this topic."

EXAMPLE = {
    "items": [
        {
            "kind": "atomic",
            "content": "Ana signed up for a pottery class on 2 March 2022.",
            "sources": ["S1"],
            "said_in": "D1:4",
            "when": "2022-03-02",
            "when_phrase": "",
            "keywords": ["Ana", "pottery class"],
        },
        {
            "kind": "atomic",
            "content": "Ana visited her grandmother in Porto in the week before 2 March 2022.",
            "sources": ["S1"],
            "said_in": "D1:6",
            "when": "2022-02-21/2022-02-27",
            "when_phrase": "last week",
            "keywords": ["Ana", "grandmother", "Porto"],
        },
        {
            "kind": "connected",
            "content": "Ana's pottery class, begun in March 2022, led to her first sold bowl in June 2022.",
            "sources": ["S1", "S3"],
            "said_in": "D5:2",
            "when": "2022-06",
            "when_phrase": "this month",
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

"""Topic creation: a specific title and at least ten keywords for a scene that no topic admits.

Used for the first scene of a conversation and whenever the matching call did not propose a
usable new topic itself (see ``topic_match``).
"""

from __future__ import annotations

from pydantic import BaseModel, Field

from tmem.prompts.base import Prompt
from tmem.prompts.common import assemble

OPERATION = "topic_create"
VERSION = "1"
MIN_KEYWORDS = 10


class SceneView(BaseModel):
    """What the topic operations see of a scene."""

    date: str
    title: str
    summary: str
    narrative: str


class CreateInput(BaseModel):
    conversation_id: str = Field(exclude=True)
    scene_ref: str = Field(exclude=True)
    scene: SceneView


TOPIC_TITLE_HELP = (
    "A specific title for the recurring subject this scene belongs to, naming the person and the "
    "thread (e.g. 'Maya's move to Lisbon'), not a generic theme like 'life updates'."
)
KEYWORDS_HELP = (
    f"At least {MIN_KEYWORDS} distinct keywords or short phrases: people, places, objects, "
    "activities and plans of the subject, as words a later mention would use."
)


class TopicDraft(BaseModel):
    title: str = Field(min_length=1, description=TOPIC_TITLE_HELP)
    keywords: list[str] = Field(min_length=MIN_KEYWORDS, description=KEYWORDS_HELP)


SYSTEM = (
    "You keep a list of topics for a long chat between two people. A topic is a recurring "
    "subject, one specific thread of a person's life that later scenes may continue. Open a "
    "topic for the scene in the input: give it a title and keywords that will recognise later "
    "scenes of the same thread."
)

TASK = "Open a topic for this scene."

EXAMPLE = {
    "title": "Maya's move to Lisbon",
    "keywords": [
        "Maya",
        "Lisbon",
        "moving",
        "apartment",
        "job offer",
        "Portugal",
        "packing",
        "landlord",
        "new city",
        "relocation",
        "flat hunting",
    ],
}


def build(payload: CreateInput, feedback: str | None = None) -> Prompt[TopicDraft]:
    return assemble(
        operation=OPERATION,
        version=VERSION,
        system=SYSTEM,
        response_model=TopicDraft,
        example=EXAMPLE,
        task=TASK,
        payload=payload,
        input_ref=f"{payload.conversation_id} scene {payload.scene_ref}",
        feedback=feedback,
    )

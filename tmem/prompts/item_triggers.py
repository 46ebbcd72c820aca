"""Item triggers for several items per call: entity concepts (Q I) and bridge situations (Q II)."""

from __future__ import annotations

from pydantic import BaseModel, Field

from tmem.prompts.base import Prompt
from tmem.prompts.common import assemble

OPERATION = "item_triggers"
VERSION = "2"
# Stated in the descriptions and cut to by the construction stage (tmem/construct/triggers.py), not
# enforced by the schema: a longer list is clipped and counted, not a failed answer.
MAX_ENTITIES = 5
MAX_BRIDGES = 4


class ItemView(BaseModel):
    ref: str
    content: str
    date: str | None = None


class ItemTriggerInput(BaseModel):
    conversation_id: str = Field(exclude=True)
    items: list[ItemView]


class Bridge(BaseModel):
    situation: str = Field(
        min_length=1,
        description="A later situation, worded in its own terms, where knowing the item would change what to say or do.",
    )
    rationale: str = Field(min_length=1, description="One clause: why the item matters there.")


class ItemTriggerAnswer(BaseModel):
    ref: str = Field(description="The item's ref from the input.")
    entities: list[str] = Field(
        min_length=1,
        description="One to five broader concepts the item is an instance of (e.g. 'food allergy', 'dietary restriction').",
    )
    bridges: list[Bridge] = Field(
        min_length=1, description="One to four situations far from the item's wording."
    )


class ItemTriggerResponse(BaseModel):
    items: list[ItemTriggerAnswer] = Field(description="Exactly one entry per input item.")


SYSTEM = (
    "You add recall cues to remembered facts so that they come to mind at the right moment later. "
    "For each item give two kinds of cue. Entity cues name the general kinds of thing the item is "
    "about, so a question phrased in general terms finds it. Bridge cues describe future "
    "situations in which the item would matter although the situation shares few words with it. "
    "A bridge is an imagined later moment, not a claim about what happened, so its particulars "
    "may be invented as long as the moment is a plausible one for this person; only the item "
    "itself must be true. Write the situation as the person might describe it then. Each bridge "
    "carries a short reason."
)

TASK = "Write the entity and bridge cues of each item."

EXAMPLE = {
    "items": [
        {
            "ref": "I1",
            "entities": ["food allergy", "dietary restriction"],
            "bridges": [
                {
                    "situation": "I'm picking the restaurant for our team dinner on Friday",
                    "rationale": "the menu must be safe for Tom's peanut allergy",
                }
            ],
        }
    ]
}


def build(payload: ItemTriggerInput, feedback: str | None = None) -> Prompt[ItemTriggerResponse]:
    refs = [item.ref for item in payload.items]
    return assemble(
        operation=OPERATION,
        version=VERSION,
        system=SYSTEM,
        response_model=ItemTriggerResponse,
        example=EXAMPLE,
        task=TASK,
        payload=payload,
        input_ref=f"{payload.conversation_id} items {','.join(refs)}",
        feedback=feedback,
    )

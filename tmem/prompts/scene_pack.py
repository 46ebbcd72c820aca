"""Scene packing: title, summary and narrative for several already-cut scenes in one call.

Used for the scenes that no boundary call described: a scene cut by the runaway guard, or the
last open scene when the model did not close it at the end of the conversation.
"""

from __future__ import annotations

from pydantic import BaseModel, Field

from tmem.prompts.base import Prompt
from tmem.prompts.common import DialogueBlock, assemble
from tmem.prompts.scene_boundaries import NARRATIVE_HELP, SUMMARY_HELP, TITLE_HELP

OPERATION = "scene_pack"
VERSION = "1"


class SceneToPack(BaseModel):
    ref: str
    dialogue: list[DialogueBlock]


class PackInput(BaseModel):
    conversation_id: str = Field(exclude=True)
    scenes: list[SceneToPack]


class PackedScene(BaseModel):
    ref: str = Field(description="The scene's ref from the input.")
    title: str = Field(min_length=1, description=TITLE_HELP)
    summary: str = Field(min_length=1, description=SUMMARY_HELP)
    narrative: str = Field(min_length=1, description=NARRATIVE_HELP)


class PackResponse(BaseModel):
    scenes: list[PackedScene] = Field(description="One entry per input scene, in input order.")


SYSTEM = (
    "You describe scenes of a long chat between two people. Each scene is a short stretch of "
    "dialogue about one matter, shown with its dates. For every scene write a title, a summary "
    "and a narrative from its own turns only; scenes are described independently of each other."
)

TASK = "Describe each scene of the input."

EXAMPLE = {
    "scenes": [
        {
            "ref": "S1",
            "title": "Omar's first week at the bakery job",
            "summary": "Omar told Lea about his new bakery job and the early shifts.",
            "narrative": (
                "On 12 June 2021 Omar said he had started working at a bakery. "
                "He found the 5 a.m. shifts hard. Lea suggested going to bed earlier."
            ),
        }
    ]
}


def build(payload: PackInput, feedback: str | None = None) -> Prompt[PackResponse]:
    first = payload.scenes[0].dialogue[0].turns[0].id if payload.scenes else "?"
    return assemble(
        operation=OPERATION,
        version=VERSION,
        system=SYSTEM,
        response_model=PackResponse,
        example=EXAMPLE,
        task=TASK,
        payload=payload,
        input_ref=f"{payload.conversation_id} {len(payload.scenes)} scenes from turn {first}",
        feedback=feedback,
    )

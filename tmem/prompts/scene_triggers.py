"""Scene triggers (Q IV: situation, object, event, emotion) and horizon triggers (Q III), per scene.

Both families read the scene's narrative, so one call answers both for several scenes.
"""

from __future__ import annotations

from pydantic import BaseModel, Field

from tmem.prompts.base import Prompt
from tmem.prompts.common import assemble

OPERATION = "scene_triggers"
VERSION = "1"


class SceneNarrative(BaseModel):
    ref: str
    date: str
    speakers: list[str]
    title: str
    narrative: str


class SceneTriggerInput(BaseModel):
    conversation_id: str = Field(exclude=True)
    scenes: list[SceneNarrative]


HORIZON_HELP = "One sentence, or empty when the scene gives nothing for it."


class SceneTriggerAnswer(BaseModel):
    ref: str = Field(description="The scene's ref from the input.")
    situation: str = Field(min_length=1, description="One sentence: the setting and circumstances.")
    object: str = Field(min_length=1, description="One sentence: the main thing, person or place involved.")
    event: str = Field(min_length=1, description="One sentence: what happened.")
    emotion: str = Field(min_length=1, description="One sentence: how the speakers felt.")
    personal_arc: str = Field(
        default="", description="How this may shape the person's story or sense of self later. " + HORIZON_HELP
    )
    avoidance_habit: str = Field(
        default="",
        description="Something the person may steer clear of or put off later because of it. " + HORIZON_HELP,
    )
    goal_arc: str = Field(default="", description="An aim this points to and what a later step may be. " + HORIZON_HELP)
    belief_in_action: str = Field(
        default="", description="A value shown here and a later choice it would guide. " + HORIZON_HELP
    )
    legacy_anchor: str = Field(
        default="", description="What this may leave for family, friends or community later. " + HORIZON_HELP
    )


class SceneTriggerResponse(BaseModel):
    scenes: list[SceneTriggerAnswer] = Field(description="Exactly one entry per input scene.")


SYSTEM = (
    "You add recall cues to scenes of a long chat between two people, reading each scene's "
    "narrative. First describe the scene itself in four sentences: situation, object, event and "
    "emotion. Then look ahead along five horizons: ways a future conversation could come back "
    "to this scene from a related but different situation, such as a later step of the same "
    "plan or a choice that the same value would guide. Leave a horizon empty rather than guess "
    "beyond the narrative."
)

TASK = "Write the scene and horizon cues of each scene."

EXAMPLE = {
    "scenes": [
        {
            "ref": "S1",
            "situation": "Ben called Ana after his first marathon in Berlin.",
            "object": "The marathon medal Ben earned.",
            "event": "Ben finished the race in under four hours.",
            "emotion": "Ben was proud and exhausted.",
            "personal_arc": "Ben may come to see himself as a serious runner.",
            "avoidance_habit": "",
            "goal_arc": "Ben may aim for a faster time at his next race.",
            "belief_in_action": "Ben's belief in steady training may guide how he handles a new challenge at work.",
            "legacy_anchor": "",
        }
    ]
}


def build(payload: SceneTriggerInput, feedback: str | None = None) -> Prompt[SceneTriggerResponse]:
    refs = [scene.ref for scene in payload.scenes]
    return assemble(
        operation=OPERATION,
        version=VERSION,
        system=SYSTEM,
        response_model=SceneTriggerResponse,
        example=EXAMPLE,
        task=TASK,
        payload=payload,
        input_ref=f"{payload.conversation_id} scenes {','.join(refs)}",
        feedback=feedback,
    )

"""Scene triggers (Q IV: situation, object, event, emotion) and horizon triggers (Q III), per scene.

Both families read the scene's narrative, so one call answers both for several scenes.
"""

from __future__ import annotations

from pydantic import BaseModel, Field

from tmem.prompts.base import Prompt
from tmem.prompts.common import assemble

OPERATION = "scene_triggers"
VERSION = "2"


class SceneNarrative(BaseModel):
    ref: str
    date: str
    speakers: list[str]
    title: str
    narrative: str


class SceneTriggerInput(BaseModel):
    conversation_id: str = Field(exclude=True)
    scenes: list[SceneNarrative]


HORIZON_HELP = (
    "Write it as one short line the person might say then, in the first person and in words of "
    "that later moment rather than the scene's; empty when the scene gives this channel nothing."
)


class SceneTriggerAnswer(BaseModel):
    ref: str = Field(description="The scene's ref from the input.")
    situation: str = Field(min_length=1, description="One sentence: the setting and circumstances.")
    object: str = Field(min_length=1, description="One sentence: the main thing, person or place involved.")
    event: str = Field(min_length=1, description="One sentence: what happened.")
    emotion: str = Field(min_length=1, description="One sentence: how the speakers felt.")
    personal_arc: str = Field(
        default="",
        description="A later moment in which what happened here shows in how the person sees or carries "
        "themselves. " + HORIZON_HELP,
    )
    avoidance_habit: str = Field(
        default="",
        description="A later moment in which the person holds back, hesitates, avoids something or takes a "
        "precaution because of this. " + HORIZON_HELP,
    )
    goal_arc: str = Field(
        default="",
        description="A later step, success or setback of an aim this scene points to. " + HORIZON_HELP,
    )
    belief_in_action: str = Field(
        default="",
        description="A later choice or dilemma that the value shown here would decide. " + HORIZON_HELP,
    )
    legacy_anchor: str = Field(
        default="",
        description="A later moment in which the person passes this on: advice, a story told, a habit "
        "taught, something left to others. " + HORIZON_HELP,
    )


class SceneTriggerResponse(BaseModel):
    scenes: list[SceneTriggerAnswer] = Field(description="Exactly one entry per input scene.")


SYSTEM = (
    "You add recall cues to scenes of a long chat between two people, reading each scene's "
    "narrative. First describe the scene itself in four sentences: situation, object, event and "
    "emotion. Then look ahead along five horizons for the person whose matter the scene is (either "
    "speaker when they share it). Each horizon imagines a later moment, weeks or months on, in "
    "which that person would bring this scene up or act because of it, although that "
    "later moment is about something else and shares few words with the scene: a later step of "
    "the same plan, a situation the person now handles differently, a choice the same value "
    "decides, advice they pass on. Write each as the person might put it then, so that it matches "
    "how they will talk, not how the scene was told. The later moment is imagined, but its link "
    "to the scene must follow from the narrative: invent no facts about what happened, and leave a "
    "channel empty when no such moment follows from the scene."
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
            "personal_arc": "These days I actually call myself a runner when people ask what I do for fun.",
            "avoidance_habit": "I skipped the office pizza night because I'm tapering before the half in May.",
            "goal_arc": "I signed up for Boston qualifying, so the next months are all interval training.",
            "belief_in_action": "The new project looks impossible, but I'll take it one week at a time like training.",
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

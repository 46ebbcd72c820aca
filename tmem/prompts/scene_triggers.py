"""Scene triggers (Q IV: situation, object, event, emotion) and horizon triggers (Q III), per scene.

Both families read the scene's narrative, so one call answers both for several scenes.
"""

from __future__ import annotations

from pydantic import BaseModel, Field

from tmem.prompts.base import Prompt
from tmem.prompts.common import assemble

OPERATION = "scene_triggers"
VERSION = "3"


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
    "One sentence in general terms (the kinds of situation, not one invented instance of them), saying "
    "what of the scene they would call back; empty when the scene gives this channel nothing."
)


class SceneTriggerAnswer(BaseModel):
    ref: str = Field(description="The scene's ref from the input.")
    situation: str = Field(min_length=1, description="One sentence: the setting and circumstances.")
    object: str = Field(min_length=1, description="One sentence: the main thing, person or place involved.")
    event: str = Field(min_length=1, description="One sentence: what happened.")
    emotion: str = Field(min_length=1, description="One sentence: how the speakers felt.")
    personal_arc: str = Field(
        default="",
        description="Later situations in which what happened here shows in how the person sees themselves or "
        "what they now feel able or unable to do. " + HORIZON_HELP,
    )
    avoidance_habit: str = Field(
        default="",
        description="Later situations in which the person would hold back, hesitate, avoid something or take a "
        "precaution because of this. " + HORIZON_HELP,
    )
    goal_arc: str = Field(
        default="",
        description="Later steps, successes or setbacks of an aim this scene points to. " + HORIZON_HELP,
    )
    belief_in_action: str = Field(
        default="",
        description="Later choices or dilemmas that the value shown here would decide, including seeing others "
        "act against it. " + HORIZON_HELP,
    )
    legacy_anchor: str = Field(
        default="",
        description="Later situations in which the person would pass this on: advising someone, telling the "
        "story, teaching the habit, leaving something to others. " + HORIZON_HELP,
    )


class SceneTriggerResponse(BaseModel):
    scenes: list[SceneTriggerAnswer] = Field(description="Exactly one entry per input scene.")


SYSTEM = (
    "You add recall cues to scenes of a long chat between two people, reading each scene's "
    "narrative. First describe the scene itself in four sentences: situation, object, event and "
    "emotion. Then look ahead along five horizons for the person whose matter the scene is (either "
    "speaker when they share it). Each horizon names the kind of later situation, weeks or months "
    "on, in which this scene would matter to that person again: described in general terms, broad "
    "enough to cover the different ways it could come up (a similar request, another mishap of the "
    "same sort, a choice of the same kind, someone else in the same spot), and saying what of the "
    "scene it would call back (the decision, the worry, the habit, the lesson). A later conversation "
    "about such a situation may share no words with the scene, so use the words that situation "
    "would bring. Invent no facts about what happened, and leave a channel empty when no such later "
    "situation follows from the scene."
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
            "personal_arc": "When Ben describes himself or takes on something demanding, finishing the marathon "
            "would shape how he sees his own stamina and discipline.",
            "avoidance_habit": "Before late nights, heavy meals or lost sleep ahead of a race or another big day, Ben "
            "would hold back to protect what his training built.",
            "goal_arc": "Any next race, qualifying time or training plan would be the next step after his first "
            "marathon finish.",
            "belief_in_action": "When a big task at work or at home looks out of reach, his belief in steady, "
            "step-by-step training would guide how he takes it on.",
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

"""Scene boundaries for one window of turns, packing each scene that closes in the same answer.

One call reads the turns of the scene still open (context) and the next window of new turns,
and returns every scene that closes inside the new turns with its title, summary and
narrative. Packing rides along because the model has just read the whole scene; a separate
packing call (``scene_pack``) is only needed for scenes cut without a boundary call.
"""

from __future__ import annotations

from pydantic import BaseModel, Field

from tmem.prompts.base import Prompt
from tmem.prompts.common import DialogueBlock, assemble

OPERATION = "scene_boundaries"
VERSION = "3"


class BoundaryInput(BaseModel):
    conversation_id: str = Field(exclude=True)
    open_scene: list[DialogueBlock] = Field(description="Turns of the scene that is still open (already read).")
    new_turns: list[DialogueBlock] = Field(description="The turns to segment now.")
    final: bool = Field(description="True when the conversation ends with the last new turn.")


TITLE_HELP = "A specific title of at most ten words naming who and what, e.g. a person and the event."
SUMMARY_HELP = "One or two sentences: what happened, what was decided, shared or learned."
NARRATIVE_HELP = (
    "Three to five sentences in the third person and past tense, naming the speakers and keeping "
    "every date, place, name and number that was mentioned."
)


class ClosedScene(BaseModel):
    last_turn: str = Field(
        description=(
            "Id of the turn with which this scene's matter closes: a new turn, or the last turn of the "
            "open scene when the open scene was already finished and the new turns start something else."
        )
    )
    title: str = Field(min_length=1, description=TITLE_HELP)
    summary: str = Field(min_length=1, description=SUMMARY_HELP)
    narrative: str = Field(min_length=1, description=NARRATIVE_HELP)


class BoundaryResponse(BaseModel):
    closed: list[ClosedScene] = Field(
        description="The scenes that close inside the new turns, in dialogue order; empty when the event goes on."
    )


SYSTEM = (
    "You cut a long chat between two people into scenes. A scene is one event or exchange about a "
    "single matter, from where it opens to where the speakers have finished with it and turn to "
    "something else. Greetings, small talk, asides and follow-up questions belong to the matter they "
    "surround, and a matter the speakers come back to after an aside is still the same scene. Within a "
    "session most scenes run for about six to twenty turns: close a scene when the matter changes, not "
    "after every reply. A short exchange is a scene of its own when it stands alone: a session, or a "
    "clear break within one, given to one matter that the turns around it do not continue, even when "
    "it is only a remark and its reply.\n"
    "A new session does not close a scene by itself: an unfinished matter may continue in the next "
    "session, and one session may hold several scenes. But when a new session, or a new turn, takes "
    "up a different matter, the scene before it has closed.\n"
    "The input holds the turns of the scene that is still open (already read in an earlier request) "
    "and the new turns. Name every scene that closes by the id of its last turn, in dialogue order. "
    "The first scene you close starts with the first turn of the open scene, or with the first new "
    "turn when nothing is open; each further scene starts right after the previous close. When the "
    "open scene was already finished and the new turns turn to something else, close it at its own "
    "last turn. A turn that wraps up one matter and opens another goes with the matter it says most "
    "about; goodbyes end the scene they close. Turns after your last close stay open for the next "
    "request. When final is true the chat ends with the last new turn, so close the last scene there.\n"
    "Describe each closed scene from all of its turns, using the dates shown."
)

TASK = "Find where events close in the new turns and describe each closed scene."

EXAMPLE = {
    "closed": [
        {
            "last_turn": "D4:9",
            "title": "Ana plans her sister's surprise party",
            "summary": "Ana asked Ben for help with her sister's surprise party on Saturday.",
            "narrative": (
                "On 3 March 2022 Ana told Ben she was planning a surprise party for her sister Eva. "
                "Ben offered to bake the cake. They agreed to meet at the park on Saturday."
            ),
        }
    ]
}


def build(payload: BoundaryInput, feedback: str | None = None) -> Prompt[BoundaryResponse]:
    new_ids = [turn.id for block in payload.new_turns for turn in block.turns]
    open_count = sum(len(block.turns) for block in payload.open_scene)
    span = f"{new_ids[0]}..{new_ids[-1]}" if new_ids else "no new turns"
    return assemble(
        operation=OPERATION,
        version=VERSION,
        system=SYSTEM,
        response_model=BoundaryResponse,
        example=EXAMPLE,
        task=TASK,
        payload=payload,
        input_ref=f"{payload.conversation_id} turns {span} (+{open_count} open)",
        feedback=feedback,
    )

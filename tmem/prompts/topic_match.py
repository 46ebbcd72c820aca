"""Topic matching with the update folded in: which of up to b topic labels admit a new scene.

One call per batch of labels. For each admitted label the answer also carries the scene's new
keywords, which is the whole of the topic update (the title is kept as created), so an update
costs no call of its own. On the last batch, when no earlier batch admitted the scene, the
call may also propose the new topic, saving the separate ``topic_create`` call.
"""

from __future__ import annotations

from pydantic import BaseModel, Field

from tmem.prompts.base import Prompt
from tmem.prompts.common import assemble
from tmem.prompts.topic_create import KEYWORDS_HELP, MIN_KEYWORDS, TOPIC_TITLE_HELP, SceneView

OPERATION = "topic_match"
VERSION = "3"
MAX_NEW_KEYWORDS = 5  # stated in the description; more are clipped by tmem/construct/topics.py


class TopicLabel(BaseModel):
    ref: str
    title: str
    keywords: list[str]


class TopicTitle(BaseModel):
    ref: str
    title: str


class MatchInput(BaseModel):
    conversation_id: str = Field(exclude=True)
    scene_ref: str = Field(exclude=True)
    scene: SceneView
    topics: list[TopicLabel]
    may_open_new: bool
    already_admitted: list[str] | None = Field(
        default=None, description="Titles of topics that earlier batches admitted this scene to (last batch only)."
    )
    other_topics: list[TopicTitle] | None = Field(
        default=None,
        description="Shortlist mode: the conversation's next most similar topics, by title only (admissible too).",
    )


class Admission(BaseModel):
    ref: str = Field(description="Ref of a topic that this scene continues.")
    new_keywords: list[str] = Field(
        default_factory=list,
        description=f"Up to {MAX_NEW_KEYWORDS} keywords of this scene that the topic lacks; may be empty.",
    )


class TopicProposal(BaseModel):
    title: str = Field(description=TOPIC_TITLE_HELP)
    keywords: list[str] = Field(description=KEYWORDS_HELP)


class MatchResponse(BaseModel):
    admitted: list[Admission] = Field(
        description="Every listed topic whose specific thread this scene continues; several are fine, none is fine."
    )
    new_topic: TopicProposal | None = Field(
        default=None,
        description=(
            "Only when may_open_new is true: a new topic for the scene's matter, or for a second matter of the "
            "scene, that none of the listed topics and none of already_admitted covers; else null."
        ),
    )


_THREADS = (
    "You sort the scenes of a long chat between two people into topics. A topic is one specific "
    "recurring thread (a person's project, relationship, hobby, plan or problem). Decide for each "
    "{which} whether the new scene continues that same thread. Sharing a broad theme is not "
    "enough: the scene must be about the same specific matter. A scene may continue several "
    "topics. "
)

SYSTEM = _THREADS.format(which="listed topic") + (
    "The topics are shown in batches: this request lists only some of them, and the "
    "others are asked about in requests of their own, so judge only the listed ones (admitting none "
    "is a normal answer). may_open_new is true in the last batch: then, if the scene's matter (or a "
    "second matter the scene also takes up) is covered neither by a listed topic nor by the topics "
    "already_admitted names, propose a new topic for it with at least "
    f"{MIN_KEYWORDS} keywords."
)

# Shortlist mode (settings.topic_shortlist): one request per scene; the topics most like the scene
# with their keywords, the next ones by title only, so a match or a duplicate is still visible.
SYSTEM_SHORTLIST = _THREADS.format(which="topic") + (
    "The conversation has many topics: those most like the scene are listed with their keywords, the "
    "next ones in other_topics by title only, and either list may be admitted from. If the scene's "
    "matter (or a second matter the scene also takes up) is covered by no topic of either list, "
    f"propose a new topic for it with at least {MIN_KEYWORDS} keywords; never one that repeats a "
    "listed title."
)

TASK = "Which of these topics does the scene continue?"

EXAMPLE = {
    "admitted": [{"ref": "T2", "new_keywords": ["landlord", "deposit"]}],
    "new_topic": None,
}


def build(payload: MatchInput, feedback: str | None = None) -> Prompt[MatchResponse]:
    return assemble(
        operation=OPERATION,
        version=VERSION,
        system=SYSTEM if payload.other_topics is None else SYSTEM_SHORTLIST,
        response_model=MatchResponse,
        example=EXAMPLE,
        task=TASK,
        payload=payload,
        input_ref=f"{payload.conversation_id} scene {payload.scene_ref} vs {len(payload.topics)} topics"
        + (f" (+{len(payload.other_topics)} by title)" if payload.other_topics else ""),
        feedback=feedback,
    )

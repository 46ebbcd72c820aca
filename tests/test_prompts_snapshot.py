"""Every prompt rendered with a fixed input and compared with its reviewed snapshot.

A prompt change shows up as a snapshot diff in review. To accept a change, regenerate:

    TMEM_UPDATE_SNAPSHOTS=1 pytest tests/test_prompts_snapshot.py
"""

from __future__ import annotations

import importlib
import json
import os
import pkgutil
from pathlib import Path
from typing import Any, ClassVar

import pytest
from pydantic import BaseModel

import tmem.prompts
from tests.fakes import dialogue
from tmem.prompts import (
    answer,
    item_extract,
    item_triggers,
    judge_locomo,
    judge_memory_awareness,
    memory_reply,
    persona,
    scene_boundaries,
    scene_pack,
    scene_triggers,
    topic_create,
    topic_match,
)
from tmem.prompts.base import Prompt, parse_input
from tmem.prompts.common import dialogue_blocks

SNAPSHOTS = Path(__file__).parent / "snapshots" / "prompts"
UPDATE = os.environ.get("TMEM_UPDATE_SNAPSHOTS") == "1"

TURNS = dialogue("conv-snap", sessions=(3, 3))
SCENE = topic_create.SceneView(
    date="2023-05-08",
    title="Ana adopts a shelter puppy",
    summary="Ana told Ben she adopted a puppy named Biscuit.",
    narrative="On 8 May 2023 Ana told Ben she had adopted a puppy from the shelter. She named her Biscuit.",
)
DRAFT = persona.PersonaDraft(
    identity=["dog owner"],
    preferences=["pottery"],
    traits=["caring"],
    relations=["friend of Ben"],
    timeline=[persona.TimelineEntry(fact="owns a puppy named Biscuit", since="2023-05")],
)

CASES: dict[str, Prompt[Any]] = {
    scene_boundaries.OPERATION: scene_boundaries.build(
        scene_boundaries.BoundaryInput(
            conversation_id="conv-snap",
            open_scene=dialogue_blocks(TURNS[:2]),
            new_turns=dialogue_blocks(TURNS[2:]),
            final=True,
        )
    ),
    scene_pack.OPERATION: scene_pack.build(
        scene_pack.PackInput(
            conversation_id="conv-snap",
            scenes=[
                scene_pack.SceneToPack(ref="S1", dialogue=dialogue_blocks(TURNS[:3])),
                scene_pack.SceneToPack(ref="S2", dialogue=dialogue_blocks(TURNS[3:])),
            ],
        )
    ),
    topic_create.OPERATION: topic_create.build(
        topic_create.CreateInput(conversation_id="conv-snap", scene_ref="#0 scn_x", scene=SCENE)
    ),
    topic_match.OPERATION: topic_match.build(
        topic_match.MatchInput(
            conversation_id="conv-snap",
            scene_ref="#3 scn_y",
            scene=SCENE,
            topics=[
                topic_match.TopicLabel(ref="T1", title="Ana's pottery class", keywords=["pottery", "bowl", "class"]),
                topic_match.TopicLabel(ref="T2", title="Ana's pets", keywords=["puppy", "shelter", "dog"]),
            ],
            may_open_new=True,
        ),
        feedback="topic ref 'T9' is not among the listed topics ['T1', 'T2'].",
    ),
    item_extract.OPERATION: item_extract.build(
        item_extract.ExtractInput(
            conversation_id="conv-snap",
            topic_id="tpc_x",
            topic="Ana's pets",
            scenes=[
                item_extract.TopicScene(ref="S1", title="Ana adopts a puppy", dialogue=dialogue_blocks(TURNS[:3])),
                item_extract.TopicScene(ref="S2", title="Biscuit at the vet", dialogue=dialogue_blocks(TURNS[3:])),
            ],
        )
    ),
    item_triggers.OPERATION: item_triggers.build(
        item_triggers.ItemTriggerInput(
            conversation_id="conv-snap",
            items=[
                item_triggers.ItemView(ref="I1", content="Ana adopted a puppy named Biscuit.", date="2023-05-07"),
                item_triggers.ItemView(ref="I2", content="Ben runs a marathon every spring."),
            ],
        )
    ),
    scene_triggers.OPERATION: scene_triggers.build(
        scene_triggers.SceneTriggerInput(
            conversation_id="conv-snap",
            scenes=[
                scene_triggers.SceneNarrative(
                    ref="S1", date="2023-05-08", speakers=["Ana", "Ben"], title=SCENE.title, narrative=SCENE.narrative
                )
            ],
        )
    ),
    persona.OPERATION: persona.build(
        persona.PersonaInput(
            conversation_id="conv-snap",
            speaker="Ana",
            persona_so_far=DRAFT,
            turns=dialogue_blocks([t for t in TURNS if t.speaker == "Ana"], with_speaker=False, with_session=False),
        )
    ),
    answer.OPERATION: answer.build(
        answer.AnswerInput(
            conversation_id="conv-snap",
            question="When did Ana adopt Biscuit?",
            question_date="2023-06-01 Thu 10:00",
            context="## Facts\n- [7 May 2023] Ana adopted a puppy named Biscuit.",
        )
    ),
    judge_locomo.OPERATION: judge_locomo.build(
        judge_locomo.JudgeLocomoInput(
            conversation_id="conv-snap", qid="conv-snap#3", question="When did Ana adopt Biscuit?",
            reference_answer="7 May 2023", candidate_answer="The day before 8 May 2023", judge_run=2,
        )
    ),
    judge_memory_awareness.OPERATION: judge_memory_awareness.build(
        judge_memory_awareness.JudgeAwarenessInput(
            conversation_id="plus-snap", qid="plus-0003",
            earlier_exchange="Ana: I hurt my knee on the trail.\nBen: Take it easy for a while.",
            later_message="I signed up for the mountain race next month!",
            reply="Great! Is your knee up to it after the trail fall?", judge_run=1,
        )
    ),
    memory_reply.OPERATION: memory_reply.build(
        memory_reply.MemoryReplyInput(
            conversation_id="plus-snap", qid="plus-0003", speaker="Ana", respondent="Ben",
            message_date="2023-06-01 Thu 10:00", latest_message="I signed up for the mountain race next month!",
            context="## Conversation excerpts\n\n### Ana's knee (8 May 2023)\n[8 May 2023] Ana: I hurt my knee on the trail.",
        )
    ),
}


def render(prompt: Prompt[Any]) -> str:
    parts = [
        f"operation: {prompt.operation}",
        f"version: {prompt.version}",
        f"input_ref: {prompt.input_ref}",
    ]
    for message in prompt.messages:
        parts += [f"=== {message.role} ===", message.content]
    parts += ["=== response schema ===", json.dumps(prompt.json_schema(), indent=1, sort_keys=True)]
    return "\n".join(parts) + "\n"


def operation_modules() -> list[Any]:
    names = [m.name for m in pkgutil.iter_modules(tmem.prompts.__path__) if m.name not in {"base", "common", "budgets", "operations"}]
    return [importlib.import_module(f"tmem.prompts.{name}") for name in names]


@pytest.mark.parametrize("operation", sorted(CASES))
def test_prompt_matches_snapshot(operation: str) -> None:
    path = SNAPSHOTS / f"{operation}.txt"
    text = render(CASES[operation])
    if UPDATE:
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text, encoding="utf-8")
    assert path.exists(), f"no snapshot {path}; run with TMEM_UPDATE_SNAPSHOTS=1 and review it"
    assert text == path.read_text(encoding="utf-8"), f"prompt {operation} changed; review, then regenerate"


def test_every_operation_module_has_a_snapshot_case() -> None:
    modules = operation_modules()
    operations = {m.OPERATION for m in modules}
    assert operations == set(CASES)
    for module in modules:
        assert isinstance(module.VERSION, str) and module.VERSION
        assert callable(module.build)
    assert len(operations) == len(modules), "two prompt modules share an operation name"


@pytest.mark.parametrize("operation", sorted(CASES))
def test_input_block_round_trips_and_fields_are_explained(operation: str) -> None:
    prompt = CASES[operation]
    last = prompt.messages[-1]
    assert last.role == "user"
    data = parse_input(last.content)
    assert isinstance(data, dict) and data
    assert "conversation_id" not in data  # routing data stays out of the model's input
    system = prompt.messages[0].content

    def descriptions(model: type[BaseModel]) -> list[str]:
        return [info.description for info in model.model_fields.values() if info.description]

    for description in descriptions(prompt.response_model):
        assert description in system


def test_feedback_goes_before_the_input_block_and_changes_the_cache_key() -> None:
    prompt = CASES[topic_match.OPERATION]
    content = prompt.messages[-1].content
    assert content.index("T9") < content.index("<input>")
    payload = topic_match.MatchInput.model_validate({**parse_input(content), "conversation_id": "c", "scene_ref": "r"})
    plain = topic_match.build(payload)
    assert "T9" not in plain.messages[-1].content
    assert plain.cache_key("m") != topic_match.build(payload, feedback="other").cache_key("m")


class _Counted(BaseModel):
    """A response model that counts how often pydantic is asked for its schema."""

    answer: str
    generated: ClassVar[int] = 0

    @classmethod
    def model_json_schema(cls, *args: Any, **kwargs: Any) -> dict[str, Any]:
        cls.generated += 1
        return super().model_json_schema(*args, **kwargs)


def test_a_response_schema_is_generated_once_and_each_caller_gets_its_own_copy() -> None:
    from tmem.prompts.base import Message

    prompts = [Prompt("toy", "v1", (Message("user", f"question {n}"),), _Counted, f"toy {n}") for n in range(3)]
    schemas = [p.json_schema() for p in prompts] + [prompts[0].json_schema()]
    keys = {p.cache_key("m") for p in prompts}
    assert _Counted.generated == 1 and len(keys) == 3  # one generation for every call and key of the model
    assert all(s == _Counted.model_json_schema() for s in schemas)
    schemas[0]["properties"]["answer"]["description"] = "changed by one caller"
    assert "description" not in prompts[1].json_schema()["properties"]["answer"]

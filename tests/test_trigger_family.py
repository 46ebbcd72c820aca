"""A fifth trigger family declared through tmem/construct/families.py alone — its prompt, its
construction function and one declaration, all in this file: a build of a LoCoMo conversation
against the scripted server writes it, the published snapshot indexes its view, and a query worded
like nothing but that family's text recalls its item through TrigRecall."""

from __future__ import annotations

import json
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path
from typing import Any

import pytest
from pydantic import BaseModel

from tests.flow_helpers import ingest_slice
from tests.query_store import Conv, HashEmbedder, publish
from tmem.build.conversation import build_conversation
from tmem.build.runtime import BuildRuntime
from tmem.build.spec import BuildSpec, build_fingerprint
from tmem.construct.families import TriggerFamily, register_trigger_family, unregister_trigger_family
from tmem.devtools import synth  # noqa: F401 - registers the scripted answers of the built-in operations
from tmem.devtools.responders import request_input
from tmem.devtools.scripted_llm import ScriptedLLM
from tmem.domain import Item
from tmem.ports import ChatModel
from tmem.prompts.base import Message, Prompt, render_input
from tmem.providers.openai_chat import ChatConfig, OpenAIChatModel
from tmem.query.memory import Memory
from tmem.settings import load_settings
from tmem.store.conversations import load_turns
from tmem.store.duck import connect
from tmem.store.stage_cache import StageCache

CID = "conv-30"
OPERATION = "omen_triggers"
CUE = "a raven circles the lighthouse at dusk"
VERSION = "omen-1"


# ---- 1. the prompt module --------------------------------------------------------------------

class OmenItem(BaseModel):
    ref: str
    content: str


class OmenInput(BaseModel):
    conversation_id: str
    items: list[OmenItem]


class Omen(BaseModel):
    ref: str
    omens: list[str]


class OmenResponse(BaseModel):
    items: list[Omen]


def omen_prompt(conversation_id: str, items: Sequence[Item]) -> Prompt[OmenResponse]:
    payload = OmenInput(conversation_id=conversation_id, items=[OmenItem(ref=i.item_id, content=i.content) for i in items])
    return Prompt(OPERATION, VERSION, (Message("system", "Name an omen that foreshadows each item."),
                                        Message("user", render_input(payload))), OmenResponse, f"{len(items)} items")


# ---- 2. the construction function -------------------------------------------------------------

def omens(conversation_id: str, items: Sequence[Item], chat: ChatModel) -> dict[str, list[str]]:
    answer = chat.complete(omen_prompt(conversation_id, items))
    return {o.ref: o.omens for o in answer.items}


# ---- 3. the declaration -----------------------------------------------------------------------

OMEN = TriggerFamily("omen", "item", "omn", OPERATION, build=omens, version=VERSION, what="omens that foreshadow the item")


@pytest.fixture
def omen_family() -> Iterator[TriggerFamily]:
    register_trigger_family(OMEN)
    yield OMEN
    unregister_trigger_family(OMEN.name)


def scripted_omens(operation: str, body: dict[str, Any]) -> str:
    """The scripted model's answer: the cue for the first item (by id), a plain omen for the others."""
    refs = sorted(i["ref"] for i in request_input(body)["items"])
    return json.dumps({"items": [{"ref": ref, "omens": [CUE if ref == refs[0] else f"omen number {n}"]}
                                 for n, ref in enumerate(refs)]})


def test_a_declared_family_is_built_indexed_and_recalled(
    tmp_path: Path, omen_family: TriggerFamily, scripted_llm_factory: Callable[..., ScriptedLLM],
    chat_config: Callable[..., ChatConfig],
) -> None:
    store = tmp_path / "store"
    ingest_slice(store, tmp_path / "slice.json", {CID: 1})
    server = scripted_llm_factory(responders={OPERATION: scripted_omens})
    settings = load_settings(store=store)
    chat = OpenAIChatModel(chat_config(server))
    con = connect(store)
    rt = BuildRuntime(spec=BuildSpec.resolve(store, settings), settings=settings, run_id="r1", con=con, chat=chat,
                      embedder=HashEmbedder(), stages=StageCache.of_store(store),
                      fingerprint=build_fingerprint(settings, chat.model_name))
    try:
        built = build_conversation(rt, CID)
        turns = load_turns(con, CID)
    finally:
        con.close()
    assert len(server.requests_for(OPERATION)) == 1  # one call for the conversation
    target = min(i.item_id for i in built.memory.items)
    by_item = {t.item_id: t.texts for t in built.memory.family_triggers}
    assert {t.family for t in built.memory.family_triggers} == {"omen"} and by_item[target] == (CUE,)
    assert len(by_item) == len(built.memory.items)

    publish(store, [Conv(built.memory, turns)], HashEmbedder())
    memory = Memory.open(store, load_settings(store=store), embedder=HashEmbedder())
    stored = memory.snapshot().reader.read_conversation(CID)[0]
    assert stored.family_triggers == built.memory.family_triggers  # through the tables and the image
    index = memory.snapshot().index(CID)
    assert set(index.items.families) == {"omn"}

    # The paper's raw-cosine gate: five items are too few for the default standardised one.
    result = memory.search(CUE, conversation_id=CID, preset="paper", trace=True)
    hit = next(i for i in result.items if i.item_id == target)
    assert "entity_bridge" in hit.channels  # TrigRecall reached it
    assert result.trace is not None
    stage = result.trace.stage("trig_recall")
    assert stage is not None and target in stage.selected
    candidate = next(c for c in stage.candidates if c.id == target)
    assert candidate.scores["omn"] == pytest.approx(1.0, abs=1e-5)


def test_a_family_may_not_take_a_built_in_name() -> None:
    with pytest.raises(ValueError, match="clashes"):
        register_trigger_family(TriggerFamily("entity", "item", "ent2", OPERATION, build=omens))
    with pytest.raises(ValueError, match="clashes"):
        register_trigger_family(TriggerFamily("omen", "item", "con", OPERATION, build=omens))

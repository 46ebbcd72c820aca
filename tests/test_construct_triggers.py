"""Item triggers and scene/horizon triggers: batches cover every host, answers are checked."""

from __future__ import annotations

import math
from typing import Any

import pytest

from tests.fakes import T0, FakeChatModel, dialogue, edited, scene
from tmem.construct import item_triggers, scene_triggers
from tmem.domain import HORIZON_CHANNELS, Item
from tmem.errors import ValidationFailure

CONTENTS = (
    "Ana adopted a shelter puppy named Biscuit.",
    "Ben runs twenty miles every Sunday for his marathon.",
    "Ana made a blue bowl for her mother in pottery class.",
    "Ben's sister is moving to Lisbon for an engineering job.",
    "Ana volunteers at the community garden planting tomatoes.",
    "Ben's book club is reading a novel about sailing.",
    "Ana is studying counseling to support young people.",
)


def items(count: int = len(CONTENTS)) -> list[Item]:
    return [
        Item(
            conversation_id="conv-t",
            item_id=f"itm_{n}",
            topic_id="tpc_0",
            kind="atomic",
            content=CONTENTS[n % len(CONTENTS)],
            source_scene_ids=("scn_0",),
            event_time=T0 if n % 2 else None,
            keywords=(),
        )
        for n in range(count)
    ]


def test_item_triggers_are_batched_and_cover_every_item_in_order() -> None:
    chat = FakeChatModel()
    hosts = items(7)
    found = item_triggers("conv-t", hosts, chat, batch=3)
    assert chat.count("item_triggers") == math.ceil(7 / 3)
    assert [len(c.input["items"]) for c in chat.of("item_triggers")] == [3, 3, 1]
    assert [t.item_id for t in found] == [i.item_id for i in hosts]
    for triggers in found:
        assert triggers.entities and triggers.bridges
        assert all(b.situation and b.rationale for b in triggers.bridges)
    assert "date" not in chat.calls[0].input["items"][0]  # no event time, no date sent
    assert chat.calls[0].input["items"][1]["date"] == "2023-05-08"


def drop_last(answer: dict[str, Any], data: dict[str, Any]) -> dict[str, Any]:
    return {"items": answer["items"][:-1]}


def rename_first(answer: dict[str, Any], data: dict[str, Any]) -> dict[str, Any]:
    answer["items"][0]["ref"] = "I99"
    return answer


def blank_bridges(answer: dict[str, Any], data: dict[str, Any]) -> dict[str, Any]:
    answer["items"][0]["bridges"] = [{"situation": " ", "rationale": "x"}]
    return answer


@pytest.mark.parametrize(
    ("edit", "message"),
    [(drop_last, "no answer for item refs"), (rename_first, "unknown item refs"), (blank_bridges, "bridge")],
)
def test_item_trigger_answers_are_checked(edit: Any, message: str) -> None:
    chat = FakeChatModel({"item_triggers": edited("item_triggers", edit)})
    with pytest.raises(ValidationFailure, match=message) as caught:
        item_triggers("conv-t", items(3), chat, batch=3)
    assert caught.value.operation == "item_triggers"
    assert chat.count("item_triggers") == 2


def test_scene_triggers_are_batched_with_all_horizon_channels() -> None:
    turns = dialogue(sessions=(10,))
    by_id = {t.turn_id: t for t in turns}
    scenes = [
        scene(
            n,
            f"Scene {n}",
            "Ana told Ben she was proud of her puppy.",
            turn_ids=[t.turn_id for t in turns[2 * n : 2 * n + 2]],
        )
        for n in range(5)
    ]
    chat = FakeChatModel()
    found = scene_triggers("conv-t", scenes, by_id, chat, batch=2)
    assert chat.count("scene_triggers") == 3
    assert [t.scene_id for t in found] == [s.scene_id for s in scenes]
    sent = chat.calls[0].input["scenes"][0]
    assert sent["speakers"] == ["Ana", "Ben"] and sent["narrative"] == scenes[0].narrative
    for triggers in found:
        assert set(triggers.horizons) == set(HORIZON_CHANNELS)
        assert triggers.situation and triggers.object and triggers.event and triggers.emotion
    assert found[0].emotion == "They felt joyful and proud."


def test_scene_trigger_blank_attribute_and_missing_scene_are_rejected() -> None:
    turns = dialogue(sessions=(4,))
    by_id = {t.turn_id: t for t in turns}
    scenes = [scene(n, f"Scene {n}", turn_ids=[turns[n].turn_id]) for n in range(2)]

    def blank_emotion(answer: dict[str, Any], data: dict[str, Any]) -> dict[str, Any]:
        answer["scenes"][1]["emotion"] = "  "
        return answer

    with pytest.raises(ValidationFailure, match="emotion"):
        scene_triggers(
            "conv-t", scenes, by_id, FakeChatModel({"scene_triggers": edited("scene_triggers", blank_emotion)})
        )

    def missing(answer: dict[str, Any], data: dict[str, Any]) -> dict[str, Any]:
        return {"scenes": answer["scenes"][:1]}

    with pytest.raises(ValidationFailure, match="S2"):
        scene_triggers("conv-t", scenes, by_id, FakeChatModel({"scene_triggers": edited("scene_triggers", missing)}))


def test_hosts_of_another_conversation_are_caller_errors() -> None:
    with pytest.raises(ValueError, match="do not belong"):
        item_triggers("other", items(2), FakeChatModel())

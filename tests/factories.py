"""Small hand-built domain objects for tests."""

from __future__ import annotations

from datetime import UTC, datetime, timedelta

from tmem import domain
from tmem.domain import BridgeTrigger, Item, ItemTriggers, Persona, PersonaFact, Scene, SceneTriggers, Topic

T0 = datetime(2023, 5, 8, 13, 56, tzinfo=UTC)


def sample_memory(conversation_id: str = "conv-a", tag: str = "") -> domain.ConversationMemory:
    scenes = tuple(
        Scene(
            conversation_id=conversation_id,
            scene_id=f"scn_{tag}{n}",
            seq=n,
            title=f"Scene {n} {tag}",
            summary=f"summary {n}",
            narrative=f"narrative {n}",
            turn_ids=(f"D1:{2 * n + 1}", f"D1:{2 * n + 2}"),
            start_time=T0 + timedelta(minutes=n),
            end_time=T0 + timedelta(minutes=n, seconds=30),
        )
        for n in range(3)
    )
    topics = (
        Topic(conversation_id=conversation_id, topic_id=f"top_{tag}0", seq=0, title="Pottery",
              keywords=tuple(f"kw{k}" for k in range(10)), scene_ids=(scenes[0].scene_id, scenes[2].scene_id)),
        Topic(conversation_id=conversation_id, topic_id=f"top_{tag}1", seq=1, title="Allergy",
              keywords=tuple(f"al{k}" for k in range(10)), scene_ids=(scenes[1].scene_id,)),
    )
    items = (
        Item(conversation_id=conversation_id, item_id=f"itm_{tag}0", topic_id=topics[0].topic_id, kind="atomic",
             content="Caroline made a bowl.", source_scene_ids=(scenes[0].scene_id,), event_time=T0,
             keywords=("bowl", "pottery")),
        Item(conversation_id=conversation_id, item_id=f"itm_{tag}1", topic_id=topics[0].topic_id, kind="connected",
             content="Caroline's pottery improved over weeks.",
             source_scene_ids=(scenes[0].scene_id, scenes[2].scene_id), event_time=None, keywords=("pottery",)),
    )
    item_triggers = (
        ItemTriggers(conversation_id=conversation_id, item_id=items[0].item_id, entities=("ceramics", "craft"),
                     bridges=(BridgeTrigger(situation="buying a gift", rationale="she likes handmade bowls"),)),
    )
    scene_triggers = (
        SceneTriggers(conversation_id=conversation_id, scene_id=scenes[1].scene_id, situation="at dinner",
                      object="peanuts", event="reaction", emotion="fear",
                      horizons={"personal_arc": "will avoid nuts", "goal_arc": ""}),
    )
    personas = (
        Persona(conversation_id=conversation_id, speaker="Caroline", identity=("counsellor",),
                preferences=("pottery",), traits=("kind",), relations=("friend of Melanie",),
                timeline=(PersonaFact(fact="started pottery", since="2023-05"),)),
    )
    return domain.ConversationMemory(conversation_id=conversation_id, scenes=scenes, topics=topics, items=items,
                  item_triggers=item_triggers, scene_triggers=scene_triggers, personas=personas)

"""The retrieval cascade on a hand-built conversation with hand-made unit vectors (no model).

The world (query direction e0 = "pottery"):

    topic t0 Pottery  → s0, s1      (topic vector e0: the only topic the prefilter keeps at kT=1)
    topic t1 Adoption → s2, s3
    topic t2 Camping  → s4          s4's scene-trigger view scn points at e0 (cos 0.9)
    topic t3 Charity  → s5          s5's horizon sentence points at e0 (cos 1.0)

    items: i0 (s0) pottery bowl; i1 (s2) adoption, entity view cos 0.9 ≥ τ; i2 (s3) bridge view
    cos 0.8 < τ; i3 (s4) only a joint view, cos 0.95; i4 (s5) no trigger views; i5 (s0, s1).
    Every scene's dialogue vector is e7 (orthogonal to the query, so dlg ranks are index ties).
"""

from __future__ import annotations

import math
from dataclasses import replace
from datetime import UTC, datetime, timedelta

import numpy as np
import pytest

from tmem.domain import (
    BridgeTrigger,
    Item,
    ItemTriggers,
    Persona,
    PersonaFact,
    Scene,
    SceneTriggers,
    Topic,
    Turn,
)
from tmem.errors import ScopeError
from tmem.retrieval.cascade import search
from tmem.retrieval.config import ABLATIONS, RetrievalConfig, UnknownPresetError, config_from_settings, preset
from tmem.retrieval.index import (
    ConversationIndex,
    IndexConsistencyError,
    QueryVectorError,
    VectorBundle,
    build_index,
)
from tmem.settings import Settings

CID = "conv-1"
D = 8
T0 = datetime(2023, 5, 8, 13, 56, tzinfo=UTC)


def e(i: int) -> np.ndarray:
    v = np.zeros(D, dtype=np.float32)
    v[i] = 1.0
    return v


def mix(c: float, a: int, b: int) -> np.ndarray:
    """A unit vector with cosine ``c`` to e_a (the rest along e_b)."""
    return c * e(a) + math.sqrt(1 - c * c) * e(b)


Q = e(0)

SCENES = [
    ("s0", "Pottery class with the kids", "Melanie took her kids to a pottery class", "t0"),
    ("s1", "Melanie's clay bowl", "Melanie shaped a clay bowl and glazed it", "t0"),
    ("s2", "Adoption agency research", "Caroline compared adoption agencies", "t1"),
    ("s3", "Support group evening", "Caroline went to the LGBTQ support group", "t1"),
    ("s4", "Camping in the mountains", "Melanie camped with her family", "t2"),
    ("s5", "Charity race", "Caroline ran a charity race", "t3"),
]
TOPICS = [
    ("t0", "Pottery class", ("pottery", "clay", "bowl", "kids"), ("s0", "s1"), e(0)),
    ("t1", "Adoption and support", ("adoption", "agency", "support", "group"), ("s2", "s3"), e(2)),
    ("t2", "Camping trips", ("camping", "mountains", "family"), ("s4",), e(4)),
    ("t3", "Charity running", ("charity", "race", "running"), ("s5",), e(5)),
]
SCENE_VECTORS = {"s0": e(0), "s1": mix(0.7, 0, 1), "s2": e(2), "s3": e(3), "s4": e(4), "s5": e(5)}
ITEMS = [
    ("i0", "atomic", "Melanie made a clay bowl at the pottery class", ("s0",), e(0)),
    ("i1", "atomic", "Caroline contacted two adoption agencies", ("s2",), e(2)),
    ("i2", "atomic", "Caroline felt accepted at the support group", ("s3",), e(3)),
    ("i3", "atomic", "Melanie roasted marshmallows while camping", ("s4",), e(4)),
    ("i4", "atomic", "Caroline ran a charity race for mental health", ("s5",), e(5)),
    ("i5", "connected", "Melanie's kids keep asking for more clay projects", ("s0", "s1"), mix(0.6, 0, 6)),
]
TRIGGER_VIEWS = {("i1", "con"): mix(0.9, 0, 2), ("i2", "brg"): mix(0.8, 0, 3), ("i3", "joint"): mix(0.95, 0, 4)}


def make_world(*, vectors: bool = True) -> ConversationIndex:
    turns, scenes = [], []
    for n, (sid, title, summary, _topic) in enumerate(SCENES):
        when = T0 + timedelta(days=7 * n)
        ids = []
        for k, speaker in enumerate(("Caroline", "Melanie")):
            tid = f"D{n + 1}:{k + 1}"
            ids.append(tid)
            turns.append(
                Turn(
                    conversation_id=CID,
                    session_id=f"session_{n + 1}",
                    turn_id=tid,
                    seq=2 * n + k,
                    speaker=speaker,
                    text=f"{speaker} talks about {title.lower()}.",
                    event_time=when,
                )
            )
        scenes.append(
            Scene(
                conversation_id=CID,
                scene_id=sid,
                seq=n,
                title=title,
                summary=summary,
                narrative=f"{summary}.",
                turn_ids=tuple(ids),
                start_time=when,
                end_time=when,
            )
        )
    topics = [
        Topic(conversation_id=CID, topic_id=tid, seq=n, title=title, keywords=kw, scene_ids=sids)
        for n, (tid, title, kw, sids, _v) in enumerate(TOPICS)
    ]
    items = [
        Item(
            conversation_id=CID,
            item_id=iid,
            topic_id="t0",
            kind=kind,
            content=content,
            source_scene_ids=sids,
            event_time=T0,
            keywords=(),
        )
        for iid, kind, content, sids, _v in ITEMS
    ]
    item_triggers = [
        ItemTriggers(
            conversation_id=CID,
            item_id="i1",
            entities=("family planning",),
            bridges=(BridgeTrigger(situation="a child", rationale="r"),),
        )
    ]
    scene_triggers = [
        SceneTriggers(
            conversation_id=CID,
            scene_id="s5",
            situation="a race",
            object="shoes",
            event="running",
            emotion="pride",
            horizons={
                "personal_arc": "She grows into a runner.",
                "goal_arc": "She may take up ceramics to relax after training.",
            },
        )
    ]
    personas = [
        Persona(
            conversation_id=CID,
            speaker=name,
            identity=(f"{name} is a speaker",),
            preferences=(),
            traits=(),
            relations=(),
            timeline=(PersonaFact(fact="lives in town", since="2022"),),
        )
        for name in ("Caroline", "Melanie")
    ]
    rows: list[tuple[str, str, str, int, np.ndarray]] = []
    if vectors:
        rows += [("topic", tid, "summary", 0, v) for tid, _t, _k, _s, v in TOPICS]
        rows += [("scene", sid, "summary", 0, v) for sid, v in SCENE_VECTORS.items()]
        rows += [("scene", sid, "dlg", 0, e(7)) for sid, *_ in SCENES]
        rows += [("scene", "s4", "scn", 0, mix(0.9, 0, 4))]
        rows += [("scene", "s5", "hor", 0, e(3)), ("scene", "s5", "hor", 1, e(0))]  # personal_arc, goal_arc
        rows += [("item", iid, "content", 0, v) for iid, _k, _c, _s, v in ITEMS]
        rows += [("item", iid, view, 0, v) for (iid, view), v in TRIGGER_VIEWS.items()]
    bundle = VectorBundle.from_columns(*([r[k] for r in rows] for k in range(5))) if rows else VectorBundle.empty()
    return build_index(CID, scenes, topics, items, item_triggers, scene_triggers, personas, turns, bundle)


# The raw-cosine gate (τ = 0.85): this world has too few items for the standardised gate to estimate
# a score distribution (see test_standardised_gate_*).
BASE = RetrievalConfig(name="test", k_topics=1, k_scenes=5, k_items=15, k_cue=2, trigger_gate_rule="cosine")


@pytest.fixture(scope="module")
def world() -> ConversationIndex:
    return make_world()


def scene_ids(result) -> list[str]:
    return [s.scene_id for s in result.scenes]


def item_ids(result) -> list[str]:
    return [i.item_id for i in result.items]


def candidate(trace, stage, doc_id):
    return next((c for c in trace.stage(stage).candidates if c.id == doc_id), None)


# ----------------------------------------------------------------------------- the cascade


def test_topic_prefilter_limits_the_scene_pool(world):
    no_cue = BASE.with_(k_cue=0)
    r = search(world, "pottery class", Q, no_cue, trace=True)
    assert r.trace.stage("topic_prefilter").selected == ("t0",)
    assert r.trace.stage("scene_selection").pool_size == 2
    assert set(scene_ids(r)) == {"s0", "s1"}
    wider = search(world, "pottery class", Q, no_cue.with_(k_topics=2), trace=True)
    assert wider.trace.stage("scene_selection").pool_size == 4
    unfiltered = search(world, "pottery class", Q, no_cue.with_(topic_filter=False), trace=True)
    assert unfiltered.trace.stage("topic_prefilter") is None
    assert unfiltered.trace.stage("scene_selection").pool_size == 6


def test_horizon_sentence_bypasses_the_topic_prefilter(world):
    r = search(world, "pottery class", Q, BASE, trace=True)
    assert "s5" not in {
        world.scenes.ids[int(i)] for i in world.topics.scene_indices[: world.topics.scene_indptr[1]]
    }  # s5 is not under the kept topic t0 …
    assert "s5" in scene_ids(r)  # … yet it is returned
    s5 = next(s for s in r.scenes if s.scene_id == "s5")
    assert "horizon" in s5.channels and "scene_trigger" not in s5.channels
    sel = candidate(r.trace, "scene_selection", "s5")
    assert sel.pools == ("scene_cue",)
    cue = candidate(r.trace, "scene_cue", "s5")
    assert cue.ranks["horizon"] == 1 and cue.detail.startswith("goal_arc: She may take up ceramics")
    without = search(world, "pottery class", Q, BASE.with_(horizon_trigger=False), trace=True)
    assert "s5" not in scene_ids(without)
    assert candidate(without.trace, "scene_selection", "s5") is None


def test_trigger_gate_keeps_items_at_or_above_tau(world):
    r = search(world, "pottery class", Q, BASE, trace=True)
    recall = r.trace.stage("trig_recall")
    assert recall.selected == ("i3", "i1")  # by score: joint 0.95, entity 0.9
    below = candidate(r.trace, "trig_recall", "i2")
    assert not below.selected and below.scores["max"] == pytest.approx(0.8, abs=1e-5) and below.detail == "brg"
    assert candidate(r.trace, "trig_recall", "i3").detail == "joint"
    assert candidate(r.trace, "trig_recall", "i4") is None  # no trigger view at all: NaN, never a candidate
    # i1's scene s2 is not selected, so i1 is in the result only through TrigRecall (ungated).
    assert "s2" not in scene_ids(r)
    i1 = next(i for i in r.items if i.item_id == "i1")
    assert "entity_bridge" in i1.channels
    assert candidate(r.trace, "item_selection", "i1").pools == ("trigger",)
    assert "i2" not in item_ids(r)
    stricter = search(world, "pottery class", Q, BASE.with_(trigger_gate=0.92), trace=True)
    assert stricter.trace.stage("trig_recall").selected == ("i3",)
    capped = search(world, "pottery class", Q, BASE.with_(trigger_cap=1), trace=True)
    assert capped.trace.stage("trig_recall").selected == ("i3",)


def test_trace_names_the_reaching_channels(world):
    r = search(world, "pottery class", Q, BASE.with_(k_scenes=3, k_items=2), trace=True)
    s0 = next(s for s in r.scenes if s.scene_id == "s0")
    assert {"lexical", "dense"} <= set(s0.channels)
    i0 = next(i for i in r.items if i.item_id == "i0")
    assert "lexical" in i0.channels and "entity_bridge" not in i0.channels
    s4 = candidate(r.trace, "scene_cue", "s4")
    assert s4.selected and s4.channels == ("scene_trigger",) and s4.ranks["scene_trigger"] == 1


def test_lexical_mode_without_query_vector(world):
    r = search(world, "adoption agencies", None, BASE, trace=True)
    assert r.mode == "lexical" and r.trace.mode == "lexical"
    assert r.trace.stage("scene_cue") is None and r.trace.stage("trig_recall") is None
    assert r.trace.stage("topic_prefilter").selected == ("t1",)
    assert scene_ids(r) == ["s2"]  # s3 is under t1 but shares no term with the query
    assert item_ids(r) == ["i1"] and r.items[0].channels == ("lexical",)
    assert all(stage.lists == ("lexical",) for stage in r.trace.stages)


def test_index_without_vectors_answers_lexically():
    bare = make_world(vectors=False)
    r = search(bare, "adoption agencies", Q, BASE)
    assert r.mode == "lexical" and scene_ids(r) == ["s2"]


def test_search_is_deterministic(world):
    a = search(world, "pottery class kids", Q, BASE, speaker="Melanie", trace=True)
    b = search(world, "pottery class kids", Q, BASE, speaker="Melanie", trace=True)
    assert a == b


def test_query_vector_must_fit_the_index(world):
    with pytest.raises(QueryVectorError, match="dimension 3"):
        search(world, "x", np.ones(3), BASE)
    with pytest.raises(QueryVectorError, match="zero"):
        search(world, "x", np.zeros(D), BASE)
    unscoped = replace(world, conversation_id="")
    with pytest.raises(ScopeError):
        search(unscoped, "x", Q, BASE)


def test_persona_by_speaker(world):
    one = search(world, "pottery", Q, BASE, speaker="  caroline ", trace=True)
    assert [p.speaker for p in one.personas] == ["Caroline"] and one.trace.persona_matched
    both = search(world, "pottery", Q, BASE)
    assert [p.speaker for p in both.personas] == ["Caroline", "Melanie"]
    unknown = search(world, "pottery", Q, BASE, speaker="Nobody", trace=True)
    assert len(unknown.personas) == 2 and not unknown.trace.persona_matched


# ----------------------------------------------------------------------------- ablations


def run(world, config):
    return search(world, "pottery class", Q, config, speaker="Melanie", trace=True)


def stage_or_none(result, name):
    return result.trace.stage(name)


def test_ablation_scene_trigger_removes_only_the_scn_view(world):
    on, off = run(world, BASE), run(world, BASE.with_(scene_trigger=False))
    assert on.trace.stage("scene_cue").lists == ("dialogue", "scene_trigger", "horizon")
    assert off.trace.stage("scene_cue").lists == ("dialogue", "horizon")
    for c_off in off.trace.stage("scene_cue").candidates:  # the other views rank exactly as before
        c_on = candidate(on.trace, "scene_cue", c_off.id)
        assert {k: v for k, v in c_on.ranks.items() if k != "scene_trigger"} == c_off.ranks
    assert "s4" in scene_ids(on) and "s4" not in scene_ids(off)
    assert on.trace.stage("topic_prefilter") == off.trace.stage("topic_prefilter")
    assert all("scene_trigger" not in s.channels for s in off.scenes)


def test_ablation_horizon_removes_only_the_hor_views(world):
    on, off = run(world, BASE), run(world, BASE.with_(horizon_trigger=False))
    assert off.trace.stage("scene_cue").lists == ("dialogue", "scene_trigger")
    for c_off in off.trace.stage("scene_cue").candidates:
        c_on = candidate(on.trace, "scene_cue", c_off.id)
        assert {k: v for k, v in c_on.ranks.items() if k != "horizon"} == c_off.ranks
    assert "s5" in scene_ids(on) and "s5" not in scene_ids(off)
    assert on.trace.stage("topic_prefilter") == off.trace.stage("topic_prefilter")
    both_off = run(world, preset("no-scene-horizon", BASE))
    assert both_off.trace.stage("scene_cue").lists == ("dialogue",)


def test_ablation_item_triggers_removes_trig_recall(world):
    on, off = run(world, BASE), run(world, BASE.with_(item_triggers=False))
    assert off.trace.stage("trig_recall") is None
    assert "entity_bridge" in on.trace.stage("item_selection").lists
    assert off.trace.stage("item_selection").lists == ("lexical", "dense")
    assert "i1" in item_ids(on) and "i1" not in item_ids(off)
    assert all("entity_bridge" not in i.channels for i in off.items)
    assert on.scenes == off.scenes  # the scene side is untouched


def test_ablation_topic_filter_opens_the_pool(world):
    on, off = run(world, BASE), run(world, BASE.with_(topic_filter=False))
    assert on.trace.stage("topic_prefilter") is not None and off.trace.stage("topic_prefilter") is None
    assert off.trace.stage("scene_selection").pool_size == world.n_scenes
    assert on.trace.stage("scene_cue") == off.trace.stage("scene_cue")


def test_ablation_persona_changes_nothing_else(world):
    on, off = run(world, BASE), run(world, BASE.with_(persona=False))
    assert [p.speaker for p in on.personas] == ["Melanie"] and off.personas == ()
    assert on.scenes == off.scenes and on.items == off.items and on.trace.stages == off.trace.stages


def test_ablation_scene_layer_chooses_items_over_all_items(world):
    on, off = run(world, BASE), run(world, BASE.with_(scene_layer=False))
    assert off.scenes == ()
    names = [s.stage for s in off.trace.stages]
    assert names == ["trig_recall", "item_selection"]
    assert off.trace.stage("item_selection").pool_size == world.n_items
    assert on.trace.stage("trig_recall") == off.trace.stage("trig_recall")


def test_ablation_item_channel_returns_no_items(world):
    on, off = run(world, BASE), run(world, BASE.with_(item_channel=False))
    assert off.items == () and on.items != ()
    assert on.scenes == off.scenes
    assert [s.stage for s in off.trace.stages] == ["topic_prefilter", "scene_cue", "scene_selection"]


def test_fusion_rules_are_recorded_and_change_the_order(world):
    paper = run(world, preset("paper", BASE))
    assert paper.trace.stage("scene_selection").fusion == "rrf"
    assert paper.trace.stage("item_selection").fusion == "rrf"
    reserved = run(world, preset("reserved", BASE).with_(k_scenes=1, reserved_scene_slots=1))
    assert scene_ids(reserved) == ["s4"]  # the best SceneCue hit holds the only slot
    assert scene_ids(run(world, preset("paper", BASE).with_(k_scenes=1))) == ["s0"]


def test_default_reads_each_scenecue_view_as_its_own_list(world):
    # s5 is first in the horizon view only and s4 first in the scene-trigger view only: fused, SceneCue
    # ranks s4 ahead and the third slot goes to the topical s1; read per view, s5 competes on its own
    default = run(world, preset("default").with_(k_scenes=3, k_topics=1))
    assert default.trace.stage("scene_selection").lists == (
        "lexical", "dense", "cue_dialogue", "cue_scene_trigger", "cue_horizon")
    assert set(scene_ids(default)) == {"s0", "s4", "s5"}
    fused = run(world, preset("default").with_(k_scenes=3, k_topics=1, cue_lists="fused"))
    assert fused.trace.stage("scene_selection").lists == ("lexical", "dense", "scene_cue")
    assert set(scene_ids(fused)) == {"s0", "s4", "s1"}
    assert preset("paper").cue_lists == "fused"  # the paper fuses SceneCue before scene selection


def test_reserved_slots_need_the_fused_scenecue_list():
    assert preset("reserved").cue_lists == "fused"
    with pytest.raises(ValueError, match="cue_lists='fused'"):
        preset("default").with_(scene_fusion="reserved")
    assert preset("default").with_(scene_fusion="reserved", reserved_scene_slots=0).cue_lists == "views"


# ----------------------------------------------------------------------------- presets


def test_presets_and_errors():
    assert preset("paper").scene_fusion == "rrf" and preset("paper").item_fusion == "rrf"
    default = preset("default")
    for name, switches in ABLATIONS.items():
        ablated = preset(name)
        diff = {k for k, v in ablated.model_dump().items() if v != default.model_dump()[k]}
        assert diff == {"name", *switches}, name
    combo = preset("paper+no-horizon")
    assert combo.scene_fusion == "rrf" and not combo.horizon_trigger and combo.scene_trigger
    with pytest.raises(UnknownPresetError, match=r"no-such.*bases: paper"):
        preset("no-such")
    with pytest.raises(UnknownPresetError, match="no-hrizon"):
        preset("paper+no-hrizon")
    with pytest.raises(ValueError):
        RetrievalConfig(k_topics=0)
    cfg = config_from_settings(Settings(k_scenes=7, trigger_gate=0.5), "no-persona")
    assert cfg.k_scenes == 7 and cfg.trigger_gate == 0.5 and not cfg.persona and cfg.name == "no-persona"


# ----------------------------------------------------------------------------- index building


def test_vector_bundle_groups_columns_by_view():
    b = VectorBundle.from_columns(["scene"] * 3, ["a", "b", "a"], ["hor", "dlg", "hor"], [0, 0, 1], np.eye(3))
    assert b.dim == 3 and set(b.views) == {("scene", "hor"), ("scene", "dlg")}
    assert b.views[("scene", "hor")].owner_ids == ("a", "a") and b.views[("scene", "hor")].ordinals.tolist() == [0, 1]
    with pytest.raises(IndexConsistencyError, match="unknown vector view"):
        VectorBundle.from_columns(["item"], ["a"], ["dlg"], [0], np.eye(1))
    with pytest.raises(IndexConsistencyError, match="disagree"):
        VectorBundle.from_columns(["scene", "scene"], ["a", "b"], ["dlg"], [0], np.eye(2))


def test_index_arrays_and_links(world):
    assert world.n_topics == 4 and world.n_scenes == 6 and world.n_items == 6 and world.dim == D
    assert np.isnan(world.items.con[world.item_pos["i2"]]).all()  # missing view → NaN row
    assert world.scenes.hor.shape == (2, D) and world.scenes.hor_labels[0] == "personal_arc: She grows into a runner."
    assert world.scenes.hor_labels[1].startswith("goal_arc: ")
    s0 = world.scene_pos["s0"]
    members = world.scenes.item_indices[world.scenes.item_indptr[s0] : world.scenes.item_indptr[s0 + 1]]
    assert {world.items.ids[i] for i in members} == {"i0", "i5"}
    assert world.scenes.turns[s0][0].turn_id == "D1:1"
    assert not world.scenes.dlg.flags.writeable


def test_build_index_rejects_inconsistent_input():
    good = make_world()
    base = dict(
        scenes=[],
        topics=[],
        items=[],
        item_triggers=[],
        scene_triggers=[],
        personas=[],
        turns=[],
        vectors=VectorBundle.empty(),
    )
    scene = Scene(
        conversation_id=CID,
        scene_id="s0",
        seq=0,
        title="t",
        summary="s",
        narrative="n",
        turn_ids=("D1:1",),
        start_time=T0,
        end_time=T0,
    )
    with pytest.raises(IndexConsistencyError, match="unknown turn"):
        build_index(CID, **{**base, "scenes": [scene]})
    other = scene.model_copy(update={"conversation_id": "conv-2"})
    with pytest.raises(IndexConsistencyError, match="conv-2"):
        build_index(CID, **{**base, "scenes": [other]})
    item = Item(
        conversation_id=CID,
        item_id="i9",
        topic_id="t0",
        kind="atomic",
        content="c",
        source_scene_ids=("nope",),
        event_time=None,
        keywords=(),
    )
    with pytest.raises(IndexConsistencyError, match="unknown scene"):
        build_index(CID, **{**base, "items": [item]})
    stray = VectorBundle.from_columns(["item"], ["ghost"], ["content"], [0], np.eye(2)[:1])
    with pytest.raises(IndexConsistencyError, match="ghost"):
        build_index(CID, **{**base, "vectors": stray})
    twice = VectorBundle.from_columns(["topic"] * 2, ["t0", "t0"], ["summary"] * 2, [0, 1], np.eye(2))
    topic = Topic(conversation_id=CID, topic_id="t0", seq=0, title="x", keywords=(), scene_ids=())
    with pytest.raises(IndexConsistencyError, match="more than one"):
        build_index(CID, **{**base, "topics": [topic], "vectors": twice})
    with pytest.raises(ScopeError):
        build_index("", **base)
    assert good.conversation_id == CID


def test_empty_memory_returns_nothing():
    empty = build_index(CID, [], [], [], [], [], [], [], VectorBundle.empty())
    r = search(empty, "anything at all", None, BASE, trace=True)
    assert r.scenes == () and r.items == () and r.personas == ()

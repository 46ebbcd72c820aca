"""TrigRecall's standardised gate: an item passes when its trigger score stands out from the
conversation's scores for this query, whatever the encoder's cosine scale."""

from __future__ import annotations

import math
from datetime import UTC, datetime

import numpy as np
import pytest

from tmem.domain import BridgeTrigger, Item, ItemTriggers, Scene, Turn
from tmem.retrieval.cascade import search
from tmem.retrieval.config import RetrievalConfig, preset
from tmem.retrieval.index import ConversationIndex, VectorBundle, build_index
from tmem.retrieval.scoring import MIN_GATE_SAMPLE, robust_z

CID = "c"
D = 16
T0 = datetime(2023, 5, 8, tzinfo=UTC)


def unit(c: float, noise_axis: int) -> np.ndarray:
    """A unit vector with cosine ``c`` to e0, the rest along e_{noise_axis}."""
    v = np.zeros(D, dtype=np.float32)
    v[0], v[noise_axis] = c, math.sqrt(1 - c * c)
    return v


def world(trigger_cosines: list[float], *, scale: float = 1.0) -> ConversationIndex:
    """One scene, one item per cosine; item i's entity view has cosine ``scale * c_i`` to the query e0."""
    turns = [Turn(conversation_id=CID, session_id="s1", turn_id="D1:1", seq=0, speaker="A", text="hello", event_time=T0)]
    scenes = [Scene(conversation_id=CID, scene_id="s0", seq=0, title="t", summary="s", narrative="n",
                    turn_ids=("D1:1",), start_time=T0, end_time=T0)]
    items = [Item(conversation_id=CID, item_id=f"i{n}", topic_id="t0", kind="atomic", content=f"fact {n}",
                  source_scene_ids=("s0",), event_time=T0, keywords=()) for n in range(len(trigger_cosines))]
    triggers = [ItemTriggers(conversation_id=CID, item_id=f"i{n}", entities=("x",),
                             bridges=(BridgeTrigger(situation="y", rationale="z"),)) for n in range(len(trigger_cosines))]
    rows = [("item", f"i{n}", "con", 0, unit(scale * c, 1 + n % (D - 1))) for n, c in enumerate(trigger_cosines)]
    bundle = VectorBundle.from_columns(*([r[k] for r in rows] for k in range(5)))
    return build_index(CID, scenes, [], items, triggers, [], [], turns, bundle)


Q = unit(1.0, 1)
# 19 unrelated items around cosine .10-.20 and one associative item at .42 (MiniLM-like scale).
BACKGROUND = [0.10 + 0.005 * n for n in range(19)]
COSINES = [*BACKGROUND, 0.42]
GATED = RetrievalConfig(name="t", k_topics=1, k_scenes=1, k_items=5, k_cue=0, trigger_gate_z=3.0)


def test_robust_z_standardises_by_median_and_mad():
    scores = np.array([1, 2, 3, 4, 5, 6, 7, 8, 100, np.nan], dtype=np.float32)
    z, med, sigma = robust_z(scores)
    assert med == pytest.approx(5.0)
    assert sigma == pytest.approx(1.4826 * 2.0)  # MAD of 1..8,100 around 5 is 2 (the outlier barely moves it)
    assert z[8] == pytest.approx((100 - 5.0) / sigma, rel=1e-5) and np.isnan(z[9])


def test_robust_z_needs_a_sample():
    z, med, _ = robust_z(np.arange(MIN_GATE_SAMPLE - 1, dtype=np.float32))
    assert np.isnan(med) and np.isnan(z).all()


def test_standardised_gate_recalls_the_item_that_stands_out():
    r = search(world(COSINES), "q", Q, GATED, trace=True)
    stage = r.trace.stage("trig_recall")
    assert stage.selected == ("i19",)
    assert "gate z≥3" in stage.note and "cosine ≥" in stage.note
    assert "entity_bridge" in next(i for i in r.items if i.item_id == "i19").channels


def test_the_raw_cosine_gate_stays_silent_on_the_same_scores():
    """What the real-model fixture showed: τ = 0.85 never fires at MiniLM's scale (best .29-.47)."""
    r = search(world(COSINES), "q", Q, GATED.with_(trigger_gate_rule="cosine"), trace=True)
    assert r.trace.stage("trig_recall").selected == ()


def test_the_gate_means_the_same_on_another_encoder_scale():
    """Scores shifted up (an encoder whose unrelated texts sit near .4, as bge-m3's do): same decision."""
    shifted = [0.4 + c for c in COSINES]
    a = search(world(COSINES), "q", Q, GATED, trace=True).trace.stage("trig_recall").selected
    b = search(world(shifted), "q", Q, GATED, trace=True).trace.stage("trig_recall").selected
    assert a == b == ("i19",)


def test_nothing_stands_out_nothing_passes():
    r = search(world([*BACKGROUND, 0.2]), "q", Q, GATED, trace=True)
    assert r.trace.stage("trig_recall").selected == ()


def test_too_few_items_to_standardise():
    r = search(world([0.1, 0.2, 0.9]), "q", Q, GATED, trace=True)
    stage = r.trace.stage("trig_recall")
    assert stage.selected == () and "too few items" in stage.note


def test_presets_choose_their_gate():
    assert preset("default").trigger_gate_rule == "robust_z"
    assert preset("paper").trigger_gate_rule == "cosine" and preset("paper").trigger_gate == 0.85
    assert preset("paper+no-horizon").trigger_gate_rule == "cosine"
    assert preset("no-horizon").trigger_gate_rule == "robust_z"

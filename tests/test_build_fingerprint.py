from tmem.build.spec import build_fingerprint
from tmem.devtools import synth
from tmem.prompts.base import prompt_versions
from tmem.prompts.operations import BUILD_OPERATIONS
from tmem.settings import load_settings


def test_build_operations_are_exactly_the_construction_prompts() -> None:
    # synth scripts every construction operation, plus the query side's answer.
    assert set(synth.RESPONDERS) - {"answer"} == BUILD_OPERATIONS
    assert BUILD_OPERATIONS <= set(prompt_versions())


def test_fingerprint_depends_on_model_and_build_knobs_only() -> None:
    base = build_fingerprint(load_settings(), "m1")
    assert build_fingerprint(load_settings(), "m1") == base
    assert build_fingerprint(load_settings(), "m2") != base
    assert build_fingerprint(load_settings(segment_window=8), "m1") != base
    assert build_fingerprint(load_settings(k_scenes=3), "m1") == base  # a query knob


def test_topic_shortlist_is_a_build_knob_and_0_keeps_the_fingerprints_of_before_it() -> None:
    from tmem.ids import content_hash
    from tmem.views.texts import VIEWS_VERSION

    s = load_settings(topic_shortlist=0)
    versions = {op: v for op, v in prompt_versions().items() if op in BUILD_OPERATIONS}
    # the formula before the setting existed: a store built then is not rebuilt for it
    before = content_hash("m1", versions, s.embedding_model, s.segment_window, s.topic_batch, s.trigger_batch,
                          s.scene_trigger_batch, VIEWS_VERSION)
    assert build_fingerprint(s, "m1") == before  # TMEM_TOPIC_SHORTLIST=0: a store built then is not rebuilt
    assert load_settings().topic_shortlist == 40 and build_fingerprint(load_settings(), "m1") != before


def test_a_shortlist_not_beyond_the_batch_is_refused_at_load() -> None:
    import pytest

    with pytest.raises(ValueError, match="TMEM_TOPIC_SHORTLIST=10 must exceed TMEM_TOPIC_BATCH=10"):
        load_settings(topic_shortlist=10)
    assert load_settings(topic_shortlist=0, topic_batch=50).topic_shortlist == 0

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

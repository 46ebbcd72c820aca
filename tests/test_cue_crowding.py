"""Cue crowding: with several cues in one memory, how often another cue's scene takes a cue's place."""

import pytest

from tmem.eval.diagnostics import cue_crowding


def test_a_miss_counts_as_crowded_only_when_another_cues_scene_was_returned() -> None:
    cue_scenes = {"c1", "c2", "c3"}
    own = [{"c1"}, {"c2"}, {"c3"}]
    returned = [["c1", "x", "c2"],  # hit, one other cue returned
                ["x", "c3", "y"],   # miss, crowded by c3
                ["x", "y", "z"]]    # miss, not crowded
    c = cue_crowding(own, returned, cue_scenes, n_scenes=12)
    assert (c.questions, c.returned, c.misses_crowded) == (3, 1, 1)
    assert c.other_cue_scenes_per_question == pytest.approx(2 / 3)
    assert c.cue_scene_share == pytest.approx(0.25)
    assert c.as_dict()["misses"] == 2


def test_a_cue_held_by_two_scenes_is_not_its_own_crowd() -> None:
    c = cue_crowding([{"a", "b"}], [["b", "a"]], {"a", "b"}, n_scenes=4)
    assert (c.returned, c.misses_crowded, c.other_cue_scenes_per_question) == (1, 0, 0.0)


def test_questions_and_results_must_pair_up() -> None:
    with pytest.raises(ValueError, match="2 questions but 1 results"):
        cue_crowding([{"a"}, {"b"}], [["a"]], {"a", "b"}, n_scenes=2)

"""The stage-result cache of a build (tmem/store/stage_cache.py): keys and files."""

from __future__ import annotations

from datetime import UTC, datetime
from pathlib import Path

import pytest

from tmem.domain import Turn
from tmem.ids import conversation_partition
from tmem.store.stage_cache import StageCache, stage_key


def _turn(n: int, text: str = "hello") -> Turn:
    return Turn(conversation_id="c1", session_id="s1", turn_id=f"D1:{n}", seq=n, speaker="Ann", text=text,
                event_time=datetime(2024, 1, n, tzinfo=UTC))


def test_the_key_names_the_stage_and_changes_with_any_content() -> None:
    turns = [_turn(1), _turn(2)]
    base = stage_key("segment", {"conversation_id": "c1", "turns": turns, "fingerprint": "f"})
    assert base == stage_key("segment", {"fingerprint": "f", "turns": tuple(_turn(n) for n in (1, 2)),
                                         "conversation_id": "c1"})  # equal models, new objects, any order
    assert base != stage_key("persona", {"conversation_id": "c1", "turns": turns, "fingerprint": "f"})
    assert base != stage_key("segment", {"conversation_id": "c1", "turns": [_turn(1), _turn(2, "hello!")],
                                         "fingerprint": "f"})  # one character of content
    assert base != stage_key("segment", {"conversation_id": "c1", "turns": turns, "fingerprint": "g"})
    assert base != stage_key("segment", {"conversation_id": "c2", "turns": turns, "fingerprint": "f"})


def test_an_input_without_a_json_form_is_refused() -> None:
    with pytest.raises(TypeError, match="cannot key a stage input of type object"):
        stage_key("persona", {"speaker": object()})


def test_results_are_kept_per_conversation_directory_and_a_damaged_file_is_a_miss(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    cache = StageCache.of_store(tmp_path)
    assert cache.get("c1", "k1", dict) is None
    cache.put("c1", "k1", "segment", {"value": [1, 2]})
    cache.put("c2", "k1", "segment", {"value": [3]})  # same key, another conversation: its own file
    assert cache.get("c1", "k1", dict) == {"value": [1, 2]}
    assert cache.get("c2", "k1", dict) == {"value": [3]}
    path = cache.path("c1", "k1")
    assert path.parent == tmp_path / "prefect" / "results" / conversation_partition("c1")  # tmem forget's directory
    assert [p.name for p in path.parent.iterdir()] == [path.name]  # no temporary file left
    cache.put("c1", "k1", "segment", {"value": [9]})
    assert cache.get("c1", "k1", dict) == {"value": [9]}  # last writer wins

    path.write_text('{"outcome": ')  # cut short
    assert cache.get("c1", "k1", dict) is None
    assert "no longer decodes" in caplog.text
    cache.put("c1", "k2", "segment", {"value": "x"})
    assert cache.get("c1", "k2", lambda raw: raw["missing"]) is None  # a decoder that refuses it: a miss


def test_a_codec_s_json_writes_the_file_its_dict_writes(tmp_path: Path) -> None:
    """The build writes each outcome as pydantic's JSON in one pass; the file is the one the plain
    JSON form of the same outcome gives, byte for byte (so stores written before read the same)."""
    from tmem.build.conversation import SCENES
    from tmem.construct import BuildNote, StageOutcome
    from tmem.domain import Scene

    scene = Scene(conversation_id="c1", scene_id="s1", seq=0, title="Pottery — über café", summary="A bowl.",
                  narrative="Ana glazed a bowl.", turn_ids=("D1:1", "D1:2"),
                  start_time=datetime(2024, 1, 1, 9, tzinfo=UTC), end_time=datetime(2024, 1, 1, 9, 5, tzinfo=UTC))
    outcome = StageOutcome([scene], (BuildNote(operation="scene_pack", input_ref="c1", kind="split", detail="é"),))
    plain, fast = StageCache(tmp_path / "a"), StageCache(tmp_path / "b")
    plain.put("c1", "k", "segment", SCENES.encode(outcome))
    fast.put_json("c1", "k", "segment", SCENES.encode_json(outcome))
    assert plain.path("c1", "k").read_bytes() == fast.path("c1", "k").read_bytes()
    assert fast.get("c1", "k", SCENES.decode) == outcome

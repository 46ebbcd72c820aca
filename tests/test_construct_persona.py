"""Persona per speaker: one call for a bounded input, chunk-and-fold beyond it."""

from __future__ import annotations

import itertools
import json
import math
from typing import Any

import pytest

from tests.fakes import FakeChatModel, dialogue, replies
from tmem.construct import persona
from tmem.construct.persona import chunks
from tmem.errors import ValidationFailure

EMPTY = {"identity": [], "preferences": [], "traits": [], "relations": [], "timeline": []}


def test_persona_reads_only_the_speakers_turns_in_one_call() -> None:
    turns = dialogue(sessions=(10, 10))
    chat = FakeChatModel()
    ana = persona("conv-t", "Ana", turns, chat)
    assert chat.count("persona") == 1
    sent = chat.calls[0].input
    ids = [t["id"] for block in sent["turns"] for t in block["turns"]]
    assert ids == [t.turn_id for t in turns if t.speaker == "Ana"]
    assert "speaker" not in sent["turns"][0]["turns"][0]
    assert ana.speaker == "Ana" and ana.conversation_id == "conv-t"
    assert ana.identity and ana.relations  # "I am studying...", "...for my mother"
    assert all(f.since for f in ana.timeline)


def test_long_speakers_are_chunked_and_folded() -> None:
    turns = dialogue(sessions=(20, 20, 20))  # 30 turns of Ana
    chat = FakeChatModel()
    folded = persona("conv-t", "Ana", turns, chat, chunk_turns=8)
    calls = chat.of("persona")
    assert len(calls) == math.ceil(30 / 8)
    assert "persona_so_far" not in calls[0].input
    for before, after in itertools.pairwise(calls):
        assert after.input["persona_so_far"]["identity"] == json.loads(before.content)["identity"]
    assert all(sum(len(b["turns"]) for b in c.input["turns"]) <= 8 for c in calls)
    assert folded.identity == tuple(json.loads(calls[-1].content)["identity"])


def test_chunks_respect_both_bounds() -> None:
    turns = [t.model_copy(update={"text": "x" * 10}) for t in dialogue(sessions=(12,))]
    parts = chunks(turns, max_turns=5, max_chars=30)
    assert [len(p) for p in parts] == [3, 3, 3, 3]
    assert [t for p in parts for t in p] == turns
    assert [len(p) for p in chunks(turns, max_turns=5, max_chars=10**6)] == [5, 5, 2]


def test_empty_profile_is_rejected_and_unknown_speaker_is_an_error() -> None:
    turns = dialogue(sessions=(4,))
    chat = FakeChatModel({"persona": replies(EMPTY)})
    with pytest.raises(ValidationFailure, match="empty") as caught:
        persona("conv-t", "Ana", turns, chat)
    assert caught.value.operation == "persona" and "'Ana'" in caught.value.input_ref
    with pytest.raises(ValueError, match="no turns"):
        persona("conv-t", "Zed", turns, FakeChatModel())


def test_persona_entries_are_cleaned() -> None:
    answer: dict[str, Any] = {
        **EMPTY,
        "preferences": ["loves  hiking ", "Loves hiking", ""],
        "timeline": [{"fact": " works nights ", "since": " 2021-09 "}, {"fact": " ", "since": None}],
    }
    result = persona("conv-t", "Ana", dialogue(sessions=(4,)), FakeChatModel({"persona": replies(answer)}))
    assert result.preferences == ("loves hiking",)
    assert [(f.fact, f.since) for f in result.timeline] == [("works nights", "2021-09")]

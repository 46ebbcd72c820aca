"""LoCoMo-Plus in one build: many cues stitched into one LoCoMo conversation, on the real files."""

from __future__ import annotations

import json
from datetime import UTC, datetime
from pathlib import Path

import pytest

from tests.paths import LOCOMO10, LOCOMO_PLUS
from tmem.eval.cue_stitch import cue_positions, hosted_items, stitch_cues, write_cue_stitch
from tmem.eval.datasets import load_locomo_qa
from tmem.eval.examples import DatasetError
from tmem.eval.plus_stitch import read_plus_items
from tmem.ingest.load import ingest_archives, read_archive

NOW = datetime(2026, 12, 1, tzinfo=UTC)


def test_cue_positions_spread_over_the_host():
    assert cue_positions(19, 16) == [1, 2, 3, 4, 6, 7, 8, 9, 10, 11, 12, 13, 15, 16, 17, 18]
    assert cue_positions(3, 1) == [2]
    assert cue_positions(2, 5) == [1, 1, 1, 1, 2]  # never before the first session, never past the last


def test_one_build_stitch_of_conv30(tmp_path: Path):
    stitch = stitch_cues(LOCOMO10, LOCOMO_PLUS, "conv-30", cues=16)
    assert stitch.conversation_id == "conv-30+cues16"
    hosted = hosted_items(read_plus_items(LOCOMO_PLUS), 1, 10)[:16]  # conv-30 is the file's second sample
    assert [e.extra["plus_index"] for e in stitch.cue_examples] == [str(i.index) for i in hosted]
    archive_path, cue_path = write_cue_stitch(stitch, tmp_path / "out")
    conv = read_archive(archive_path).conversations[0]
    host = next(c for c in read_archive(LOCOMO10).conversations if c.conversation_id == "conv-30")
    assert len(conv.sessions) == len(host.sessions) + 16
    assert len(conv.turns) == len(host.turns) + sum(len(e.evidence) for e in stitch.cue_examples)
    times = [t.event_time for t in conv.turns]
    assert times == sorted(times)
    by_id = {t.turn_id: t for t in conv.turns}
    for example in stitch.cue_examples:  # each cue is a session of its own, both speakers, before the trigger
        cue = [by_id[t] for t in example.evidence]
        assert len({t.session_id for t in cue}) == 1 and {t.speaker for t in cue} == set(host.speakers)
        assert all(t.event_time < datetime.fromisoformat(example.question_date or "") for t in cue)
        session_turns = [t for t in conv.turns if t.session_id == cue[0].session_id]
        assert session_turns == cue
    # the host's questions keep their evidence: the same turn texts under the new ids
    host_qa = {q.question: q for q in load_locomo_qa(LOCOMO10)[0] if q.conversation_id == "conv-30"}
    host_text = {t.turn_id: t.text for t in host.turns}
    stitched_qa = load_locomo_qa(archive_path)[0]
    assert len(stitched_qa) == len(host_qa) == 81
    for q in stitched_qa:
        assert [by_id[t].text for t in q.evidence] == [host_text[t] for t in host_qa[q.question].evidence]
    cues = load_locomo_qa(cue_path)[0]
    assert [c.evidence for c in cues] == [e.evidence for e in stitch.cue_examples]
    assert ingest_archives([archive_path], tmp_path / "store", now=NOW).turns == len(conv.turns)


def test_explicit_items_and_errors():
    stitch = stitch_cues(LOCOMO10, LOCOMO_PLUS, "conv-26", item_indices=[400, 60])
    assert [e.extra["plus_index"] for e in stitch.cue_examples] == ["400", "60"]
    assert json.loads(json.dumps(stitch.sample))["sample_id"] == "conv-26+cues2"
    with pytest.raises(DatasetError, match="no sample 'conv-99'"):
        stitch_cues(LOCOMO10, LOCOMO_PLUS, "conv-99")
    with pytest.raises(DatasetError, match=r"no LoCoMo-Plus items \[5000\]"):
        stitch_cues(LOCOMO10, LOCOMO_PLUS, "conv-26", item_indices=[5000])

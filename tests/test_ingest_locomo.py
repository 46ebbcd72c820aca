"""LoCoMo ingest: the real locomo10.json, and small LoCoMo-shaped archives built here."""

from __future__ import annotations

import random
from collections import Counter
from datetime import UTC, datetime, timedelta
from itertools import pairwise
from pathlib import Path

import pytest

from tests.ingest_helpers import LOCOMO10, ingest_counts, locomo_sample, query, write_json
from tmem.errors import IngestError
from tmem.ingest import TURN_SPACING, ingest_archives, parse_locomo_datetime, read_locomo, render_turn_text

T1 = datetime(2025, 1, 2, 3, 4, 5, tzinfo=UTC)
T2 = datetime(2025, 2, 3, 4, 5, 6, tzinfo=UTC)


@pytest.fixture(scope="module")
def locomo10():
    return read_locomo(LOCOMO10)


@pytest.fixture(scope="module")
def locomo10_store(tmp_path_factory):
    store = tmp_path_factory.mktemp("locomo10-store")
    report = ingest_archives([LOCOMO10], store, now=T1)
    return store, report


def test_locomo10_counts_match_the_provenance_table(locomo10):
    convs = {c.conversation_id: c for c in locomo10.conversations}
    assert len(convs) == 10
    assert sum(len(c.sessions) for c in convs.values()) == 272
    assert sum(len(c.turns) for c in convs.values()) == 5882
    assert (len(convs["conv-26"].sessions), len(convs["conv-26"].turns)) == (19, 419)
    assert (len(convs["conv-41"].sessions), len(convs["conv-41"].turns)) == (32, 663)
    assert convs["conv-43"].speakers == ("Tim", "John")


def test_locomo10_qa_block_is_kept(locomo10):
    qa = [q for c in locomo10.conversations for q in c.qa]
    assert len(qa) == 1986
    assert Counter(q.category for q in qa) == {1: 282, 2: 321, 3: 96, 4: 841, 5: 446}
    assert sum(q.adversarial_answer is not None for q in qa) == 446
    assert sum(q.answer is None for q in qa) == 444
    # The six integer answers become strings; "When did Melanie paint a sunrise?" → 2022.
    sunrise = next(q for q in locomo10.conversations[0].qa if q.question == "When did Melanie paint a sunrise?")
    assert sunrise.answer == "2022"
    assert all(isinstance(q.answer, str) for q in qa if q.answer is not None)
    # Malformed evidence strings are kept as written.
    assert any(e == "D8:6; D9:17" for q in qa for e in q.evidence)


def test_conv26_ignores_date_keys_without_a_session(locomo10):
    conv26 = locomo10.conversations[0]
    assert conv26.conversation_id == "conv-26"
    assert [s.session_id for s in conv26.sessions] == [f"session_{n}" for n in range(1, 20)]
    assert [s.index for s in conv26.sessions] == list(range(1, 20))


def test_sessions_follow_their_number_not_string_order(locomo10):
    conv41 = next(c for c in locomo10.conversations if c.conversation_id == "conv-41")
    assert [s.session_id for s in conv41.sessions] == [f"session_{n}" for n in range(1, 33)]
    starts = [s.started_at for s in conv41.sessions]
    assert starts == sorted(starts) and len(set(starts)) == len(starts)
    # Turns are in session order: session_2's turns come before session_10's.
    positions = {t.turn_id: t.seq for t in conv41.turns}
    assert positions["D2:1"] < positions["D10:1"]


def test_sessions_order_numerically_whatever_the_key_order(tmp_path):
    sample = locomo_sample(sessions=12, turns_per_session=2)
    conv = sample["conversation"]
    keys = [k for k in conv if k.startswith("session_")]
    random.Random(7).shuffle(keys)
    sample["conversation"] = {"speaker_a": conv["speaker_a"], "speaker_b": conv["speaker_b"]} | {k: conv[k] for k in keys}
    parsed = read_locomo(write_json(tmp_path / "a.json", [sample]))
    (conversation,) = parsed.conversations
    assert [s.session_id for s in conversation.sessions] == [f"session_{n}" for n in range(1, 13)]
    assert [t.turn_id for t in conversation.turns][:4] == ["D1:1", "D1:2", "D2:1", "D2:2"]
    assert [t.seq for t in conversation.turns] == list(range(24))
    times = [t.event_time for t in conversation.turns]
    assert times == sorted(times)


def test_datetimes_are_timezone_aware_utc_with_one_second_per_turn(locomo10):
    conv26 = locomo10.conversations[0]
    assert conv26.sessions[0].started_at == datetime(2023, 5, 8, 13, 56, tzinfo=UTC)
    first_session = [t for t in conv26.turns if t.session_id == "session_1"]
    for k, turn in enumerate(first_session):
        assert turn.event_time.utcoffset() == timedelta(0)
        assert turn.event_time == conv26.sessions[0].started_at + k * TURN_SPACING
    for conv in locomo10.conversations:
        times = [t.event_time for t in conv.turns]
        assert all(a < b for a, b in pairwise(times)), conv.conversation_id


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        ("1:56 pm on 8 May, 2023", datetime(2023, 5, 8, 13, 56, tzinfo=UTC)),
        ("12:00 am on 1 January, 2024", datetime(2024, 1, 1, 0, 0, tzinfo=UTC)),
        ("12:30 pm on 29 February, 2024", datetime(2024, 2, 29, 12, 30, tzinfo=UTC)),
        ("9:05 AM on 3 Sep, 2022", datetime(2022, 9, 3, 9, 5, tzinfo=UTC)),
    ],
)
def test_parse_locomo_datetime(text, expected):
    assert parse_locomo_datetime(text) == expected


@pytest.mark.parametrize("text", ["13:00 pm on 8 May, 2023", "1:56 pm on 31 April, 2023", "8 May 2023", "1:56 pm on 8 Mayo, 2023"])
def test_parse_locomo_datetime_refuses_bad_dates(text):
    with pytest.raises(ValueError, match=r"LoCoMo date|no such time|day is out of range|unknown month"):
        parse_locomo_datetime(text)


def test_image_turns_keep_their_caption_and_metadata(locomo10):
    turn = next(t for t in locomo10.conversations[0].turns if t.turn_id == "D1:5")
    assert turn.text.startswith("The transgender stories were so inspiring!")
    assert turn.text.endswith("[shares a photo: a photo of a dog walking past a wall with a painting of a woman]")
    assert turn.metadata == {
        "blip_caption": "a photo of a dog walking past a wall with a painting of a woman",
        "img_url": "https://i.redd.it/l7hozpetnhlb1.jpg",
        "query": "transgender pride flag mural",
    }
    captioned = [t for c in locomo10.conversations for t in c.turns if "blip_caption" in t.metadata]
    assert len(captioned) == 1226
    assert sum("re-download" in t.metadata for c in locomo10.conversations for t in c.turns) == 206
    assert render_turn_text("", "a cat") == "[shares a photo: a cat]"


def test_store_holds_locomo10_with_qa(locomo10_store):
    store, report = locomo10_store
    assert (report.conversations, report.sessions, report.turns, report.new_turns) == (10, 272, 5882, 5882)
    assert ingest_counts(store) == {"conversations": 10, "sessions": 272, "turns": 5882, "qa": 1986}
    categories = dict(query(store, "SELECT category, count(*) FROM qa GROUP BY category"))
    assert categories == {1: 282, 2: 321, 3: 96, 4: 841, 5: 446}
    (row,) = query(store, "SELECT answer FROM qa WHERE question = 'When did Melanie paint a sunrise?'")
    assert row == ("2022",)
    first = query(store, "SELECT turn_id, seq, event_time FROM turns WHERE conversation_id = 'conv-26' ORDER BY seq LIMIT 2")
    assert first == [
        ("D1:1", 0, datetime(2023, 5, 8, 13, 56, 0, tzinfo=UTC)),
        ("D1:2", 1, datetime(2023, 5, 8, 13, 56, 1, tzinfo=UTC)),
    ]
    sessions = query(store, "SELECT session_id FROM sessions WHERE conversation_id = 'conv-26' ORDER BY session_index")
    assert [s for (s,) in sessions][8:11] == ["session_9", "session_10", "session_11"]


def _snapshot(store: Path) -> list[list[tuple]]:
    return [
        query(store, "SELECT * FROM conversations ORDER BY conversation_id"),
        query(store, "SELECT * FROM sessions ORDER BY conversation_id, session_id"),
        query(store, "SELECT * EXCLUDE (metadata), metadata::VARCHAR FROM turns ORDER BY conversation_id, turn_id"),
        query(store, "SELECT * FROM qa ORDER BY conversation_id, qa_index"),
    ]


def test_ingesting_twice_changes_nothing(tmp_path):
    store = tmp_path / "store"
    ingest_archives([LOCOMO10], store, now=T1)
    before = _snapshot(store)
    again = ingest_archives([LOCOMO10], store, now=T2)
    assert (again.new_turns, again.new_sessions, again.new_conversations, again.updated_conversations, again.new_qa) == (0, 0, 0, 0, 0)
    assert again.turns == 5882
    assert _snapshot(store) == before  # updated_at and ingested_at untouched too


def test_new_sessions_are_added_and_the_watermark_advances(tmp_path):
    store = tmp_path / "store"
    two = write_json(tmp_path / "two.json", [locomo_sample(sessions=2, turns_per_session=3)])
    first = ingest_archives([two], store, now=T1)
    assert (first.new_sessions, first.new_turns) == (2, 6)
    (mark1,) = query(store, "SELECT watermark_session_index, watermark_turn_seq, watermark_time, ingested_at, updated_at FROM conversations")
    assert mark1 == (2, 5, datetime(2023, 5, 9, 13, 56, 2, tzinfo=UTC), T1, T1)

    three = write_json(tmp_path / "three.json", [locomo_sample(sessions=3, turns_per_session=3)])
    second = ingest_archives([three], store, now=T2)
    assert (second.sessions, second.turns) == (3, 9)
    assert (second.new_sessions, second.new_turns, second.updated_conversations, second.new_qa) == (1, 3, 1, 0)
    (mark2,) = query(store, "SELECT watermark_session_index, watermark_turn_seq, watermark_time, ingested_at, updated_at FROM conversations")
    assert mark2 == (3, 8, datetime(2023, 5, 10, 13, 56, 2, tzinfo=UTC), T1, T2)
    rows = query(store, "SELECT turn_id, seq, ingested_at FROM turns ORDER BY seq")
    assert [(t, s) for t, s, _ in rows] == [(f"D{n}:{k}", 3 * (n - 1) + k - 1) for n in (1, 2, 3) for k in (1, 2, 3)]
    assert {t: at for t, _, at in rows}["D2:3"] == T1
    assert {t: at for t, _, at in rows}["D3:1"] == T2
    assert query(store, "SELECT session_id, session_index FROM sessions ORDER BY session_index")[-1] == ("session_3", 3)


def test_a_conflicting_change_is_refused_and_nothing_is_written(tmp_path):
    store = tmp_path / "store"
    ingest_archives([write_json(tmp_path / "v1.json", [locomo_sample(sessions=2)])], store, now=T1)
    before = _snapshot(store)
    changed = locomo_sample(sessions=3)  # adds session 3, but also edits a stored turn
    changed["conversation"]["session_2"][1]["text"] = "edited afterwards"
    path = write_json(tmp_path / "v2.json", [changed])
    with pytest.raises(IngestError) as err:
        ingest_archives([path], store, now=T2)
    assert err.value.path == str(path)
    assert err.value.record == "/0/conversation/session_2/1"
    assert "conflicting change" in err.value.reason and "'D2:2'" in err.value.reason and "text" in err.value.reason
    assert _snapshot(store) == before


def test_a_changed_session_date_is_a_conflict_on_event_time(tmp_path):
    store = tmp_path / "store"
    ingest_archives([write_json(tmp_path / "v1.json", [locomo_sample(sessions=2)])], store, now=T1)
    moved = locomo_sample(sessions=2)
    moved["conversation"]["session_2_date_time"] = "3:00 pm on 9 May, 2023"
    with pytest.raises(IngestError, match="different event_time"):
        ingest_archives([write_json(tmp_path / "v2.json", [moved])], store, now=T2)


def test_a_changed_qa_answer_is_a_conflict(tmp_path):
    store = tmp_path / "store"
    ingest_archives([write_json(tmp_path / "v1.json", [locomo_sample()])], store, now=T1)
    sample = locomo_sample()
    sample["qa"][0]["answer"] = "9 May 2023"
    with pytest.raises(IngestError) as err:
        ingest_archives([write_json(tmp_path / "v2.json", [sample])], store, now=T2)
    assert err.value.record == "/0/qa/0"
    assert "QA item 0" in err.value.reason and "answer" in err.value.reason
    assert ingest_counts(store)["qa"] == 3


def test_new_qa_items_are_appended(tmp_path):
    store = tmp_path / "store"
    ingest_archives([write_json(tmp_path / "v1.json", [locomo_sample()])], store, now=T1)
    sample = locomo_sample()
    sample["qa"].append({"question": "Who?", "answer": "Ann", "evidence": ["D1:1"], "category": 1})
    report = ingest_archives([write_json(tmp_path / "v2.json", [sample])], store, now=T2)
    assert (report.new_qa, report.new_turns, report.updated_conversations) == (1, 0, 1)
    assert query(store, "SELECT updated_at FROM conversations") == [(T2,)]

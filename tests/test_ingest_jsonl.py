"""The generic JSON Lines format: happy paths, ordering rules and incremental (delta) files."""

from __future__ import annotations

import json
import tempfile
from datetime import UTC, datetime, timedelta, timezone
from pathlib import Path

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from tests.ingest_helpers import ingest_counts, jsonl_turn, query, write_jsonl
from tmem.errors import IngestError
from tmem.ingest import ingest_archives, read_archive, read_jsonl

T1 = datetime(2025, 1, 2, 3, 4, 5, tzinfo=UTC)
T2 = datetime(2025, 2, 3, 4, 5, 6, tzinfo=UTC)


def two_conversations() -> list[dict]:
    """c1 (declared speakers, two sessions, +02:00 offsets) interleaved with c2 (undeclared, Z times)."""
    return [
        {"kind": "conversation", "conversation_id": "c1", "speakers": ["Ann", "Bob"]},
        jsonl_turn("t1", text="Hi Bob", timestamp="2024-05-01T09:00:00+02:00", metadata={"channel": "sms"}),
        jsonl_turn("x1", conversation_id="c2", session_id="a", speaker="Zoe", timestamp="2024-05-01T06:00:00Z"),
        jsonl_turn("t2", speaker="Bob", text="Hi Ann", timestamp="2024-05-01T09:00:00+02:00"),
        jsonl_turn("x2", conversation_id="c2", session_id="a", speaker="Yan", timestamp="2024-05-01T06:01:00Z"),
        jsonl_turn("t3", session_id="s2", text="Morning", timestamp="2024-05-03T08:15:30.250+02:00"),
        jsonl_turn("t4", session_id="s2", speaker="Bob", text="Hey", timestamp="2024-05-03T08:16:00+02:00"),
    ]


def test_parse_two_conversations(tmp_path):
    parsed = read_jsonl(write_jsonl(tmp_path / "a.jsonl", two_conversations()))
    c1, c2 = parsed.conversations
    assert (c1.conversation_id, c1.speakers) == ("c1", ("Ann", "Bob"))
    assert (c2.conversation_id, c2.speakers) == ("c2", ("Zoe", "Yan"))  # first appearance
    assert [(s.session_id, s.index) for s in c1.sessions] == [("s1", 1), ("s2", 2)]
    assert c1.sessions[1].started_at == datetime(2024, 5, 3, 6, 15, 30, 250000, tzinfo=UTC)
    assert [(t.turn_id, t.seq) for t in c1.turns] == [("t1", 0), ("t2", 1), ("t3", 2), ("t4", 3)]
    assert c1.turns[0].event_time.utcoffset() == timedelta(hours=2)
    assert c1.turns[0].metadata == {"channel": "sms"}
    assert parsed.records.turns[("c2", "x2")] == "line 5"


def test_ingest_generic_archive_into_the_store(tmp_path):
    store = tmp_path / "store"
    report = ingest_archives([write_jsonl(tmp_path / "a.jsonl", two_conversations())], store, now=T1)
    assert (report.conversations, report.sessions, report.turns, report.qa, report.new_turns) == (2, 3, 6, 0, 6)
    rows = query(store, "SELECT turn_id, session_id, seq, event_time, metadata::VARCHAR FROM turns WHERE conversation_id = 'c1' ORDER BY seq")
    assert rows[0] == ("t1", "s1", 0, datetime(2024, 5, 1, 7, 0, tzinfo=UTC), '{"channel":"sms"}')
    assert rows[2][:3] == ("t3", "s2", 2)
    assert query(store, "SELECT source_format, speakers, watermark_session_index, watermark_turn_seq FROM conversations ORDER BY 1, 2") == [
        ("jsonl", ["Ann", "Bob"], 2, 3),
        ("jsonl", ["Zoe", "Yan"], 1, 1),
    ]
    again = ingest_archives([tmp_path / "a.jsonl"], store, now=T2)
    assert again.new_turns == 0 and again.updated_conversations == 0


def test_blank_lines_crlf_equal_timestamps_and_unicode_line_separators(tmp_path):
    lines = [
        json.dumps(jsonl_turn("t1", text="first\u2028still the first line")),
        "",
        "   ",
        json.dumps(jsonl_turn("t2", speaker="Bob")),  # same timestamp as t1: allowed, file order decides
    ]
    path = tmp_path / "a.jsonl"
    path.write_bytes(("\r\n".join(lines) + "\r\n").encode("utf-8"))
    (conv,) = read_jsonl(path).conversations
    assert [t.turn_id for t in conv.turns] == ["t1", "t2"]
    assert conv.turns[0].text == "first\u2028still the first line"


def test_format_detection_by_content_for_other_extensions(tmp_path):
    path = tmp_path / "export.log"
    write_jsonl(path, [jsonl_turn("t1")])
    assert read_archive(path).source_format == "jsonl"
    with pytest.raises(IngestError, match="cannot tell the archive format"):
        read_archive(_write(tmp_path / "x.txt", "hello"))


def _write(path, text):
    path.write_text(text, encoding="utf-8")
    return path


def test_a_delta_file_appends_a_new_session(tmp_path):
    store = tmp_path / "store"
    ingest_archives([write_jsonl(tmp_path / "day1.jsonl", two_conversations())], store, now=T1)
    delta = [
        jsonl_turn("t5", session_id="s3", speaker="Cid", timestamp="2024-05-04T10:00:00+00:00"),
        jsonl_turn("t6", session_id="s3", speaker="Ann", timestamp="2024-05-04T10:00:05+00:00"),
    ]
    report = ingest_archives([write_jsonl(tmp_path / "day2.jsonl", delta)], store, now=T2)
    assert (report.new_sessions, report.new_turns, report.updated_conversations, report.new_conversations) == (1, 2, 1, 0)
    assert query(store, "SELECT turn_id, seq FROM turns WHERE conversation_id = 'c1' ORDER BY seq")[-2:] == [("t5", 4), ("t6", 5)]
    assert query(store, "SELECT session_id, session_index FROM sessions WHERE conversation_id = 'c1' ORDER BY 2")[-1] == ("s3", 3)
    (row,) = query(store, "SELECT speakers, watermark_session_index, watermark_turn_seq, watermark_time, updated_at FROM conversations WHERE conversation_id = 'c1'")
    assert row == (["Ann", "Bob", "Cid"], 3, 5, datetime(2024, 5, 4, 10, 0, 5, tzinfo=UTC), T2)


def test_a_delta_may_continue_the_last_session_but_not_a_closed_one(tmp_path):
    store = tmp_path / "store"
    ingest_archives([write_jsonl(tmp_path / "day1.jsonl", two_conversations())], store, now=T1)
    ok = [jsonl_turn("t5", session_id="s2", timestamp="2024-05-03T08:17:00+02:00")]
    report = ingest_archives([write_jsonl(tmp_path / "ok.jsonl", ok)], store, now=T2)
    assert (report.new_sessions, report.new_turns) == (0, 1)

    closed = [jsonl_turn("x3", conversation_id="c2", session_id="b", speaker="Zoe", timestamp="2024-05-02T06:00:00Z"),
              jsonl_turn("t6", session_id="s1", timestamp="2024-05-03T09:00:00+02:00")]
    before = ingest_counts(store)
    path = write_jsonl(tmp_path / "closed.jsonl", closed)
    with pytest.raises(IngestError) as err:
        ingest_archives([path], store, now=T2)
    assert (err.value.path, err.value.record) == (str(path), "line 2")
    assert "continues session 's1', which is closed" in err.value.reason
    assert ingest_counts(store) == before  # the valid c2 turn on line 1 was not written either


def test_a_delta_before_the_watermark_is_refused(tmp_path):
    store = tmp_path / "store"
    ingest_archives([write_jsonl(tmp_path / "day1.jsonl", two_conversations())], store, now=T1)
    late = [jsonl_turn("t9", session_id="s9", timestamp="2024-05-02T00:00:00+00:00")]
    with pytest.raises(IngestError, match="earlier than the stored watermark 2024-05-03T06:16:00\\+00:00 of conversation 'c1'"):
        ingest_archives([write_jsonl(tmp_path / "late.jsonl", late)], store, now=T2)


def test_a_new_turn_inserted_before_stored_ones_is_refused(tmp_path):
    store = tmp_path / "store"
    records = two_conversations()
    ingest_archives([write_jsonl(tmp_path / "v1.jsonl", records)], store, now=T1)
    inserted = [*records[:2], jsonl_turn("t1b", timestamp="2024-05-01T09:00:00+02:00"), *records[2:]]
    with pytest.raises(IngestError) as err:
        ingest_archives([write_jsonl(tmp_path / "v2.jsonl", inserted)], store, now=T2)
    assert err.value.record == "line 3"
    assert "comes before the already stored turn" in err.value.reason


def test_naive_now_is_refused(tmp_path):
    with pytest.raises(ValueError, match="timezone-aware"):
        ingest_archives([write_jsonl(tmp_path / "a.jsonl", [jsonl_turn("t1")])], tmp_path / "s", now=datetime(2025, 1, 1))


def test_offsets_are_normalised_to_the_same_instant(tmp_path):
    tz = timezone(timedelta(hours=-5))
    path = write_jsonl(tmp_path / "a.jsonl", [jsonl_turn("t1", timestamp=datetime(2024, 1, 1, 7, tzinfo=tz).isoformat())])
    ingest_archives([path], tmp_path / "s", now=T1)
    assert query(tmp_path / "s", "SELECT event_time FROM turns") == [(datetime(2024, 1, 1, 12, tzinfo=UTC),)]


def _store_view(store) -> list[list[tuple]]:
    return [
        query(store, "SELECT turn_id, session_id, seq, speaker, text, event_time FROM turns ORDER BY seq"),
        query(store, "SELECT session_id, session_index, started_at FROM sessions ORDER BY session_index"),
        query(store, "SELECT speakers, watermark_session_index, watermark_turn_seq, watermark_time FROM conversations"),
    ]


@settings(max_examples=12, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    sizes=st.lists(st.integers(min_value=1, max_value=3), min_size=1, max_size=4),
    gaps=st.lists(st.integers(min_value=0, max_value=90), min_size=12, max_size=12),
    split=st.floats(min_value=0.0, max_value=1.0),
)
def test_incremental_ingest_equals_a_full_ingest(sizes, gaps, split):
    """Property: any prefix, then the rest as a delta file, gives the same store as the whole at once."""
    records, moment, k = [], datetime(2024, 1, 1, tzinfo=UTC), 0
    for s, size in enumerate(sizes):
        for _ in range(size):
            moment += timedelta(seconds=gaps[k % len(gaps)])
            records.append(jsonl_turn(f"t{k}", session_id=f"s{s}", speaker=("Ann", "Bob", "Cy")[k % 3], timestamp=moment.isoformat()))
            k += 1
    cut = max(1, round(split * len(records)))
    with tempfile.TemporaryDirectory() as tmp:
        root = Path(tmp)
        ingest_archives([write_jsonl(root / "all.jsonl", records)], root / "full", now=T1)
        ingest_archives([write_jsonl(root / "head.jsonl", records[:cut])], root / "inc", now=T1)
        if records[cut:]:
            report = ingest_archives([write_jsonl(root / "tail.jsonl", records[cut:])], root / "inc", now=T2)
            assert report.new_turns == len(records) - cut
        assert _store_view(root / "inc") == _store_view(root / "full")

"""Benchmark datasets: LoCoMo evidence normalisation and defect counts, LoCoMo-Plus stitching."""

from __future__ import annotations

import json
import re
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import Any

import pytest

from tests.paths import LOCOMO10, LOCOMO_PLUS
from tmem.eval.datasets import (
    DatasetError,
    DefectLog,
    load_locomo_plus_qa,
    load_locomo_qa,
    normalise_evidence_id,
    parse_time_gap,
    resolve_evidence,
    stitch_locomo_plus,
)
from tmem.eval.datasets import question_speaker as speaker_of
from tmem.eval.plus_stitch import StitchedConversation, stitch_all
from tmem.ingest.load import ingest_archives, read_archive
from tmem.store.conversations import load_turns
from tmem.store.duck import connect

NOW = datetime(2026, 2, 1, 12, 0, tzinfo=UTC)

# --------------------------------------------------------------------------- evidence rules


@pytest.mark.parametrize(
    ("raw", "ids", "rules", "unresolved"),
    [
        ("D3:7", ("D3:7",), (), ()),
        (" D3:7 ", ("D3:7",), (), ()),
        ("D8:6; D9:17", ("D8:6", "D9:17"), ("split_list",), ()),
        ("D9:1 D4:4 D4:6", ("D9:1", "D4:4", "D4:6"), ("split_list",), ()),
        ("D1:2,D1:3", ("D1:2", "D1:3"), ("split_list",), ()),
        ("D:11:26", ("D11:26",), ("stray_colon",), ()),
        ("D30:05", ("D30:5",), ("zero_padded",), ()),
        ("D", (), (), ("D",)),
        ("", (), (), ("",)),
        ("D2:4; D", ("D2:4",), ("split_list",), ("D",)),
        ("turn 4", (), ("split_list",), ("turn", "4")),
    ],
)
def test_normalise_evidence_id(raw: str, ids: tuple[str, ...], rules: tuple[str, ...], unresolved: tuple[str, ...]) -> None:
    parsed = normalise_evidence_id(raw)
    assert (parsed.ids, parsed.rules, parsed.unresolved) == (ids, rules, unresolved)


def test_resolve_evidence_counts_each_defect() -> None:
    log = DefectLog()
    turns = {"D1:1", "D1:2", "D2:5", "D11:26"}
    assert resolve_evidence(["D1:1", "D:11:26", "D1:1", "D9:9", "D", "D2:05 D1:2"], turns, log, "q1") == (
        "D1:1", "D11:26", "D2:5", "D1:2",
    )
    assert resolve_evidence([], turns, log, "q2") == ()
    assert resolve_evidence(["D7:7"], turns, log, "q3") == ()
    report = log.report()
    assert report.counts == {
        "duplicate_evidence": 1,
        "empty_evidence": 1,
        "evidence_rule:split_list": 1,
        "evidence_rule:stray_colon": 1,
        "evidence_rule:zero_padded": 1,
        "malformed_evidence_excluded": 1,
        "malformed_evidence_normalised": 2,
        "missing_evidence_turn": 2,
        "no_usable_evidence": 2,
    }
    assert report.examples["missing_evidence_turn"] == ["q1 D9:9", "q3 D7:7"]


@pytest.mark.parametrize(
    ("question", "speaker"),
    [
        ("What did Melanie paint recently?", "Melanie"),
        ("What is Melanie's favourite book?", "Melanie"),
        ("Did Caroline and Melanie meet?", None),
        ("When was the race?", None),
        ("What did Melanies say?", None),
    ],
)
def test_question_speaker(question: str, speaker: str | None) -> None:
    assert speaker_of(question, ("Caroline", "Melanie")) == speaker


# --------------------------------------------------------------------------- LoCoMo, the real file


@pytest.fixture(scope="module")
def locomo() -> tuple[list[Any], Any]:
    return load_locomo_qa(LOCOMO10)


def test_locomo_questions_and_categories(locomo: tuple[list[Any], Any]) -> None:
    examples, _ = locomo
    assert len(examples) == 1540
    counts: dict[str, int] = {}
    for e in examples:
        counts[e.category] = counts.get(e.category, 0) + 1
        assert e.dataset == "locomo" and e.qid == f"{e.conversation_id}#{e.extra['qa_index']}"
    assert counts == {"multi-hop": 282, "temporal": 321, "open-domain": 96, "single-hop": 841}
    assert len({e.qid for e in examples}) == 1540
    first = examples[0]
    assert (first.qid, first.answer, first.evidence, first.category_id) == ("conv-26#0", "7 May 2023", ("D1:3",), 2)
    assert first.question_date == "2023-10-22T09:55:00+00:00"  # conv-26's last session (19) starts then
    assert first.speaker == "Caroline"


def test_locomo_defect_counts_on_the_real_file(locomo: tuple[list[Any], Any]) -> None:
    _, report = locomo
    expected = {
        "malformed_evidence_normalised": 6,  # 1 ";" list, 3 space lists, "D:11:26", "D30:05"
        "evidence_rule:split_list": 4,
        "evidence_rule:stray_colon": 1,
        "evidence_rule:zero_padded": 1,
        "malformed_evidence_excluded": 1,  # "D"
        "missing_evidence_turn": 2,  # D10:19 (conv-42 session 10 has 16 turns), D4:36 (conv-47: 25)
        "duplicate_evidence": 1,
        "empty_evidence": 4,
        "no_usable_evidence": 4,
        "answer_int": 6,
        "audit_flagged": 156,
        "audit:WRONG_CITATION": 57,
        "audit:HALLUCINATION": 33,
        "audit:TEMPORAL_ERROR": 26,
        "audit:ATTRIBUTION_ERROR": 24,
        "audit:AMBIGUOUS": 13,
        "audit:INCOMPLETE": 3,
    }
    assert report.counts == dict(sorted(expected.items()))


def test_locomo_normalised_evidence_of_known_questions(locomo: tuple[list[Any], Any]) -> None:
    by_id = {e.qid: e for e in locomo[0]}
    assert by_id["conv-26#37"].evidence == ("D8:6", "D9:17")
    assert by_id["conv-49#31"].evidence == ("D9:1", "D4:4", "D4:6")
    assert "D11:26" in by_id["conv-43#18"].evidence and len(by_id["conv-43#18"].evidence) == 7
    assert by_id["conv-50#69"].evidence == ("D30:5",)
    assert by_id["conv-42#88"].evidence == ("D1:18", "D1:20")
    assert by_id["conv-50#5"].evidence == ("D4:5", "D5:5")
    assert "D10:19" not in by_id["conv-42#58"].evidence and len(by_id["conv-42#58"].evidence) == 6
    assert by_id["conv-26#30"].evidence == ()
    assert json.loads(by_id["conv-26#37"].extra["raw_evidence"]) == ["D8:6; D9:17"]
    assert by_id["conv-26#1"].answer == "2022"  # an integer in the file
    flagged = by_id["conv-26#1"]
    assert flagged.extra["audit_error_type"] == "WRONG_CITATION" and flagged.evidence == ("D1:12",)
    assert json.loads(flagged.extra["audit_correct_evidence"]) == ["D1:14"]


def test_locomo_options(tmp_path: Path) -> None:
    audited, _ = load_locomo_qa(LOCOMO10, audited_evidence=True)
    assert {e.qid: e for e in audited}["conv-26#1"].evidence == ("D1:14",)
    adversarial, report = load_locomo_qa(LOCOMO10, (5,), audit=False)
    assert len(adversarial) == 446 and {e.category for e in adversarial} == {"adversarial"}
    assert report.count("answer_absent") == 444 and report.count("audit_flagged") == 0
    both = [e for e in adversarial if e.answer]
    assert len(both) == 2 and all(e.extra["adversarial_answer"] for e in both)
    copy = tmp_path / "locomo10.json"  # no errata folder beside it: no audit
    copy.write_bytes(LOCOMO10.read_bytes())
    assert load_locomo_qa(copy)[1].count("audit_flagged") == 0
    with pytest.raises(ValueError, match="categories are 1-5"):
        load_locomo_qa(LOCOMO10, (0,))
    bad = tmp_path / "bad.json"
    bad.write_text('[{"sample_id": "x"}]')
    with pytest.raises(DatasetError, match="conversation"):
        load_locomo_qa(bad)


# --------------------------------------------------------------------------- time gaps


@pytest.mark.parametrize(
    ("text", "days", "status"),
    [
        ("two weeks later", 14, "exact"),
        ("about six weeks later", 42, "exact"),
        ("three months later", 90, "exact"),
        ("one year later", 365, "exact"),
        ("a year after", 365, "exact"),
        ("a month later", 30, "exact"),
        ("3 days later", 3, "exact"),
        ("roughly three months later", 90, "exact"),
        ("two months after the challenge ended", 60, "exact"),
        ("around one week after the birth", 7, "exact"),
        ("Two-Week gap", 14, "exact"),
        ("several months later", 90, "vague"),
        ("a couple of months later", 60, "vague"),
        ("a few weeks later", 21, "vague"),
        ("several years later", 1095, "vague"),
        ("soon after", 0, "unparseable"),
        ("", 0, "unparseable"),
    ],
)
def test_parse_time_gap(text: str, days: int, status: str) -> None:
    gap = parse_time_gap(text)
    assert (gap.days, gap.status) == (days, status)


def _official_days(text: str) -> int:
    """The published rule (PROVENANCE): a number word or digits, or "a"/"an", directly before
    week(s)/month(s)/year(s); 7/30/365 days; anything else 0."""
    words = {"a": 1, "an": 1, "one": 1, "two": 2, "three": 3, "four": 4, "five": 5, "six": 6, "seven": 7,
             "eight": 8, "nine": 9, "ten": 10, "eleven": 11, "twelve": 12}
    m = re.search(r"\b(\d+|" + "|".join(words) + r")\b\s*(week|month|year)s?\b", text.lower())
    if not m:
        return 0
    return (int(m[1]) if m[1].isdigit() else words[m[1]]) * {"week": 7, "month": 30, "year": 365}[m[2]]


def test_time_gaps_of_the_real_file_agree_with_the_official_reading_except_vague_ones() -> None:
    items = json.loads(LOCOMO_PLUS.read_text())
    statuses: dict[str, int] = {}
    for item in items:
        gap = parse_time_gap(item["time_gap"])
        statuses[gap.status] = statuses.get(gap.status, 0) + 1
        if gap.status == "exact":
            assert gap.days == _official_days(item["time_gap"]), item["time_gap"]
        else:
            assert _official_days(item["time_gap"]) == 0
    assert statuses == {"exact": 386, "vague": 15}


# --------------------------------------------------------------------------- stitching, hand-built


def _session(n: int, speakers: tuple[str, str], texts: list[str]) -> list[dict[str, Any]]:
    return [{"speaker": speakers[k % 2], "dia_id": f"D{n}:{k + 1}", "text": t} for k, t in enumerate(texts)]


def _tiny_locomo(path: Path) -> Path:
    """Two hosts: h0 (Ann/Bob) sessions on 1 Jan, 1 Feb, 1 Mar 2023; h1 (Cy/Di) on 1 and 10 Jun 2023."""
    h0: dict[str, Any] = {"speaker_a": "Ann", "speaker_b": "Bob"}
    for n, date in enumerate(("10:00 am on 1 January, 2023", "10:00 am on 1 February, 2023", "10:00 am on 1 March, 2023"), 1):
        h0[f"session_{n}_date_time"] = date
        h0[f"session_{n}"] = _session(n, ("Ann", "Bob"), [f"h0 s{n} t{k}" for k in range(3)])
    h1: dict[str, Any] = {"speaker_a": "Cy", "speaker_b": "Di"}
    for n, date in enumerate(("9:00 pm on 1 June, 2023", "9:00 pm on 10 June, 2023"), 1):
        h1[f"session_{n}_date_time"] = date
        h1[f"session_{n}"] = _session(n, ("Cy", "Di"), [f"h1 s{n} t{k}" for k in range(2)])
    path.write_text(json.dumps([{"sample_id": "h0", "conversation": h0, "qa": []},
                                {"sample_id": "h1", "conversation": h1, "qa": []}]))
    return path


def _item(cue: str, trigger: str, gap: str, relation: str = "causal") -> dict[str, Any]:
    return {"relation_type": relation, "cue_dialogue": cue, "trigger_query": trigger, "time_gap": gap,
            "model_name": "m", "scores": {}, "ranks": {}, "final_similarity_score": 0.5}


@pytest.fixture
def tiny(tmp_path: Path) -> tuple[Path, Path]:
    locomo = _tiny_locomo(tmp_path / "locomo.json")
    plus = tmp_path / "plus.json"
    plus.write_text(json.dumps([
        _item("A: I broke my leg skiing.\nB: Oh no, take care!", "A: Want to go skiing?", "two months later"),  # → h0, between s1 and s2
        _item("A: I stopped eating meat.", "A: Let's grab burgers!", "one week later", "value"),  # → h1, on the last session's start
        _item("A: I fear heights.\nB: Noted.", "A: The tower tour is booked!", "one year later"),  # → h0, before s1
        _item("A: New job!\nB: Congrats.", "A: Monday again...", "soon"),  # → h1, unparseable: at the trigger time
    ]))
    return locomo, plus


def _by_id(stitched: list[StitchedConversation]) -> dict[str, StitchedConversation]:
    return {s.conversation_id: s for s in stitched}


def test_stitch_places_cue_by_time_gap_and_renumbers(tiny: tuple[Path, Path]) -> None:
    stitched, report = stitch_all(*tiny)
    convs = _by_id(stitched)
    assert list(convs) == ["plus-0000", "plus-0001", "plus-0002", "plus-0003"]
    assert [s.host_id for s in stitched] == ["h0", "h1", "h0", "h1"]  # item i → host i mod 2

    c0 = convs["plus-0000"]  # trigger 8 Mar 10:00; cue 60 days earlier = 7 Jan 10:00, after session 1
    assert [t.turn_id for t in c0.turns] == ["D1:1", "D1:2", "D1:3", "D2:1", "D2:2",
                                             "D3:1", "D3:2", "D3:3", "D4:1", "D4:2", "D4:3"]
    assert c0.cue_turn_ids == ("D2:1", "D2:2")
    cue = [t for t in c0.turns if t.turn_id in c0.cue_turn_ids]
    assert [(t.speaker, t.text) for t in cue] == [("Ann", "I broke my leg skiing."), ("Bob", "Oh no, take care!")]
    assert cue[0].event_time == datetime(2023, 1, 7, 10, 0, tzinfo=UTC) and cue[0].session_id == "session_2"
    assert c0.turns[3].metadata == {}  # the cue carries no tell-tale
    assert c0.turns[5].metadata == {"locomo_dia_id": "D2:1"} and c0.turns[5].text == "h0 s2 t0"
    assert all("Want to go skiing" not in t.text for t in c0.turns)  # the trigger is the question, not history
    e0 = c0.example
    assert (e0.qid, e0.conversation_id, e0.dataset, e0.question, e0.answer, e0.category, e0.category_id) == (
        "plus-0000", "plus-0000", "locomo-plus", "Want to go skiing?", "", "cognitive", None)
    assert e0.evidence == ("D2:1", "D2:2") and e0.speaker == "Ann"
    assert e0.question_date == datetime(2023, 3, 8, 10, 0, tzinfo=UTC).isoformat()
    assert e0.extra["relation_type"] == "causal" and e0.extra["time_gap_days"] == "60"

    c1 = convs["plus-0001"]  # trigger 17 Jun 21:00, cue 7 days earlier = the last session's start: shifted after it
    last_host_turn = next(t for t in c1.turns if t.metadata.get("locomo_dia_id") == "D2:2")
    cue1 = [t for t in c1.turns if t.turn_id in c1.cue_turn_ids]
    assert c1.cue_turn_ids == ("D3:1",) and cue1[0].speaker == "Cy"
    assert cue1[0].event_time == last_host_turn.event_time + timedelta(seconds=1)

    c2 = convs["plus-0002"]  # one year before 8 Mar 2023: before the first session
    assert c2.cue_turn_ids == ("D1:1", "D1:2") and c2.turns[2].metadata["locomo_dia_id"] == "D1:1"

    c3 = convs["plus-0003"]  # unparseable gap: 0 days, the cue sits right before the trigger time
    assert c3.cue_turn_ids == ("D3:1", "D3:2")
    assert c3.turns[-2].event_time == datetime(2023, 6, 17, 21, 0, tzinfo=UTC)

    assert report.counts == {"cue_before_first_session": 1, "cue_one_speaker": 1, "cue_shifted": 1,
                             "time_gap_unparseable": 1}
    for conv in stitched:
        times = [t.event_time for t in conv.turns]
        assert times == sorted(times)
        assert [t.seq for t in conv.turns] == list(range(len(conv.turns)))


def test_stitched_archives_ingest(tiny: tuple[Path, Path], tmp_path: Path) -> None:
    paths, examples, _ = stitch_locomo_plus(*tiny, tmp_path / "out", limit=3)
    assert [p.name for p in paths] == ["plus-0000.jsonl", "plus-0001.jsonl", "plus-0002.jsonl"]
    assert [e.qid for e in examples] == ["plus-0000", "plus-0001", "plus-0002"]
    first = json.loads(paths[0].read_text().splitlines()[0])
    assert first == {"kind": "conversation", "conversation_id": "plus-0000", "speakers": ["Ann", "Bob"]}
    report = ingest_archives(paths, tmp_path / "store", now=NOW)
    assert (report.conversations, report.turns, report.sessions) == (3, 11 + 5 + 11, 4 + 3 + 4)
    con = connect(tmp_path / "store", read_only=True)
    try:
        stored = load_turns(con, "plus-0000")
    finally:
        con.close()
    assert [t.turn_id for t in stored if t.turn_id in examples[0].evidence] == list(examples[0].evidence)
    assert stored[3].text == "I broke my leg skiing." and stored[3].session_id == "session_2"


def test_cue_dialogue_with_the_reply_inline_is_split(tmp_path: Path) -> None:
    locomo = _tiny_locomo(tmp_path / "locomo.json")
    plus = tmp_path / "plus.json"
    plus.write_text(json.dumps([
        _item("A: I fixed the fence after the storm.\\nB: Great timing.", "A: Storm again!", "two weeks later"),
        _item("A: I sold my car, and I bike now. B: That saves money.", "A: Rain today...", "two weeks later"),
        _item("A: Plan B: ask again.\nB: Good idea.", "A: They said no.", "two weeks later"),
    ]))
    stitched, report = stitch_all(locomo, plus)
    assert [[(t.speaker, t.text) for t in s.cue_turns] for s in stitched] == [
        [("Ann", "I fixed the fence after the storm."), ("Bob", "Great timing.")],
        [("Cy", "I sold my car, and I bike now."), ("Di", "That saves money.")],
        [("Ann", "Plan B: ask again."), ("Bob", "Good idea.")],  # "Plan B:" is not a speaker
    ]
    assert report.count("dialogue_literal_newline") == 1 and report.count("dialogue_inline_speaker") == 1
    assert report.count("cue_one_speaker") == 0


# --------------------------------------------------------------------------- stitching, the real files


@pytest.fixture(scope="module")
def plus_real() -> tuple[list[StitchedConversation], Any]:
    return stitch_all(LOCOMO10, LOCOMO_PLUS)


def test_real_plus_stitching(plus_real: tuple[list[StitchedConversation], Any]) -> None:
    stitched, report = plus_real
    assert len(stitched) == 401
    # 44 cues wrote the second speaker's reply inline (31 after a literal backslash-n, 13 after the
    # first sentence): split, counted, and no cue is left with one speaker (it was 44 before the split).
    assert report.counts == {"cue_before_first_session": 29, "cue_shifted": 18, "dialogue_inline_speaker": 13,
                             "dialogue_literal_newline": 31, "duplicate_cue": 7, "time_gap_vague": 15}
    hosts = [s.host_id for s in stitched]
    order = ["conv-26", "conv-30", "conv-41", "conv-42", "conv-43", "conv-44", "conv-47", "conv-48", "conv-49", "conv-50"]
    assert hosts == [order[i % 10] for i in range(401)]
    items = json.loads(LOCOMO_PLUS.read_text())
    for i, conv in enumerate(stitched):
        # the cue fits strictly between the host session before it and the one after it
        sessions = conv.host.sessions
        before = [t for t in conv.host.turns if conv.position and t.session_id == sessions[conv.position - 1].session_id]
        assert not before or conv.cue_turns[0].event_time > before[-1].event_time, conv.conversation_id
        assert conv.position == len(sessions) or conv.cue_turns[-1].event_time < sessions[conv.position].started_at
        lines = re.split(r"\n|\\n|(?<=[.!?…\"'”’)])\s+(?=B:\s)", items[i]["cue_dialogue"])
        assert [(t.speaker, t.text) for t in conv.cue_turns] == [
            (conv.speakers[0] if line.strip().startswith("A:") else conv.speakers[1], line.strip()[2:].strip())
            for line in lines if line.strip()
        ]
        assert len({t.speaker for t in conv.cue_turns}) == 2
        assert conv.example.question == items[i]["trigger_query"][2:].strip()
        assert datetime.fromisoformat(conv.example.question_date or "") > conv.host.turns[-1].event_time
    for conv in stitched[::40]:  # materialised archives: non-decreasing times, cue ids name the cue turns
        times = [t.event_time for t in conv.turns]
        assert times == sorted(times) and len(conv.turns) == len(conv.host.turns) + len(conv.cue_turns)
        assert [t.text for t in conv.turns if t.turn_id in conv.cue_turn_ids] == [t.text for t in conv.cue_turns]
    examples, _ = load_locomo_plus_qa(LOCOMO10, LOCOMO_PLUS, limit=5)
    assert [e.evidence for e in examples] == [s.example.evidence for s in stitched[:5]]


def test_real_plus_archives_ingest(tmp_path: Path) -> None:
    """The first 12 items cover all ten hosts and a shifted cue (plus-0001, 'one week later')."""
    paths, examples, report = stitch_locomo_plus(LOCOMO10, LOCOMO_PLUS, tmp_path / "out", limit=12)
    assert report.count("cue_shifted") >= 1
    archive = read_archive(paths[1])
    assert archive.conversations[0].conversation_id == "plus-0001"
    ingest = ingest_archives(paths, tmp_path / "store", now=NOW)
    assert ingest.conversations == 12
    host_turns = {c.conversation_id: len(c.turns) for c in read_archive(LOCOMO10).conversations}
    expected = sum(host_turns[e.extra["host_conversation_id"]] + len(e.evidence) for e in examples)
    assert ingest.turns == expected

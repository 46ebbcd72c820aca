"""Hypothesis strategies for hostile archives in both ingest formats (tests/test_ingest_hostile.py).

A case is a valid archive (random unicode: RTL and zero-width marks, control characters, NUL,
astral characters that JSON escapes as surrogate pairs) with one mutation applied, either to
the records (duplicate ids, empty or huge texts, wrong types, missing fields, deep nesting,
lone surrogates, timestamps backwards / in the future / out of range) or to the bytes (BOM,
CRLF, truncation, invalid UTF-8, raw control bytes). Each mutation says what ingest must do
with it: ``"ok"``, ``"error"``, or ``None`` when either is acceptable (e.g. a truncation that
happens to fall on a line boundary). For ``"ok"`` cases the case carries the turn texts the
store must then hold, character for character.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from datetime import UTC, datetime, timedelta, timezone
from typing import Any

from hypothesis import strategies as st

from tests.ingest_helpers import locomo_date

Expect = str | None  # "ok", "error" or None (either is fine, never a traceback)
TurnKey = tuple[str, str]

SPECIALS = (
    "\u202e", "\u202d", "\u200f", "\u061c",  # RTL overrides and marks
    "\u200b", "\u200c", "\u200d", "\u2060", "\ufeff",  # zero-width characters, BOM inside text
    "\x00", "\x07", "\x1b", "\x7f", "\x85", "\u2028", "\u2029", "\t", "\n", "\r",  # control characters
    "\U0001f642", "\U0001d11e", "\u05d0", "\u0627", "\u4f1a", "'", '"', "\\", "/", "%", "_",
)
_CHARS = st.one_of(st.characters(exclude_categories=["Cs"]), st.sampled_from(SPECIALS))
HOSTILE_TEXT = st.text(_CHARS, min_size=1, max_size=30).filter(lambda s: bool(s.strip()))
HUGE_TEXT = "\u00e9" * 600_000 + " \u202eend"  # 1.2 MB of UTF-8 in one turn
DEEP_DEPTHS = (2, 30, 5_000, 100_000)
DEEP = "__tmem_deep__"
WRONG_VALUES = st.one_of(
    st.none(), st.booleans(), st.integers(-(2**70), 2**70), st.floats(allow_nan=False, allow_infinity=False),
    st.lists(st.integers(), max_size=3), st.dictionaries(st.text(max_size=3), st.integers(), max_size=2),
)


@dataclass
class Case:
    """One archive file: its bytes, file suffix, the mutation applied and what ingest must do."""

    fmt: str
    mutation: str
    data: bytes
    suffix: str
    expect: Expect
    texts: dict[TurnKey, str] = field(default_factory=dict)  # for "ok": what the store must hold


def _iso(moment: datetime, draw: st.DrawFn) -> str:
    text = moment.isoformat()
    return text.replace("+00:00", "Z") if draw(st.booleans()) else text


def _distinct(draw: st.DrawFn, n: int, strategy: st.SearchStrategy[str] = HOSTILE_TEXT) -> list[str]:
    return draw(st.lists(strategy, min_size=n, max_size=n, unique=True))


def _serialise(value: Any, draw: st.DrawFn) -> str:
    ascii_only = draw(st.booleans())  # True: astral characters become \\ud83d\\ude42 escape pairs
    return json.dumps(value, ensure_ascii=ascii_only)


def _encode(text: str) -> bytes:
    # A lone surrogate left raw in the text becomes CESU bytes: invalid UTF-8 on purpose.
    return text.encode("utf-8", "surrogatepass")


# ---- JSON Lines ------------------------------------------------------------------------------

JSONL_STRING_FIELDS = ("conversation_id", "session_id", "turn_id", "speaker", "text", "timestamp")
JSONL_MUTATIONS: dict[str, Expect] = {
    "none": "ok", "huge_text": "ok", "long_ids": "ok", "future": "ok", "equal_times": "ok", "bom": "ok", "crlf": "ok",
    "extra_blank_lines": "ok", "empty_text": "error", "blank_text": "error", "duplicate_turn_id": "error",
    "backwards": "error", "naive_timestamp": "error", "garbage_timestamp": "error", "overflow_timestamp": "error",
    "wrong_type": "error", "missing_field": "error", "unknown_field": "error", "deep_required": "error",
    "lone_surrogate": "error", "unknown_speaker": "error", "declared_twice": "error", "duplicate_key": "error",
    "invalid_utf8": "error", "not_an_object": "error", "nan": "error", "huge_integer": "error",
    "truncate": None, "control_byte": None,
}


@st.composite
def jsonl_cases(draw: st.DrawFn, mutation: str | None = None) -> Case:
    """A JSON Lines case with ``mutation`` (drawn when None)."""
    records: list[dict[str, Any]] = []
    turns: list[dict[str, Any]] = []
    declared: list[dict[str, Any]] = []
    for cid in _distinct(draw, draw(st.integers(1, 2))):
        speakers = _distinct(draw, 2)
        if draw(st.booleans()):
            declared.append({"kind": "conversation", "conversation_id": cid, "speakers": speakers})
            records.append(declared[-1])
        tz = timezone(timedelta(minutes=draw(st.integers(-14 * 60, 14 * 60))))
        moment = draw(st.datetimes(min_value=datetime(1970, 1, 1), max_value=datetime(2100, 1, 1))).replace(tzinfo=UTC)
        n = draw(st.integers(1, 4))
        for k, turn_id in enumerate(_distinct(draw, n)):
            moment += timedelta(seconds=draw(st.integers(1, 3 * 86_400)))
            turn: dict[str, Any] = {
                "conversation_id": cid, "session_id": "s1" if k < n // 2 + 1 else "s2", "turn_id": turn_id,
                "speaker": speakers[k % 2], "text": draw(HOSTILE_TEXT), "timestamp": _iso(moment.astimezone(tz), draw),
            }
            if draw(st.integers(0, 4)) == 0:
                turn["metadata"] = {draw(HOSTILE_TEXT): draw(HOSTILE_TEXT)}
            turns.append(turn)
            records.append(turn)
    mutation = mutation or draw(st.sampled_from(sorted(JSONL_MUTATIONS)))
    victim = draw(st.sampled_from(turns))
    suffix = draw(st.sampled_from((".jsonl", ".ndjson", ".log")))
    eol = "\n"
    raw_edit: tuple[str, str] | None = None
    if mutation == "huge_text":
        victim["text"] = HUGE_TEXT
    elif mutation == "long_ids":
        victim["turn_id"] = victim["turn_id"] * 5_000
    elif mutation == "future":  # the same times shifted to the year 2999, order kept
        shift = datetime(2999, 1, 1, tzinfo=UTC) - datetime.fromisoformat(turns[0]["timestamp"])
        for turn in turns:
            turn["timestamp"] = (datetime.fromisoformat(turn["timestamp"]) + shift).isoformat()
    elif mutation == "equal_times":
        for turn in turns:
            same = next(t for t in turns if t["conversation_id"] == turn["conversation_id"])
            turn["timestamp"] = same["timestamp"]
    elif mutation == "crlf":
        eol = "\r\n"
    elif mutation in ("empty_text", "blank_text"):
        victim["text"] = "" if mutation == "empty_text" else draw(st.sampled_from((" ", "\t\n", "\u2028", "\x1f \u3000")))
    elif mutation == "duplicate_turn_id":
        others = [t for t in turns if t["conversation_id"] == victim["conversation_id"] and t is not victim]
        if not others:
            turns.append(dict(victim))
            records.append(turns[-1])
        else:
            others[0]["turn_id"] = victim["turn_id"]
    elif mutation == "backwards":
        first = next(t for t in turns if t["conversation_id"] == victim["conversation_id"])
        earlier = datetime.fromisoformat(first["timestamp"]) - timedelta(seconds=draw(st.integers(1, 10**6)))
        extra = dict(victim, turn_id=victim["turn_id"] + "\u200b-late", timestamp=earlier.isoformat())
        records.append(extra)
    elif mutation == "naive_timestamp":
        victim["timestamp"] = datetime.fromisoformat(victim["timestamp"]).replace(tzinfo=None).isoformat()
    elif mutation == "garbage_timestamp":
        victim["timestamp"] = draw(st.sampled_from(("yesterday", "2024-13-01T00:00:00Z", "", "1:56 pm on 8 May, 2023")))
    elif mutation == "overflow_timestamp":
        victim["timestamp"] = draw(st.sampled_from(("9999-12-31T23:30:00-05:00", "0001-01-01T00:10:00+01:00")))
    elif mutation == "wrong_type":
        victim[draw(st.sampled_from(JSONL_STRING_FIELDS))] = draw(WRONG_VALUES)
    elif mutation == "missing_field":
        del victim[draw(st.sampled_from(JSONL_STRING_FIELDS))]
    elif mutation == "unknown_field":
        victim[draw(st.sampled_from(("speeker", "Text", "tenant", "\u202etext")))] = draw(HOSTILE_TEXT)
    elif mutation == "deep_required":
        victim[draw(st.sampled_from(JSONL_STRING_FIELDS))] = DEEP
    elif mutation == "lone_surrogate":
        key = draw(st.sampled_from(("conversation_id", "turn_id", "speaker", "text")))
        victim[key] = victim[key] + draw(st.sampled_from(("\ud800", "\udfff", "\udc00x")))
    elif mutation == "unknown_speaker":
        if not any(d["conversation_id"] == victim["conversation_id"] for d in declared):
            declared.append({"kind": "conversation", "conversation_id": victim["conversation_id"],
                             "speakers": [victim["speaker"]]})
            records.insert(0, declared[-1])
        victim["speaker"] = victim["speaker"] + "\u200d"
    elif mutation == "declared_twice":
        records.insert(0, {"kind": "conversation", "conversation_id": victim["conversation_id"], "speakers": ["A"]})
        records.insert(0, records[0])
    elif mutation == "duplicate_key":
        raw_edit = ('{"conversation_id": ', '{"turn_id": "dup", "turn_id": "dup2", "conversation_id": ')
    elif mutation == "not_an_object":
        records.append(draw(st.one_of(st.lists(st.integers(), max_size=2), st.text(max_size=5), st.integers())))
    elif mutation == "nan":
        raw_edit = ('{"conversation_id": ', '{"metadata": {"x": NaN}, "conversation_id": ')
    elif mutation == "huge_integer":
        raw_edit = ('{"conversation_id": ', '{"metadata": {"x": ' + "9" * 5_000 + '}, "conversation_id": ')
    text = eol.join(_serialise(r, draw) for r in records) + eol
    if mutation == "extra_blank_lines":
        text = "\n  \n" + text.replace(eol, eol + "\t" + eol, 1)
    if raw_edit is not None:
        text = text.replace(*raw_edit, 1)
    if mutation == "deep_required":
        depth = draw(st.sampled_from(DEEP_DEPTHS))
        text = text.replace(json.dumps(DEEP), "[" * depth + "]" * depth)
    data = _byte_mutation(mutation, _encode(text), draw)
    expect = JSONL_MUTATIONS[mutation]
    texts = {(t["conversation_id"], t["turn_id"]): t["text"] for t in turns} if expect == "ok" else {}
    return Case("jsonl", mutation, data, suffix, expect, texts)


def _byte_mutation(mutation: str, data: bytes, draw: st.DrawFn) -> bytes:
    if mutation == "bom":
        return b"\xef\xbb\xbf" + data
    if mutation == "truncate":
        return data[: draw(st.integers(0, max(len(data) - 1, 0)))]
    if mutation in ("invalid_utf8", "control_byte"):
        at = draw(st.integers(0, len(data)))
        while 0 < at < len(data) and (data[at] & 0xC0) == 0x80:  # insert between characters, not inside one
            at -= 1
        byte = draw(st.sampled_from((b"\xff", b"\xc3", b"\x80", b"\xed\xa0\x80"))) if mutation == "invalid_utf8" else (
            draw(st.sampled_from((b"\x00", b"\x01", b"\x1b", b"\x7f", b"\x0b", b"\x0c")))
        )
        return data[:at] + byte + data[at:]
    return data


# ---- LoCoMo ----------------------------------------------------------------------------------

LOCOMO_TURN_STRINGS = ("speaker", "dia_id", "text")
LOCOMO_MUTATIONS: dict[str, Expect] = {
    "none": "ok", "huge_text": "ok", "future": "ok", "image_turn": "ok", "ignored_extras": "ok", "bom": "ok",
    "deep_ignored": "ok", "session_order": "ok",
    "empty_text": "error", "duplicate_dia_id": "error", "duplicate_sample_id": "error", "backwards": "error",
    "garbage_date": "error", "year_overflow": "error", "wrong_type": "error", "missing_field": "error",
    "deep_required": "error", "deep_bomb": "error", "lone_surrogate": "error", "unknown_speaker": "error",
    "session_gap": "error", "huge_session_number": "error", "same_speakers": "error", "duplicate_key": "error",
    "invalid_utf8": "error", "qa_category_overflow": "error", "not_an_array": "error", "nan": "error",
    "truncate": None, "control_byte": None,
}


@st.composite
def locomo_cases(draw: st.DrawFn, mutation: str | None = None) -> Case:
    """A LoCoMo case with ``mutation`` (drawn when None)."""
    samples: list[dict[str, Any]] = []
    turns: list[tuple[str, dict[str, Any]]] = []
    for cid in _distinct(draw, draw(st.integers(1, 2))):
        speakers = _distinct(draw, 2)
        conversation: dict[str, Any] = {"speaker_a": speakers[0], "speaker_b": speakers[1]}
        moment = draw(st.datetimes(min_value=datetime(1990, 1, 1), max_value=datetime(2090, 1, 1)))
        dia_ids = iter(_distinct(draw, 6))
        for n in range(1, draw(st.integers(1, 3)) + 1):
            moment += timedelta(days=draw(st.integers(0, 400)), minutes=draw(st.integers(1, 600)))
            conversation[f"session_{n}_date_time"] = locomo_date(moment)
            conversation[f"session_{n}"] = [
                {"speaker": speakers[k % 2], "dia_id": next(dia_ids), "text": draw(HOSTILE_TEXT)}
                for k in range(draw(st.integers(1, 2)))
            ]
            turns += [(cid, t) for t in conversation[f"session_{n}"]]
        qa = [{"question": draw(HOSTILE_TEXT), "answer": draw(st.one_of(HOSTILE_TEXT, st.integers(0, 10**6))),
               "evidence": [draw(HOSTILE_TEXT)], "category": draw(st.integers(1, 5))}]
        samples.append({"sample_id": cid, "conversation": conversation, "qa": qa})
    mutation = mutation or draw(st.sampled_from(sorted(LOCOMO_MUTATIONS)))
    cid, victim = draw(st.sampled_from(turns))
    sample = next(s for s in samples if s["sample_id"] == cid)
    conv = sample["conversation"]
    document: Any = samples
    raw_edit: tuple[str, str] | None = None
    deep = None
    if mutation == "huge_text":
        victim["text"] = HUGE_TEXT
    elif mutation == "future":  # 800 years on: same weekdays' leap rules, order kept
        for key in [k for k in conv if k.endswith("_date_time")]:
            conv[key] = conv[key][:-4] + str(int(conv[key][-4:]) + 800)
    elif mutation == "image_turn":
        victim["text"] = draw(st.sampled_from(("", " ")))
        victim["blip_caption"] = draw(HOSTILE_TEXT)
        victim["img_url"] = [draw(HOSTILE_TEXT)]
    elif mutation == "ignored_extras":
        victim["\u202eunknown"] = draw(WRONG_VALUES)
        conv["session_99_summary"] = draw(WRONG_VALUES)
        conv["session_777_date_time"] = "not a date at all"
        sample["event_summary"] = {"x": [draw(HOSTILE_TEXT)]}
    elif mutation in ("deep_ignored", "deep_bomb"):
        sample["observation"] = DEEP
        deep = draw(st.sampled_from((2, 30))) if mutation == "deep_ignored" else draw(st.sampled_from((5_000, 100_000)))
    elif mutation == "session_order":  # keys in reverse order, session_10 after session_9 ... numbers rule, not text
        items = list(conv.items())
        conv.clear()
        conv.update(reversed(items))
    elif mutation == "empty_text":
        victim["text"] = draw(st.sampled_from(("", "  ", "\u3000")))
    elif mutation == "duplicate_dia_id":
        conv["session_1"].append(dict(conv["session_1"][0], speaker=conv["speaker_b"]))
    elif mutation == "duplicate_sample_id":
        samples.append(dict(sample))
    elif mutation == "backwards":
        last = max(int(k.split("_")[1]) for k in conv if k.endswith("_date_time"))
        conv[f"session_{last + 1}_date_time"] = "1:00 am on 1 January, 1980"
        conv[f"session_{last + 1}"] = [{"speaker": conv["speaker_a"], "dia_id": "late\u200b", "text": "late"}]
    elif mutation == "garbage_date":
        conv["session_1_date_time"] = draw(st.sampled_from(("yesterday", "25:61 pm on 8 May, 2023", "1:56 pm on 31 Feb, 2023")))
    elif mutation == "year_overflow":
        conv["session_1_date_time"] = "11:59 pm on 31 December, 9999"
        conv["session_1"] = [{"speaker": conv["speaker_a"], "dia_id": f"Y{k}", "text": "t"} for k in range(61)]
        for key in [k for k in conv if k.startswith("session_") and k not in ("session_1", "session_1_date_time")]:
            del conv[key]
    elif mutation == "wrong_type":
        where = draw(st.sampled_from(("turn", "sample_id", "speaker_a", "conversation")))
        target = victim if where == "turn" else conv if where == "speaker_a" else sample
        target[draw(st.sampled_from(LOCOMO_TURN_STRINGS)) if where == "turn" else where] = draw(
            WRONG_VALUES.filter(lambda v: not isinstance(v, dict)) if where == "conversation" else WRONG_VALUES
        )
    elif mutation == "missing_field":
        del victim[draw(st.sampled_from(LOCOMO_TURN_STRINGS))]
    elif mutation == "deep_required":
        victim[draw(st.sampled_from(LOCOMO_TURN_STRINGS))] = DEEP
        deep = draw(st.sampled_from(DEEP_DEPTHS))
    elif mutation == "lone_surrogate":
        target, key = draw(st.sampled_from(((victim, "text"), (victim, "dia_id"), (sample, "sample_id"), (conv, "speaker_a"))))
        target[key] = target[key] + "\udbff"
    elif mutation == "unknown_speaker":
        victim["speaker"] = victim["speaker"] + "\u202e"
    elif mutation == "session_gap":
        conv["session_3_date_time"] = "1:00 am on 1 January, 2095"
        conv["session_3"] = [{"speaker": conv["speaker_a"], "dia_id": "gap", "text": "gap"}]
        conv.pop("session_2", None)
    elif mutation == "huge_session_number":
        conv["session_" + "9" * draw(st.sampled_from((12, 5_000)))] = [dict(victim)]
    elif mutation == "same_speakers":
        conv["speaker_b"] = conv["speaker_a"]
    elif mutation == "duplicate_key":
        raw_edit = ('{"sample_id": ', '{"sample_id": "x", "sample_id": ')
    elif mutation == "qa_category_overflow":
        sample["qa"][0]["category"] = 2**63
    elif mutation == "not_an_array":
        document = draw(st.sampled_from(("root-object", "empty", "scalar")))
        document = {"root-object": samples[0], "empty": [], "scalar": 7}[document]
    elif mutation == "nan":
        raw_edit = ('"answer": ', '"answer": NaN, "x": ')  # NaN is not JSON: it must not become "nan"
    text = _serialise(document, draw)
    if raw_edit is not None:
        text = text.replace(*raw_edit, 1)
    if deep is not None:
        text = text.replace(json.dumps(DEEP), "[" * deep + "]" * deep)
    data = _byte_mutation(mutation, _encode(text), draw)
    expect = LOCOMO_MUTATIONS[mutation]
    texts: dict[TurnKey, str] = {}
    if expect == "ok":
        for cid_, turn in turns:
            caption = turn.get("blip_caption")
            photo = f"[shares a photo: {caption.strip()}]" if caption else ""
            texts[(cid_, turn["dia_id"])] = (
                (f"{turn['text']} {photo}" if turn["text"].strip() else photo) if caption else turn["text"]
            )
    return Case("locomo", mutation, data, draw(st.sampled_from((".json", ".dat"))), expect, texts)

"""Parse and validate a LoCoMo archive (``locomo10.json`` and files shaped like it).

Decisions (documented in docs/ingest-formats.md):

- ``conversation_id`` is the sample's ``sample_id``; sessions are the ``session_<N>`` keys,
  ordered by the number N (``session_10`` after ``session_2``), and must run 1..K without gaps.
  Date keys without a session (conv-26 has 35 date keys for 19 sessions) are ignored.
- ``session_<N>_date_time`` (``"1:56 pm on 8 May, 2023"``) carries no zone; it is read as UTC.
- Turns carry no time of their own: turn k (0-based) of a session gets the session start plus
  k seconds (:data:`TURN_SPACING`), so event order is explicit and strictly increasing.
- An image turn keeps its caption in the text (``<text> [shares a photo: <caption>]``) and its
  ``blip_caption``/``img_url``/``query``/``re-download`` fields in the turn metadata.
- The ``qa`` block is kept (integer answers become strings; evidence ids are kept as written).
"""

from __future__ import annotations

import re
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import Any

from tmem.domain import Conversation, QAItem, Session, Turn
from tmem.errors import IngestError
from tmem.ingest.archive import (
    ROOT,
    Fields,
    InvalidJson,
    ParsedArchive,
    RecordIndex,
    child,
    decode_json,
    json_type,
    read_text,
    shown,
    unicode_problem,
)

TURN_SPACING = timedelta(seconds=1)
PHOTO_TEMPLATE = "[shares a photo: {caption}]"

MAX_SESSION_NUMBER = 999_999
_SESSION_KEY = re.compile(r"session_(\d+)")
_DATE_KEY = re.compile(r"session_(\d+)_date_time")
_LOCOMO_TIME = re.compile(
    r"\s*(?P<hour>\d{1,2}):(?P<minute>\d{2})\s*(?P<ampm>[ap])\.?m\.?\s+on\s+"
    r"(?P<day>\d{1,2})\s+(?P<month>[A-Za-z]+)\.?,?\s+(?P<year>\d{4})\s*",
    re.IGNORECASE,
)
_MONTHS = {
    name: number
    for number, full in enumerate(
        ("january", "february", "march", "april", "may", "june", "july", "august", "september", "october", "november", "december"),
        start=1,
    )
    for name in (full, full[:3])
}
_MONTHS["sept"] = 9


def parse_locomo_datetime(value: str) -> datetime:
    """``"1:56 pm on 8 May, 2023"`` → 2023-05-08 13:56 UTC. English month names, no locale use."""
    match = _LOCOMO_TIME.fullmatch(value)
    if match is None:
        raise ValueError(f"{shown(value)} is not a LoCoMo date like '1:56 pm on 8 May, 2023'")
    hour, minute = int(match["hour"]), int(match["minute"])
    month = _MONTHS.get(match["month"].lower())
    if month is None:
        raise ValueError(f"{value!r}: unknown month {match['month']!r}")
    if not 1 <= hour <= 12 or minute > 59:
        raise ValueError(f"{value!r}: no such time of day")
    hour = hour % 12 + (12 if match["ampm"].lower() == "p" else 0)
    try:
        return datetime(int(match["year"]), month, int(match["day"]), hour, minute, tzinfo=UTC)
    except ValueError as exc:
        raise ValueError(f"{value!r}: {exc}") from None


def render_turn_text(text: str, caption: str | None) -> str:
    """The turn text, with an image turn's caption appended so the photo's content is searchable."""
    if not caption:
        return text
    photo = PHOTO_TEMPLATE.format(caption=caption.strip())
    return f"{text} {photo}" if text.strip() else photo


def read_locomo(path: Path) -> ParsedArchive:
    """Read and validate a LoCoMo JSON file."""
    return parse_locomo_text(read_text(path), str(path))


def parse_locomo_text(text: str, path: str) -> ParsedArchive:
    """Validate the text of a LoCoMo JSON file; ``path`` names it in errors."""
    try:
        data = decode_json(text)
    except InvalidJson as exc:
        where = "file" if exc.line is None else f"line {exc.line} column {exc.column}"
        raise IngestError(path, where, f"not valid JSON: {exc.reason}") from None
    return parse_locomo(data, path)


def parse_locomo(data: object, path: str) -> ParsedArchive:
    """Validate decoded LoCoMo data (a list of samples) into conversations."""
    if not isinstance(data, list):
        raise IngestError(path, ROOT, f"a LoCoMo archive is a JSON array of samples, got {json_type(data)}")
    if not data:
        raise IngestError(path, ROOT, "the archive holds no samples")
    records = RecordIndex()
    conversations: list[Conversation] = []
    for i, sample in enumerate(data):
        conversation = _parse_sample(Fields.of(sample, path, f"/{i}", pointer=True, what="sample"), records)
        conversations.append(conversation)
    return ParsedArchive(path=path, source_format="locomo", conversations=tuple(conversations), records=records)


def _parse_sample(sample: Fields, records: RecordIndex) -> Conversation:
    conversation_id = sample.string("sample_id")
    if conversation_id in records.conversations:
        first = records.conversations[conversation_id]
        raise sample.error(f"duplicate sample_id {shown(conversation_id)} (first at {first})", "sample_id")
    records.conversations[conversation_id] = sample.where()
    if "conversation" not in sample.obj:
        raise sample.error("missing required field 'conversation'", "conversation")
    conv = Fields.of(sample.obj["conversation"], sample.path, sample.where("conversation"), pointer=True, what="conversation")
    speaker_a, speaker_b = conv.string("speaker_a"), conv.string("speaker_b")
    if speaker_a == speaker_b:
        raise conv.error(f"speaker_a and speaker_b are both {shown(speaker_a)}", "speaker_b")
    numbers, date_keys = _session_keys(conv)

    sessions: list[Session] = []
    turns: list[Turn] = []
    seen_turns: dict[str, str] = {}
    previous_end: tuple[datetime, str] | None = None
    for number in numbers:
        key = f"session_{number}"
        date_key = date_keys.get(number, f"session_{number}_date_time")
        if date_key not in conv.obj:
            raise conv.error(f"missing required field {date_key!r} (the start time of {key})", date_key)
        started_at = conv.timestamp(date_key, parse_locomo_datetime)
        if previous_end is not None and started_at < previous_end[0]:
            raise conv.error(
                f"timestamps go backwards: {key} starts at {started_at.isoformat()}, before the last turn "
                f"of {previous_end[1]} at {previous_end[0].isoformat()}",
                date_key,
            )
        raw_turns = conv.obj[numbers[number]]
        if not raw_turns:
            raise conv.error(f"{key} has no turns", numbers[number])
        session_pointer = conv.where(numbers[number])
        for k, raw in enumerate(raw_turns):
            turn_fields = Fields.of(raw, conv.path, child(session_pointer, k), pointer=True, what="turn")
            try:
                event_time = started_at + k * TURN_SPACING
            except OverflowError:
                raise turn_fields.error(f"turn {k} of {key} would fall after the year 9999") from None
            turn = _parse_turn(
                turn_fields,
                conversation_id=conversation_id,
                session_id=key,
                seq=len(turns),
                event_time=event_time,
                speakers=(speaker_a, speaker_b),
            )
            if turn.turn_id in seen_turns:
                raise turn_fields.error(
                    f"duplicate turn id {shown(turn.turn_id)} (first at {seen_turns[turn.turn_id]})", "dia_id"
                )
            seen_turns[turn.turn_id] = turn_fields.where()
            records.turns[(conversation_id, turn.turn_id)] = turn_fields.where()
            turns.append(turn)
        sessions.append(Session(conversation_id=conversation_id, session_id=key, index=number, started_at=started_at))
        previous_end = (turns[-1].event_time, key)

    qa = _parse_qa(sample, conversation_id, records)
    return Conversation(
        conversation_id=conversation_id,
        speakers=(speaker_a, speaker_b),
        sessions=tuple(sessions),
        turns=tuple(turns),
        qa=qa,
        source=sample.path,
    )


def _session_keys(conv: Fields) -> tuple[dict[int, str], dict[int, str]]:
    """Session number → its key in numeric order, and number → its date key.

    Refuses duplicate numbers (``session_3`` and ``session_03``) and gaps in the numbering.
    """
    found: dict[int, str] = {}
    dates: dict[int, str] = {}
    for key, value in conv.obj.items():
        date_match = _DATE_KEY.fullmatch(key)
        if date_match is not None:
            date_number = _session_number(date_match[1])
            if date_number is None:
                continue  # no session can have this number: an unused date key, ignored like the others
            if date_number in dates:
                raise conv.error(f"duplicate date key for session {date_number} (also {dates[date_number]!r})", key)
            dates[date_number] = key
            continue
        match = _SESSION_KEY.fullmatch(key)
        if match is None:
            continue
        number = _session_number(match[1])
        if number is None:
            raise conv.error(f"key {shown(key)}: session number too large (at most {MAX_SESSION_NUMBER})")
        if number < 1:
            raise conv.error("session numbers start at 1", key)
        if number in found:
            raise conv.error(f"duplicate session number {number} (also key {found[number]!r})", key)
        if not isinstance(value, list):
            raise conv.error(f"field {key!r} must be an array of turns, got {json_type(value)}", key)
        found[number] = key
    if not found:
        raise conv.error("no session_<N> keys: the conversation has no sessions")
    ordered = sorted(found)
    if len(ordered) != ordered[-1]:  # numbers are distinct and >= 1, so a gap shows as fewer keys than the last number
        missing = next(n for n, number in enumerate(ordered, start=1) if n != number)
        raise conv.error(f"session numbers must run 1..{ordered[-1]} without gaps; session_{missing} is missing")
    return {number: found[number] for number in ordered}, dates


def _session_number(digits: str) -> int | None:
    """The number of a ``session_<digits>`` key (leading zeros allowed), None above MAX_SESSION_NUMBER."""
    significant = digits.lstrip("0") or "0"
    if len(significant) > len(str(MAX_SESSION_NUMBER)):
        return None
    number = int(significant)
    return number if number <= MAX_SESSION_NUMBER else None


def _parse_turn(
    turn: Fields,
    *,
    conversation_id: str,
    session_id: str,
    seq: int,
    event_time: datetime,
    speakers: tuple[str, str],
) -> Turn:
    speaker = turn.string("speaker")
    if speaker not in speakers:
        raise turn.error(
            f"unknown speaker {shown(speaker)}; this conversation's speakers are {shown(speakers[0])} and {shown(speakers[1])}",
            "speaker",
        )
    turn_id = turn.string("dia_id")
    caption = turn.optional_string("blip_caption", empty_ok=False)
    text = turn.string("text", empty_ok=caption is not None)
    metadata: dict[str, str] = {}
    if caption is not None:
        metadata["blip_caption"] = caption
    urls = turn.string_list("img_url", required=False)
    if urls:
        metadata["img_url"] = " ".join(urls)
    query = turn.optional_string("query")
    if query is not None:
        metadata["query"] = query
    redownload: Any = turn.obj.get("re-download")
    if redownload is not None:
        if not isinstance(redownload, bool):
            raise turn.error(f"field 're-download' must be a boolean, got {json_type(redownload)}", "re-download")
        metadata["re-download"] = "true" if redownload else "false"
    return Turn(
        conversation_id=conversation_id,
        session_id=session_id,
        turn_id=turn_id,
        seq=seq,
        speaker=speaker,
        text=render_turn_text(text, caption),
        event_time=event_time,
        metadata=metadata,
    )


def _parse_qa(sample: Fields, conversation_id: str, records: RecordIndex) -> tuple[QAItem, ...]:
    raw = sample.obj.get("qa")
    if raw is None:
        return ()
    if not isinstance(raw, list):
        raise sample.error(f"field 'qa' must be an array, got {json_type(raw)}", "qa")
    items: list[QAItem] = []
    for i, entry in enumerate(raw):
        qa = Fields.of(entry, sample.path, child(sample.where("qa"), i), pointer=True, what="QA item")
        answer = _answer(qa, "answer")
        adversarial = _answer(qa, "adversarial_answer")
        if answer is None and adversarial is None:
            raise qa.error("a QA item needs 'answer' or 'adversarial_answer'")
        category = qa.integer("category")
        if category < 1:
            raise qa.error(f"field 'category' must be a positive integer, got {category}", "category")
        evidence = qa.string_list("evidence", required=False) or []
        items.append(
            QAItem(
                conversation_id=conversation_id,
                index=i,
                question=qa.string("question"),
                answer=answer,
                evidence=tuple(evidence),
                category=category,
                adversarial_answer=adversarial,
            )
        )
        records.qa[(conversation_id, i)] = qa.where()
    return tuple(items)


def _answer(qa: Fields, key: str) -> str | None:
    """An answer as text: LoCoMo stores a few as numbers (e.g. ``2022``)."""
    value = qa.obj.get(key)
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, str | int | float):
        raise qa.error(f"field {key!r} must be a string or a number, got {json_type(value)}", key)
    if isinstance(value, str):
        problem = unicode_problem(value)
        if problem is not None:
            raise qa.error(f"field {key!r} {problem}", key)
        return value
    return str(value)

"""Parse and validate tmem's generic archive format: JSON Lines, one turn per line.

The format is specified in docs/ingest-formats.md. In short::

    {"kind": "conversation", "conversation_id": "c1", "speakers": ["Ann", "Bob"]}
    {"conversation_id": "c1", "session_id": "s1", "turn_id": "t1", "speaker": "Ann",
     "text": "Hi!", "timestamp": "2024-05-01T09:30:00+02:00", "metadata": {"channel": "sms"}}

- A ``conversation`` line is optional; when present it must come before the conversation's
  first turn, and every turn's speaker must be one it declares.
- Within a conversation, file order is turn order; timestamps must not decrease, turn ids are
  unique, and a session's turns are contiguous. Sessions are ordered by their first timestamp.
- Timestamps need a UTC offset (naive ones are refused). Blank lines are skipped.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator
from dataclasses import dataclass, field
from datetime import datetime
from pathlib import Path

from tmem.domain import Conversation, Session, Turn
from tmem.errors import IngestError
from tmem.ingest.archive import (
    Fields,
    InvalidJson,
    JsonObject,
    ParsedArchive,
    RecordIndex,
    decode_json,
    json_type,
    read_text,
    shown,
    unicode_problem,
)

TURN_FIELDS = frozenset({"kind", "conversation_id", "session_id", "turn_id", "speaker", "text", "timestamp", "metadata"})
CONVERSATION_FIELDS = frozenset({"kind", "conversation_id", "speakers"})
RECORD_KINDS = ("conversation", "turn")


@dataclass
class _Open:
    """A conversation being assembled while reading the file."""

    conversation_id: str
    declared_speakers: tuple[str, ...] | None = None
    declared_on: str | None = None
    turns: list[Turn] = field(default_factory=list)
    turn_lines: dict[str, str] = field(default_factory=dict)
    sessions: list[Session] = field(default_factory=list)
    session_lines: dict[str, str] = field(default_factory=dict)
    seen_speakers: list[str] = field(default_factory=list)
    last_time: datetime | None = None
    last_line: str = ""


def read_jsonl(path: Path) -> ParsedArchive:
    """Read and validate a JSON Lines archive."""
    return parse_jsonl_text(read_text(path), str(path))


def parse_jsonl_text(text: str, path: str) -> ParsedArchive:
    """Validate the text of a JSON Lines archive; ``path`` names it in errors."""
    # Split on "\n" only: str.splitlines() would also split on U+2028 etc., which JSON allows in strings.
    return parse_jsonl([line.removesuffix("\r") for line in text.split("\n")], path)


def parse_jsonl(lines: list[str], path: str) -> ParsedArchive:
    """Validate the lines of a JSON Lines archive into conversations (file order is kept)."""
    return parse_jsonl_records(_decoded_lines(lines, path), path)


def _decoded_lines(lines: list[str], path: str) -> Iterator[tuple[str, object]]:
    for number, line in enumerate(lines, start=1):
        if not line.strip():
            continue
        record = f"line {number}"
        try:
            value = decode_json(line)
        except InvalidJson as exc:
            column = f" (column {exc.column})" if exc.column is not None else ""
            raise IngestError(path, record, f"not valid JSON: {exc.reason}{column}") from None
        yield record, value


def parse_jsonl_records(records: Iterable[tuple[str, object]], path: str) -> ParsedArchive:
    """Validate decoded JSON Lines records, each named by where it came from (``line 7`` in a
    file, ``turns[3]`` in a posted batch), into conversations; every rule of the format applies."""
    open_conversations: dict[str, _Open] = {}
    for record, value in records:
        fields = Fields.of(value, path, record, pointer=False)
        kind = fields.optional_string("kind", empty_ok=False) or "turn"
        if kind not in RECORD_KINDS:
            raise fields.error(f"unknown record kind {shown(kind)}; expected one of {', '.join(RECORD_KINDS)}")
        if kind == "conversation":
            _declare(fields, open_conversations)
        else:
            _add_turn(fields, open_conversations)
    if not open_conversations:
        raise IngestError(path, "file", "the archive holds no turns")
    index = RecordIndex()
    conversations = tuple(_close(state, path, index) for state in open_conversations.values())
    return ParsedArchive(path=path, source_format="jsonl", conversations=conversations, records=index)


def _refuse_unknown_fields(fields: Fields, allowed: frozenset[str]) -> None:
    unknown = sorted(set(fields.obj) - allowed)
    if unknown:
        raise fields.error(f"unknown field {shown(unknown[0])}; allowed: {', '.join(sorted(allowed))}")


def _declare(fields: Fields, open_conversations: dict[str, _Open]) -> None:
    _refuse_unknown_fields(fields, CONVERSATION_FIELDS)
    conversation_id = fields.string("conversation_id")
    speakers = fields.string_list("speakers", empty_ok=False) or []
    for speaker in speakers:
        if not speaker.strip():
            raise fields.error("field 'speakers' must not contain an empty name")
    duplicates = sorted({s for s in speakers if speakers.count(s) > 1})
    if duplicates:
        raise fields.error(f"speaker {shown(duplicates[0])} is declared twice")
    state = open_conversations.get(conversation_id)
    if state is not None and state.declared_on is not None:
        raise fields.error(f"conversation {shown(conversation_id)} is already declared on {state.declared_on}")
    if state is not None:
        raise fields.error(
            f"conversation {shown(conversation_id)} is declared after its first turn ({shown(state.turns[0].turn_id)} "
            f"on {state.turn_lines[state.turns[0].turn_id]}); put the declaration first"
        )
    open_conversations[conversation_id] = _Open(conversation_id, tuple(speakers), fields.record)


def _add_turn(fields: Fields, open_conversations: dict[str, _Open]) -> None:
    _refuse_unknown_fields(fields, TURN_FIELDS)
    conversation_id = fields.string("conversation_id")
    session_id = fields.string("session_id")
    turn_id = fields.string("turn_id")
    speaker = fields.string("speaker")
    text = fields.string("text")
    event_time = fields.timestamp("timestamp")
    metadata = _metadata(fields)

    state = open_conversations.setdefault(conversation_id, _Open(conversation_id))
    if state.declared_speakers is not None and speaker not in state.declared_speakers:
        raise fields.error(
            f"unknown speaker {shown(speaker)}; conversation {shown(conversation_id)} declares "
            f"{', '.join(shown(s) for s in state.declared_speakers[:10])} on {state.declared_on}"
        )
    if turn_id in state.turn_lines:
        raise fields.error(
            f"duplicate turn id {shown(turn_id)} in conversation {shown(conversation_id)} (first on {state.turn_lines[turn_id]})"
        )
    if state.last_time is not None and event_time < state.last_time:
        raise fields.error(
            f"timestamps go backwards in conversation {shown(conversation_id)}: {event_time.isoformat()} is before "
            f"{state.last_time.isoformat()} on {state.last_line}"
        )
    current = state.sessions[-1].session_id if state.sessions else None
    if session_id != current:
        if session_id in state.session_lines:
            raise fields.error(
                f"session {shown(session_id)} resumes after session {shown(current)} began; a session's turns must be "
                f"contiguous (session {shown(session_id)} began on {state.session_lines[session_id]})"
            )
        state.sessions.append(
            Session(
                conversation_id=conversation_id,
                session_id=session_id,
                index=len(state.sessions) + 1,
                started_at=event_time,
            )
        )
        state.session_lines[session_id] = fields.record
    if speaker not in state.seen_speakers:
        state.seen_speakers.append(speaker)
    state.turns.append(
        Turn(
            conversation_id=conversation_id,
            session_id=session_id,
            turn_id=turn_id,
            seq=len(state.turns),
            speaker=speaker,
            text=text,
            event_time=event_time,
            metadata=metadata,
        )
    )
    state.turn_lines[turn_id] = fields.record
    state.last_time, state.last_line = event_time, fields.record


def _metadata(fields: Fields) -> dict[str, str]:
    raw = fields.obj.get("metadata")
    if raw is None:
        return {}
    if not isinstance(raw, dict):
        raise fields.error(f"field 'metadata' must be an object of string values, got {json_type(raw)}")
    if isinstance(raw, JsonObject) and raw.duplicate_keys:
        raise fields.error(f"duplicate metadata key {shown(raw.duplicate_keys[0])}")
    for key, value in raw.items():
        if not isinstance(value, str):
            raise fields.error(f"metadata value {shown(key)} must be a string, got {json_type(value)}")
        problem = unicode_problem(key) or unicode_problem(value)
        if problem is not None:
            raise fields.error(f"metadata entry {shown(key)} {problem}")
    return dict(raw)


def _close(state: _Open, path: str, records: RecordIndex) -> Conversation:
    if not state.turns:
        raise IngestError(path, state.declared_on or "file", f"conversation {shown(state.conversation_id)} has no turns")
    records.conversations[state.conversation_id] = state.declared_on or state.turn_lines[state.turns[0].turn_id]
    for turn in state.turns:
        records.turns[(state.conversation_id, turn.turn_id)] = state.turn_lines[turn.turn_id]
    speakers = state.declared_speakers if state.declared_speakers is not None else tuple(state.seen_speakers)
    return Conversation(
        conversation_id=state.conversation_id,
        speakers=speakers,
        sessions=tuple(state.sessions),
        turns=tuple(state.turns),
        source=path,
    )

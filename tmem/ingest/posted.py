"""Turns posted by a live assistant (``POST /conversations/{id}/turns``, the MCP ``add_turns`` tool).

A post is a JSON object ``{"speakers": [...], "turns": [...]}`` for the conversation named by the
request. Its records are the JSON Lines records of docs/ingest-formats.md (a turn's
``conversation_id`` may be left out: the request names it) and are validated by the JSON Lines
parser itself, record by record, so a post is refused with the very errors a file would get;
only the record names differ (``turns[3]``, ``speakers`` instead of ``line 4``).

A post is then planned against what the store will hold once the posts before it are ingested
(:func:`plan_post`), and what it adds is written to the spool as a JSON Lines archive
(:func:`spool_text`) that ``tmem ingest`` reads like any other file.
"""

from __future__ import annotations

import json
from collections.abc import Iterable
from datetime import datetime

import polars as pl

from tmem.domain import Conversation
from tmem.errors import IngestError
from tmem.ingest.archive import Fields, InvalidJson, JsonObject, ParsedArchive, decode_json, json_type, shown
from tmem.ingest.frames import PlanCounts, archive_frames, plan_ingest
from tmem.ingest.jsonl import parse_jsonl_records
from tmem.store.ingest_writer import (
    STORED_CONVERSATIONS,
    STORED_SESSIONS,
    STORED_TURNS,
    IngestPlan,
    StoredState,
)

REQUEST = "request"  # the "file" part of a posted batch's errors: "request: turns[3]: <reason>"
POST_FIELDS = frozenset({"speakers", "turns"})


def parse_posted_text(conversation_id: str, text: str, source: str = REQUEST) -> ParsedArchive:
    """A raw request body (JSON text), decoded as strictly as an archive file, then :func:`parse_posted`."""
    try:
        body = decode_json(text)
    except InvalidJson as exc:
        where = f" (line {exc.line}, column {exc.column})" if exc.line is not None else ""
        raise IngestError(source, "body", f"not valid JSON: {exc.reason}{where}") from None
    return parse_posted(conversation_id, body, source)


def parse_posted(conversation_id: str, body: object, source: str = REQUEST) -> ParsedArchive:
    """Validate a posted batch for ``conversation_id``; raises :class:`IngestError` naming the record."""
    Fields.of({"conversation_id": conversation_id}, source, "conversation id", pointer=False).string("conversation_id")
    envelope = Fields.of(body, source, "body", pointer=False, what="the request body")
    unknown = sorted(set(envelope.obj) - POST_FIELDS)
    if unknown:
        raise envelope.error(f"unknown field {shown(unknown[0])}; allowed: {', '.join(sorted(POST_FIELDS))}")
    if "turns" not in envelope.obj:
        raise envelope.error("missing required field 'turns'")
    turns = envelope.obj["turns"]
    if not isinstance(turns, list):
        raise envelope.error(f"field 'turns' must be a list of turn records, got {json_type(turns)}")
    if not turns:
        raise envelope.error("field 'turns' is empty: post at least one turn")
    return parse_jsonl_records(_records(conversation_id, envelope.obj.get("speakers"), turns, source), source)


def _records(conversation_id: str, speakers: object, turns: list[object], source: str) -> Iterable[tuple[str, object]]:
    if speakers is not None:
        yield "speakers", {"kind": "conversation", "conversation_id": conversation_id, "speakers": speakers}
    for i, turn in enumerate(turns):
        where = f"turns[{i}]"
        if not isinstance(turn, dict):
            yield where, turn  # the parser names the wrong type
            continue
        if turn.get("kind") == "conversation":
            raise IngestError(source, where, "only turn records belong in 'turns'; declare speakers with 'speakers'")
        if "conversation_id" in turn and turn["conversation_id"] != conversation_id:
            raise IngestError(source, where, f"field 'conversation_id' is {shown(turn['conversation_id'])}, but the turns "
                                             f"were posted to conversation {shown(conversation_id)}")
        record = JsonObject(turn)
        record.duplicate_keys = getattr(turn, "duplicate_keys", ())
        record.setdefault("conversation_id", conversation_id)
        yield where, record


def apply_plan(stored: StoredState, plan: IngestPlan) -> StoredState:
    """What the store holds once ``plan`` is written on top of ``stored`` (pure; for planning a
    post after the posts still waiting before it)."""
    changed = plan.conversations["conversation_id"].to_list()
    conversations = pl.concat([
        stored.conversations.filter(~pl.col("conversation_id").is_in(changed)),
        plan.conversations.select(list(STORED_CONVERSATIONS)).cast(STORED_CONVERSATIONS),  # type: ignore[arg-type]
    ])
    return StoredState(
        conversations=conversations,
        sessions=pl.concat([stored.sessions, plan.sessions.select(list(STORED_SESSIONS)).cast(STORED_SESSIONS)]),  # type: ignore[arg-type]
        turns=pl.concat([stored.turns, plan.turns.select(list(STORED_TURNS)).cast(STORED_TURNS)]),  # type: ignore[arg-type]
        qa=stored.qa,
    )


def plan_post(
    archive: ParsedArchive, stored: StoredState, now: datetime
) -> tuple[IngestPlan, PlanCounts]:
    """The ingest plan of a post against ``stored`` (raises :class:`IngestError` exactly as ingest would)."""
    return plan_ingest(archive_frames([archive]), stored, now)


def spool_text(conversation: Conversation, new_turn_ids: set[str], declared: bool) -> str:
    """The JSON Lines archive of a post's new turns (and its speaker declaration): the spool file,
    which ingest reads back into the same turns (timestamps keep their offsets)."""
    lines: list[str] = []
    if declared:
        lines.append(_dumps({"kind": "conversation", "conversation_id": conversation.conversation_id,
                             "speakers": list(conversation.speakers)}))
    for turn in conversation.turns:
        if turn.turn_id not in new_turn_ids:
            continue
        record: dict[str, object] = {
            "conversation_id": turn.conversation_id, "session_id": turn.session_id, "turn_id": turn.turn_id,
            "speaker": turn.speaker, "text": turn.text, "timestamp": turn.event_time.isoformat(),
        }
        if turn.metadata:
            record["metadata"] = dict(turn.metadata)
        lines.append(_dumps(record))
    return "\n".join(lines) + "\n"


def _dumps(value: object) -> str:
    # JSON escapes "\n" and control characters inside strings, so one record stays one line.
    return json.dumps(value, ensure_ascii=False, separators=(",", ":"))

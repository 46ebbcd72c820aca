"""Reading ingested conversations back from the working database (the builder's input)."""

from __future__ import annotations

import json
from collections.abc import Sequence
from dataclasses import dataclass
from datetime import datetime
from typing import Any

import duckdb

from tmem.domain import Turn
from tmem.errors import ScopeError


@dataclass(frozen=True)
class ConversationState:
    """An ingested conversation and how far its last published memory got."""

    conversation_id: str
    speakers: tuple[str, ...]
    turns: int
    watermark_turn_seq: int
    watermark_time: datetime
    built_turn_seq: int | None  # None: never built

    @property
    def changed(self) -> bool:
        return self.built_turn_seq is None or self.built_turn_seq < self.watermark_turn_seq


def conversation_states(con: duckdb.DuckDBPyConnection, ids: list[str] | None = None) -> list[ConversationState]:
    """States of the given (or all) conversations, ordered by id. Unknown ids raise ScopeError."""
    rows = con.execute(
        "SELECT c.conversation_id, c.speakers, (SELECT count(*) FROM turns t WHERE t.conversation_id = c.conversation_id), "
        "c.watermark_turn_seq, c.watermark_time, b.watermark_turn_seq "
        "FROM conversations c LEFT JOIN memory_builds b USING (conversation_id) ORDER BY c.conversation_id"
    ).fetchall()
    states = {
        r[0]: ConversationState(
            conversation_id=r[0], speakers=tuple(r[1]), turns=int(r[2]), watermark_turn_seq=int(r[3]),
            watermark_time=r[4], built_turn_seq=None if r[5] is None else int(r[5]),
        )
        for r in rows
    }
    if ids is None:
        return list(states.values())
    unknown = [i for i in ids if i not in states]
    if unknown:
        raise ScopeError(f"unknown conversation id(s): {', '.join(map(repr, unknown))}")
    return [states[i] for i in ids]


# Row order and columns ``turns_from_rows`` expects (``tmem.store.snapshot.image`` keeps them).
TURN_ROW_QUERY = (
    "SELECT session_id, turn_id, seq, speaker, text, event_time, metadata "
    "FROM turns WHERE conversation_id = ? ORDER BY seq, turn_id"
)


def load_turns(con: duckdb.DuckDBPyConnection, conversation_id: str) -> tuple[Turn, ...]:
    """All turns of a conversation in conversation order."""
    return turns_from_rows(conversation_id, con.execute(TURN_ROW_QUERY, [conversation_id]).fetchall())


def turns_from_rows(conversation_id: str, rows: Sequence[Sequence[Any]]) -> tuple[Turn, ...]:
    """Turns from rows of :data:`TURN_ROW_QUERY` (event times as aware datetimes, metadata as JSON text)."""
    return tuple(
        Turn(
            conversation_id=conversation_id, session_id=r[0], turn_id=r[1], seq=int(r[2]), speaker=r[3], text=r[4],
            event_time=r[5], metadata=_metadata(r[6]),
        )
        for r in rows
    )


def _metadata(raw: str | None) -> dict[str, str]:
    if not raw:
        return {}
    data = json.loads(raw)
    return {str(k): str(v) for k, v in data.items()} if isinstance(data, dict) else {}

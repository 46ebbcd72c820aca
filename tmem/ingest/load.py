"""Ingest archives into a store: read and validate every file, plan, then write once.

Nothing is written unless every input parses and validates and the plan finds no conflict with
what is stored; the whole command is one DuckDB transaction (see
:mod:`tmem.store.ingest_writer`).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import asdict, dataclass
from datetime import UTC, datetime
from pathlib import Path
from typing import TYPE_CHECKING

from tmem.errors import IngestError
from tmem.ingest.archive import SOURCE_FORMATS, ParsedArchive, SourceFormat, read_text, shown
from tmem.ingest.frames import archive_frames, plan_ingest
from tmem.ingest.jsonl import parse_jsonl_text
from tmem.ingest.locomo import parse_locomo_text
from tmem.store.ingest_writer import ingest_transaction
from tmem.store.tombstones import Tombstone

if TYPE_CHECKING:
    import duckdb

SUFFIX_FORMATS: dict[str, SourceFormat] = {".json": "locomo", ".jsonl": "jsonl", ".ndjson": "jsonl"}


@dataclass(frozen=True)
class IngestReport:
    """What the archives hold (``conversations`` … ``qa``) and what this ingest added (``new_*``)."""

    files: tuple[str, ...]
    conversations: int
    sessions: int
    turns: int
    qa: int
    new_conversations: int
    updated_conversations: int
    new_sessions: int
    new_turns: int
    new_qa: int

    def as_dict(self) -> dict[str, object]:
        out = asdict(self)
        out["files"] = list(self.files)
        return out


def _check_forgotten(archives: Sequence[ParsedArchive], refused: Sequence[Tombstone], allow: bool) -> None:
    """Raise IngestError for the first forgotten conversation the archives bring back (unless
    ``allow``; a forget still in progress is refused even then)."""
    blocking = [t for t in refused if t.in_progress or not allow]
    if not blocking:
        return
    stone = blocking[0]
    archive = next(a for a in archives if stone.conversation_id in a.records.conversations)
    when = stone.forgotten_at.astimezone(UTC).strftime("%Y-%m-%dT%H:%M:%SZ")
    if stone.in_progress:
        reason = (f"conversation {shown(stone.conversation_id)} is being forgotten (tmem forget started {when}); "
                  "finish it with `tmem forget --resume` before ingesting it again")
    else:
        reason = (f"conversation {shown(stone.conversation_id)} was forgotten at {when} (tmem forget); "
                  "pass --allow-forgotten to ingest it again")
    raise IngestError(archive.path, archive.records.conversations[stone.conversation_id], reason)


def detect_format(path: Path, text: str | None = None) -> SourceFormat:
    """By extension (``.json`` → LoCoMo, ``.jsonl``/``.ndjson`` → generic), else by the first character."""
    by_suffix = SUFFIX_FORMATS.get(path.suffix.lower())
    if by_suffix is not None:
        return by_suffix
    head = (text if text is not None else read_text(path)).lstrip()[:1]
    if head == "[":
        return "locomo"
    if head == "{":
        return "jsonl"
    raise IngestError(
        str(path),
        "file",
        "cannot tell the archive format: expected a JSON array (LoCoMo) or JSON Lines objects; "
        "name the file .json or .jsonl, or pass the format explicitly",
    )


def read_archive(path: Path, source_format: SourceFormat | None = None) -> ParsedArchive:
    """Read and validate one archive file; the format is detected unless given."""
    path = Path(path)
    text = read_text(path)
    fmt = source_format or detect_format(path, text)
    if fmt not in SOURCE_FORMATS:
        raise ValueError(f"unknown archive format {fmt!r}; expected one of {SOURCE_FORMATS}")
    if fmt == "locomo":
        return parse_locomo_text(text, str(path))
    return parse_jsonl_text(text, str(path))


def read_archives(paths: Sequence[Path], source_format: SourceFormat | None = None) -> list[ParsedArchive]:
    """Read and validate every file; a conversation may appear in only one of them."""
    archives: list[ParsedArchive] = []
    seen: dict[str, str] = {}
    for path in paths:
        archive = read_archive(path, source_format)
        for conv in archive.conversations:
            cid = conv.conversation_id
            if cid in seen:
                raise IngestError(
                    archive.path,
                    archive.records.conversations[cid],
                    f"conversation {shown(cid)} also appears in {seen[cid]}; ingest these files in separate commands",
                )
            seen[cid] = archive.path
        archives.append(archive)
    return archives


def ingest_archives(
    paths: Sequence[Path], store: Path, *, now: datetime, source_format: SourceFormat | None = None,
    allow_forgotten: bool = False,
) -> IngestReport:
    """Validate every archive, then add what is new to ``store`` in one transaction.

    ``now`` is the record time written as ``ingested_at``/``updated_at`` (timezone-aware).
    Raises IngestError (and writes nothing) on any malformed input or conflicting change, and for
    a conversation ``tmem forget`` erased, unless ``allow_forgotten`` readmits it.
    """
    if not paths:
        raise ValueError("no archive paths given")
    return ingest_parsed(read_archives(paths, source_format), store, now=now, allow_forgotten=allow_forgotten)


def ingest_parsed(
    archives: Sequence[ParsedArchive], store: Path, *, now: datetime, con: duckdb.DuckDBPyConnection | None = None,
    allow_forgotten: bool = False,
) -> IngestReport:
    """Write already validated archives into ``store`` (see :func:`ingest_archives`), through
    ``con`` when given (an open connection to the working database, e.g. the builder's). A forgotten
    conversation (a tombstone) is refused unless ``allow_forgotten``."""
    if now.tzinfo is None:
        raise ValueError("now must be timezone-aware")
    frames = archive_frames(archives)
    with ingest_transaction(store, con) as tx:
        _check_forgotten(archives, tx.refused(frames.conversation_ids), allow_forgotten)
        plan, counts = plan_ingest(frames, tx.stored_state(frames.conversation_ids), now)
        tx.write(plan)
        if allow_forgotten:
            tx.readmit(frames.conversation_ids, now)
    return IngestReport(
        files=tuple(a.path for a in archives),
        conversations=frames.conversations.height,
        sessions=frames.sessions.height,
        turns=frames.turns.height,
        qa=frames.qa.height,
        new_conversations=counts.new_conversations,
        updated_conversations=counts.updated_conversations,
        new_sessions=counts.new_sessions,
        new_turns=counts.new_turns,
        new_qa=counts.new_qa,
    )

"""Archive ingest: parse and validate LoCoMo JSON and tmem JSON Lines, then add new turns to a store.

Formats are specified in docs/ingest-formats.md. The entry point is :func:`ingest_archives`;
the readers return :class:`ParsedArchive` objects holding frozen domain conversations.
"""

from tmem.ingest.archive import SOURCE_FORMATS, ParsedArchive, RecordIndex, SourceFormat, parse_iso_timestamp
from tmem.ingest.frames import IngestFrames, PlanCounts, archive_frames, plan_ingest
from tmem.ingest.jsonl import parse_jsonl_text, read_jsonl
from tmem.ingest.load import IngestReport, detect_format, ingest_archives, ingest_parsed, read_archive, read_archives
from tmem.ingest.locomo import (
    TURN_SPACING,
    parse_locomo,
    parse_locomo_datetime,
    parse_locomo_text,
    read_locomo,
    render_turn_text,
)

__all__ = [
    "SOURCE_FORMATS",
    "TURN_SPACING",
    "IngestFrames",
    "IngestReport",
    "ParsedArchive",
    "PlanCounts",
    "RecordIndex",
    "SourceFormat",
    "archive_frames",
    "detect_format",
    "ingest_archives",
    "ingest_parsed",
    "parse_iso_timestamp",
    "parse_jsonl_text",
    "parse_locomo",
    "parse_locomo_datetime",
    "parse_locomo_text",
    "plan_ingest",
    "read_archive",
    "read_archives",
    "read_jsonl",
    "read_locomo",
    "render_turn_text",
]

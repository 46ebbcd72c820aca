"""What a parsed archive is, and the checked field access both archive parsers share.

Every failure raises :class:`~tmem.errors.IngestError` naming the file, the record (``line N``
for JSON Lines, a JSON pointer such as ``/0/conversation/session_3/4/speaker`` for JSON) and
the reason, so that the message alone says what to fix.
"""

from __future__ import annotations

import json
import math
import re
from collections.abc import Callable
from dataclasses import dataclass, field
from datetime import UTC, datetime
from pathlib import Path
from typing import Any, Literal

from tmem.domain import Conversation
from tmem.errors import IngestError

SourceFormat = Literal["locomo", "jsonl"]
SOURCE_FORMATS: tuple[SourceFormat, ...] = ("locomo", "jsonl")
ROOT = "(root)"
MAX_INT_DIGITS = 100  # a longer integer is no id, count or category: refuse it (CPython refuses > 4300 anyway)
MAX_NESTING_SHOWN = 100  # depth named when a document nests deeper than the decoder can follow
INT64_RANGE = (-(2**63), 2**63 - 1)
SHOWN_CHARS = 80  # values echoed in an error message are cut to this many characters
_SURROGATE = re.compile(r"[\ud800-\udfff]")


@dataclass(frozen=True)
class RecordIndex:
    """Where each parsed object came from, so later checks (against the store) can name it."""

    conversations: dict[str, str] = field(default_factory=dict)
    turns: dict[tuple[str, str], str] = field(default_factory=dict)
    qa: dict[tuple[str, int], str] = field(default_factory=dict)


@dataclass(frozen=True)
class ParsedArchive:
    """One archive file, fully parsed and validated on its own."""

    path: str
    source_format: SourceFormat
    conversations: tuple[Conversation, ...]
    records: RecordIndex


class JsonObject(dict[str, Any]):
    """A decoded JSON object that remembers keys the file repeated (plain ``json`` keeps the last)."""

    duplicate_keys: tuple[str, ...] = ()


def _object_pairs(pairs: list[tuple[str, Any]]) -> JsonObject:
    obj = JsonObject()
    duplicates: list[str] = []
    for key, value in pairs:
        if key in obj:
            duplicates.append(key)
        obj[key] = value
    if duplicates:
        obj.duplicate_keys = tuple(duplicates)
    return obj


class InvalidJson(ValueError):
    """The text is not a JSON document tmem accepts; ``line``/``column`` are 1-based when known."""

    def __init__(self, reason: str, line: int | None = None, column: int | None = None) -> None:
        super().__init__(reason)
        self.reason = reason
        self.line = line
        self.column = column


def _refuse_constant(name: str) -> Any:
    raise InvalidJson(f"{name} is not a JSON value")


def _bounded_int(digits: str) -> int:
    if len(digits.lstrip("-")) > MAX_INT_DIGITS:
        raise InvalidJson(f"an integer with {len(digits.lstrip('-'))} digits is too long (at most {MAX_INT_DIGITS})")
    return int(digits)


def _finite_float(text: str) -> float:
    value = float(text)
    if not math.isfinite(value):
        raise InvalidJson(f"number {shown(text)} is out of range")
    return value


def decode_json(text: str) -> Any:
    """Strict ``json.loads``: tracks repeated object keys (see :class:`JsonObject`), refuses NaN and
    Infinity (not JSON), over-long integers, out-of-range floats and nesting deeper than the decoder
    can follow. Every refusal is an :class:`InvalidJson`."""
    try:
        return json.loads(
            text,
            object_pairs_hook=_object_pairs,
            parse_constant=_refuse_constant,
            parse_int=_bounded_int,
            parse_float=_finite_float,
        )
    except json.JSONDecodeError as exc:
        raise InvalidJson(exc.msg, exc.lineno, exc.colno) from None
    except RecursionError:
        line, column = _deep_position(text, MAX_NESTING_SHOWN)
        raise InvalidJson(f"nested too deeply (past {MAX_NESTING_SHOWN} levels here)", line, column) from None


def _deep_position(text: str, depth: int) -> tuple[int | None, int | None]:
    """Line and column where the nesting of ``text`` first exceeds ``depth`` (only run on error)."""
    level, in_string, escaped = 0, False, False
    for offset, char in enumerate(text):
        if in_string:
            if escaped:
                escaped = False
            elif char == "\\":
                escaped = True
            elif char == '"':
                in_string = False
        elif char == '"':
            in_string = True
        elif char in "[{":
            level += 1
            if level > depth:
                line = text.count("\n", 0, offset) + 1
                return line, offset - (text.rfind("\n", 0, offset) + 1) + 1
        elif char in "]}":
            level -= 1
    return None, None


def read_text(path: Path) -> str:
    """The file's text (UTF-8, an optional BOM is dropped), or an IngestError naming why not."""
    where = str(path)
    if not path.exists():
        raise IngestError(where, "file", "no such file")
    if path.is_dir():
        raise IngestError(where, "file", "is a directory, not an archive file")
    try:
        raw = path.read_bytes()
    except OSError as exc:
        raise IngestError(where, "file", f"cannot read: {exc.strerror or exc}") from exc
    try:
        return raw.decode("utf-8-sig")
    except UnicodeDecodeError as exc:
        line = raw[: exc.start].count(b"\n") + 1
        raise IngestError(where, f"line {line}", f"not UTF-8 text (byte offset {exc.start})") from exc


def pointer_token(key: str | int) -> str:
    """One JSON-pointer reference token (RFC 6901 escaping)."""
    return str(key).replace("~", "~0").replace("/", "~1")


def parse_iso_timestamp(value: str) -> datetime:
    """An ISO 8601 timestamp with a UTC offset. Raises ValueError with a readable reason."""
    text = value.strip()
    if not text:
        raise ValueError("timestamp is empty")
    try:
        parsed = datetime.fromisoformat(text)
    except ValueError:
        raise ValueError(f"timestamp {shown(value)} is not ISO 8601 (e.g. 2024-05-01T09:30:00+02:00)") from None
    if parsed.tzinfo is None or parsed.utcoffset() is None:
        raise ValueError(f"timestamp {shown(value)} has no UTC offset; add one, e.g. 'Z' or '+02:00'")
    try:
        parsed.astimezone(UTC)
    except OverflowError:
        raise ValueError(f"timestamp {shown(value)} is outside the years 1-9999 in UTC") from None
    return parsed


def shown(value: object) -> str:
    """``repr(value)`` cut to :data:`SHOWN_CHARS`, for echoing archive values in error messages."""
    text = repr(value)
    return text if len(text) <= SHOWN_CHARS else text[: SHOWN_CHARS - 1] + "…"


def unicode_problem(value: str) -> str | None:
    """Why ``value`` cannot be stored as UTF-8 text (a lone surrogate from a ``\\ud800`` escape), or None."""
    bad = _SURROGATE.search(value)
    if bad is None:
        return None
    return f"holds an unpaired surrogate \\u{ord(bad.group()):04x} (not valid Unicode) at character {bad.start()}"


@dataclass(frozen=True)
class Fields:
    """Checked access to the fields of one JSON object at a known place in a file.

    ``record`` is where the object sits (``line 4`` or a JSON pointer); with ``pointer=True``
    a field's own location is the pointer extended by the field name.
    """

    path: str
    record: str
    obj: dict[str, Any]
    pointer: bool

    @classmethod
    def of(cls, value: object, path: str, record: str, *, pointer: bool, what: str = "record") -> Fields:
        if not isinstance(value, dict):
            raise IngestError(path, display(record), f"{what} must be a JSON object, got {json_type(value)}")
        if isinstance(value, JsonObject) and value.duplicate_keys:
            key = value.duplicate_keys[0]
            where = child(record, key) if pointer else record
            raise IngestError(path, display(where), f"duplicate key {key!r} in one JSON object")
        return cls(path, record, value, pointer)

    def where(self, key: str | int | None = None) -> str:
        if key is None or not self.pointer:
            return display(self.record)
        return child(self.record, key)

    def error(self, reason: str, key: str | int | None = None) -> IngestError:
        return IngestError(self.path, self.where(key), reason)

    def has(self, key: str) -> bool:
        return key in self.obj

    def string(self, key: str, *, empty_ok: bool = False) -> str:
        """A required string field; empty (or all-space) strings are refused unless ``empty_ok``."""
        if key not in self.obj:
            raise self.error(f"missing required field {key!r}", key)
        return self._check_string(key, self.obj[key], empty_ok=empty_ok)

    def optional_string(self, key: str, *, empty_ok: bool = True) -> str | None:
        if key not in self.obj or self.obj[key] is None:
            return None
        return self._check_string(key, self.obj[key], empty_ok=empty_ok)

    def _check_string(self, key: str, value: object, *, empty_ok: bool) -> str:
        if not isinstance(value, str):
            raise self.error(f"field {key!r} must be a string, got {json_type(value)}", key)
        problem = unicode_problem(value)
        if problem is not None:
            raise self.error(f"field {key!r} {problem}", key)
        if not empty_ok and not value.strip():
            raise self.error(f"field {key!r} must not be empty", key)
        return value

    def string_list(self, key: str, *, required: bool = True, empty_ok: bool = True) -> list[str] | None:
        """A list of strings; each element's location is reported on error."""
        if key not in self.obj or self.obj[key] is None:
            if required:
                raise self.error(f"missing required field {key!r}", key)
            return None
        value = self.obj[key]
        if not isinstance(value, list):
            raise self.error(f"field {key!r} must be a list of strings, got {json_type(value)}", key)
        for i, element in enumerate(value):
            where = child(self.where(key), i) if self.pointer else self.record
            if not isinstance(element, str):
                raise IngestError(self.path, where, f"{key}[{i}] must be a string, got {json_type(element)}")
            problem = unicode_problem(element)
            if problem is not None:
                raise IngestError(self.path, where, f"{key}[{i}] {problem}")
        if not empty_ok and not value:
            raise self.error(f"field {key!r} must not be an empty list", key)
        return list(value)

    def integer(self, key: str) -> int:
        if key not in self.obj:
            raise self.error(f"missing required field {key!r}", key)
        value = self.obj[key]
        # bool is an int in Python but not in JSON's eyes.
        if isinstance(value, bool) or not isinstance(value, int):
            raise self.error(f"field {key!r} must be an integer, got {json_type(value)}", key)
        if not INT64_RANGE[0] <= value <= INT64_RANGE[1]:
            raise self.error(f"field {key!r} is out of range (a 64-bit integer)", key)
        return value

    def timestamp(self, key: str, parse: Callable[[str], datetime] = parse_iso_timestamp) -> datetime:
        raw = self.string(key)
        try:
            return parse(raw)
        except ValueError as exc:
            raise self.error(f"field {key!r}: {exc}", key) from None


def child(record: str, key: str | int) -> str:
    """The JSON pointer of ``key`` under ``record`` (``record`` may be the root, ``""``)."""
    base = "" if record == ROOT else record
    return f"{base}/{pointer_token(key)}"


def display(record: str) -> str:
    return record if record else ROOT


def json_type(value: object) -> str:
    """The JSON name of a decoded value's type, for error messages."""
    if value is None:
        return "null"
    if isinstance(value, bool):
        return "boolean"
    if isinstance(value, int | float):
        return "number"
    if isinstance(value, str):
        return "string"
    if isinstance(value, list):
        return "array"
    if isinstance(value, dict):
        return "object"
    return type(value).__name__

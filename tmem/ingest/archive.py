"""What a parsed archive is, and the checked field access both archive parsers share.

Every failure raises :class:`~tmem.errors.IngestError` naming the file, the record (``line N``
for JSON Lines, a JSON pointer such as ``/0/conversation/session_3/4/speaker`` for JSON) and
the reason, so that the message alone says what to fix.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from dataclasses import dataclass, field
from datetime import datetime
from pathlib import Path
from typing import Any, Literal

from tmem.domain import Conversation
from tmem.errors import IngestError

SourceFormat = Literal["locomo", "jsonl"]
SOURCE_FORMATS: tuple[SourceFormat, ...] = ("locomo", "jsonl")
ROOT = "(root)"


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


def decode_json(text: str) -> Any:
    """``json.loads`` that keeps track of repeated object keys (see :class:`JsonObject`)."""
    return json.loads(text, object_pairs_hook=_object_pairs)


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
        raise ValueError(f"timestamp {value!r} is not ISO 8601 (e.g. 2024-05-01T09:30:00+02:00)") from None
    if parsed.tzinfo is None or parsed.utcoffset() is None:
        raise ValueError(f"timestamp {value!r} has no UTC offset; add one, e.g. 'Z' or '+02:00'")
    return parsed


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
            if not isinstance(element, str):
                where = child(self.where(key), i) if self.pointer else self.record
                raise IngestError(self.path, where, f"{key}[{i}] must be a string, got {json_type(element)}")
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

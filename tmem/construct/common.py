"""Helpers shared by the construction stages: checked asks, batching, text and date normalising."""

from __future__ import annotations

import re
from collections.abc import Callable, Iterable, Iterator, Sequence
from dataclasses import dataclass
from datetime import datetime
from typing import Literal, TypeVar

from pydantic import BaseModel

from tmem.errors import ValidationFailure
from tmem.ports import ChatModel
from tmem.prompts.base import Prompt

P = TypeVar("P", bound=BaseModel)
R = TypeVar("R", bound=BaseModel)
T = TypeVar("T")

DEFAULT_REASKS = 1


class Rejected(Exception):
    """Raised by a check when an answer parses but contradicts its input; carries the reason."""

    def __init__(self, reason: str) -> None:
        self.reason = reason
        super().__init__(reason)


def ask_checked(
    chat: ChatModel,
    build: Callable[[P, str | None], Prompt[R]],
    payload: P,
    check: Callable[[R], T],
    *,
    reasks: int = DEFAULT_REASKS,
) -> T:
    """Ask, check the answer against the input, and re-ask with the reason up to ``reasks`` times.

    The re-ask carries the rejection reason in its messages, so it has a cache key of its own
    (a cached bad answer cannot be served again). When every attempt is rejected, raise
    :class:`ValidationFailure` naming the operation, the input and the last reason.
    """
    feedback: str | None = None
    failure: ValidationFailure | None = None
    for _ in range(reasks + 1):
        prompt = build(payload, feedback)
        answer = chat.complete(prompt)
        try:
            return check(answer)
        except Rejected as rejected:
            feedback = rejected.reason
            failure = ValidationFailure(
                prompt.operation, prompt.input_ref, rejected.reason, raw_output=answer.model_dump_json(),
                input_digest=prompt.input_digest(), input_excerpt=prompt.input_excerpt(),
            )
    assert failure is not None  # the loop ran at least once
    raise failure


def batched(values: Sequence[T], size: int) -> Iterator[Sequence[T]]:
    if size < 1:
        raise ValueError(f"batch size must be >= 1, got {size}")
    for start in range(0, len(values), size):
        yield values[start : start + size]


_SPACE = re.compile(r"\s+")


def clean(text: str) -> str:
    return _SPACE.sub(" ", text).strip()


def unique_phrases(phrases: Iterable[str], limit: int | None = None) -> tuple[str, ...]:
    """Whitespace-normalised, non-empty, case-insensitively unique, first spelling kept."""
    seen: set[str] = set()
    kept: list[str] = []
    for phrase in phrases:
        text = clean(phrase)
        key = text.casefold()
        if text and key not in seen:
            seen.add(key)
            kept.append(text)
            if limit is not None and len(kept) >= limit:
                break
    return tuple(kept)


_ISO_DATE = re.compile(r"^\s*(\d{4})-(\d{2})-(\d{2})")
_WHEN_DAY = re.compile(r"(\d{4})-(\d{2})-(\d{2})(?:[T ][\d:.]+)?")
_WHEN_MONTH = re.compile(r"(\d{4})-(\d{2})")
_WHEN_YEAR = re.compile(r"(\d{4})")


@dataclass(frozen=True)
class ModelTime:
    """A time expression of a model's answer: start (and end of a span) at a granularity."""

    start: datetime
    end: datetime | None
    granularity: Literal["day", "month", "year", "span"]


def _day(match: re.Match[str], like: datetime) -> datetime | None:
    try:
        return datetime(int(match[1]), int(match[2]), int(match[3]), tzinfo=like.tzinfo)
    except ValueError:
        return None


def parse_model_when(value: str | None, like: datetime) -> ModelTime | None:
    """``YYYY-MM-DD`` (a day), ``YYYY-MM`` (a month), ``YYYY`` (a year) or ``START/END`` (a span of
    days, in order; equal ends read as the day) in ``like``'s time zone; ``None`` when absent or
    not a real time."""
    text = (value or "").strip()
    if not text:
        return None
    if "/" in text:
        first, _, last = (part.strip() for part in text.partition("/"))
        a, b = _WHEN_DAY.fullmatch(first), _WHEN_DAY.fullmatch(last)
        start, end = (_day(a, like) if a else None), (_day(b, like) if b else None)
        if start is None or end is None or end < start:
            return None
        return ModelTime(start, None, "day") if end == start else ModelTime(start, end, "span")
    if (day := _WHEN_DAY.fullmatch(text)) is not None:
        parsed = _day(day, like)
        return ModelTime(parsed, None, "day") if parsed else None
    if (month := _WHEN_MONTH.fullmatch(text)) is not None:
        if not 1 <= int(month[2]) <= 12:
            return None
        return ModelTime(datetime(int(month[1]), int(month[2]), 1, tzinfo=like.tzinfo), None, "month")
    if (year := _WHEN_YEAR.fullmatch(text)) is not None:
        return ModelTime(datetime(int(year[1]), 1, 1, tzinfo=like.tzinfo), None, "year")
    return None


def parse_model_date(value: str | None, like: datetime) -> datetime | None:
    """A model's ``YYYY-MM-DD`` (optionally followed by a time, which is ignored) as midnight of
    that day in ``like``'s time zone; ``None`` when absent or not a real date."""
    if not value:
        return None
    match = _ISO_DATE.match(value)
    if match is None:
        return None
    try:
        return datetime(int(match[1]), int(match[2]), int(match[3]), tzinfo=like.tzinfo)
    except ValueError:
        return None


def local_refs(prefix: str, values: Sequence[T]) -> dict[str, T]:
    """Short prompt refs (``S1``, ``S2``...) standing for long ids or objects, in order: ref -> value.

    Models copy ``S3`` far more reliably than a 20-character hash id.
    """
    return {f"{prefix}{n}": value for n, value in enumerate(values, start=1)}


def check_refs(operation_what: str, answered: Sequence[str], expected: Sequence[str]) -> None:
    """Every expected ref answered exactly once, nothing else: raise :class:`Rejected` otherwise."""
    unknown = [ref for ref in answered if ref not in expected]
    if unknown:
        raise Rejected(f"unknown {operation_what} refs {unknown}; the input has {list(expected)}.")
    duplicated = sorted({ref for ref in answered if answered.count(ref) > 1})
    if duplicated:
        raise Rejected(f"{operation_what} refs {duplicated} were answered more than once.")
    missing = [ref for ref in expected if ref not in answered]
    if missing:
        raise Rejected(f"no answer for {operation_what} refs {missing}; answer every one of them.")

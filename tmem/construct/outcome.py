"""What a construction stage returns besides what it built: typed notes and quarantined units.

A capable model's answers are sometimes longer than the completion budget, longer lists than
asked, or inconsistent in a small way. The stages repair what can be repaired without a call and
say so, instead of failing the conversation:

* ``clipped``: a list longer than its stated limit was cut to the limit;
* ``reclassified``: an item whose source count contradicts its kind changed kind;
* ``dropped_ref``: a cited ref that is not part of the input was removed (an item left with none
  was dropped);
* ``split``: an answer was cut at its budget (:class:`~tmem.errors.LLMTruncatedError`), so the
  input was asked in halves — deterministic halves, so a rerun meets the response cache;
* ``quarantined``: a unit's answer stayed invalid after the adapter's repair, the stage's checked
  re-asks and the splits. Only that unit is left out (one topic chunk's items, one item's or one
  scene's triggers, one speaker's persona) and recorded as a :class:`QuarantinedUnit`.

Everything is returned (:class:`StageOutcome`), never kept in a global. A :class:`StageLog` is the
accumulator of one stage call. With ``isolate=False`` (the strict mode of the plain stage
functions) a unit's failure is raised instead of quarantined; truncations are split in both modes.
Transport errors and rejected requests are never caught here.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from typing import Generic, Literal, TypeVar, get_args

from tmem.errors import LLMOutputError, LLMTruncatedError
from tmem.ids import content_hash

T = TypeVar("T")
H = TypeVar("H")
V = TypeVar("V")

NoteKind = Literal["clipped", "reclassified", "dropped_ref", "split", "quarantined"]
NOTE_KINDS: tuple[NoteKind, ...] = get_args(NoteKind)
# What a quarantined unit is the part of: a topic (one chunk of its scenes), an item, a scene, a speaker.
UnitKind = Literal["topic_chunk", "item", "scene", "speaker"]


@dataclass(frozen=True)
class BuildNote:
    operation: str
    input_ref: str
    kind: NoteKind
    detail: str


@dataclass(frozen=True)
class QuarantinedUnit:
    """A unit left out of the memory: what it is, the input that failed, the answer and the reason."""

    operation: str
    unit_kind: UnitKind
    unit_id: str  # topic id, item id, scene id or speaker
    input_ref: str
    input_digest: str
    input_excerpt: str | None
    raw_output: str | None
    reason: str
    error_type: str

    @classmethod
    def of(cls, unit_kind: UnitKind, unit_id: str, exc: LLMOutputError) -> QuarantinedUnit:
        return cls(
            operation=exc.operation, unit_kind=unit_kind, unit_id=unit_id, input_ref=exc.input_ref,
            input_digest=exc.input_digest or content_hash(exc.operation, exc.input_ref),
            input_excerpt=exc.input_excerpt, raw_output=exc.raw_output, reason=exc.reason,
            error_type=type(exc).__name__,
        )


@dataclass(frozen=True)
class StageOutcome(Generic[T]):
    value: T
    notes: tuple[BuildNote, ...] = ()
    quarantined: tuple[QuarantinedUnit, ...] = ()


class StageLog:
    """Notes and quarantined units of one stage call."""

    def __init__(self, *, isolate: bool) -> None:
        self.isolate = isolate
        self.notes: list[BuildNote] = []
        self.quarantined: list[QuarantinedUnit] = []

    def note(self, operation: str, input_ref: str, kind: NoteKind, detail: str) -> None:
        self.notes.append(BuildNote(operation, input_ref, kind, detail))

    def extend(self, notes: Iterable[BuildNote]) -> None:
        self.notes.extend(notes)

    def quarantine(self, unit_kind: UnitKind, unit_id: str, exc: LLMOutputError) -> None:
        """Leave the unit out (isolating) or raise ``exc`` (strict)."""
        if not self.isolate:
            raise exc
        self.quarantined.append(QuarantinedUnit.of(unit_kind, unit_id, exc))
        self.note(exc.operation, exc.input_ref, "quarantined", f"{unit_kind} {unit_id}: {exc.reason}")

    def outcome(self, value: T) -> StageOutcome[T]:
        return StageOutcome(value, tuple(self.notes), tuple(self.quarantined))


def ask_in_halves(
    hosts: Sequence[H],
    ask: Callable[[Sequence[H]], V],
    on_failure: Callable[[Sequence[H], LLMOutputError], None],
    log: StageLog,
    *,
    what: str,
    split_failures: bool = False,
) -> list[V]:
    """``ask(hosts)``; when its answer was cut at the budget, ask each half (recursively, down to
    one host) and note the split. With ``split_failures`` any invalid output of a group of several
    hosts is split too, to find the host(s) at fault. A failure that is not split goes to
    ``on_failure(group, error)``, which quarantines or raises. The answers, in host order."""
    try:
        return [ask(hosts)]
    except LLMOutputError as exc:
        truncated = isinstance(exc, LLMTruncatedError)
        if len(hosts) < 2 or not (truncated or split_failures):
            on_failure(hosts, exc)
            return []
        middle = len(hosts) // 2
        cause = "answer cut at its budget" if truncated else f"invalid answer ({type(exc).__name__})"
        log.note(exc.operation, exc.input_ref, "split",
                 f"{cause}: {len(hosts)} {what} asked again as {middle} + {len(hosts) - middle}")
    first = ask_in_halves(hosts[:middle], ask, on_failure, log, what=what, split_failures=split_failures)
    return first + ask_in_halves(hosts[middle:], ask, on_failure, log, what=what, split_failures=split_failures)


def clip(values: Sequence[T], limit: int, log: StageLog, operation: str, input_ref: str, what: str) -> list[T]:
    """``values`` cut to ``limit`` entries; a cut is noted (``clipped``)."""
    if len(values) <= limit:
        return list(values)
    log.note(operation, input_ref, "clipped", f"{what}: {len(values)} entries, kept the first {limit}")
    return list(values[:limit])

"""The stage units of one conversation's build: content-keyed results, retries, progress events.

A unit is one call of a construction stage (:mod:`tmem.construct`) on one input: a conversation's
segmentation or topic admission, one topic's items, one batch of item or scene triggers, one
speaker's persona. :class:`ConversationStages` runs a unit so that

* a unit whose result is in the stage cache (:mod:`tmem.store.stage_cache`, keyed by the unit's
  stage, its content inputs and the build fingerprint) is not run at all: a warm rebuild, a resumed
  build and the unchanged parts of a grown conversation cost no call and no recomputation;
* a unit that raises is run again, ``RETRIES`` times with the delays of ``RETRY_DELAYS_S`` (what a
  Prefect task retry did per stage task): the adapter has already retried transient HTTP errors
  and repaired invalid answers by then, so this is the stage's own bounded second chance;
* its outcome (notes, quarantined units) is kept for the conversation's report; an outcome that
  quarantined a unit is not cached, so the next build runs that unit again;
* the observer hears of each stage as it finishes and of each retry (the Prefect task logs them:
  that is how a conversation's stages show in the UI).

Units off the serial path run in a thread pool of their own per conversation (``fanout``
threads), as the stage tasks of a conversation's subflow did.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable, Iterable
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Generic, Protocol, TypeVar

from pydantic import TypeAdapter

from tmem.construct import BuildNote, QuarantinedUnit, StageOutcome
from tmem.ports import conversation_scope
from tmem.store.stage_cache import stage_key

if TYPE_CHECKING:
    from tmem.build.runtime import BuildRuntime

T = TypeVar("T")
log = logging.getLogger(__name__)

RETRIES = 2
RETRY_DELAYS_S: tuple[float, ...] = (2.0, 10.0)


@dataclass(frozen=True)
class StageEvent:
    """One stage of one conversation finished: how many units, how many came from the cache."""

    conversation_id: str
    stage: str  # segment | topics | items | item-triggers | scene-triggers | persona | embed
    units: int
    cached: int
    seconds: float  # from the first unit's start to the last unit's end
    detail: str  # what it built, e.g. "12 scenes"


class StageObserver(Protocol):
    def stage_done(self, event: StageEvent) -> None: ...

    def stage_retry(self, conversation_id: str, stage: str, unit: str, attempt: int, error: BaseException,
                    delay_s: float) -> None: ...


class LogObserver:
    """Reports to a standard :mod:`logging` logger (the default: no Prefect in the library)."""

    def __init__(self, logger: logging.Logger | logging.LoggerAdapter[logging.Logger] = log) -> None:
        self.logger = logger

    def stage_done(self, event: StageEvent) -> None:
        cached = f", {event.cached} of {event.units} from the stage cache" if event.cached else ""
        self.logger.info("%s: %s in %.2f s (%d unit%s%s)", event.stage, event.detail, event.seconds, event.units,
                         "" if event.units == 1 else "s", cached)

    def stage_retry(self, conversation_id: str, stage: str, unit: str, attempt: int, error: BaseException,
                    delay_s: float) -> None:
        self.logger.warning("%s %s failed (attempt %d of %d), retrying in %.0f s: %s: %s", stage, unit, attempt,
                            RETRIES + 1, delay_s, type(error).__name__, str(error)[:300])


@dataclass(frozen=True)
class Codec(Generic[T]):
    """How a stage's outcome value is kept in the stage cache (JSON through pydantic)."""

    value: TypeAdapter[T]

    def encode(self, outcome: StageOutcome[T]) -> dict[str, Any]:
        return {"value": self.value.dump_python(outcome.value, mode="json"),
                "notes": _NOTES.dump_python(outcome.notes, mode="json")}

    def encode_json(self, outcome: StageOutcome[T]) -> bytes:
        """:meth:`encode` as compact JSON, serialised by pydantic in one pass (no Python objects)."""
        return (b'{"value":' + self.value.dump_json(outcome.value) + b',"notes":' + _NOTES.dump_json(outcome.notes)
                + b"}")

    def decode(self, raw: dict[str, Any]) -> StageOutcome[T]:
        return StageOutcome(self.value.validate_python(raw["value"]), _NOTES.validate_python(raw["notes"]))


_NOTES: TypeAdapter[tuple[BuildNote, ...]] = TypeAdapter(tuple[BuildNote, ...])


@dataclass(frozen=True)
class Unit(Generic[T]):
    """One unit: its stage, a name for logs, its content inputs (the cache key) and how to run it."""

    stage: str
    name: str
    inputs: dict[str, Any]
    run: Callable[[], StageOutcome[T]]
    codec: Codec[T] | None  # None: never cached (embedding: the embedding cache answers it)


class ConversationStages:
    """Runs the units of one conversation (a context manager: the fan-out pool lives inside it)."""

    def __init__(self, rt: BuildRuntime, conversation_id: str, observer: StageObserver, *, fanout: int,
                 sleep: Callable[[float], None] = time.sleep) -> None:
        self.rt = rt
        self.conversation_id = conversation_id
        self.observer = observer
        self._sleep = sleep
        self._pool = ThreadPoolExecutor(max_workers=max(1, fanout), thread_name_prefix=f"tmem-{conversation_id[:20]}")
        self._lock = threading.Lock()
        self.outcomes: list[StageOutcome[Any]] = []

    def __enter__(self) -> ConversationStages:
        return self

    def __exit__(self, *exc: object) -> None:
        self._pool.shutdown(wait=True, cancel_futures=True)

    @property
    def notes(self) -> tuple[BuildNote, ...]:
        return tuple(n for o in self.outcomes for n in o.notes)

    @property
    def quarantined(self) -> tuple[QuarantinedUnit, ...]:
        return tuple(u for o in self.outcomes for u in o.quarantined)

    def run(self, unit: Unit[T], detail: Callable[[T], str]) -> T:
        """Run one unit here and report its stage."""
        started = time.perf_counter()
        outcome, hit = self._outcome(unit)
        self._done(unit.stage, 1, int(hit), started, detail(outcome.value))
        return outcome.value

    def submit(self, unit: Unit[T]) -> Future[tuple[StageOutcome[T], bool]]:
        return self._pool.submit(self._outcome, unit)

    def gather(self, stage: str, futures: Iterable[Future[tuple[StageOutcome[T], bool]]], started: float,
               detail: Callable[[list[T]], str]) -> list[T]:
        """The values of a stage's submitted units, in submission order; reports the stage."""
        done = [f.result() for f in futures]
        values = [o.value for o, _ in done]
        self._done(stage, len(done), sum(hit for _, hit in done), started, detail(values))
        return values

    def _outcome(self, unit: Unit[T]) -> tuple[StageOutcome[T], bool]:
        key = None
        if unit.codec is not None:
            key = stage_key(unit.stage, unit.inputs | {"conversation_id": self.conversation_id,
                                                        "fingerprint": self.rt.fingerprint})
            found = self.rt.stages.get(self.conversation_id, key, unit.codec.decode)
            if found is not None:
                return self._took(found), True
        outcome = self._with_retries(unit)
        if key is not None and unit.codec is not None and not outcome.quarantined:
            self.rt.stages.put_json(self.conversation_id, key, unit.stage, unit.codec.encode_json(outcome))
        return self._took(outcome), False

    def _with_retries(self, unit: Unit[T]) -> StageOutcome[T]:
        for attempt in range(1, RETRIES + 2):
            try:
                with conversation_scope(self.conversation_id):  # its calls' ledger rows name it (tmem forget)
                    return unit.run()
            except Exception as exc:  # any failure, as a Prefect task retry; the last attempt raises it
                if attempt > RETRIES:
                    raise
                delay = RETRY_DELAYS_S[min(attempt - 1, len(RETRY_DELAYS_S) - 1)]
                self.observer.stage_retry(self.conversation_id, unit.stage, unit.name, attempt, exc, delay)
                self._sleep(delay)
        raise AssertionError("unreachable: the last attempt returns or raises")

    def _took(self, outcome: StageOutcome[T]) -> StageOutcome[T]:
        with self._lock:
            self.outcomes.append(outcome)
        return outcome

    def _done(self, stage: str, units: int, cached: int, started: float, detail: str) -> None:
        self.observer.stage_done(StageEvent(self.conversation_id, stage, units, cached,
                                            time.perf_counter() - started, detail))

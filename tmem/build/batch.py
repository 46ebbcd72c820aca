"""Several conversations in one orchestration unit: how many per unit, and building them in turn.

An orchestrator's task run costs CPU of its own before the build starts (on a Dask worker, Prefect's
task engine spends ~0.2 s per task run: its context, a new API client, state round trips), which
for a nightly of one new session per conversation is more than the conversation's own work outside
the LLM and the encoder. A batch divides that cost: a unit builds its conversations in turn, each
exactly as a unit of one would (same stages, caches, notes, quarantine), the next one starting as
soon as the one before has only its embedding left (:func:`build_in_turn`), and reports every
conversation's outcome on its own — a failed conversation never fails its neighbours.

:func:`batch_size` keeps units small enough that every worker thread still draws several of them
(the last ones to finish decide the build's tail), and sends one conversation per unit whenever
the build is small enough to afford it.
"""

from __future__ import annotations

import contextvars
import logging
import math
import threading
import time
from collections.abc import Callable, Sequence
from typing import TypeVar

from tmem.errors import LLMError

log = logging.getLogger(__name__)

T = TypeVar("T")

UNITS_PER_SLOT = 4  # each worker thread draws about this many units of a batched build
# On a Dask worker a task run costs more than in the flow's threads (~0.1 s of the worker's CPU: Prefect
# rebuilds the flow run's context there, its settings from their sources, and opens two API clients, each
# with a new TLS context; ~0.04 s more in the flow process to submit it), so its slots draw fewer, larger units.
DASK_UNITS_PER_SLOT = 2
RETRY_DELAY_S = 5.0  # a conversation's one retry after an orchestration-side error, as its own task would wait


def batch_size(conversations: int, slots: int, configured: int = 0, per_slot: int = UNITS_PER_SLOT) -> int:
    """Conversations per unit: ``configured`` when set (> 0); else one while there are at most
    ``per_slot`` conversations per slot (a worker thread), and above that enough per unit for about
    ``per_slot`` units per slot (:data:`UNITS_PER_SLOT`; :data:`DASK_UNITS_PER_SLOT` on Dask)."""
    if configured > 0:
        return configured
    return max(1, math.ceil(conversations / (max(1, per_slot) * max(1, slots))))


def batches(conversation_ids: Sequence[str], size: int) -> list[list[str]]:
    """``conversation_ids`` in order, cut into runs of ``size`` (the last may be shorter)."""
    step = max(1, size)
    return [list(conversation_ids[n:n + step]) for n in range(0, len(conversation_ids), step)]


def retryable(error: BaseException) -> bool:
    """Whether a conversation's failure is worth a second attempt: not an LLM error, which reached
    here after its stage's own retries and the adapter's repairs (asking again is waste)."""
    return not isinstance(error, LLMError)


def build_in_turn(conversation_ids: Sequence[str], build: Callable[[str, Callable[[], None]], T], *,
                  sleep: Callable[[float], None] = time.sleep,
                  retry_delay_s: float = RETRY_DELAY_S) -> dict[str, T | Exception]:
    """Each conversation's outcome, in the order given: what ``build`` returned for it, or the exception
    that ended it after one retry of a :func:`retryable` failure. Finished stage units come from the
    stage cache, so a retry redoes only what was lost.

    ``build(cid, handed_over)`` calls ``handed_over()`` once the conversation's LLM work is done and
    only its embedding is left (:func:`tmem.build.conversation.build_conversation`): the next
    conversation starts then, in a thread of its own, rather than when the vectors come back. Built
    strictly one after another, every slot of a nightly waited on the encoder's queue with its LLM
    work stopped, then all sent the encoder nothing while they asked the LLM: the two took turns
    instead of overlapping (a 200-conversation nightly on Dask: the workers at 0.03 cores for tens of
    seconds while the encoders ran, the encoders at 0.2 while the workers ran). At most one
    conversation of a unit is in its LLM stages at a time, as before; the others wait for vectors.

    Interrupts (``KeyboardInterrupt``, ``SystemExit``) end the whole unit, as they would a unit of one:
    no further conversation starts, the ones already running are waited for, and the interrupt is raised."""
    outcomes: dict[str, T | Exception] = {}
    interrupts: list[BaseException] = []
    running: list[threading.Thread] = []
    for cid in conversation_ids:
        if interrupts:
            break
        turn = threading.Event()

        def one(cid: str = cid, turn: threading.Event = turn) -> None:
            try:
                outcomes[cid] = _attempts(cid, lambda: build(cid, turn.set), sleep, retry_delay_s)
            except BaseException as exc:  # noqa: BLE001 -- an interrupt: raised in the unit's thread below
                interrupts.append(exc)
            finally:
                turn.set()

        thread = threading.Thread(target=contextvars.copy_context().run, args=(one,), daemon=True,
                                  name=f"tmem-conversation-{cid}")
        thread.start()
        running.append(thread)
        turn.wait()  # this conversation's LLM work is done (or it ended): the next one may start
    for thread in running:
        thread.join()
    if interrupts:
        raise interrupts[0]
    return {cid: outcomes[cid] for cid in conversation_ids if cid in outcomes}


def _attempts(cid: str, build: Callable[[], T], sleep: Callable[[float], None], retry_delay_s: float) -> T | Exception:
    for attempt in (1, 2):
        try:
            return build()
        except Exception as exc:  # noqa: BLE001 -- the conversation's outcome, reported by the caller
            if attempt == 2 or not retryable(exc):
                return exc
            log.warning("conversation %s failed (attempt 1 of 2), retrying in %.0f s: %s: %s",
                        cid, retry_delay_s, type(exc).__name__, str(exc)[:300])
            sleep(retry_delay_s)
    raise AssertionError("unreachable: the second attempt returns")

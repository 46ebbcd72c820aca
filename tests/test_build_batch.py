"""Batches of conversations in one task run (tmem.build.batch): their size, their order, and each
conversation's outcome on its own — a neighbour's failure, retry or interrupt as a unit of one."""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable

import pytest

from tmem.build.batch import DASK_UNITS_PER_SLOT, RETRY_DELAY_S, UNITS_PER_SLOT, batch_size, batches, build_in_turn
from tmem.errors import LLMError
from tmem.tasks.build import _ConversationLog


def test_a_small_build_keeps_one_conversation_per_unit() -> None:
    assert batch_size(2, slots=2) == 1
    assert batch_size(UNITS_PER_SLOT * 64, slots=64) == 1


def test_a_large_build_gives_every_slot_about_four_units() -> None:
    size = batch_size(1000, slots=64)
    assert size == 4
    units = batches([f"c{n:04d}" for n in range(1000)], size)
    assert len(units) == 250 and UNITS_PER_SLOT * 64 >= len(units) > (UNITS_PER_SLOT - 1) * 64
    assert batch_size(1000, slots=0) == 250  # no slot known: still about four units


def test_fewer_units_per_slot_make_fewer_larger_units() -> None:
    assert batch_size(1000, slots=64, per_slot=DASK_UNITS_PER_SLOT) == 8  # 125 units: ~2 per Dask worker thread
    assert batch_size(DASK_UNITS_PER_SLOT * 64, slots=64, per_slot=DASK_UNITS_PER_SLOT) == 1
    assert batch_size(1000, slots=64, configured=3, per_slot=DASK_UNITS_PER_SLOT) == 3


class _Cluster:
    """What conversation_units reads of a Dask client: its workers' threads."""

    def nthreads(self) -> dict[str, int]:
        return {"tcp://w1": 32, "tcp://w2": 32}


def test_the_units_follow_the_runner(monkeypatch: pytest.MonkeyPatch) -> None:
    """The thread pool's 64 slots draw about four units each; the Dask cluster's 64 worker threads about two,
    a task run costing more on a worker."""
    from tmem.settings import load_settings
    from tmem.tasks import scaleout

    ids = [f"c{n:04d}" for n in range(1000)]
    settings = load_settings(build_concurrency=64)
    monkeypatch.setattr(scaleout, "dask_client", lambda: None)
    here = scaleout.conversation_units(ids, settings)
    assert (len(here), {len(u) for u in here}) == (250, {4})
    monkeypatch.setattr(scaleout, "dask_client", lambda: _Cluster())
    on_dask = scaleout.conversation_units(ids, settings)
    assert (len(on_dask), {len(u) for u in on_dask}) == (125, {8})
    assert [cid for unit in on_dask for cid in unit] == ids  # every conversation once, in order
    assert len(scaleout.conversation_units(ids, load_settings(build_batch=5))) == 200  # a configured size wins


def test_a_configured_size_wins() -> None:
    assert batch_size(10, slots=64, configured=3) == 3
    assert batches(["a", "b", "c", "d", "e", "f", "g"], 3) == [["a", "b", "c"], ["d", "e", "f"], ["g"]]


def test_each_conversation_has_its_own_outcome_and_retry() -> None:
    attempts: dict[str, int] = {}
    waits: list[float] = []
    llm = LLMError("segment", "b", "invalid output after repairs")

    def build(cid: str, handed_over: Callable[[], None]) -> str:
        attempts[cid] = attempts.get(cid, 0) + 1
        if cid == "b":
            raise llm  # after the stage's own retries: not asked again
        if cid == "c" and attempts[cid] == 1:
            raise ConnectionError("API went away")  # transient: one more attempt
        if cid == "d":
            raise RuntimeError(f"broken, attempt {attempts[cid]}")
        return f"memory of {cid}"

    outcomes = build_in_turn(["a", "b", "c", "d", "e"], build, sleep=waits.append)
    assert list(outcomes) == ["a", "b", "c", "d", "e"]
    assert outcomes["a"] == "memory of a" and outcomes["c"] == "memory of c" and outcomes["e"] == "memory of e"
    assert outcomes["b"] is llm
    assert isinstance(outcomes["d"], RuntimeError) and str(outcomes["d"]) == "broken, attempt 2"
    assert attempts == {"a": 1, "b": 1, "c": 2, "d": 2, "e": 1}
    assert waits == [RETRY_DELAY_S, RETRY_DELAY_S]


def test_an_interrupt_ends_the_whole_unit() -> None:
    built: list[str] = []

    def build(cid: str, handed_over: Callable[[], None]) -> str:
        if cid == "b":
            raise KeyboardInterrupt
        built.append(cid)
        return cid

    with pytest.raises(KeyboardInterrupt):
        build_in_turn(["a", "b", "c"], build, sleep=lambda _: None)
    assert built == ["a"]


def test_the_next_conversation_starts_once_one_hands_over_its_embedding_not_when_it_ends() -> None:
    """``a`` waits for its "vectors" until ``b`` has started: built strictly one after another (the
    old way) it would wait forever; ``b``, which never hands over, holds ``c`` back until it ends."""
    started: list[str] = []
    b_started = threading.Event()
    b_may_end = threading.Event()
    lock = threading.Lock()

    def build(cid: str, handed_over: Callable[[], None]) -> str:
        with lock:
            started.append(cid)
        if cid == "a":
            handed_over()  # its LLM work is done; now it waits for its embedding
            assert b_started.wait(timeout=10), "b did not start while a waited for its vectors"
            b_may_end.set()
        if cid == "b":
            b_started.set()
            assert b_may_end.wait(timeout=10)
            assert started == ["a", "b"], "c started before b, which never handed over, had ended"
        return f"memory of {cid}"

    outcomes = build_in_turn(["a", "b", "c"], build, sleep=lambda _: None)
    assert outcomes == {"a": "memory of a", "b": "memory of b", "c": "memory of c"}
    assert list(outcomes) == ["a", "b", "c"] and started == ["a", "b", "c"]


def test_an_interrupt_after_handing_over_waits_for_the_running_conversation_and_starts_no_other() -> None:
    """``b`` is interrupted in its LLM work while ``a`` still waits for its vectors: ``a`` finishes, ``c``
    never starts."""
    built: list[str] = []
    a_may_end = threading.Event()

    def build(cid: str, handed_over: Callable[[], None]) -> str:
        if cid == "b":
            a_may_end.set()
            raise KeyboardInterrupt
        handed_over()
        if cid == "a":
            assert a_may_end.wait(timeout=10)
        built.append(cid)
        return cid

    with pytest.raises(KeyboardInterrupt):
        build_in_turn(["a", "b", "c"], build, sleep=lambda _: None)
    assert built == ["a"]


def test_a_batch_log_line_names_its_conversation(caplog: pytest.LogCaptureFixture) -> None:
    logger = logging.getLogger("tests.batch")
    with caplog.at_level(logging.INFO, logger="tests.batch"):
        _ConversationLog(logger, {"conversation_id": "conv-7"}).info("segment: %d scenes", 3)
    assert [r.getMessage() for r in caplog.records] == ["conv-7: segment: 3 scenes"]

"""Prefect tasks of the build: a few lines each around one library function.

``build_conversation_task`` is one task run per conversation (``conversation/<id>``): it opens the
run's runtime in its process from the spec (once per process; on a Dask worker with the run's
exchange file) and runs the conversation's stages in process (:mod:`tmem.build.conversation`),
reporting each stage and retry to the task run's log. Its inputs are the spec, the run id, the
conversation id and the exchange path: plain values that travel to any worker.

``build_conversations_task`` does the same for a batch of conversations in turn, each starting once
the one before waits only for its vectors (``conversations/<first id>+<more>``; :mod:`tmem.build.batch`): a build of many more
conversations than it builds at once, where a task run's own cost would outweigh a conversation's.
Each line of its log names its conversation; each conversation's outcome comes back on its own.
:func:`submit_conversations` sends the units, :func:`unit_outcomes` reads one back.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Iterator, MutableMapping, Sequence
from contextlib import contextmanager
from dataclasses import replace
from typing import Any

from prefect import task
from prefect.context import SettingsContext
from prefect.exceptions import MissingResult
from prefect.futures import PrefectFuture
from prefect.logging import get_run_logger

from tmem.build.batch import build_in_turn, retryable
from tmem.build.conversation import ConversationBuild, build_conversation
from tmem.build.runtime import drain_journal, runtime_for
from tmem.build.spec import BuildSpec
from tmem.build.stages import LogObserver


def _orchestration_failure(task: Any, task_run: Any, state: Any) -> bool:
    """Retry a conversation only for what its stages did not already retry: an LLM error reached
    here after the stage's own retries (and the adapter's repair), so asking again is waste."""
    data = getattr(state, "data", None)
    return not isinstance(data, BaseException) or retryable(data)


# One retry of the whole conversation: finished stage units come from the stage cache, so a retry after
# a transient orchestration error only redoes what was lost. No tags: each tag costs every task run a
# concurrency-lease round trip to the API; LLM calls are bounded in process (TMEM_LLM_CONCURRENCY).
# Prefect's default cache policy (inputs, source, run id): the result is kept only where the user asks
# Prefect to persist results (PREFECT_RESULTS_PERSIST_BY_DEFAULT), never across runs.
@task(name="build-conversation", task_run_name="conversation/{conversation_id}", retries=1, retry_delay_seconds=5,
      retry_condition_fn=_orchestration_failure)
def build_conversation_task(spec: BuildSpec, run_id: str, conversation_id: str,
                            exchange: str | None = None) -> ConversationBuild:
    rt = runtime_for(spec, run_id, exchange)
    # The task run's logger (safe from the conversation's fan-out threads): the UI shows its stages and retries.
    built = build_conversation(rt, conversation_id, LogObserver(get_run_logger()))  # type: ignore[arg-type]
    return replace(built, journal=drain_journal(spec, run_id, exchange))


def conversation_result(future: PrefectFuture[ConversationBuild]) -> ConversationBuild | BaseException:
    """What a finished conversation task gave: its build, or the exception that ended it."""
    future.wait()  # done already; wait() keeps the final state with its data (`.state` alone re-reads the API)
    state = future.state
    if not state.is_completed():
        found = state.result(raise_on_failure=False)
        if isinstance(found, BaseException):
            return found
        return RuntimeError(f"conversation build ended in state {state.type.value}: {state.message}")
    try:
        built: ConversationBuild = state.result()
    except MissingResult as exc:
        # Seen after a retry under API load: the state came back without its data. Recorded as this
        # conversation's failure; the next build gets it from the caches at no LLM cost.
        return exc
    return built


class _ConversationLog(logging.LoggerAdapter):  # type: ignore[type-arg]
    """A batch's task-run logger, each line headed by the conversation it is about."""

    def process(self, msg: Any, kwargs: MutableMapping[str, Any]) -> tuple[Any, MutableMapping[str, Any]]:
        return f"{self.extra['conversation_id'] if self.extra else '?'}: {msg}", kwargs


# No retry of the unit as a whole for a conversation's failure (each conversation has its own one retry,
# tmem.build.batch); a retry of the unit is for what ended the task run itself (e.g. a lost worker), and
# finished conversations then come back from the stage and response caches at no LLM cost.
@task(name="build-conversations", task_run_name="conversations/{name}", retries=1, retry_delay_seconds=5)
def build_conversations_task(spec: BuildSpec, run_id: str, conversation_ids: list[str], exchange: str | None,
                             name: str) -> dict[str, ConversationBuild | Exception]:
    rt = runtime_for(spec, run_id, exchange)
    logger = get_run_logger()

    def one(cid: str, handed_over: Callable[[], None]) -> ConversationBuild:
        return build_conversation(rt, cid, LogObserver(_ConversationLog(logger, {"conversation_id": cid})),  # type: ignore[arg-type]
                                  handed_over=handed_over)

    outcomes = build_in_turn(conversation_ids, one)
    built = [cid for cid, outcome in outcomes.items() if isinstance(outcome, ConversationBuild)]
    if built:  # the worker's writes ride with a built conversation; with none, the flow's final sweep takes them
        first = outcomes[built[0]]
        assert isinstance(first, ConversationBuild)
        outcomes[built[0]] = replace(first, journal=drain_journal(spec, run_id, exchange))
    return outcomes


class _SettingsSerializedOnce(SettingsContext):
    """The current Prefect settings context, serialised once for all the task runs submitted under it,
    with the settings model itself in place of their dump.

    A Dask task runner sends each task run the flow run's context, its settings serialised anew for
    every submission (~45 ms of the flow process each here: several hundred settings visited one by
    one; a nightly of 1,000 conversations submits 125 units, measured with py-spy). The settings do
    not change while the units are submitted, so the first serialisation serves them all. On the
    worker, each task run makes its settings context from what it was sent: from the dump, pydantic
    validated the settings again through every source (environment, ``.env``, profiles, the
    ``pyproject.toml`` and ``prefect.toml`` files: ~30 ms of the worker per task run); the model
    itself (pickled with the task run) is taken as it is."""

    _serialized: dict[str, Any] | None = None

    def serialize(self, include_secrets: bool = True) -> dict[str, Any]:
        if not include_secrets:
            return super().serialize(include_secrets=False)
        if self._serialized is None:
            self._serialized = super().serialize(include_secrets=True) | {"settings": self.settings}
        return self._serialized


@contextmanager
def settings_serialized_once() -> Iterator[None]:
    """Within it, the current settings context serialises once (:class:`_SettingsSerializedOnce`)."""
    current = SettingsContext.get()
    if current is None:
        yield
        return
    with _SettingsSerializedOnce(profile=current.profile, settings=current.settings):
        yield


def submit_conversations(spec: BuildSpec, run_id: str, units: Sequence[list[str]],
                         exchange: str | None) -> dict[PrefectFuture[Any], list[str]]:
    """One task run per unit: ``build_conversation_task`` for a unit of one, else the batch task."""
    futures: dict[PrefectFuture[Any], list[str]] = {}
    with settings_serialized_once():
        for ids in units:
            if len(ids) == 1:
                futures[build_conversation_task.submit(spec, run_id, ids[0], exchange)] = ids
            else:
                futures[build_conversations_task.submit(spec, run_id, ids, exchange, f"{ids[0]}+{len(ids) - 1}")] = ids
    return futures


def unit_outcomes(future: PrefectFuture[Any], ids: list[str]) -> dict[str, ConversationBuild | BaseException]:
    """What a finished unit gave, per conversation: its build or the exception that ended it (a batch
    whose task run itself failed gives every one of its conversations that failure)."""
    found = conversation_result(future)
    if len(ids) == 1:
        return {ids[0]: found}
    if isinstance(found, BaseException):
        return dict.fromkeys(ids, found)
    outcomes: dict[str, ConversationBuild | BaseException] = dict(found)  # type: ignore[call-overload]
    missing = [cid for cid in ids if cid not in outcomes]
    if missing:  # never expected: a batch reports every conversation it was given
        raise RuntimeError(f"batch {ids[0]}+{len(ids) - 1} returned no outcome for {missing}")
    return outcomes

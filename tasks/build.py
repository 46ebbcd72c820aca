"""Prefect tasks of the build: a few lines each around one library function.

``build_conversation_task`` is one task run per conversation (``conversation/<id>``): it opens the
run's runtime in its process from the spec (once per process; on a Dask worker with the run's
exchange file) and runs the conversation's stages in process (:mod:`tmem.build.conversation`),
reporting each stage and retry to the task run's log. Its inputs are the spec, the run id, the
conversation id and the exchange path: plain values that travel to any worker.
"""

from __future__ import annotations

from dataclasses import replace
from typing import Any

from prefect import task
from prefect.exceptions import MissingResult
from prefect.futures import PrefectFuture
from prefect.logging import get_run_logger

from tmem.build.conversation import ConversationBuild, build_conversation
from tmem.build.runtime import drain_journal, runtime_for
from tmem.build.spec import BuildSpec
from tmem.build.stages import LogObserver
from tmem.errors import LLMError


def _orchestration_failure(task: Any, task_run: Any, state: Any) -> bool:
    """Retry a conversation only for what its stages did not already retry: an LLM error reached
    here after the stage's own retries (and the adapter's repair), so asking again is waste."""
    return not isinstance(getattr(state, "data", None), LLMError)


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

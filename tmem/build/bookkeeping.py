"""A build run's records in the working database, from its start to its report.

:class:`BuildRun` is held by the publisher (the flow process) for one run:

1. :meth:`BuildRun.open` refuses to build while a ``tmem forget`` is unfinished and marks runs
   left ``running`` by a dead process ``interrupted``;
2. :meth:`BuildRun.start` chooses the conversations (all, the given ones, or with ``only_changed``
   those with new turns or a build recorded but never published) and records the run;
3. as each conversation's result arrives, :meth:`BuildRun.built` records the units it quarantined
   and its stages' notes at once (durable even if the build dies later; settled at publish), and
   :meth:`BuildRun.failed` the error that stopped a conversation (a conversation whose spine kept
   answering invalid output is quarantined whole);
4. :meth:`BuildRun.finish` writes the run's final record and returns the summary (what ``tmem
   build --json`` prints) and the markdown report (the Prefect artifact), with the cost estimate.
"""

from __future__ import annotations

import os
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from datetime import UTC, datetime
from typing import Any

from tmem.build.conversation import ConversationBuild
from tmem.build.runtime import BuildRuntime
from tmem.build_report import BuildSummary, Failure, MissingUnit, render_markdown
from tmem.construct import QuarantinedUnit
from tmem.errors import LLMError, LLMOutputError, StoreError
from tmem.pricing import cost_markdown, estimate_cost, price_table
from tmem.store.build_notes import note_counts, record_build_notes
from tmem.store.conversations import conversation_states
from tmem.store.quarantine import quarantines, record_quarantine, record_unit_quarantines
from tmem.store.runs import close_interrupted_runs, finish_run, memory_counts, start_run
from tmem.store.snapshot.published import unpublished_conversations

RAW_EXCERPT_CHARS = 300  # of a quarantined answer, in the report (the whole answer is in the quarantine table)


def utc_now() -> datetime:
    return datetime.now(UTC)


@dataclass(frozen=True)
class BuildResult:
    summary: dict[str, Any]  # what `tmem build --json` prints
    report: str  # markdown: the build report artifact
    status: str  # completed | partial | failed


@dataclass
class BuildRun:
    rt: BuildRuntime
    started: float = field(default_factory=time.perf_counter)
    ids: list[str] = field(default_factory=list)
    builds: dict[str, ConversationBuild] = field(default_factory=dict)
    failures: list[Failure] = field(default_factory=list)
    missing: list[MissingUnit] = field(default_factory=list)

    @classmethod
    def open(cls, rt: BuildRuntime) -> BuildRun:
        # Imported here: the flow's module (so this one) is imported by every Dask worker that unpickles the
        # flow run's context, and tmem.store.forget brings LanceDB and polars, which a worker never uses.
        from tmem.store.forget import pending_forget

        forgetting = pending_forget(rt.con)
        if forgetting is not None:  # a killed forget: building now could publish what it was removing
            raise StoreError(f"{rt.store}: a `tmem forget` started {forgetting.isoformat()} is unfinished; "
                             "run `tmem forget --resume` before building")
        close_interrupted_runs(rt.con, current_pid=os.getpid(), at=utc_now())
        return cls(rt)

    def start(self, conversation_ids: list[str] | None, only_changed: bool, label: str) -> list[str]:
        """Choose and record the conversations this run builds."""
        states = conversation_states(self.rt.con, conversation_ids)
        if only_changed:
            unpublished = set(unpublished_conversations(self.rt.con, self.rt.store))
            states = [s for s in states if s.changed or s.conversation_id in unpublished]
        self.ids = [s.conversation_id for s in states]
        start_run(self.rt.con, self.rt.run_id, {"store": self.rt.spec.store, "conversation_ids": self.ids,
                                                "only_changed": only_changed, "label": label, "pid": os.getpid()},
                  utc_now())
        return self.ids

    def built(self, conversation_id: str, build: ConversationBuild) -> None:
        self.builds[conversation_id] = build
        record_unit_quarantines(self.rt.con, self.rt.run_id, conversation_id, build.quarantined, utc_now())
        record_build_notes(self.rt.con, self.rt.run_id, conversation_id, build.notes, utc_now())
        self.missing += missing_units(conversation_id, build.quarantined)

    def failed(self, conversation_id: str, error: BaseException) -> None:
        self.failures.append(failure_of(conversation_id, error))
        if isinstance(error, LLMOutputError):  # recorded at once: durable even if the build dies later
            record_quarantine(self.rt.con, self.rt.run_id, conversation_id, error, utc_now())

    def finish(self, snapshot_id: str | None, prices: dict[str, dict[str, float]] | None = None) -> BuildResult:
        usage = self.rt.usage()
        counts = memory_counts(self.rt.con)
        status = "completed" if not self.failures else ("partial" if self.builds else "failed")
        summary = BuildSummary(
            run_id=self.rt.run_id, status=status, conversations_requested=self.ids,
            conversations_built=sorted(self.builds), failures=self.failures,
            counts={k: v for k, v in counts.items() if not k.startswith("llm_")}, usage=usage,
            snapshot_id=snapshot_id, seconds=time.perf_counter() - self.started,
            quarantined_units=[u for u in self.missing if u.conversation_id in self.builds],
            notes=note_counts(self.rt.con, self.rt.run_id),
        )
        finish_run(self.rt.con, self.rt.run_id, status=status, counts=summary.counts, usage=summary.usage_totals(),
                   failures=[f.__dict__ for f in self.failures], snapshot_id=snapshot_id, at=utc_now())
        table, model = price_table(prices), self.rt.chat.model_name
        batch = {"batch_prompt_tokens": summary.batch_prompt_tokens,
                 "batch_completion_tokens": summary.batch_completion_tokens}
        cost = estimate_cost(model, summary.prompt_tokens, summary.completion_tokens, table, **batch)
        report = render_markdown(summary) + "\n" + cost_markdown(model, summary.prompt_tokens,
                                                                summary.completion_tokens, table, **batch)
        return BuildResult(summary.to_json() | {"model": model, "cost_usd": cost, "embedding": self.embedding()}, report,
                           status)

    def embedding(self) -> dict[str, Any]:
        """What this process's embedding queue did in the run: on Dask it serves the workers on this
        machine (``TMEM_DASK_SHARED_ENCODER``); a worker embedding with its own encoder is not counted."""
        queue = self.rt.embed_queue
        if queue is None:
            return {}
        u = queue.usage
        return {"texts": u.texts, "requested": u.requested, "model_calls": u.calls, "model_s": round(u.seconds, 2),
                "cache_hits": u.cache_hits, "cache_lookups": u.lookups, "cache_s": round(u.lookup_s, 2),
                "prefetched": u.prefetched,
                # seconds from the queue's start to its first model call and to the end of its last
                "model_window_s": [round(x, 2) for x in window] if (window := u.window()) else None}


def missing_units(conversation_id: str, units: Sequence[QuarantinedUnit]) -> list[MissingUnit]:
    return [
        MissingUnit(conversation_id, u.operation, u.unit_kind, u.unit_id, u.input_ref, u.error_type, u.reason,
                    u.input_digest, (u.raw_output or "")[:RAW_EXCERPT_CHARS])
        for u in units
    ]


def failure_of(conversation_id: str, exc: BaseException) -> Failure:
    if isinstance(exc, LLMError):
        quarantined = quarantines(exc)
        raw = (exc.raw_output or "")[:RAW_EXCERPT_CHARS] if quarantined else None
        return Failure(conversation_id, type(exc).__name__, str(exc), exc.operation, exc.input_ref,
                       quarantined=quarantined, input_digest=exc.input_digest, raw_output_excerpt=raw)
    return Failure(conversation_id, type(exc).__name__, str(exc))

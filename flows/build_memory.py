"""The construction DAG (DESIGN.md §2) as Prefect flows.

``build-memory`` runs one ``build-conversation`` subflow per conversation, in parallel;
inside one, segmentation and topic admission run in order, then item extraction, item
triggers, scene triggers and personas fan out; the views are embedded; finally the parent
publishes every conversation that succeeded as one new snapshot. A conversation that fails
keeps its previous memory and is reported with the typed error that stopped it.

A unit whose answer stays invalid after repairs, re-asks and splits (one topic chunk's items,
one item's or scene's triggers, one speaker's persona) is left out and quarantined as that unit;
its conversation publishes with the rest. The stage results carry those units and the stages'
notes (:mod:`tmem.construct.outcome`); the parent records them (tables ``quarantine`` and
``build_notes``) and names them in the build report. A stage task whose unit is quarantined is
re-run by the next build (``refresh_cache``) instead of being served from Prefect's result cache.
"""

from __future__ import annotations

import logging
import os
import time
import uuid
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, replace
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

from prefect import flow, task
from prefect.artifacts import create_markdown_artifact
from prefect.exceptions import MissingResult
from prefect.futures import PrefectFuture, as_completed
from prefect.runtime import flow_run

from tasks.build import (
    LLM_TAG,
    admit_scene_topics,
    derive_item_triggers,
    derive_scene_triggers,
    embed_views,
    extract_topic_items,
    segment_scenes,
    summarize_persona,
)
from tasks.maintenance import drain_posted_turns
from tasks.publish import publish_builds
from tasks.runtime import bundle, content_cache, drain_journal, release, result_storage
from tasks.scaleout import ConfiguredTaskRunner, open_exchange_for_workers, remove_exchange, store_worker_journals
from tmem.build_report import BuildSummary, Failure, MissingUnit, render_markdown
from tmem.construct import BuildNote, QuarantinedUnit, StageOutcome, dedupe_items
from tmem.construct.stable_batches import item_trigger_batches, scene_trigger_batches
from tmem.domain import Memory, Turn
from tmem.errors import LLMError, LLMOutputError, StoreError
from tmem.ids import content_hash
from tmem.index.views import VIEWS_VERSION
from tmem.pricing import cost_markdown, estimate_cost, price_table
from tmem.prompts.base import prompt_versions
from tmem.providers.journal import JournalBatch
from tmem.settings import Settings, load_settings
from tmem.store.build_notes import note_counts, record_build_notes
from tmem.store.conversations import conversation_states, load_turns
from tmem.store.forget import pending_forget
from tmem.store.lance import VectorRow
from tmem.store.quarantine import active_units, quarantines, record_quarantine, record_unit_quarantines
from tmem.store.runs import close_interrupted_runs, finish_run, memory_counts, start_run
from tmem.store.snapshot import unpublished_conversations

# One record per finished conversation (``tmem build`` shows them as progress); extra fields
# ``conversation_id``, ``done``, ``total``, ``ok``.
progress_log = logging.getLogger("tmem.build.progress")


@dataclass(frozen=True)
class ConversationBuild:
    memory: Memory
    vectors: list[VectorRow]
    watermark_turn_seq: int
    journal: JournalBatch | None = None  # built on a Dask worker: its cache/ledger writes, for the publisher
    notes: tuple[BuildNote, ...] = ()  # what the stages clipped, reclassified, dropped, split, quarantined
    quarantined: tuple[QuarantinedUnit, ...] = ()  # the units left out of ``memory``


# The operations a build calls; query/eval prompts (answer, judges) must not invalidate build caches.
BUILD_OPERATIONS = frozenset({
    "scene_boundaries", "scene_pack", "topic_match", "topic_create", "item_extract", "item_triggers",
    "scene_triggers", "persona",
})


def build_fingerprint(settings: Settings, model_name: str) -> str:
    """What makes a stage's output differ for the same input: model, prompt versions, knobs."""
    return content_hash(
        model_name, {op: v for op, v in prompt_versions().items() if op in BUILD_OPERATIONS}, settings.embedding_model, settings.segment_window, settings.topic_batch,
        settings.trigger_batch, settings.scene_trigger_batch, VIEWS_VERSION,
    )


# The LLM operation of each stage that TMEM_LLM_BATCH may send through the Batch API.
BATCHABLE_STAGES = {"items": "item_extract", "item_triggers": "item_triggers", "scene_triggers": "scene_triggers",
                    "persona": "persona"}


def _configured(store: str, t: Any, conversation_id: str, batched: bool = False) -> Any:
    options: dict[str, Any] = {}
    if batched:  # a task waiting on a batch holds no `llm` slot: that limit bounds synchronous calls
        options["tags"] = (set(t.tags) - {LLM_TAG}) | {"llm-batch"}
    # Results and cache records per conversation: `tmem forget` deletes the conversation's directory.
    return t.with_options(cache_policy=content_cache(store, conversation_id),
                          result_storage=result_storage(store, conversation_id), persist_result=True, **options)


class _Stages:
    """The stage tasks of one conversation, configured; a task whose unit is quarantined (``refresh``:
    operation -> unit ids with an active record) runs again, overwriting its cached result."""

    def __init__(self, store: str, conversation_id: str, batched: frozenset[str], refresh: dict[str, list[str]]) -> None:
        self._tasks = {name: _configured(store, t, conversation_id, BATCHABLE_STAGES.get(name) in batched) for name, t in {
            "segment": segment_scenes, "topics": admit_scene_topics, "items": extract_topic_items,
            "item_triggers": derive_item_triggers, "scene_triggers": derive_scene_triggers,
            "persona": summarize_persona, "embed": embed_views,
        }.items()}
        self._refresh = {op: set(units) for op, units in refresh.items()}
        self.outcomes: list[StageOutcome[Any]] = []  # every stage result, for its notes and quarantined units

    def __getitem__(self, name: str) -> Any:
        return self._tasks[name]

    def units(self, name: str, operation: str, units: Iterable[str]) -> Any:
        """Stage ``name``'s task for the given units of ``operation``, refreshed if one is quarantined."""
        if self._refresh.get(operation, set()) & set(units):
            return self._tasks[name].with_options(refresh_cache=True)
        return self._tasks[name]

    def took(self, outcome: StageOutcome[Any]) -> Any:
        self.outcomes.append(outcome)
        return outcome.value


@flow(name="build-conversation", flow_run_name="build-conversation/{conversation_id}", log_prints=False)
def build_conversation(
    store: str, run_id: str, conversation_id: str, fingerprint: str, refresh: dict[str, list[str]] | None = None
) -> ConversationBuild:
    b = bundle(store, run_id)
    cur = b.con.cursor()
    try:
        turns: tuple[Turn, ...] = load_turns(cur, conversation_id)
    finally:
        cur.close()
    if not turns:
        raise LLMError("load-turns", conversation_id, "conversation has no turns")
    c = _Stages(store, conversation_id, b.settings.batch_operations, refresh or {})
    speakers = sorted({t.speaker for t in turns})
    persona_futs: list[PrefectFuture[Any]] = [
        c.units("persona", "persona", [spk]).submit(
            store, run_id, conversation_id, spk, [t for t in turns if t.speaker == spk], fingerprint)
        for spk in speakers
    ]
    scenes = c.took(c["segment"](store, run_id, conversation_id, turns, fingerprint))
    by_id = {t.turn_id: t for t in turns}
    # Trigger batches are cut so that a grown conversation keeps its earlier batches (and their
    # cached answers): see tmem.construct.stable_batches.
    scene_trig_futs = [
        c.units("scene_triggers", "scene_triggers", [s.scene_id for s in batch]).submit(
            store, run_id, conversation_id, n, batch, [by_id[t] for s in batch for t in s.turn_ids], fingerprint
        )
        for n, batch in enumerate(scene_trigger_batches(scenes, b.settings.scene_trigger_batch))
    ]
    topics = list(c.took(c["topics"](store, run_id, conversation_id, scenes, fingerprint)).topics)
    scene_by_id = {s.scene_id: s for s in scenes}
    titles_of_scene: dict[str, list[tuple[str, str]]] = {}
    for topic in topics:
        for sid in topic.scene_ids:
            titles_of_scene.setdefault(sid, []).append((topic.topic_id, topic.title))
    item_futs = []
    for topic in topics:
        members = [scene_by_id[sid] for sid in topic.scene_ids]
        member_turns = [by_id[t] for s in members for t in s.turn_ids]
        others = {sid: [title for tid, title in titles_of_scene[sid] if tid != topic.topic_id] for sid in topic.scene_ids}
        item_futs.append(c.units("items", "item_extract", [topic.topic_id]).submit(
            store, run_id, conversation_id, topic, members, member_turns, {sid: t for sid, t in others.items() if t},
            fingerprint))
    items = dedupe_items(c.took(f.result()).items for f in item_futs)
    scene_seq = {s.scene_id: s.seq for s in scenes}
    item_trig_futs = [
        c.units("item_triggers", "item_triggers", [i.item_id for i in batch]).submit(
            store, run_id, conversation_id, n, batch, fingerprint)
        for n, batch in enumerate(item_trigger_batches(topics, items, scene_seq, b.settings.trigger_batch))
    ]
    personas = [c.took(f.result()) for f in persona_futs]
    memory = Memory(
        conversation_id=conversation_id,
        scenes=tuple(scenes),
        topics=tuple(topics),
        items=tuple(items),
        item_triggers=tuple(t for f in item_trig_futs for t in c.took(f.result())),
        scene_triggers=tuple(t for f in scene_trig_futs for t in c.took(f.result())),
        personas=tuple(p for p in personas if p is not None),
    )
    vectors = c["embed"](store, run_id, memory, turns, fingerprint)
    return ConversationBuild(
        memory=memory, vectors=vectors, watermark_turn_seq=max(t.seq for t in turns),
        notes=tuple(n for o in c.outcomes for n in o.notes),
        quarantined=tuple(u for o in c.outcomes for u in o.quarantined),
    )


def _orchestration_failure(task: Any, task_run: Any, state: Any) -> bool:
    """Retry a conversation only for what its stages did not already retry: an LLM error reached
    here after the stage's own retries (and the adapter's repair), so asking again is waste."""
    return not isinstance(getattr(state, "data", None), LLMError)


# One retry of the whole conversation: finished stages are cache hits, so a retry after a transient
# orchestration error (e.g. the local Prefect API answering 503 under load) only redoes what was lost.
@task(name="build-conversation", task_run_name="conversation/{conversation_id}", retries=1, retry_delay_seconds=5,
      retry_condition_fn=_orchestration_failure)
def build_conversation_task(
    store: str, run_id: str, conversation_id: str, fingerprint: str, refresh: dict[str, list[str]] | None = None
) -> ConversationBuild:
    built = build_conversation(store, run_id, conversation_id, fingerprint, refresh)
    return replace(built, journal=drain_journal(store, run_id))


def _exception_of(state: Any) -> BaseException:
    """The exception a failed or crashed state carries (Prefect returns it instead of raising)."""
    found = state.result(raise_on_failure=False)
    if isinstance(found, BaseException):
        return found
    return RuntimeError(f"conversation build ended in state {state.type.value}: {state.message}")


RAW_EXCERPT_CHARS = 300  # of a quarantined answer, in the report (the whole answer is in the quarantine table)


def _missing_units(conversation_id: str, units: Sequence[QuarantinedUnit]) -> list[MissingUnit]:
    return [
        MissingUnit(conversation_id, u.operation, u.unit_kind, u.unit_id, u.input_ref, u.error_type, u.reason,
                    u.input_digest, (u.raw_output or "")[:RAW_EXCERPT_CHARS])
        for u in units
    ]


def _by_unit(units: list[tuple[str, str, str]]) -> dict[str, list[str]]:
    """Active unit records (operation, kind, id) as the ``refresh`` of a conversation's build."""
    out: dict[str, list[str]] = {}
    for operation, _kind, unit in units:
        out.setdefault(operation, []).append(unit)
    return out


def _failure(conversation_id: str, exc: BaseException) -> Failure:
    if isinstance(exc, LLMError):
        quarantined = quarantines(exc)
        raw = (exc.raw_output or "")[:RAW_EXCERPT_CHARS] if quarantined else None
        return Failure(conversation_id, type(exc).__name__, str(exc), exc.operation, exc.input_ref,
                       quarantined=quarantined, input_digest=exc.input_digest, raw_output_excerpt=raw)
    return Failure(conversation_id, type(exc).__name__, str(exc))


@flow(name="build-memory", flow_run_name="build-memory/{label}", task_runner=ConfiguredTaskRunner())
def build_memory(
    store: str,
    conversation_ids: list[str] | None = None,
    only_changed: bool = False,
    label: str = "all",
    prices: dict[str, dict[str, float]] | None = None,
) -> dict[str, Any]:
    """Build (or rebuild) the memory of the given conversations (default: all) and publish a snapshot.

    First the turns posted to ``tmem serve`` / ``tmem mcp`` and waiting in the spool are ingested.
    ``only_changed`` keeps the conversations with turns newer than their last build, plus any
    whose last build was recorded but never published (a build killed mid-publish). An
    incremental build re-runs every stage over the whole conversation; requests whose content
    did not change are answered by the LLM response cache, so only new work costs tokens.
    ``prices`` overrides the model price table of the cost estimate (USD per 1M tokens).
    """
    started = time.perf_counter()
    settings = load_settings(store=Path(store))
    table = price_table(prices)
    run_id = str(flow_run.get_id() or uuid.uuid4())
    b = bundle(store, run_id)
    try:
        forgetting = pending_forget(b.con)
        if forgetting is not None:  # a killed forget: building now could publish what it was removing
            raise StoreError(f"{store}: a `tmem forget` started {forgetting.isoformat()} is unfinished; "
                             "run `tmem forget --resume` before building")
        close_interrupted_runs(b.con, current_pid=os.getpid(), at=datetime.now(UTC))
        spooled = drain_posted_turns(store, datetime.now(UTC), run_id)  # posted turns join this build
        states = conversation_states(b.con, conversation_ids)
        if only_changed:
            unpublished = set(unpublished_conversations(b.con, settings.store))
            states = [s for s in states if s.changed or s.conversation_id in unpublished]
        ids = [s.conversation_id for s in states]
        start_run(b.con, run_id, {"store": store, "conversation_ids": ids, "only_changed": only_changed,
                                  "label": label, "pid": os.getpid()}, datetime.now(UTC))
        fingerprint = build_fingerprint(settings, b.chat.model_name)
        open_exchange_for_workers(b, store, ids)  # TMEM_TASK_RUNNER=dask: what workers read, exported once
        refresh = active_units(b.con, ids)  # units quarantined before: their stage tasks run again
        futures = {build_conversation_task.submit(store, run_id, cid, fingerprint, _by_unit(refresh.get(cid, [])))
                   : cid for cid in ids}
        builds: dict[str, ConversationBuild] = {}
        failures: list[Failure] = []
        missing: list[MissingUnit] = []
        for done, fut in enumerate(as_completed(list(futures)), start=1):
            cid = futures[fut]
            fut.wait()  # done already; wait() keeps the final state with its data (`.state` alone re-reads the API)
            state = fut.state
            if state.is_completed():
                try:
                    built = builds[cid] = state.result()
                    # Recorded at once (durable even if the build dies later); settled at publish.
                    record_unit_quarantines(b.con, run_id, cid, built.quarantined, datetime.now(UTC))
                    record_build_notes(b.con, run_id, cid, built.notes, datetime.now(UTC))
                    missing += _missing_units(cid, built.quarantined)
                except MissingResult as exc:
                    # Seen after a retry under API load: the state came back without its data. Recorded as
                    # this conversation's failure; the next build gets it from the caches at no LLM cost.
                    failures.append(_failure(cid, exc))
            else:
                error = _exception_of(state)
                failures.append(_failure(cid, error))
                if isinstance(error, LLMOutputError):  # recorded at once: durable even if the build dies later
                    record_quarantine(b.con, run_id, cid, error, datetime.now(UTC))
            progress_log.info("%s %s (%d/%d)", cid, "built" if cid in builds else "FAILED", done, len(ids),
                              extra={"conversation_id": cid, "done": done, "total": len(ids), "ok": cid in builds})
        builds = store_worker_journals(b, store, builds)  # workers' cache and ledger writes, one transaction
        snapshot_id = publish_builds(store, run_id, builds) if builds else None
        usage = b.usage()
        counts = memory_counts(b.con)
        status = "completed" if not failures else ("partial" if builds else "failed")
        summary = BuildSummary(
            run_id=run_id, status=status, conversations_requested=ids, conversations_built=sorted(builds),
            failures=failures, counts={k: v for k, v in counts.items() if not k.startswith("llm_")}, usage=usage,
            snapshot_id=snapshot_id, seconds=time.perf_counter() - started,
            quarantined_units=[u for u in missing if u.conversation_id in builds], notes=note_counts(b.con, run_id),
        )
        finish_run(b.con, run_id, status=status, counts=summary.counts, usage=summary.usage_totals(),
                   failures=[f.__dict__ for f in failures], snapshot_id=snapshot_id, at=datetime.now(UTC))
        model = b.chat.model_name
        batch = {"batch_prompt_tokens": summary.batch_prompt_tokens,
                 "batch_completion_tokens": summary.batch_completion_tokens}
        cost = estimate_cost(model, summary.prompt_tokens, summary.completion_tokens, table, **batch)
        report = render_markdown(summary) + "\n" + cost_markdown(model, summary.prompt_tokens,
                                                                summary.completion_tokens, table, **batch)
        create_markdown_artifact(markdown=report, key="tmem-build-report",
                                 description=f"tmem build {run_id}: {status}")
        return summary.to_json() | {"model": model, "cost_usd": cost, "spool": spooled}
    finally:
        remove_exchange(store, run_id)
        release(store, run_id)

"""Prefect tasks of the construction DAG: each wraps one library stage.

Every task takes ``store`` and ``run_id`` (to find the process's dependency bundle, excluded
from cache keys), its content inputs, and ``fingerprint`` — the model, prompt versions and
stage knobs — so the content cache key changes whenever the output could. Each returns the
stage's :class:`~tmem.construct.outcome.StageOutcome`: what it built, its notes and the units it
quarantined (items, triggers and persona isolate a failing unit; segmentation and topic
admission raise, failing the conversation). Completion budgets are not in the fingerprint: an
answer that validated is valid under any budget, as in the LLM response cache.
"""

from __future__ import annotations

from collections.abc import Sequence

from prefect import task

from tasks.runtime import bundle
from tmem.construct import (
    ExtractedItems,
    StageOutcome,
    TopicPool,
    admit_topics_outcome,
    extract_items_outcome,
    item_triggers_outcome,
    persona_outcome,
    scene_triggers_outcome,
    segment_outcome,
)
from tmem.domain import Item, ItemTriggers, Memory, Persona, Scene, SceneTriggers, Topic, Turn
from tmem.index.embed import embed_memory_views
from tmem.store.lance import VectorRow

LLM_TAG = "llm"
RETRIES = 2
RETRY_DELAY_S: list[float] = [2.0, 10.0]


@task(name="segment-scenes", task_run_name="segment/{conversation_id}", tags=[LLM_TAG, "stage:segment"],
      retries=RETRIES, retry_delay_seconds=RETRY_DELAY_S)
def segment_scenes(
    store: str, run_id: str, conversation_id: str, turns: Sequence[Turn], fingerprint: str
) -> StageOutcome[list[Scene]]:
    b = bundle(store, run_id)
    return segment_outcome(conversation_id, list(turns), b.chat, window=b.settings.segment_window)


@task(name="admit-topics", task_run_name="topics/{conversation_id}", tags=[LLM_TAG, "stage:topics"],
      retries=RETRIES, retry_delay_seconds=RETRY_DELAY_S)
def admit_scene_topics(
    store: str, run_id: str, conversation_id: str, scenes: Sequence[Scene], fingerprint: str
) -> StageOutcome[TopicPool]:
    b = bundle(store, run_id)
    return admit_topics_outcome(conversation_id, list(scenes), b.chat, batch=b.settings.topic_batch)


@task(name="extract-items", task_run_name="items/{conversation_id}/{topic.topic_id}", tags=[LLM_TAG, "stage:items"],
      retries=RETRIES, retry_delay_seconds=RETRY_DELAY_S)
def extract_topic_items(
    store: str, run_id: str, conversation_id: str, topic: Topic, scenes: Sequence[Scene], turns: Sequence[Turn],
    other_topics: dict[str, list[str]], fingerprint: str,
) -> StageOutcome[ExtractedItems]:
    b = bundle(store, run_id)
    return extract_items_outcome(conversation_id, topic, list(scenes), {t.turn_id: t for t in turns}, b.chat,
                                 other_topics=other_topics)


@task(name="item-triggers", task_run_name="item-triggers/{conversation_id}/{batch_no}", tags=[LLM_TAG, "stage:item-triggers"],
      retries=RETRIES, retry_delay_seconds=RETRY_DELAY_S)
def derive_item_triggers(
    store: str, run_id: str, conversation_id: str, batch_no: int, items: Sequence[Item], fingerprint: str
) -> StageOutcome[list[ItemTriggers]]:
    b = bundle(store, run_id)
    return item_triggers_outcome(conversation_id, list(items), b.chat, batch=max(1, len(items)))


@task(name="scene-triggers", task_run_name="scene-triggers/{conversation_id}/{batch_no}",
      tags=[LLM_TAG, "stage:scene-triggers"], retries=RETRIES, retry_delay_seconds=RETRY_DELAY_S)
def derive_scene_triggers(
    store: str, run_id: str, conversation_id: str, batch_no: int, scenes: Sequence[Scene], turns: Sequence[Turn],
    fingerprint: str,
) -> StageOutcome[list[SceneTriggers]]:
    b = bundle(store, run_id)
    return scene_triggers_outcome(
        conversation_id, list(scenes), {t.turn_id: t for t in turns}, b.chat, batch=max(1, len(scenes))
    )


@task(name="persona", task_run_name="persona/{conversation_id}/{speaker}", tags=[LLM_TAG, "stage:persona"],
      retries=RETRIES, retry_delay_seconds=RETRY_DELAY_S)
def summarize_persona(
    store: str, run_id: str, conversation_id: str, speaker: str, turns: Sequence[Turn], fingerprint: str
) -> StageOutcome[Persona | None]:
    b = bundle(store, run_id)
    return persona_outcome(conversation_id, speaker, list(turns), b.chat)


@task(name="embed-views", task_run_name="embed/{memory.conversation_id}", tags=["stage:index"],
      retries=RETRIES, retry_delay_seconds=RETRY_DELAY_S)
def embed_views(store: str, run_id: str, memory: Memory, turns: Sequence[Turn], fingerprint: str) -> list[VectorRow]:
    b = bundle(store, run_id)
    return embed_memory_views(memory, {t.turn_id: t for t in turns}, b.embedder)

"""Trigger batches that stay the same when a conversation grows (incremental construction).

An incremental build re-runs every stage over the whole conversation and relies on the LLM
response cache: a request whose content did not change is answered from the cache. A batch is
one request, so a batch is free only if its members are exactly those of the previous build.
Batches are therefore cut where new content cannot shift them:

* **scene triggers**: scenes in arrival order, cut every ``size`` from the first scene. New
  scenes arrive at the end (segmentation only rewrites the scenes of its last window), so only
  the batch holding the first changed scene and those after it are new.
* **item triggers**: items grouped by the topic that extracted them (topics in creation order),
  ordered inside a topic by their latest source scene, then id, and cut every ``size`` inside
  each topic. A topic that gains scenes gains items at its end; only its last batches change,
  and no other topic's batch moves. (Cutting the flat item list instead would shift every
  batch after the first topic that gained an item, and re-ask most trigger calls.)
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

from tmem.construct.common import batched
from tmem.domain import Item, Scene, Topic


def scene_trigger_batches(scenes: Sequence[Scene], size: int) -> list[list[Scene]]:
    """Scenes by ``seq``, ``size`` per batch from the first scene."""
    return [list(b) for b in batched(sorted(scenes, key=lambda s: s.seq), size)]


def item_trigger_batches(
    topics: Sequence[Topic], items: Sequence[Item], scene_seq: Mapping[str, int], size: int
) -> list[list[Item]]:
    """Items batched per extracting topic, at most ``size`` per batch (see the module docstring).

    ``scene_seq`` maps scene id to its ``seq``; every item's topic must be among ``topics``.
    """
    by_topic: dict[str, list[Item]] = {t.topic_id: [] for t in topics}
    for item in items:
        if item.topic_id not in by_topic:
            raise ValueError(f"item {item.item_id} names topic {item.topic_id}, which is not among the topics")
        by_topic[item.topic_id].append(item)
    out: list[list[Item]] = []
    for topic in sorted(topics, key=lambda t: t.seq):
        members = sorted(by_topic[topic.topic_id], key=lambda i: (_latest(i, scene_seq), i.item_id))
        out.extend(list(b) for b in batched(members, size))
    return out


def _latest(item: Item, scene_seq: Mapping[str, int]) -> int:
    try:
        return max(scene_seq[s] for s in item.source_scene_ids)
    except KeyError as exc:
        raise ValueError(f"item {item.item_id} cites scene {exc.args[0]}, which is not among the scenes") from exc

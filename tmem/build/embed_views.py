"""The build stage that embeds a conversation's view texts (tmem.views.texts) into vector rows (DESIGN.md §3)."""

from __future__ import annotations

from collections.abc import Mapping, Sequence

from tmem.domain import ConversationMemory, Scene, Turn
from tmem.ports import Embedder, Prefetcher
from tmem.store.vector_rows import VectorRow
from tmem.views.texts import DIALOGUE_WINDOW_TURNS, memory_views, scene_views, word_budget


def embed_memory_views(memory: ConversationMemory, turns_by_id: Mapping[str, Turn], embedder: Embedder) -> list[VectorRow]:
    """One L2-normalised vector per view text, in :func:`memory_views` order; dialogue views are
    chunked to fit the embedder's input."""
    views = memory_views(memory, turns_by_id, dialogue_words=word_budget(embedder.max_input_tokens),
                         dialogue_turns=DIALOGUE_WINDOW_TURNS)
    matrix = embedder.embed([v.text for v in views])
    return [
        VectorRow(
            conversation_id=memory.conversation_id, owner_kind=v.owner_kind, owner_id=v.owner_id, view=v.view,
            ordinal=v.ordinal, text=v.text, vector=matrix[n],
        )
        for n, v in enumerate(views)
    ]


def prefetch_scene_views(scenes: Sequence[Scene], turns_by_id: Mapping[str, Turn], embedder: Embedder) -> int:
    """Queue the scene views known right after segmentation (summaries and dialogue windows, the
    longest texts of a conversation) on the build's embedding worker without waiting, so the encoder
    works on them while the conversation's later stages wait for the LLM; the conversation's own
    :func:`embed_memory_views` then finds them embedded. Returns how many texts were queued (0: the
    embedder queues nothing ahead: neither the build's queue nor its encoder service)."""
    if not isinstance(embedder, Prefetcher):
        return 0
    views = scene_views(scenes, turns_by_id, dialogue_words=word_budget(embedder.max_input_tokens),
                        dialogue_turns=DIALOGUE_WINDOW_TURNS)
    embedder.prefetch([v.text for v in views])
    return len(views)

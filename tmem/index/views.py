"""The texts that get embedded, one row per (owner, view, ordinal) — DESIGN.md §3.

Dense node views: topic ``summary``; scene ``summary`` (title + summary); item ``content``.
Item trigger views: ``con`` (entity concepts), ``brg`` (bridge situations), ``joint``
(entities ‖ bridges ‖ rationales). Scene trigger views: ``dlg`` (the scene's dialogue, one row
per chunk of consecutive turns that fits the encoder's input, see :func:`dialogue_chunks`),
``scn`` (the four attributes), ``hor`` (one row per non-empty horizon sentence). The query side
scores a multi-row view by its best row. A view with no text produces no row; the query side
reads a missing view as NaN.

An encoder cuts what is longer than its input (MiniLM reads 256 word pieces; 8 of the 20 scenes
of a real-model build of LoCoMo had longer dialogues, up to 668), so a whole-scene dialogue
vector would only see the scene's opening. Every other view is far shorter than that.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Literal

from tmem.domain import HORIZON_CHANNELS, SCENE_ATTRIBUTES, Memory, Turn

OwnerKind = Literal["topic", "scene", "item"]

VIEWS_VERSION = 2
"""Bump when the texts of the views change for the same memory (part of the build fingerprint).
2: ``dlg`` in chunks that fit the encoder."""
PIECES_PER_WORD = 1.6
"""Word pieces per whitespace word assumed when sizing a chunk (measured on LoCoMo dialogue lines with
MiniLM's tokenizer: mean 1.37, 90th percentile 1.56)."""
RESERVED_TOKENS = 2  # the encoder's own [CLS] / [SEP]


def word_budget(max_input_tokens: int | None) -> int | None:
    """Whitespace words of dialogue that fit an encoder reading ``max_input_tokens`` (None: no limit)."""
    if not max_input_tokens:
        return None
    return max(8, int((max_input_tokens - RESERVED_TOKENS) / PIECES_PER_WORD))


@dataclass(frozen=True)
class ViewText:
    owner_kind: OwnerKind
    owner_id: str
    view: str
    ordinal: int
    text: str


def dialogue_text(turn_ids: tuple[str, ...], turns_by_id: Mapping[str, Turn]) -> str:
    """A scene's dialogue as ``Speaker: text`` lines, in turn order."""
    return "\n".join(dialogue_lines(turn_ids, turns_by_id))


def dialogue_lines(turn_ids: tuple[str, ...], turns_by_id: Mapping[str, Turn]) -> list[str]:
    return [f"{turns_by_id[t].speaker}: {turns_by_id[t].text}" for t in turn_ids if t in turns_by_id]


def dialogue_chunks(turn_ids: tuple[str, ...], turns_by_id: Mapping[str, Turn], max_words: int | None) -> list[str]:
    """The scene's dialogue in chunks of consecutive whole turns of at most ``max_words`` words each
    (a longer turn is cut into pieces of ``max_words`` words on its own); one chunk when unlimited."""
    lines = dialogue_lines(turn_ids, turns_by_id)
    if not lines:
        return []
    if max_words is None:
        return ["\n".join(lines)]
    chunks: list[list[str]] = []
    size = 0
    for line in lines:
        words = line.split()
        if len(words) > max_words:
            chunks.extend([" ".join(words[i : i + max_words])] for i in range(0, len(words), max_words))
            size = max_words  # nothing joins a cut turn's last piece
            continue
        if not chunks or size + len(words) > max_words:
            chunks.append([])
            size = 0
        chunks[-1].append(line)
        size += len(words)
    return ["\n".join(chunk) for chunk in chunks]


def memory_views(memory: Memory, turns_by_id: Mapping[str, Turn], *, dialogue_words: int | None = None) -> list[ViewText]:
    """Every embeddable view of a conversation's memory, in a deterministic order.
    ``dialogue_words``: words per ``dlg`` chunk (:func:`word_budget` of the encoder; None: one chunk)."""
    out: list[ViewText] = []
    for topic in memory.topics:
        out.append(ViewText("topic", topic.topic_id, "summary", 0, topic.summary))
    for scene in memory.scenes:
        out.append(ViewText("scene", scene.scene_id, "summary", 0, f"{scene.title}. {scene.summary}"))
        for ordinal, chunk in enumerate(dialogue_chunks(scene.turn_ids, turns_by_id, dialogue_words)):
            out.append(ViewText("scene", scene.scene_id, "dlg", ordinal, chunk))
    for st in memory.scene_triggers:
        attrs = " ".join(getattr(st, a).strip() for a in SCENE_ATTRIBUTES if getattr(st, a).strip())
        if attrs:
            out.append(ViewText("scene", st.scene_id, "scn", 0, attrs))
        ordinal = 0
        for channel in HORIZON_CHANNELS:
            sentence = st.horizons.get(channel, "").strip()
            if sentence:
                out.append(ViewText("scene", st.scene_id, "hor", ordinal, sentence))
                ordinal += 1
    for item in memory.items:
        out.append(ViewText("item", item.item_id, "content", 0, item.content))
    for it in memory.item_triggers:
        entities = "; ".join(e.strip() for e in it.entities if e.strip())
        bridges = "; ".join(b.situation.strip() for b in it.bridges if b.situation.strip())
        rationales = "; ".join(b.rationale.strip() for b in it.bridges if b.rationale.strip())
        if entities:
            out.append(ViewText("item", it.item_id, "con", 0, entities))
        if bridges:
            out.append(ViewText("item", it.item_id, "brg", 0, bridges))
        joint = " | ".join(part for part in (entities, bridges, rationales) if part)
        if joint:
            out.append(ViewText("item", it.item_id, "joint", 0, joint))
    return out

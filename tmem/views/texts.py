"""The texts that get embedded, one row per (owner, view, ordinal) — DESIGN.md §3.

Dense node views: topic ``summary``; scene ``summary`` (title + summary); item ``content``.
Item trigger views: ``con`` (entity concepts), ``brg`` (bridge situations), ``joint``
(entities ‖ bridges ‖ rationales). Scene trigger views: ``dlg`` (the scene's dialogue, one row
per window of a few consecutive turns that fits the encoder's input, see :func:`dialogue_windows`),
``scn`` (the four attributes), ``hor`` (one row per non-empty horizon sentence). The query side
scores a multi-row view by its best row. A view with no text produces no row; the query side
reads a missing view as NaN.

An encoder cuts what is longer than its input (MiniLM reads 256 word pieces; 8 of the 20 scenes
of a real-model build of LoCoMo had longer dialogues, up to 668), so a whole-scene dialogue
vector would only see the scene's opening. Every other view is far shorter than that.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass

from tmem.construct.families import family_named
from tmem.domain import HORIZON_CHANNELS, SCENE_ATTRIBUTES, ConversationMemory, Scene, Turn
from tmem.views.catalog import OwnerKind

VIEWS_VERSION = 2
"""Bump when the texts of the views change for the same memory (part of the build fingerprint).
2: ``dlg`` in windows of turns that fit the encoder, ordinals naming their first turn."""
DIALOGUE_WINDOW_TURNS = 3
"""Turns per ``dlg`` window: about a remark, its reply and a follow-up (LoCoMo turns average 24 words),
so a window matches one moment of a scene, and the context can hand over that moment alone."""
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


PIECES_PER_TURN = 16
"""A ``dlg`` row's ordinal is ``PIECES_PER_TURN × (position of its first turn in the scene) + piece``
(piece > 0 only for the further pieces of one over-long turn), so every row says which turns it
covers: from its first turn up to the next row's first turn. The query side uses it to hand over
the window of a scene that matched instead of the whole scene."""


@dataclass(frozen=True)
class DialogueWindow:
    first: int  # position in the scene of the window's first turn
    piece: int  # 0, or the piece number of an over-long turn cut into several rows
    text: str

    @property
    def ordinal(self) -> int:
        return PIECES_PER_TURN * self.first + self.piece


def dialogue_windows(
    turn_ids: tuple[str, ...], turns_by_id: Mapping[str, Turn], max_words: int | None, max_turns: int | None
) -> list[DialogueWindow]:
    """The scene's dialogue in windows of at most ``max_turns`` consecutive whole turns and
    ``max_words`` words (a longer turn is cut into pieces of ``max_words`` words of its own).
    Unlimited both ways: one window, the whole scene."""
    lines = dialogue_lines(turn_ids, turns_by_id)
    windows: list[tuple[int, list[str]]] = []
    out: list[DialogueWindow] = []
    size = 0
    for position, line in enumerate(lines):
        words = line.split()
        if max_words is not None and len(words) > max_words:
            pieces = [" ".join(words[i : i + max_words]) for i in range(0, len(words), max_words)]
            pieces = pieces[:PIECES_PER_TURN]  # a turn of 2,500 words is cut after 16 pieces (never seen)
            windows.append((position, []))  # closes the current window; the pieces follow on their own
            out.extend(DialogueWindow(position, n, text) for n, text in enumerate(pieces))
            size = max_words
            continue
        full = windows and windows[-1][1] and (
            (max_words is not None and size + len(words) > max_words)
            or (max_turns is not None and len(windows[-1][1]) >= max_turns)
        )
        if not windows or not windows[-1][1] or full:
            windows.append((position, []))
            size = 0
        windows[-1][1].append(line)
        size += len(words)
    out.extend(DialogueWindow(first, 0, "\n".join(window)) for first, window in windows if window)
    return sorted(out, key=lambda w: w.ordinal)


def dialogue_chunks(turn_ids: tuple[str, ...], turns_by_id: Mapping[str, Turn], max_words: int | None) -> list[str]:
    """The texts of :func:`dialogue_windows` with no turn limit (whole turns up to ``max_words``)."""
    return [w.text for w in dialogue_windows(turn_ids, turns_by_id, max_words, None)]


def window_start(ordinal: int) -> int:
    """The position in its scene of the first turn of the ``dlg`` row with this ordinal."""
    return ordinal // PIECES_PER_TURN


def scene_views(
    scenes: Sequence[Scene], turns_by_id: Mapping[str, Turn], *, dialogue_words: int | None = None,
    dialogue_turns: int | None = None,
) -> list[ViewText]:
    """The views a scene has from segmentation alone (``summary`` and its ``dlg`` windows), in
    :func:`memory_views` order: known before the later stages, so a build can embed them early."""
    out: list[ViewText] = []
    for scene in scenes:
        out.append(ViewText("scene", scene.scene_id, "summary", 0, f"{scene.title}. {scene.summary}"))
        for window in dialogue_windows(scene.turn_ids, turns_by_id, dialogue_words, dialogue_turns):
            out.append(ViewText("scene", scene.scene_id, "dlg", window.ordinal, window.text))
    return out


def memory_views(
    memory: ConversationMemory, turns_by_id: Mapping[str, Turn], *, dialogue_words: int | None = None,
    dialogue_turns: int | None = None,
) -> list[ViewText]:
    """Every embeddable view of a conversation's memory, in a deterministic order. ``dialogue_words``
    / ``dialogue_turns``: size of a ``dlg`` window (:func:`word_budget` of the encoder; None: unlimited)."""
    out: list[ViewText] = []
    for topic in memory.topics:
        out.append(ViewText("topic", topic.topic_id, "summary", 0, topic.summary))
    out.extend(scene_views(memory.scenes, turns_by_id, dialogue_words=dialogue_words, dialogue_turns=dialogue_turns))
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
    for ft in memory.family_triggers:  # a declared family beyond the built-in four: one row, its texts joined
        family = family_named(ft.family)
        text = "; ".join(t.strip() for t in ft.texts if t.strip())
        if family is not None and text:
            out.append(ViewText("item", ft.item_id, family.view, 0, text))
    return out

"""The context handed to the QA model (DESIGN §4 step 7): dated raw turns of the retrieved
scenes, then items with their event dates, then personas — under a token budget.

Tokens are *estimated*, not counted with a model tokenizer (none is downloaded): one token per
:data:`CHARS_PER_TOKEN` characters, rounded up — OpenAI's rule of thumb for English text, within
~10-20 % of BPE counts on dialogue. The budget covers scenes and items; personas are ambient
context appended outside it (DESIGN §4 step 6) and reported separately.

Packing. A whole scene costs its whole dialogue (~45 tokens a turn), so at a small budget one
scene would crowd out everything else. Units are therefore taken in priority order — first the
hits the ``reserved`` fusion rule holds, then scenes and items interleaved by relative rank
(scene i of nS at (i+1)/nS, item j of nI at (j+1)/nI, a scene before an item on ties) — and:

1. each unit enters with its core: an item whole, a scene with its best-matching dialogue window
   (:attr:`~tmem.retrieval.cascade.ScoredScene.windows`; the whole scene when it has none); a unit
   that does not fit is skipped and the next one tried;
2. the budget left grows the scenes that entered, in the same order, window by window in order of
   match, up to the whole scene.

At a large budget every scene is whole and nothing is skipped; at a small one the context holds
the moments that matched. A scene shown in part marks its gaps with ``[…]``.
"""

from __future__ import annotations

import math
from collections.abc import Collection, Mapping
from dataclasses import dataclass, field
from datetime import datetime
from typing import Literal

from tmem.domain import ItemTime, Persona
from tmem.retrieval.cascade import ScoredItem, ScoredScene, SearchResult

CHARS_PER_TOKEN = 4
GAP = "[…]"
SCENES_HEADER = "## Conversation excerpts"
ITEMS_HEADER = "## Facts"
PERSONAS_HEADER = "## Speakers"


def estimate_tokens(text: str) -> int:
    """Estimated token count: ``ceil(len(text) / CHARS_PER_TOKEN)``."""
    return math.ceil(len(text) / CHARS_PER_TOKEN)


def format_date(when: datetime | None) -> str:
    """``8 May 2023``; ``date unknown`` for a missing event time."""
    return f"{when.day} {when:%B %Y}" if when is not None else "date unknown"


def format_span(start: datetime, end: datetime) -> str:
    """``1–7 May 2023``, ``28 April – 4 May 2023``, ``30 December 2022 – 2 January 2023``."""
    if (start.year, start.month) == (end.year, end.month):
        return f"{start.day}–{end.day} {end:%B %Y}"
    if start.year == end.year:
        return f"{start.day} {start:%B} – {end.day} {end:%B %Y}"
    return f"{format_date(start)} – {format_date(end)}"


def format_item_time(time: ItemTime | None, fallback: datetime | None = None) -> str:
    """An item's time as precisely as the dialogue gave it, never more: ``8 May 2023``, ``May 2023``,
    ``2023``, ``1–7 May 2023``, with the dialogue's words (``May 2023, "last month"``); a time taken
    from the turn that says it reads ``said on 8 May 2023``, one from its scene ``around 8 May 2023``."""
    if time is None or time.start is None:
        return format_date(fallback)
    start = time.start
    if time.source == "scene":
        return f"around {format_date(start)}"
    if time.source == "said":
        return f"said on {format_date(start)}"
    if time.granularity == "span" and time.end is not None:
        text = format_span(start, time.end)
    elif time.granularity == "month":
        text = f"{start:%B %Y}"
    elif time.granularity == "year":
        text = f"{start.year}"
    else:
        text = format_date(start)
    return f'{text}, "{time.phrase}"' if time.phrase else text


def render_scene(scene: ScoredScene, keep: Collection[int] | None = None) -> str:
    """A scene header with its date span, then each raw turn as ``[8 May 2023] Speaker: text``;
    ``keep``: only these turn positions (gaps marked ``[…]``)."""
    start, end = format_date(scene.start_time), format_date(scene.end_time)
    span = start if start == end else f"{start} – {end}"
    lines = [f"### {scene.title} ({span})"]
    shown = range(len(scene.turns)) if keep is None else sorted(keep)
    previous = -1
    for position in shown:
        if position > previous + 1 and (previous >= 0 or keep is not None):
            lines.append(GAP)
        t = scene.turns[position]
        lines.append(f"[{format_date(t.event_time)}] {t.speaker}: {t.text}")
        previous = position
    if keep is not None and shown and previous < len(scene.turns) - 1:
        lines.append(GAP)
    return "\n".join(lines)


def render_item(item: ScoredItem) -> str:
    return f"- [{format_item_time(item.time, item.event_time)}] {item.content}"


def render_persona(persona: Persona) -> str:
    lines = [f"### {persona.speaker}"]
    for label, values in (
        ("Identity", persona.identity),
        ("Preferences", persona.preferences),
        ("Traits and attitudes", persona.traits),
        ("Relations", persona.relations),
    ):
        if values:
            lines.append(f"{label}: " + "; ".join(values))
    if persona.timeline:
        lines.append("Timeline:")
        lines += [f"- {f'[since {p.since}] ' if p.since else ''}{p.fact}" for p in persona.timeline]
    return "\n".join(lines)


@dataclass(frozen=True, slots=True)
class ContextReport:
    budget: int  # token budget for scenes + items
    tokens_used: int  # estimated tokens of the scenes + items part (≤ budget)
    persona_tokens: int  # estimated tokens of the persona part (outside the budget)
    total_tokens: int  # estimated tokens of the whole text
    scenes_kept: int  # scenes with at least one turn in the context
    scenes_dropped: int
    items_kept: int
    items_dropped: int
    scenes_partial: int = 0  # of the kept scenes, those shown in part (their best windows)
    turns_kept: int = 0


@dataclass(frozen=True, slots=True)
class FormattedContext:
    text: str
    report: ContextReport
    kept_turns: Mapping[str, tuple[str, ...]] = field(default_factory=dict)  # scene id -> turn ids shown
    kept_items: tuple[str, ...] = ()  # item ids shown, in rank order

    @property
    def scene_ids_kept(self) -> tuple[str, ...]:
        """The scenes the text holds (whole or in part), in result order."""
        return tuple(self.kept_turns)

    @property
    def item_ids_kept(self) -> tuple[str, ...]:
        return self.kept_items


def _render_memory(scenes: list[str], items: list[str]) -> str:
    parts: list[str] = []
    if scenes:
        parts.append(SCENES_HEADER + "\n\n" + "\n\n".join(scenes))
    if items:
        parts.append(ITEMS_HEADER + "\n" + "\n".join(items))
    return "\n\n".join(parts)


Unit = tuple[Literal["scene", "item"], int]


def _priority(result: SearchResult) -> list[Unit]:
    n_s, n_i = len(result.scenes), len(result.items)
    ranked = [(("scene", i), (i + 1) / n_s, 0) for i in range(n_s)] + [
        (("item", j), (j + 1) / n_i, 1) for j in range(n_i)
    ]
    order: list[Unit] = [u for u, _, _ in sorted(ranked, key=lambda u: (u[1], u[2]))]  # type: ignore[misc]
    held = [u for u in order if (result.scenes[u[1]] if u[0] == "scene" else result.items[u[1]]).reserved]
    return held + [u for u in order if u not in held]


def _windows(scene: ScoredScene) -> list[tuple[int, int]]:
    return list(scene.windows) or [(0, len(scene.turns))]


def format_context(result: SearchResult, budget_tokens: int) -> FormattedContext:
    """Render ``result`` as QA context within the budget (packing rule in the module docstring)."""
    if budget_tokens < 0:
        raise ValueError(f"token budget must be ≥ 0, got {budget_tokens}")
    shown: dict[int, set[int]] = {}  # scene position -> turn positions kept
    items: list[int] = []

    def render() -> str:
        return _render_memory(
            [render_scene(result.scenes[i], None if len(keep) == len(result.scenes[i].turns) else keep)
             for i, keep in sorted(shown.items()) if keep],
            [render_item(result.items[j]) for j in sorted(items)],
        )

    def fits() -> bool:
        return estimate_tokens(render()) <= budget_tokens

    priority = _priority(result)
    for kind, i in priority:  # 1. the core of every unit that fits
        if kind == "item":
            items.append(i)
            if not fits():
                items.remove(i)
            continue
        first, end = _windows(result.scenes[i])[0]
        shown[i] = set(range(first, end))
        if not fits():
            del shown[i]
    for kind, i in priority:  # 2. grow the scenes that entered, window by window
        if kind != "scene" or i not in shown:
            continue
        before = set(shown[i])
        shown[i] = set(range(len(result.scenes[i].turns)))
        if fits():
            continue
        shown[i] = before
        for first, end in _windows(result.scenes[i])[1:]:
            grown = shown[i] | set(range(first, end))
            if grown == shown[i]:
                continue
            previous, shown[i] = shown[i], grown
            if not fits():
                shown[i] = previous
    memory = render()
    persona = "\n\n".join(render_persona(p) for p in result.personas)
    persona_block = f"{PERSONAS_HEADER}\n\n{persona}" if persona else ""
    text = "\n\n".join(part for part in (memory, persona_block) if part)
    kept = {i: keep for i, keep in shown.items() if keep}
    return FormattedContext(
        text=text,
        report=ContextReport(
            budget=budget_tokens,
            tokens_used=estimate_tokens(memory),
            persona_tokens=estimate_tokens(persona_block),
            total_tokens=estimate_tokens(text),
            scenes_kept=len(kept),
            scenes_dropped=len(result.scenes) - len(kept),
            items_kept=len(items),
            items_dropped=len(result.items) - len(items),
            scenes_partial=sum(1 for i, keep in kept.items() if len(keep) < len(result.scenes[i].turns)),
            turns_kept=sum(len(keep) for keep in kept.values()),
        ),
        kept_turns={result.scenes[i].scene_id: tuple(result.scenes[i].turns[p].turn_id for p in sorted(keep))
                    for i, keep in sorted(kept.items())},
        kept_items=tuple(result.items[j].item_id for j in sorted(items)),
    )

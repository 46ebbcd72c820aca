"""The context handed to the QA model (DESIGN §4 step 7): dated raw turns of the retrieved
scenes, then items with their event dates, then personas — under a token budget.

Tokens are *estimated*, not counted with a model tokenizer (none is downloaded): one token per
:data:`CHARS_PER_TOKEN` characters, rounded up — OpenAI's rule of thumb for English text, within
~10-20 % of BPE counts on dialogue. The budget covers scenes and items; personas are ambient
context appended outside it (DESIGN §4 step 6) and reported separately.

When scenes and items exceed the budget, the lowest-ranked units are dropped first. Scenes and
items are interleaved by relative rank (scene i of nS at (i+1)/nS, item j of nI at (j+1)/nI, a
scene before an item on ties) and dropped from the end of that order, so neither kind is
emptied while the other keeps its tail.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from datetime import datetime

from tmem.domain import Persona
from tmem.retrieval.cascade import ScoredItem, ScoredScene, SearchResult

CHARS_PER_TOKEN = 4
SCENES_HEADER = "## Conversation excerpts"
ITEMS_HEADER = "## Facts"
PERSONAS_HEADER = "## Speakers"


def estimate_tokens(text: str) -> int:
    """Estimated token count: ``ceil(len(text) / CHARS_PER_TOKEN)``."""
    return math.ceil(len(text) / CHARS_PER_TOKEN)


def format_date(when: datetime | None) -> str:
    """``8 May 2023``; ``date unknown`` for a missing event time."""
    return f"{when.day} {when:%B %Y}" if when is not None else "date unknown"


def render_scene(scene: ScoredScene) -> str:
    """A scene header with its date span, then each raw turn as ``[8 May 2023] Speaker: text``."""
    start, end = format_date(scene.start_time), format_date(scene.end_time)
    span = start if start == end else f"{start} – {end}"
    lines = [f"### {scene.title} ({span})"]
    lines += [f"[{format_date(t.event_time)}] {t.speaker}: {t.text}" for t in scene.turns]
    return "\n".join(lines)


def render_item(item: ScoredItem) -> str:
    return f"- [{format_date(item.event_time)}] {item.content}"


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
    scenes_kept: int
    scenes_dropped: int
    items_kept: int
    items_dropped: int


@dataclass(frozen=True, slots=True)
class FormattedContext:
    text: str
    report: ContextReport
    scene_ids_kept: tuple[str, ...] = ()  # the scenes and items the text holds, in result order
    item_ids_kept: tuple[str, ...] = ()


def _render_memory(scenes: list[str], items: list[str]) -> str:
    parts: list[str] = []
    if scenes:
        parts.append(SCENES_HEADER + "\n\n" + "\n\n".join(scenes))
    if items:
        parts.append(ITEMS_HEADER + "\n" + "\n".join(items))
    return "\n\n".join(parts)


def format_context(result: SearchResult, budget_tokens: int) -> FormattedContext:
    """Render ``result`` as QA context, dropping the lowest-ranked scenes/items to fit the budget."""
    if budget_tokens < 0:
        raise ValueError(f"token budget must be ≥ 0, got {budget_tokens}")
    n_s, n_i = len(result.scenes), len(result.items)
    units = [(("scene", i), (i + 1) / n_s, 0) for i in range(n_s)] + [
        (("item", j), (j + 1) / n_i, 1) for j in range(n_i)
    ]
    priority = [u for u, _, _ in sorted(units, key=lambda u: (u[1], u[2]))]
    scene_text = [render_scene(s) for s in result.scenes]
    item_text = [render_item(it) for it in result.items]

    kept = len(priority)
    while True:
        keep = set(priority[:kept])
        memory = _render_memory(
            [t for i, t in enumerate(scene_text) if ("scene", i) in keep],
            [t for j, t in enumerate(item_text) if ("item", j) in keep],
        )
        if estimate_tokens(memory) <= budget_tokens or kept == 0:
            break
        kept -= 1
    persona = "\n\n".join(render_persona(p) for p in result.personas)
    persona_block = f"{PERSONAS_HEADER}\n\n{persona}" if persona else ""
    text = "\n\n".join(part for part in (memory, persona_block) if part)
    scenes_kept = sum(1 for kind, _ in keep if kind == "scene")
    items_kept = len(keep) - scenes_kept
    return FormattedContext(
        text=text,
        report=ContextReport(
            budget=budget_tokens,
            tokens_used=estimate_tokens(memory),
            persona_tokens=estimate_tokens(persona_block),
            total_tokens=estimate_tokens(text),
            scenes_kept=scenes_kept,
            scenes_dropped=n_s - scenes_kept,
            items_kept=items_kept,
            items_dropped=n_i - items_kept,
        ),
        scene_ids_kept=tuple(s.scene_id for i, s in enumerate(result.scenes) if ("scene", i) in keep),
        item_ids_kept=tuple(it.item_id for j, it in enumerate(result.items) if ("item", j) in keep),
    )

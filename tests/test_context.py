"""Context formatting: dated raw turns, dated items, persona last, token budget and its report."""

from __future__ import annotations

from datetime import UTC, datetime

import pytest

from tmem.domain import Persona, PersonaFact, Turn
from tmem.retrieval.cascade import ScoredItem, ScoredScene, SearchResult
from tmem.retrieval.context import (
    CHARS_PER_TOKEN,
    ITEMS_HEADER,
    PERSONAS_HEADER,
    SCENES_HEADER,
    estimate_tokens,
    format_context,
    format_date,
    render_scene,
)

MAY8 = datetime(2023, 5, 8, 13, 56, tzinfo=UTC)
MAY9 = datetime(2023, 5, 9, 9, 0, tzinfo=UTC)


def turn(tid: str, speaker: str, text: str, when: datetime) -> Turn:
    return Turn(conversation_id="c", session_id="s1", turn_id=tid, seq=0, speaker=speaker, text=text, event_time=when)


def scene(n: int, words: int = 5) -> ScoredScene:
    body = " ".join(f"word{n}" for _ in range(words))
    return ScoredScene(
        scene_id=f"s{n}",
        title=f"Scene {n}",
        turns=(turn(f"D{n}:1", "Caroline", f"I went to the support group. {body}", MAY8),),
        start_time=MAY8,
        end_time=MAY8,
        score=1.0 / (n + 1),
        channels=("lexical",),
    )


def item(n: int, when: datetime | None = MAY9) -> ScoredItem:
    return ScoredItem(
        item_id=f"i{n}",
        kind="atomic",
        content=f"Fact number {n} about Melanie",
        event_time=when,
        source_scene_ids=("s0",),
        score=1.0 / (n + 1),
        channels=("dense",),
    )


PERSONA = Persona(
    conversation_id="c",
    speaker="Caroline",
    identity=("transgender woman",),
    preferences=("painting",),
    traits=(),
    relations=("friend of Melanie",),
    timeline=(PersonaFact(fact="started counseling studies", since="May 2023"),),
)


def result(scenes, items, personas=()) -> SearchResult:
    return SearchResult(
        conversation_id="c", query="q", mode="hybrid", scenes=tuple(scenes), items=tuple(items), personas=personas
    )


def test_renders_dated_turns_then_items_then_persona():
    two_day = ScoredScene(
        scene_id="s9",
        title="Support group",
        turns=(
            turn("D1:1", "Caroline", "I went to the LGBTQ support group.", MAY8),
            turn("D2:1", "Melanie", "Wow!", MAY9),
        ),
        start_time=MAY8,
        end_time=MAY9,
        score=1.0,
        channels=("horizon",),
    )
    out = format_context(result([two_day], [item(0), item(1, when=None)], (PERSONA,)), 10_000)
    text = out.text
    assert "### Support group (8 May 2023 – 9 May 2023)" in text
    assert "[8 May 2023] Caroline: I went to the LGBTQ support group." in text
    assert "[9 May 2023] Melanie: Wow!" in text
    assert "- [9 May 2023] Fact number 0 about Melanie" in text
    assert "- [date unknown] Fact number 1 about Melanie" in text
    assert text.index(SCENES_HEADER) < text.index(ITEMS_HEADER) < text.index(PERSONAS_HEADER)
    assert text.rstrip().endswith("- [since May 2023] started counseling studies")
    assert "Relations: friend of Melanie" in text and "Traits" not in text  # empty fields are left out
    r = out.report
    assert (r.scenes_kept, r.scenes_dropped, r.items_kept, r.items_dropped) == (1, 0, 2, 0)
    assert r.total_tokens == estimate_tokens(text) and r.persona_tokens > 0
    assert r.tokens_used <= r.budget


def test_estimator_and_dates():
    assert estimate_tokens("") == 0
    assert estimate_tokens("a" * CHARS_PER_TOKEN) == 1
    assert estimate_tokens("a" * (CHARS_PER_TOKEN + 1)) == 2
    assert format_date(datetime(2023, 1, 3, tzinfo=UTC)) == "3 January 2023"


def test_budget_drops_lowest_ranked_units_first():
    scenes = [scene(n, words=40) for n in range(3)]
    items = [item(n) for n in range(6)]
    full = format_context(result(scenes, items), 100_000)
    budget = full.report.tokens_used - 40
    out = format_context(result(scenes, items), budget)
    r = out.report
    assert r.tokens_used <= budget < full.report.tokens_used
    assert r.scenes_dropped + r.items_dropped > 0
    # what is dropped is the tail: kept scenes/items are a prefix of the ranked lists
    kept_scenes = [s.scene_id for s in scenes if f"### {s.title} " in out.text]
    kept_items = [i.item_id for i in items if i.content in out.text]
    assert kept_scenes == [s.scene_id for s in scenes[: r.scenes_kept]]
    assert kept_items == [i.item_id for i in items[: r.items_kept]]
    assert "Scene 0" in out.text and "Fact number 0 " in out.text  # the top of both lists survives


def test_tail_of_the_interleaved_order_goes_first():
    # 2 scenes and 4 items: relative ranks s0 .5, s1 1.0, i0 .25, i1 .5, i2 .75, i3 1.0;
    # the priority order is i0, s0, i1, i2, s1, i3: i3 is the last to enter
    scenes = [scene(n, words=2) for n in range(2)]
    items = [item(n) for n in range(4)]
    full = format_context(result(scenes, items), 100_000).report.tokens_used
    one = format_context(result(scenes, items), full - 1).report
    assert (one.scenes_dropped, one.items_dropped) == (0, 1)


def test_a_unit_that_does_not_fit_is_skipped_and_smaller_ones_still_enter():
    """The old rule dropped everything after the first unit that did not fit; now a long scene that
    does not fit gives its room to the items ranked after it."""
    scenes = [scene(0, words=2), scene(1, words=200)]
    items = [item(n) for n in range(4)]
    without_s1 = format_context(result(scenes[:1], items), 100_000).report.tokens_used
    out = format_context(result(scenes, items), without_s1)
    assert (out.report.scenes_dropped, out.report.items_dropped) == (1, 0)
    assert out.kept_items == ("i0", "i1", "i2", "i3") and list(out.kept_turns) == ["s0"]


def long_scene() -> ScoredScene:
    """Six turns; its windows (best first) are turns 4-5, then 0-1, then 2-3."""
    turns = tuple(turn(f"D1:{k + 1}", "Caroline", f"Turn {k} " + "words " * 30, MAY8) for k in range(6))
    return ScoredScene(scene_id="s9", title="Long talk", turns=turns, start_time=MAY8, end_time=MAY9, score=1.0,
                       channels=("dialogue",), windows=((4, 6), (0, 2), (2, 4)))


def test_a_small_budget_hands_over_the_window_that_matched():
    s9 = long_scene()
    whole = format_context(result([s9], []), 100_000)
    assert whole.report.scenes_partial == 0 and "[…]" not in whole.text

    def cost(keep: set[int]) -> int:
        return estimate_tokens(SCENES_HEADER + "\n\n" + render_scene(s9, keep))

    core = format_context(result([s9], []), cost({4, 5}))
    assert core.kept_turns == {"s9": ("D1:5", "D1:6")} and core.report.scenes_partial == 1
    assert "Turn 4" in core.text and "Turn 0" not in core.text and core.text.count("[…]") == 1
    grown = format_context(result([s9], []), cost({0, 1, 4, 5}))  # the second-best window comes next
    assert grown.kept_turns == {"s9": ("D1:1", "D1:2", "D1:5", "D1:6")} and grown.report.turns_kept == 4
    assert grown.text.count("[…]") == 1  # one gap, between turn 1 and turn 4
    assert format_context(result([s9], []), cost({4, 5}) - 1).report.scenes_kept == 0


def test_reserved_hits_enter_first():
    s0, s1 = scene(0, words=60), scene(1, words=60)
    s1 = ScoredScene(**{**{f: getattr(s1, f) for f in s1.__slots__}, "reserved": True})
    budget = format_context(result([s0], []), 100_000).report.tokens_used
    out = format_context(result([s0, s1], []), budget)
    assert list(out.kept_turns) == ["s1"]  # the reserved SceneCue hit, though ranked second


def test_persona_is_outside_the_budget_and_zero_budget_keeps_nothing():
    out = format_context(result([scene(0)], [item(0)], (PERSONA,)), 0)
    assert out.report.scenes_kept == 0 and out.report.items_kept == 0 and out.report.tokens_used == 0
    assert out.text.startswith(PERSONAS_HEADER)
    assert out.report.total_tokens == out.report.persona_tokens > 0
    with pytest.raises(ValueError, match="budget"):
        format_context(result([], []), -1)

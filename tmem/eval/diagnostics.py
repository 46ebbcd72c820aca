"""Why the cascade found (or missed) an evidence turn: channel attribution and stage diagnostics.

Used by ``bench/real_model.py`` on memory built by a real model. LLM-free; one cascade run with
a trace per question.

* **Channel attribution.** An evidence turn counts as *found* at k when a returned scene holds it,
  or a returned item's source scene does (as :mod:`tmem.eval.tmem_system` counts recall). Each
  found turn is credited to the channels that reached the units holding it (the ``channels`` of
  :class:`~tmem.retrieval.cascade.ScoredScene` / ``ScoredItem``: lexical, dense, dialogue,
  scene_trigger, horizon, entity_bridge); ``only`` counts turns that one channel alone reached.
  ``persona`` is credited when the question's gold answer appears in the persona text handed
  over with the context (personas carry no turn ids).
* **TrigRecall.** How often the entity/bridge gate let items through, and whether those items
  are evidence (a source scene holds an evidence turn).
* **SceneCue ranks.** For each evidence scene, its rank in the dialogue, scene-trigger and
  horizon lists and in the fused SceneCue list (1 = best).
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from statistics import median
from typing import Any

from tmem.eval.examples import QAExample
from tmem.retrieval.cascade import SearchResult
from tmem.retrieval.context import render_persona
from tmem.retrieval.index import ConversationIndex
from tmem.retrieval.trace import Trace

CHANNELS: tuple[str, ...] = ("lexical", "dense", "dialogue", "scene_trigger", "horizon", "entity_bridge", "persona")
CUE_VIEWS: tuple[str, ...] = ("dialogue", "scene_trigger", "horizon")


@dataclass(frozen=True)
class QuestionDiagnosis:
    qid: str
    evidence: tuple[str, ...]
    reach: Mapping[str, frozenset[str]]  # found evidence turn -> channels that reached it
    persona_holds_answer: bool
    trig_fired: int  # items past the TrigRecall gate
    trig_evidence: int  # of those, items whose source scenes hold an evidence turn
    trig_best: float | None  # best NaN-aware max trigger cosine over items
    trig_best_evidence: float | None  # best trigger cosine among evidence items
    cue_ranks: Mapping[str, Mapping[str, int]]  # evidence scene -> {view or "fused": rank}

    @property
    def found(self) -> int:
        return len(self.reach)


def evidence_scenes(index: ConversationIndex, evidence: Iterable[str]) -> list[int]:
    """Positions of the scenes holding an evidence turn, in scene order."""
    wanted = set(evidence)
    return [i for i, turns in enumerate(index.scenes.turn_ids) if wanted & set(turns)]


def _item_turns(index: ConversationIndex, source_scene_ids: Sequence[str]) -> set[str]:
    return {t for sid in source_scene_ids if sid in index.scene_pos for t in index.scenes.turn_ids[index.scene_pos[sid]]}


def diagnose(index: ConversationIndex, example: QAExample, result: SearchResult) -> QuestionDiagnosis:
    """Attribution and stage diagnostics of one traced cascade run (``search(..., trace=True)``)."""
    if result.trace is None:
        raise ValueError("diagnose needs a traced search result (trace=True)")
    wanted = set(example.evidence)
    reach: dict[str, set[str]] = {}
    for scene in result.scenes:
        for turn in scene.turns:
            if turn.turn_id in wanted:
                reach.setdefault(turn.turn_id, set()).update(scene.channels)
    for item in result.items:
        for tid in _item_turns(index, item.source_scene_ids) & wanted:
            reach.setdefault(tid, set()).update(item.channels)
    answer = example.answer.strip().casefold()
    persona_text = "\n".join(render_persona(p) for p in result.personas).casefold()
    persona_hit = bool(answer) and len(answer) >= 3 and answer in persona_text
    fired, fired_ev, best, best_ev = _trig(index, result.trace, wanted)
    return QuestionDiagnosis(
        qid=example.qid, evidence=example.evidence, reach={t: frozenset(c) for t, c in reach.items()},
        persona_holds_answer=persona_hit, trig_fired=fired, trig_evidence=fired_ev, trig_best=best,
        trig_best_evidence=best_ev, cue_ranks=_cue_ranks(index, result.trace, wanted),
    )


def _trig(index: ConversationIndex, trace: Trace, wanted: set[str]) -> tuple[int, int, float | None, float | None]:
    stage = trace.stage("trig_recall")
    if stage is None:
        return 0, 0, None, None
    evidence_items = {
        index.items.ids[i] for i in range(index.n_items) if _item_turns(index, index.items.source_scene_ids[i]) & wanted
    }
    selected = set(stage.selected)
    best = max((c.scores.get("max", float("-inf")) for c in stage.candidates), default=None)
    best_ev = max((c.scores["max"] for c in stage.candidates if c.id in evidence_items and "max" in c.scores), default=None)
    return len(selected), len(selected & evidence_items), best, best_ev


def _cue_ranks(index: ConversationIndex, trace: Trace, wanted: set[str]) -> dict[str, dict[str, int]]:
    stage = trace.stage("scene_cue")
    if stage is None:
        return {}
    ids = {index.scenes.ids[i] for i in evidence_scenes(index, wanted)}
    out: dict[str, dict[str, int]] = {}
    for fused_rank, cand in enumerate(stage.candidates, start=1):
        if cand.id in ids:
            out[cand.id] = {**{v: cand.ranks[v] for v in CUE_VIEWS if v in cand.ranks}, "fused": fused_rank}
    return out


@dataclass
class DiagnosisSummary:
    questions: int = 0
    evidence_turns: int = 0
    found_turns: int = 0
    reached: Counter[str] = field(default_factory=Counter)
    only: Counter[str] = field(default_factory=Counter)
    trig_queries_fired: int = 0
    trig_items: int = 0
    trig_items_evidence: int = 0
    trig_queries_with_evidence: int = 0
    trig_best: list[float] = field(default_factory=list)
    cue_ranks: dict[str, list[int]] = field(default_factory=dict)

    def as_dict(self) -> dict[str, Any]:
        def med(values: list[float] | list[int]) -> float | None:
            return round(float(median(values)), 3) if values else None

        found = max(self.found_turns, 1)
        return {
            "questions": self.questions,
            "evidence_turns": self.evidence_turns,
            "found_turns": self.found_turns,
            "reached_by": {c: self.reached.get(c, 0) for c in CHANNELS},
            "reached_by_share": {c: round(self.reached.get(c, 0) / found, 3) for c in CHANNELS},
            "reached_only_by": {c: self.only.get(c, 0) for c in CHANNELS},
            "trig_recall": {
                "queries_fired": self.trig_queries_fired,
                "items_recalled": self.trig_items,
                "items_recalled_that_are_evidence": self.trig_items_evidence,
                "queries_with_an_evidence_item_recalled": self.trig_queries_with_evidence,
                "best_trigger_cosine_median": med(self.trig_best),
                "best_trigger_cosine_range": [round(min(self.trig_best), 3), round(max(self.trig_best), 3)]
                if self.trig_best else None,
            },
            "evidence_scene_rank_median": {v: med(r) for v, r in self.cue_ranks.items()},
        }


def summarise(diagnoses: Sequence[QuestionDiagnosis]) -> DiagnosisSummary:
    out = DiagnosisSummary(questions=len(diagnoses))
    for d in diagnoses:
        out.evidence_turns += len(set(d.evidence))
        out.found_turns += d.found
        for channels in d.reach.values():
            out.reached.update(channels)
            if len(channels) == 1:
                out.only.update(channels)
        if d.persona_holds_answer:
            out.reached["persona"] += 1
        out.trig_queries_fired += int(d.trig_fired > 0)
        out.trig_items += d.trig_fired
        out.trig_items_evidence += d.trig_evidence
        out.trig_queries_with_evidence += int(d.trig_evidence > 0)
        if d.trig_best is not None:
            out.trig_best.append(d.trig_best)
        for ranks in d.cue_ranks.values():
            for view, rank in ranks.items():
                out.cue_ranks.setdefault(view, []).append(rank)
    return out


@dataclass(frozen=True)
class CueCrowding:
    """With several cues stitched into one memory: do the other cues' scenes take a cue's places?"""

    questions: int
    returned: int  # questions whose own cue scene is among the k returned scenes
    misses_crowded: int  # misses with at least one other cue's scene among the k returned
    other_cue_scenes_per_question: float  # mean number of other cues' scenes among the k returned
    cue_scene_share: float  # cue scenes / all scenes: what the mean would be by chance, × k

    def as_dict(self) -> dict[str, Any]:
        return {"questions": self.questions, "returned": self.returned, "misses": self.questions - self.returned,
                "misses_crowded": self.misses_crowded,
                "other_cue_scenes_per_question": round(self.other_cue_scenes_per_question, 3),
                "cue_scene_share": round(self.cue_scene_share, 3)}


def cue_crowding(own: Sequence[set[str]], returned: Sequence[Sequence[str]], cue_scenes: set[str],
                 n_scenes: int) -> CueCrowding:
    """``own[q]``: the scene ids holding question q's cue turns; ``returned[q]``: the scene ids the
    cascade returned for it; ``cue_scenes``: every stitched cue's scenes; ``n_scenes``: the memory's."""
    if len(own) != len(returned):
        raise ValueError(f"{len(own)} questions but {len(returned)} results")
    hits = crowded = others = 0
    for mine, got in zip(own, returned, strict=True):
        foreign = sum(1 for s in got if s in cue_scenes and s not in mine)
        others += foreign
        if mine & set(got):
            hits += 1
        elif foreign:
            crowded += 1
    n = len(own)
    return CueCrowding(n, hits, crowded, others / n if n else 0.0, len(cue_scenes) / n_scenes if n_scenes else 0.0)

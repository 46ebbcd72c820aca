"""tmem as a system under retrieval evaluation: the cascade on a published snapshot.

* **At k**: the cascade runs with ``kS = kI = k`` (the preset's other settings unchanged); the
  units are the k scenes (their raw turns) and the k items, each item covering the turns of its
  source scenes. ``scenes_only`` keeps only the scenes (to see what items add).
* **At a budget B**: the cascade runs with ``kS = kI = budget_k`` and the QA context is rendered
  by :func:`tmem.retrieval.context.format_context` under ``B`` tokens — exactly what the answer
  model would get (personas are outside the budget, as in the product, and not counted).

The question is embedded once (shared :class:`~tmem.eval.retrieval_metrics.VectorMemo`) and
passed to the cascade as its query vector; results are memoised per (question, k).
"""

from __future__ import annotations

from tmem.eval.examples import QAExample
from tmem.eval.retrieval_metrics import Context, RetrievedUnit, VectorMemo
from tmem.query.memory import Memory, MemorySnapshot
from tmem.retrieval.cascade import SearchResult, search
from tmem.retrieval.config import RetrievalConfig
from tmem.retrieval.context import format_context, render_item, render_scene
from tmem.retrieval.index import ConversationIndex


class TmemSearcher:
    """Runs the cascade of one preset on a pinned snapshot, memoising results per (qid, k)."""

    def __init__(
        self, memory: Memory, preset: str, vectors: VectorMemo, *, budget_k: int = 20,
        config: RetrievalConfig | None = None,
    ) -> None:
        self.snapshot: MemorySnapshot = memory.snapshot()
        self.preset = preset
        self.base: RetrievalConfig = config if config is not None else memory.config(preset)
        self.vectors = vectors
        self.budget_k = budget_k
        self._results: dict[tuple[str, int], SearchResult] = {}

    def index(self, conversation_id: str) -> ConversationIndex:
        return self.snapshot.index(conversation_id)

    def result(self, example: QAExample, k: int) -> SearchResult:
        key = (example.qid, k)
        found = self._results.get(key)
        if found is None:
            index = self.index(example.conversation_id)
            vector = self.vectors.vector(example.question) if index.dim > 0 else None
            config = self.base.with_(k_scenes=k, k_items=k)
            found = search(index, example.question, vector, config, speaker=example.speaker)
            self._results[key] = found
        return found

    def units(self, example: QAExample, result: SearchResult, *, scenes_only: bool) -> list[RetrievedUnit]:
        index = self.index(example.conversation_id)
        units = [
            RetrievedUnit("scene", s.scene_id, tuple(t.turn_id for t in s.turns), render_scene(s)) for s in result.scenes
        ]
        if not scenes_only:
            for item in result.items:
                turns = tuple(
                    tid for sid in item.source_scene_ids if sid in index.scene_pos
                    for tid in index.scenes.turn_ids[index.scene_pos[sid]]
                )
                units.append(RetrievedUnit("item", item.item_id, turns, render_item(item)))
        return units


class TmemRetriever:
    """One view of a :class:`TmemSearcher`: scenes and items (``tmem:<preset>``) or scenes only
    (``tmem-scenes:<preset>``)."""

    def __init__(self, searcher: TmemSearcher, *, scenes_only: bool = False) -> None:
        self.searcher = searcher
        self.scenes_only = scenes_only

    @property
    def name(self) -> str:
        return f"{'tmem-scenes' if self.scenes_only else 'tmem'}:{self.searcher.preset}"

    def ranked(self, example: QAExample, k: int) -> list[RetrievedUnit]:
        return self.searcher.units(example, self.searcher.result(example, k), scenes_only=self.scenes_only)

    def within_budget(self, example: QAExample, budget: int) -> Context:
        result = self.searcher.result(example, self.searcher.budget_k)
        if self.scenes_only:
            result = SearchResult(result.conversation_id, result.query, result.mode, result.scenes, (), result.personas)
        formatted = format_context(result, budget)
        # exactly what the answer model would read: the scene turns shown and the items kept (an
        # item covers the turns of its source scenes, as at k)
        units = self.searcher.units(example, result, scenes_only=self.scenes_only)
        items = [u for u in units if u.kind == "item" and u.unit_id in set(formatted.kept_items)]
        turns = frozenset(t for ids in formatted.kept_turns.values() for t in ids) | {t for u in items for t in u.turn_ids}
        return Context(turns, len(formatted.kept_turns) + len(items), formatted.report.tokens_used)

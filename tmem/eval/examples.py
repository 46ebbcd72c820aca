"""What every evaluation module shares: a benchmark question, a data-defect report, and the
reading of benchmark files (typed errors naming the file and the record)."""

from __future__ import annotations

import json
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal

from tmem.domain import Conversation
from tmem.errors import DatasetError, IngestError

__all__ = ["DatasetError"]
from tmem.ingest.locomo import parse_locomo

MAX_EXAMPLES = 12  # examples kept per defect kind

Dataset = Literal["locomo", "locomo-plus"]



@dataclass(frozen=True)
class QAExample:
    """One benchmark question, ready for retrieval and QA."""

    qid: str  # "conv-26#12" (LoCoMo: sample id + 0-based qa index) or "plus-0007"
    dataset: Dataset
    conversation_id: str  # the memory to query
    question: str
    answer: str  # gold answer as text ("" when absent)
    category: str  # LoCoMo: multi-hop|temporal|open-domain|single-hop|adversarial; Plus: cognitive
    category_id: int | None  # LoCoMo id 1-5; None for Plus
    evidence: tuple[str, ...]  # normalised evidence turn ids (LoCoMo) / the cue's turn ids (Plus)
    question_date: str | None  # ISO 8601 with offset. LoCoMo: last session's start; Plus: the trigger's time
    speaker: str | None  # who asks (Plus: the trigger's speaker; LoCoMo: the one speaker the question names)
    extra: Mapping[str, str] = field(default_factory=dict, hash=False)


@dataclass(frozen=True)
class DefectReport:
    """How many times each data defect (or handling rule) occurred, with a few examples each."""

    counts: dict[str, int]
    examples: dict[str, list[str]]

    def count(self, kind: str) -> int:
        return self.counts.get(kind, 0)

    def merged(self, other: DefectReport) -> DefectReport:
        counts = dict(self.counts)
        examples = {k: list(v) for k, v in self.examples.items()}
        for kind, n in other.counts.items():
            counts[kind] = counts.get(kind, 0) + n
            examples.setdefault(kind, [])
            examples[kind] = (examples[kind] + other.examples.get(kind, []))[:MAX_EXAMPLES]
        return DefectReport(dict(sorted(counts.items())), examples)

    def as_dict(self) -> dict[str, Any]:
        return {"counts": dict(self.counts), "examples": {k: list(v) for k, v in self.examples.items()}}

    def lines(self) -> list[str]:
        """``kind: n (e.g. ex1; ex2)``, one per kind, sorted by kind."""
        return [
            f"{kind}: {n}" + (f" (e.g. {'; '.join(self.examples.get(kind, [])[:3])})" if self.examples.get(kind) else "")
            for kind, n in sorted(self.counts.items())
        ]


class DefectLog:
    """Mutable collector behind a :class:`DefectReport`."""

    def __init__(self) -> None:
        self._counts: dict[str, int] = {}
        self._examples: dict[str, list[str]] = {}

    def note(self, kind: str, example: str | None = None, n: int = 1) -> None:
        self._counts[kind] = self._counts.get(kind, 0) + n
        if example is not None:
            kept = self._examples.setdefault(kind, [])
            if len(kept) < MAX_EXAMPLES:
                kept.append(example)

    def report(self) -> DefectReport:
        return DefectReport(dict(sorted(self._counts.items())), {k: list(v) for k, v in self._examples.items()})


def load_json(path: Path) -> Any:
    try:
        text = Path(path).read_text(encoding="utf-8-sig")
    except OSError as exc:
        raise DatasetError(f"{path}: file: cannot read ({exc.strerror or exc})") from None
    try:
        return json.loads(text)
    except json.JSONDecodeError as exc:
        raise DatasetError(f"{path}: line {exc.lineno} column {exc.colno}: not valid JSON: {exc.msg}") from None


def read_locomo_file(path: Path) -> tuple[list[Conversation], list[Any]]:
    """The validated conversations of a LoCoMo file (the ingest parser: same ids, times and QA as
    the store) and the raw decoded samples (for what parsing normalises away, e.g. int answers)."""
    data = load_json(path)
    try:
        archive = parse_locomo(data, str(path))
    except IngestError as exc:
        raise DatasetError(str(exc)) from exc
    return list(archive.conversations), data if isinstance(data, list) else []

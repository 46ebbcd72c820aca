"""The folder of one evaluation run: everything it produced, as JSON Lines, so it can resume and
be re-scored without a single LLM call.

Layout (one folder per configuration)::

    manifest.json      what the run is: dataset, config, prompts, models (checked on resume)
    examples.jsonl     the questions, as loaded (re-scoring needs no dataset file)
    contexts.jsonl     per question: the context text sent, its token report, what was recalled
    answers.jsonl      per question: the answer, the prompt used, input/context tokens
    judgements.jsonl   per question and judge run: label, score, reasoning
    errors.jsonl       per failed call: the stage, the typed error and its message
    build_costs.json   build tokens and calls per conversation (from the store's build records)

Records are appended one line at a time and flushed, so a crash loses at most the line being
written; a damaged last line is skipped on reading (and counted), and its question is redone.
"""

from __future__ import annotations

import json
import logging
import threading
from collections.abc import Iterable, Mapping
from dataclasses import asdict
from pathlib import Path
from typing import Any, Literal

from tmem.errors import TmemError
from tmem.eval.examples import QAExample

log = logging.getLogger(__name__)

Kind = Literal["contexts", "answers", "judgements", "errors"]
MANIFEST = "manifest.json"
EXAMPLES = "examples.jsonl"
BUILD_COSTS = "build_costs.json"
# Manifest keys that must match when a run resumes (anything else may change, e.g. judge_runs).
IDENTITY_KEYS = ("dataset", "config", "answer_prompt", "judge_prompt", "answer_model", "judge_model")


class RunFolderError(TmemError):
    """A run folder cannot be used: unreadable, or it holds a different run."""


def example_record(example: QAExample) -> dict[str, Any]:
    record = asdict(example)
    record["evidence"] = list(example.evidence)
    record["extra"] = dict(example.extra)
    return record


def example_from_record(record: Mapping[str, Any]) -> QAExample:
    return QAExample(
        qid=str(record["qid"]), dataset=record["dataset"], conversation_id=str(record["conversation_id"]),
        question=str(record["question"]), answer=str(record["answer"]), category=str(record["category"]),
        category_id=record.get("category_id"), evidence=tuple(record.get("evidence") or ()),
        question_date=record.get("question_date"), speaker=record.get("speaker"),
        extra={str(k): str(v) for k, v in dict(record.get("extra") or {}).items()},
    )


class RunFolder:
    """Append-only JSONL storage of one run. Thread-safe appends."""

    def __init__(self, path: Path) -> None:
        self.path = Path(path)
        self._lock = threading.Lock()
        self.damaged_lines = 0

    def file(self, kind: str) -> Path:
        return self.path / f"{kind}.jsonl"

    @property
    def exists(self) -> bool:
        return (self.path / MANIFEST).is_file()

    # ---- manifest ------------------------------------------------------------------------------

    def read_manifest(self) -> dict[str, Any]:
        try:
            data = json.loads((self.path / MANIFEST).read_text(encoding="utf-8"))
        except FileNotFoundError:
            raise RunFolderError(f"{self.path}: not an evaluation run folder (no {MANIFEST})") from None
        except (OSError, json.JSONDecodeError) as exc:
            raise RunFolderError(f"{self.path / MANIFEST}: unreadable ({exc})") from exc
        if not isinstance(data, dict):
            raise RunFolderError(f"{self.path / MANIFEST}: expected a JSON object")
        return data

    def open(self, manifest: Mapping[str, Any]) -> dict[str, Any]:
        """Start a run here, or resume the run already here if it is the same run (same
        :data:`IDENTITY_KEYS`); returns the manifest in force."""
        self.path.mkdir(parents=True, exist_ok=True)
        if self.exists:
            current = self.read_manifest()
            for key in IDENTITY_KEYS:
                if key in manifest and key in current and current[key] != manifest[key]:
                    raise RunFolderError(
                        f"{self.path} holds a different run ({key}: {current[key]!r}, now {manifest[key]!r}); "
                        "choose another results folder or delete this one"
                    )
            merged = {**current, **{k: v for k, v in manifest.items() if k not in IDENTITY_KEYS or k not in current}}
        else:
            merged = dict(manifest)
        self.write_json(MANIFEST, merged)
        return merged

    def write_json(self, name: str, value: Any) -> None:
        target = self.path / name
        tmp = target.with_suffix(target.suffix + ".tmp")
        tmp.write_text(json.dumps(value, ensure_ascii=False, indent=1, sort_keys=True, default=str), encoding="utf-8")
        tmp.replace(target)

    def read_json(self, name: str) -> Any:
        path = self.path / name
        if not path.is_file():
            return None
        try:
            return json.loads(path.read_text(encoding="utf-8"))
        except (OSError, json.JSONDecodeError) as exc:
            raise RunFolderError(f"{path}: unreadable ({exc})") from exc

    # ---- examples --------------------------------------------------------------------------------

    def add_examples(self, examples: Iterable[QAExample]) -> list[QAExample]:
        """Record the questions of this run (new qids are appended); returns all of them."""
        known = {e.qid: e for e in self.examples()}
        fresh = [e for e in examples if e.qid not in known]
        self._append_many(self.path / EXAMPLES, [example_record(e) for e in fresh])
        return [*known.values(), *fresh]

    def examples(self) -> list[QAExample]:
        return [example_from_record(r) for r in self._read(self.path / EXAMPLES)]

    # ---- records ---------------------------------------------------------------------------------

    def append(self, kind: Kind, record: Mapping[str, Any]) -> None:
        self._append_many(self.file(kind), [record])

    def records(self, kind: Kind) -> list[dict[str, Any]]:
        return self._read(self.file(kind))

    def answered(self) -> dict[str, dict[str, Any]]:
        """qid → its answer record (the last one if a qid was answered twice)."""
        return {str(r["qid"]): r for r in self.records("answers")}

    def judged(self) -> dict[tuple[str, int], dict[str, Any]]:
        """(qid, judge run) → its judgement record."""
        return {(str(r["qid"]), int(r["run"])): r for r in self.records("judgements")}

    def _append_many(self, path: Path, records: list[Mapping[str, Any]]) -> None:
        if not records:
            return
        lines = "".join(json.dumps(r, ensure_ascii=False, default=str) + "\n" for r in records)
        with self._lock:
            self.path.mkdir(parents=True, exist_ok=True)
            if path.is_file() and path.stat().st_size > 0:
                with path.open("rb") as tail:
                    tail.seek(-1, 2)
                    if tail.read(1) != b"\n":  # an interrupted write: keep the damage on its own line
                        lines = "\n" + lines
            with path.open("a", encoding="utf-8") as handle:
                handle.write(lines)
                handle.flush()

    def _read(self, path: Path) -> list[dict[str, Any]]:
        if not path.is_file():
            return []
        out: list[dict[str, Any]] = []
        with path.open(encoding="utf-8") as handle:
            for number, line in enumerate(handle, start=1):
                if not line.strip():
                    continue
                try:
                    record = json.loads(line)
                except json.JSONDecodeError:
                    record = None
                if not isinstance(record, dict):
                    self.damaged_lines += 1
                    log.warning("%s line %d is damaged (an interrupted write?); skipped, its work will be redone",
                                path, number)
                    continue
                out.append(record)
        return out

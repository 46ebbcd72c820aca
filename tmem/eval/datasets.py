"""Benchmark questions for evaluation: LoCoMo QA with its data defects normalised and counted.

LoCoMo (``locomo10.json``, ``../shared/datasets/locomo/PROVENANCE.md``) is used as published; its
defects are handled here and every case is counted in a :class:`DefectReport`:

* **Evidence ids** (``"D<session>:<turn>"``) are normalised only where the reading is unambiguous
  (:func:`normalise_evidence_id`): several ids in one string split on ``;``/``,``/whitespace
  (``"D8:6; D9:17"``, ``"D9:1 D4:4 D4:6"``); a stray colon after the ``D`` is dropped
  (``"D:11:26"`` → ``D11:26``: the only reading with two numbers); a zero-padded turn number is
  read as the number (``"D30:05"`` → ``D30:5``, the turn that answers its question). Anything
  else (``"D"``) is excluded, as are ids naming no turn of the conversation; repeated ids count
  once. A question left with no usable evidence stays in the QA set but not in recall.
* **Integer answers** (``2022``) become text; category-5 items without ``answer`` get ``""``.
* **Audit flags** (``errata/locomo-audit_errors.json``, dial481/locomo-audit, 156 items) are
  reported, never applied to answers: the flagged type, corrected answer and corrected evidence
  travel in :attr:`QAExample.extra`; ``audited_evidence=True`` measures recall against the
  audit's corrected evidence instead of the file's.

LoCoMo-Plus stitching lives in :mod:`tmem.eval.plus_stitch` and is re-exported here.
"""

from __future__ import annotations

import json
import re
from collections.abc import Collection, Iterable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Literal

from tmem.domain import Conversation
from tmem.eval.examples import DatasetError, DefectLog, DefectReport, QAExample, load_json, read_locomo_file
from tmem.eval.plus_stitch import load_locomo_plus_qa, parse_time_gap, stitch_locomo_plus

CATEGORY_NAMES: Mapping[int, str] = {
    1: "multi-hop",
    2: "temporal",
    3: "open-domain",
    4: "single-hop",
    5: "adversarial",
}
"""LoCoMo category ids as the official code uses them (not the paper's print order)."""
DEFAULT_CATEGORIES: tuple[int, ...] = (1, 2, 3, 4)
AUDIT_RELATIVE_PATH = Path("errata") / "locomo-audit_errors.json"
# --------------------------------------------------------------------------- evidence ids

_CANONICAL = re.compile(r"D(\d+):(\d+)")
_STRAY_COLON = re.compile(r"D:(\d+):(\d+)")
_SEPARATOR = re.compile(r"[;,\s]+")

EvidenceRule = Literal["zero_padded", "stray_colon", "split_list"]


@dataclass(frozen=True)
class EvidenceParse:
    """What one raw evidence string reads as: ``ids`` (possibly several), the ``rules`` applied
    (empty for a well-formed id) and the ``unresolved`` parts that name no turn id at all."""

    ids: tuple[str, ...]
    rules: tuple[EvidenceRule, ...] = ()
    unresolved: tuple[str, ...] = ()


def _single_id(part: str) -> tuple[str, EvidenceRule | None] | None:
    """One id: ``(canonical, rule)`` or ``None`` when the text is no turn id."""
    match = _CANONICAL.fullmatch(part)
    rule: EvidenceRule | None = None
    if match is None:
        match = _STRAY_COLON.fullmatch(part)
        rule = "stray_colon"
    if match is None:
        return None
    canonical = f"D{int(match[1])}:{int(match[2])}"
    if rule is None and canonical != part:
        rule = "zero_padded"
    return canonical, rule


def normalise_evidence_id(raw: str) -> EvidenceParse:
    """Read one raw evidence string of LoCoMo (rules in the module docstring).

    >>> normalise_evidence_id("D8:6; D9:17").ids
    ('D8:6', 'D9:17')
    """
    text = raw.strip()
    parts = [p for p in _SEPARATOR.split(text) if p]
    rules: list[EvidenceRule] = ["split_list"] if len(parts) > 1 else []
    ids: list[str] = []
    unresolved: list[str] = []
    for part in parts or [text]:
        read = _single_id(part)
        if read is None:
            unresolved.append(part)
            continue
        ids.append(read[0])
        if read[1] is not None and read[1] not in rules:
            rules.append(read[1])
    return EvidenceParse(tuple(ids), tuple(rules), tuple(unresolved))


def resolve_evidence(raw: Sequence[str], turn_ids: Collection[str], log: DefectLog, ref: str) -> tuple[str, ...]:
    """Normalised, existing, de-duplicated evidence ids of one question; every defect is noted in ``log``.

    Kinds: ``empty_evidence``, ``malformed_evidence_normalised`` (+ ``evidence_rule:<rule>``),
    ``malformed_evidence_excluded``, ``missing_evidence_turn``, ``duplicate_evidence``,
    ``no_usable_evidence``.
    """
    if not raw:
        log.note("empty_evidence", ref)
    out: list[str] = []
    for value in raw:
        parsed = normalise_evidence_id(value)
        if parsed.rules and parsed.ids:
            log.note("malformed_evidence_normalised", f"{ref} {value!r} -> {' '.join(parsed.ids)}")
            for rule in parsed.rules:
                log.note(f"evidence_rule:{rule}", f"{ref} {value!r}")
        for part in parsed.unresolved:
            log.note("malformed_evidence_excluded", f"{ref} {part!r} (in {value!r})")
        for tid in parsed.ids:
            if tid not in turn_ids:
                log.note("missing_evidence_turn", f"{ref} {tid}")
            elif tid in out:
                log.note("duplicate_evidence", f"{ref} {tid}")
            else:
                out.append(tid)
    if not out:
        log.note("no_usable_evidence", ref)
    return tuple(out)


# --------------------------------------------------------------------------- LoCoMo


@dataclass(frozen=True)
class AuditFlag:
    """One item of dial481/locomo-audit ``errors.json``."""

    error_type: str
    correct_answer: str
    correct_evidence: tuple[str, ...]
    reasoning: str


_AUDIT_ID = re.compile(r"locomo_(\d+)_qa(\d+)")


def read_audit(path: Path, samples: Sequence[Conversation]) -> dict[tuple[str, int], AuditFlag]:
    """Audit flags keyed by ``(sample_id, qa_index)``. The audit names questions
    ``locomo_<sample position>_qa<qa index>`` (both 0-based); each flag must name a question of
    ``samples`` with the same text, else :class:`DatasetError`."""
    data = load_json(path)
    if not isinstance(data, list):
        raise DatasetError(f"{path}: (root): expected a JSON array of audit flags")
    flags: dict[tuple[str, int], AuditFlag] = {}
    for n, entry in enumerate(data):
        where = f"{path}: /{n}"
        if not isinstance(entry, dict):
            raise DatasetError(f"{where}: expected an object")
        match = _AUDIT_ID.fullmatch(str(entry.get("question_id", "")))
        if match is None:
            raise DatasetError(f"{where}: question_id {entry.get('question_id')!r} is not locomo_<i>_qa<j>")
        sample_pos, qa_index = int(match[1]), int(match[2])
        if sample_pos >= len(samples) or qa_index >= len(samples[sample_pos].qa):
            raise DatasetError(f"{where}: {match[0]} names no question of the LoCoMo file")
        sample = samples[sample_pos]
        if sample.qa[qa_index].question != entry.get("question"):
            raise DatasetError(f"{where}: {match[0]} is {entry.get('question')!r} in the audit but "
                               f"{sample.qa[qa_index].question!r} in the LoCoMo file")
        flags[(sample.conversation_id, qa_index)] = AuditFlag(
            error_type=str(entry.get("error_type", "")),
            correct_answer=str(entry.get("correct_answer", "")),
            correct_evidence=tuple(str(e) for e in entry.get("correct_evidence") or ()),
            reasoning=str(entry.get("reasoning", "")),
        )
    return flags


def question_speaker(question: str, speakers: Iterable[str]) -> str | None:
    """The one speaker whose name the question contains (``Melanie``, ``Melanie's``), else ``None``."""
    named = [s for s in speakers if re.search(rf"\b{re.escape(s)}\b", question)]
    return named[0] if len(named) == 1 else None


def load_locomo_qa(
    path: Path,
    categories: Sequence[int] = DEFAULT_CATEGORIES,
    *,
    audit: Path | bool = True,
    audited_evidence: bool = False,
) -> tuple[list[QAExample], DefectReport]:
    """LoCoMo questions of ``categories`` (default 1-4: 1,540 questions), in file order.

    ``audit``: ``True`` reads ``errata/locomo-audit_errors.json`` beside the file when it exists,
    a path reads that file, ``False`` reads none. Flags are counted (``audit_flagged``,
    ``audit:<TYPE>``) and described in ``extra``; answers are never changed. With
    ``audited_evidence`` a flagged question's evidence is the audit's corrected evidence.
    """
    unknown = sorted(set(categories) - set(CATEGORY_NAMES))
    if unknown or not categories:
        raise ValueError(f"LoCoMo categories are 1-5, got {list(categories)}")
    conversations, raw_samples = read_locomo_file(Path(path))
    audit_path = _audit_path(Path(path), audit)
    flags = read_audit(audit_path, conversations) if audit_path is not None else {}
    log = DefectLog()
    wanted = set(categories)
    examples: list[QAExample] = []
    for position, conv in enumerate(conversations):
        turn_ids = {t.turn_id for t in conv.turns}
        question_date = conv.sessions[-1].started_at.isoformat()
        raw_qa = raw_samples[position].get("qa", []) if isinstance(raw_samples[position], dict) else []
        for qa in conv.qa:
            if qa.category not in wanted:
                continue
            qid = f"{conv.conversation_id}#{qa.index}"
            extra = {"sample_id": conv.conversation_id, "qa_index": str(qa.index), "raw_evidence": json.dumps(list(qa.evidence))}
            raw_answer = raw_qa[qa.index].get("answer") if qa.index < len(raw_qa) else None
            if isinstance(raw_answer, int | float) and not isinstance(raw_answer, bool):
                log.note("answer_int", f"{qid} {raw_answer!r}")
            if qa.answer is None:
                log.note("answer_absent", qid)
            if qa.adversarial_answer is not None:
                extra["adversarial_answer"] = qa.adversarial_answer
            evidence_raw: Sequence[str] = qa.evidence
            flag = flags.get((conv.conversation_id, qa.index))
            if flag is not None:
                log.note("audit_flagged", qid)
                log.note(f"audit:{flag.error_type}", qid)
                extra |= {
                    "audit_error_type": flag.error_type,
                    "audit_correct_answer": flag.correct_answer,
                    "audit_correct_evidence": json.dumps(list(flag.correct_evidence)),
                }
                if audited_evidence:
                    evidence_raw = flag.correct_evidence
            examples.append(
                QAExample(
                    qid=qid,
                    dataset="locomo",
                    conversation_id=conv.conversation_id,
                    question=qa.question,
                    answer=qa.answer or "",
                    category=CATEGORY_NAMES[qa.category],
                    category_id=qa.category,
                    evidence=resolve_evidence(evidence_raw, turn_ids, log, qid),
                    question_date=question_date,
                    speaker=question_speaker(qa.question, conv.speakers),
                    extra=extra,
                )
            )
    return examples, log.report()


def _audit_path(path: Path, audit: Path | bool) -> Path | None:
    if audit is False:
        return None
    if audit is True:
        candidate = path.parent / AUDIT_RELATIVE_PATH
        return candidate if candidate.is_file() else None
    return Path(audit)


__all__ = [
    "CATEGORY_NAMES",
    "DEFAULT_CATEGORIES",
    "DatasetError",
    "DefectLog",
    "DefectReport",
    "EvidenceParse",
    "QAExample",
    "load_locomo_plus_qa",
    "load_locomo_qa",
    "normalise_evidence_id",
    "parse_time_gap",
    "resolve_evidence",
    "stitch_locomo_plus",
]

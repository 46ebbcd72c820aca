"""LoCoMo-Plus in one build: many cue dialogues stitched into one LoCoMo conversation.

The official protocol (:mod:`tmem.eval.plus_stitch`) builds one memory per LoCoMo-Plus item: 401
builds of ~600 turns each. To measure associative recall (cue recall) and the memory-awareness
judge on a user's own model with **one** build, this module stitches ``n`` cues into one host
conversation, each cue as a short session of its own:

* **Which cues.** The items the protocol hosts in this conversation (item ``i`` is hosted by
  LoCoMo conversation ``i mod 10``), the first ``n`` of them, or an explicit list of item indices.
* **Where.** Spread evenly over the host: cue ``j`` of ``n`` follows host session
  ``round((j + 1) * S / (n + 1))`` (at least 1), so the cues sit among the host's matters instead
  of piling up at its end. Each cue is placed in the gap after that session (several cues in one
  gap split it evenly); after the last session, one day apart. This departs from the protocol's
  ``time_gap`` placement, which would put most cues in the last weeks: one-build cue recall
  measures whether an associative trigger finds its cue among the host's scenes, not the gap.
* **Ids.** Sessions are renumbered in time order (``session_1`` … ``session_S+n``) and turn ids
  follow (``D<session>:<turn>``); the host's questions keep their evidence, remapped to the new ids.
* **Questions.** Each trigger is asked 7 days after the host's last session (as the protocol asks
  it), by the trigger's speaker, with the cue's turns as evidence.

The result is written as a LoCoMo JSON archive (``tmem ingest`` reads it; its QA block is the
host's questions, so ``tmem eval retrieval --dataset locomo`` on it is evidence recall) and, beside
it, the same archive whose QA block holds the trigger queries (cue recall with the same command).
"""

from __future__ import annotations

import copy
import json
from collections.abc import Sequence
from dataclasses import dataclass
from datetime import datetime, timedelta
from pathlib import Path
from typing import Any

from tmem.eval.datasets import normalise_evidence_id
from tmem.eval.examples import DatasetError, DefectLog, DefectReport, QAExample, load_json
from tmem.eval.plus_stitch import PLUS_CATEGORY, TRIGGER_DELAY, PlusItem, dialogue_lines, read_plus_items
from tmem.ingest.locomo import parse_locomo_datetime

ARCHIVE_FILE = "archive.json"
CUE_QUESTIONS_FILE = "cue_questions.json"
CUE_CATEGORY = 4  # the cue questions of the LoCoMo-format export are read as single-hop questions
MIN_CUE_GAP = timedelta(minutes=2)
_SESSION_KEY_PREFIX = "session_"


@dataclass(frozen=True)
class CueStitch:
    """One host with ``n`` cues: the stitched LoCoMo sample, its cue questions and the defects."""

    conversation_id: str
    sample: dict[str, Any]  # LoCoMo JSON sample; its qa block is the host's, evidence remapped
    cue_examples: tuple[QAExample, ...]
    defects: DefectReport

    def cue_sample(self) -> dict[str, Any]:
        """The same sample whose QA block holds the trigger queries, evidence = the cue turns."""
        qa = [
            {"question": e.question, "answer": "", "evidence": list(e.evidence), "category": CUE_CATEGORY,
             "plus_index": int(e.extra["plus_index"]), "relation_type": e.extra["relation_type"]}
            for e in self.cue_examples
        ]
        return {**self.sample, "qa": qa}


def locomo_date(moment: datetime) -> str:
    """``1:56 pm on 8 May, 2023`` (the LoCoMo session date format; minutes, no seconds)."""
    hour = moment.hour % 12 or 12
    return f"{hour}:{moment.minute:02d} {'am' if moment.hour < 12 else 'pm'} on {moment.day} {moment:%B}, {moment.year}"


def _sessions(sample: dict[str, Any], ref: str) -> list[tuple[int, datetime, list[dict[str, Any]]]]:
    conv = sample.get("conversation")
    if not isinstance(conv, dict):
        raise DatasetError(f"{ref}: /conversation: expected an object")
    numbers = sorted(
        int(key[len(_SESSION_KEY_PREFIX):]) for key, value in conv.items()
        if key.startswith(_SESSION_KEY_PREFIX) and key[len(_SESSION_KEY_PREFIX):].isdigit() and isinstance(value, list)
    )
    out = []
    for number in numbers:
        turns = conv[f"session_{number}"]
        if not turns:
            continue
        try:
            start = parse_locomo_datetime(str(conv.get(f"session_{number}_date_time", "")))
        except ValueError as exc:
            raise DatasetError(f"{ref}: /conversation/session_{number}_date_time: {exc}") from None
        out.append((number, start, turns))
    if not out:
        raise DatasetError(f"{ref}: the conversation has no sessions")
    return out


def hosted_items(items: Sequence[PlusItem], host_position: int, hosts: int) -> list[PlusItem]:
    """The items the protocol hosts in the conversation at ``host_position`` (item i → i mod hosts)."""
    return [item for item in items if item.index % hosts == host_position]


def cue_positions(sessions: int, cues: int) -> list[int]:
    """After which host session (1-based) each of ``cues`` cues goes: spread evenly, never before 1."""
    return [max(1, min(sessions, round((j + 1) * sessions / (cues + 1)))) for j in range(cues)]


def stitch_cues(
    locomo_path: Path,
    plus_path: Path,
    host_id: str,
    *,
    cues: int = 16,
    item_indices: Sequence[int] | None = None,
    conversation_id: str | None = None,
) -> CueStitch:
    """Stitch ``cues`` LoCoMo-Plus cues (or the items ``item_indices``) into the host ``host_id``."""
    data = load_json(Path(locomo_path))
    if not isinstance(data, list):
        raise DatasetError(f"{locomo_path}: (root): expected a JSON array of LoCoMo samples")
    ids = [s.get("sample_id") if isinstance(s, dict) else None for s in data]
    if host_id not in ids:
        raise DatasetError(f"{locomo_path}: no sample {host_id!r}; it has {', '.join(str(i) for i in ids)}")
    host_position = ids.index(host_id)
    host = data[host_position]
    ref = f"{locomo_path}: /{host_position}"
    items = read_plus_items(Path(plus_path))
    if item_indices is not None:
        by_index = {item.index: item for item in items}
        unknown = [i for i in item_indices if i not in by_index]
        if unknown:
            raise DatasetError(f"{plus_path}: no LoCoMo-Plus items {unknown} (it has 0..{len(items) - 1})")
        chosen = [by_index[i] for i in item_indices]
    else:
        if cues < 1:
            raise ValueError(f"cues must be ≥ 1, got {cues}")
        chosen = hosted_items(items, host_position, len(data))[:cues]
    if not chosen:
        raise DatasetError(f"{plus_path}: no LoCoMo-Plus items to stitch into {host_id}")
    cid = conversation_id or f"{host_id}+cues{len(chosen)}"
    log = DefectLog()
    conv = host["conversation"]
    speakers = (str(conv.get("speaker_a", "")), str(conv.get("speaker_b", "")))
    if not all(speakers):
        raise DatasetError(f"{ref}/conversation: speaker_a and speaker_b are required")

    sessions = _sessions(host, ref)
    after = cue_positions(len(sessions), len(chosen))
    trigger_time = sessions[-1][1] + TRIGGER_DELAY
    # blocks in time order: (start, raw turns, cue item or None)
    blocks: list[tuple[datetime, list[dict[str, Any]], PlusItem | None]] = []
    for position, (_, start, turns) in enumerate(sessions, start=1):
        blocks.append((start, turns, None))
        waiting = [item for item, p in zip(chosen, after, strict=True) if p == position]
        if not waiting:
            continue
        last_turn = start + timedelta(seconds=len(turns) - 1)
        following = sessions[position][1] if position < len(sessions) else None
        for k, item in enumerate(waiting, start=1):
            if following is None:
                cue_start = start + timedelta(days=k)
            else:
                cue_start = last_turn + (following - last_turn) * k / (len(waiting) + 1)
            afternoon = cue_start.replace(hour=14, minute=0, second=0, microsecond=0)  # a chat at a daytime hour
            if afternoon - last_turn >= MIN_CUE_GAP and (following is None or following - afternoon >= MIN_CUE_GAP):
                cue_start = afternoon
            cue_start = cue_start.replace(second=0, microsecond=0)
            if cue_start - last_turn < MIN_CUE_GAP or (following is not None and following - cue_start < MIN_CUE_GAP):
                raise DatasetError(f"LoCoMo-Plus item {item.index}: no room for its cue after session {position} of {host_id}")
            lines = dialogue_lines(item.cue_dialogue, speakers, f"{cid} cue {item.index}", log)
            if not lines:
                raise DatasetError(f"LoCoMo-Plus item {item.index}: empty cue dialogue")
            blocks.append((cue_start, [{"speaker": s, "text": t} for s, t in lines], item))

    new_conv: dict[str, Any] = {"speaker_a": speakers[0], "speaker_b": speakers[1]}
    remap: dict[str, str] = {}
    cue_ids: dict[int, tuple[str, ...]] = {}
    for number, (start, turns, cue) in enumerate(blocks, start=1):
        new_conv[f"session_{number}_date_time"] = locomo_date(start)
        renumbered = []
        for k, turn in enumerate(turns, start=1):
            new_id = f"D{number}:{k}"
            if cue is None and isinstance(turn.get("dia_id"), str):
                remap[turn["dia_id"]] = new_id
            renumbered.append({**copy.deepcopy(turn), "dia_id": new_id})
        new_conv[f"session_{number}"] = renumbered
        if cue is not None:
            cue_ids[cue.index] = tuple(t["dia_id"] for t in renumbered)

    qa = [_remap_qa(q, remap, log, f"{cid}#{n}") for n, q in enumerate(host.get("qa", []) or [])]
    sample = {"sample_id": cid, "conversation": new_conv, "qa": qa}
    examples = []
    for item in chosen:
        trigger = dialogue_lines(item.trigger_query, speakers, f"{cid} trigger {item.index}", log)
        if not trigger:
            raise DatasetError(f"LoCoMo-Plus item {item.index}: empty trigger query")
        examples.append(QAExample(
            qid=f"{cid}#plus-{item.index:04d}", dataset="locomo-plus", conversation_id=cid,
            question=" ".join(text for _, text in trigger), answer="", category=PLUS_CATEGORY, category_id=None,
            evidence=cue_ids[item.index], question_date=trigger_time.isoformat(), speaker=trigger[0][0],
            extra={"relation_type": item.relation_type, "time_gap": item.time_gap, "host_conversation_id": host_id,
                   "cue_dialogue": item.cue_dialogue, "trigger_query": item.trigger_query,
                   "plus_index": str(item.index), "model_name": item.model_name, "stitch": "one-build"},
        ))
    return CueStitch(cid, sample, tuple(examples), log.report())


def _remap_qa(qa: Any, remap: dict[str, str], log: DefectLog, ref: str) -> Any:
    if not isinstance(qa, dict):
        return qa
    out = dict(qa)
    evidence = qa.get("evidence")
    if isinstance(evidence, list):
        mapped: list[Any] = []
        for raw in evidence:
            parsed = normalise_evidence_id(str(raw))
            ids = [remap.get(i) for i in parsed.ids] if parsed.ids else [None]
            if all(ids):
                mapped.extend(i for i in ids if i)
            else:
                log.note("evidence_not_remapped", f"{ref} {raw!r}")
                mapped.append(raw)
        out["evidence"] = mapped
    return out


def write_cue_stitch(stitch: CueStitch, out_dir: Path) -> tuple[Path, Path]:
    """``archive.json`` (host QA) and ``cue_questions.json`` (trigger queries) under ``out_dir``."""
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    paths = []
    for name, sample in ((ARCHIVE_FILE, stitch.sample), (CUE_QUESTIONS_FILE, stitch.cue_sample())):
        path = out / name
        tmp = path.with_suffix(".json.tmp")
        tmp.write_text(json.dumps([sample], ensure_ascii=False, indent=1), encoding="utf-8")
        tmp.replace(path)
        paths.append(path)
    return paths[0], paths[1]

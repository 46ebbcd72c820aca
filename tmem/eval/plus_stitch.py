"""LoCoMo-Plus: stitch each cognitive cue into a LoCoMo conversation, one memory per item.

The protocol (``../shared/datasets/locomo_plus/PROVENANCE.md``, the official ``build_conv.py``):

* item ``i`` is hosted by LoCoMo conversation ``i mod 10`` (file order);
* the trigger is placed 7 days after the start of the host's last session;
* the cue dialogue is placed ``time_gap`` before the trigger (:func:`parse_time_gap`);
* cue speakers map ``A`` → the host's ``speaker_a``, ``B`` → ``speaker_b`` (so does the trigger's).

Each stitched conversation (``conversation_id`` ``plus-0007``) holds the host's sessions and the
cue as a session of its own, and **not** the trigger (the trigger is the question). Rules:

* **Position.** The cue goes after every host session that starts at or before its time
  (ties: after the session, as the official stable sort does). LoCoMo turns carry no clock time
  (the ingest spaces a session's turns one second apart), so when the cue's time falls inside
  the preceding session's span — a one-week gap lands exactly on the last session's start — the
  cue starts one second after that session's last turn (counted: ``cue_shifted``). Timestamps
  therefore never decrease, as ingest requires.
* **Numbering.** Sessions are renumbered in time order (``session_1`` … ``session_K+1``) and turn
  ids follow them (``D<session>:<turn>``), so the cue looks like any other session to the
  builder's prompts (which see turn ids). The host's original turn id is kept in the turn
  metadata (``locomo_dia_id``); metadata is never shown to a model.
* Host turns are the ingest parser's turns (same text, image captions and event times as
  ``tmem ingest locomo10.json``); cue turns are one second apart from the cue's start.
"""

from __future__ import annotations

import json
import re
from collections.abc import Sequence
from dataclasses import dataclass
from datetime import timedelta
from functools import cached_property
from pathlib import Path
from typing import Any, Literal

from tmem.domain import Conversation, Turn
from tmem.eval.examples import DatasetError, DefectLog, DefectReport, QAExample, load_json, read_locomo_file
from tmem.ingest.locomo import TURN_SPACING

TRIGGER_DELAY = timedelta(days=7)
UNIT_DAYS = {"day": 1, "week": 7, "month": 30, "year": 365}  # the official parse_time_gap's units (+ days)
NUMBER_WORDS = {
    "a": 1, "an": 1, "one": 1, "two": 2, "three": 3, "four": 4, "five": 5, "six": 6,
    "seven": 7, "eight": 8, "nine": 9, "ten": 10, "eleven": 11, "twelve": 12,
}  # fmt: skip
VAGUE_WORDS = {"a couple of": 2, "couple of": 2, "a few": 3, "few": 3, "several": 3}
_GAP = re.compile(
    r"\b(?P<num>a couple of|couple of|a few|few|several|\d+|"
    + "|".join(sorted(NUMBER_WORDS, key=len, reverse=True))
    + r")[\s-]*(?P<unit>day|week|month|year)s?\b",
    re.IGNORECASE,
)
PLUS_CATEGORY = "cognitive"

GapStatus = Literal["exact", "vague", "unparseable"]


@dataclass(frozen=True)
class TimeGap:
    text: str
    days: int
    status: GapStatus  # vague: "several"/"a few"/"a couple of" read as 3/3/2; unparseable: 0 days


def parse_time_gap(text: str) -> TimeGap:
    """``"about six weeks later"`` → 42 days. A week is 7 days, a month 30, a year 365 (as the
    official parser); "a"/"an" count 1; "about"/"around"/"roughly" are ignored.

    Where the official parser gives 0 days (cue at the trigger's own time), this one reads the
    vague quantities "a couple of" as 2, "a few" and "several" as 3 (status ``vague``; 15 items of
    the data). Text without any count and unit is ``unparseable`` and gives 0 days, as officially.
    """
    match = _GAP.search(text)
    if match is None:
        return TimeGap(text, 0, "unparseable")
    num, unit = match["num"].lower(), match["unit"].lower()
    if num in VAGUE_WORDS:
        return TimeGap(text, VAGUE_WORDS[num] * UNIT_DAYS[unit], "vague")
    count = int(num) if num.isdigit() else NUMBER_WORDS[num]
    return TimeGap(text, count * UNIT_DAYS[unit], "exact")


@dataclass(frozen=True)
class PlusItem:
    """One LoCoMo-Plus item as published."""

    index: int
    relation_type: str
    cue_dialogue: str
    trigger_query: str
    time_gap: str
    model_name: str


@dataclass(frozen=True)
class StitchedConversation:
    """One item stitched into its host: the host, the cue turns, the cue's place and the question.
    :attr:`turns` (the archive's turns, renumbered) is built on first use: 401 × ~600 of them."""

    conversation_id: str
    host: Conversation
    cue_turns: tuple[Turn, ...]  # speaker, text and event time of each cue turn
    position: int  # the cue follows this many host sessions
    example: QAExample

    @property
    def host_id(self) -> str:
        return self.host.conversation_id

    @property
    def speakers(self) -> tuple[str, ...]:
        return self.host.speakers

    @property
    def cue_turn_ids(self) -> tuple[str, ...]:
        return tuple(f"D{self.position + 1}:{k}" for k in range(1, len(self.cue_turns) + 1))

    @cached_property
    def turns(self) -> tuple[Turn, ...]:
        by_session: dict[str, list[Turn]] = {}
        for turn in self.host.turns:
            by_session.setdefault(turn.session_id, []).append(turn)
        blocks = [by_session[s.session_id] for s in self.host.sessions]
        blocks.insert(self.position, list(self.cue_turns))
        turns: list[Turn] = []
        for number, block in enumerate(blocks, start=1):
            is_cue = number == self.position + 1
            for k, turn in enumerate(block, start=1):
                turns.append(turn.model_copy(update={  # no re-validation: these turns are validated
                    "conversation_id": self.conversation_id, "session_id": f"session_{number}",
                    "turn_id": f"D{number}:{k}", "seq": len(turns),
                    "metadata": {} if is_cue else {**turn.metadata, "locomo_dia_id": turn.turn_id},
                }))
        return tuple(turns)

    def jsonl_records(self) -> list[dict[str, Any]]:
        """The conversation in tmem's JSON Lines format (docs/ingest-formats.md)."""
        records: list[dict[str, Any]] = [
            {"kind": "conversation", "conversation_id": self.conversation_id, "speakers": list(self.speakers)}
        ]
        for t in self.turns:
            record: dict[str, Any] = {
                "conversation_id": t.conversation_id, "session_id": t.session_id, "turn_id": t.turn_id,
                "speaker": t.speaker, "text": t.text, "timestamp": t.event_time.isoformat(),
            }
            if t.metadata:
                record["metadata"] = dict(t.metadata)
            records.append(record)
        return records

    def jsonl(self) -> str:
        return "".join(json.dumps(r, ensure_ascii=False) + "\n" for r in self.jsonl_records())


def read_plus_items(path: Path) -> list[PlusItem]:
    data = load_json(path)
    if not isinstance(data, list):
        raise DatasetError(f"{path}: (root): expected a JSON array of LoCoMo-Plus items")
    items: list[PlusItem] = []
    for i, entry in enumerate(data):
        fields = ("relation_type", "cue_dialogue", "trigger_query", "time_gap")
        if not isinstance(entry, dict) or any(not isinstance(entry.get(f), str) for f in fields):
            raise DatasetError(f"{path}: /{i}: expected an object with string fields {', '.join(fields)}")
        items.append(
            PlusItem(i, entry["relation_type"], entry["cue_dialogue"], entry["trigger_query"], entry["time_gap"],
                     str(entry.get("model_name", "")))
        )
    return items


# A second speaker written inline: "… A-text. B: reply" (a speaker marker after the end of a sentence).
_INLINE_SPEAKER = re.compile(r"(?<=[.!?…\"'”’)])\s+(?=[AB]:\s)")
_LITERAL_NEWLINE = "\\n"  # a backslash and an n, written where a line break was meant


def dialogue_lines(text: str, speakers: Sequence[str], ref: str, log: DefectLog) -> list[tuple[str, str]]:
    """``"A: …\\nB: …"`` → ``[(speaker name, text), …]``; A → ``speakers[0]``, B → ``speakers[1]``.

    Two data defects are repaired and counted: a literal backslash-n written for a line break
    (``dialogue_literal_newline``) and a second speaker's turn written inline after the first's
    sentence, ``"… done. B: reply"`` (``dialogue_inline_speaker``). A line without a prefix
    continues the previous line (counted ``dialogue_line_unprefixed``)."""
    if _LITERAL_NEWLINE in text:
        log.note("dialogue_literal_newline", f"{ref} {text[:40]!r}")
        text = text.replace(_LITERAL_NEWLINE, "\n")
    out: list[tuple[str, str]] = []
    for raw_line in text.split("\n"):
        parts = _INLINE_SPEAKER.split(raw_line.strip())
        if len(parts) > 1:
            log.note("dialogue_inline_speaker", f"{ref} {raw_line.strip()[:40]!r}")
        for line in parts:
            line = line.strip()
            if not line:
                continue
            if line[:2] in ("A:", "B:"):
                out.append((speakers[0] if line[0] == "A" else speakers[1], line[2:].strip()))
            elif out:
                log.note("dialogue_line_unprefixed", f"{ref} {line[:40]!r}")
                out[-1] = (out[-1][0], f"{out[-1][1]} {line}")
            else:
                log.note("dialogue_line_unprefixed", f"{ref} {line[:40]!r}")
                out.append((speakers[0], line))
    return [(s, t) for s, t in out if t]


def stitch_item(item: PlusItem, host: Conversation, log: DefectLog) -> StitchedConversation:
    """Stitch one item into its host conversation (rules in the module docstring)."""
    cid = f"plus-{item.index:04d}"
    gap = parse_time_gap(item.time_gap)
    if gap.status != "exact":
        log.note(f"time_gap_{gap.status}", f"{cid} {item.time_gap!r} -> {gap.days} days")
    cue = dialogue_lines(item.cue_dialogue, host.speakers, f"{cid} cue", log)
    trigger = dialogue_lines(item.trigger_query, host.speakers, f"{cid} trigger", log)
    if not cue or not trigger:
        raise DatasetError(f"LoCoMo-Plus item {item.index}: empty {'cue dialogue' if not cue else 'trigger query'}")
    if len(trigger) > 1:
        log.note("trigger_multi_line", cid)
    if len({s for s, _ in cue}) == 1:
        log.note("cue_one_speaker", cid)

    trigger_time = host.sessions[-1].started_at + TRIGGER_DELAY
    cue_time = trigger_time - timedelta(days=gap.days)
    by_session: dict[str, list[Turn]] = {}
    for turn in host.turns:
        by_session.setdefault(turn.session_id, []).append(turn)
    position = sum(1 for s in host.sessions if s.started_at <= cue_time)
    cue_start = cue_time
    if position == 0:
        log.note("cue_before_first_session", cid)
    else:
        previous_end = by_session[host.sessions[position - 1].session_id][-1].event_time
        if cue_start <= previous_end:
            cue_start = previous_end + TURN_SPACING
            log.note("cue_shifted", f"{cid} {item.time_gap!r}: after {host.sessions[position - 1].session_id}")
    cue_end = cue_start + (len(cue) - 1) * TURN_SPACING
    if position < len(host.sessions) and cue_end >= host.sessions[position].started_at:
        raise DatasetError(
            f"LoCoMo-Plus item {item.index}: the cue ({cue_start.isoformat()}) does not fit before "
            f"{host.sessions[position].session_id} of {host.conversation_id}"
        )

    cue_turns = tuple(
        Turn(conversation_id=cid, session_id="cue", turn_id=f"cue:{k}", seq=k, speaker=speaker, text=text,
             event_time=cue_start + k * TURN_SPACING)
        for k, (speaker, text) in enumerate(cue)
    )
    cue_ids = tuple(f"D{position + 1}:{k}" for k in range(1, len(cue_turns) + 1))

    example = QAExample(
        qid=cid,
        dataset="locomo-plus",
        conversation_id=cid,
        question=" ".join(text for _, text in trigger),
        answer="",
        category=PLUS_CATEGORY,
        category_id=None,
        evidence=cue_ids,
        question_date=trigger_time.isoformat(),
        speaker=trigger[0][0],
        extra={
            "relation_type": item.relation_type,
            "time_gap": item.time_gap,
            "time_gap_days": str(gap.days),
            "time_gap_status": gap.status,
            "host_conversation_id": host.conversation_id,
            "cue_dialogue": item.cue_dialogue,
            "cue_time": cue_start.isoformat(),
            "cue_session": f"session_{position + 1}",
            "trigger_query": item.trigger_query,
            "plus_index": str(item.index),
            "model_name": item.model_name,
        },
    )
    return StitchedConversation(cid, host, cue_turns, position, example)


def stitch_all(locomo_path: Path, plus_path: Path, *, limit: int | None = None) -> tuple[list[StitchedConversation], DefectReport]:
    """Every item (or the first ``limit``) stitched into its host, in item order."""
    hosts, _ = read_locomo_file(Path(locomo_path))
    items = read_plus_items(Path(plus_path))
    if limit is not None:
        if limit < 0:
            raise ValueError(f"limit must be ≥ 0, got {limit}")
        items = items[:limit]
    log = DefectLog()
    seen_cues: dict[str, int] = {}
    stitched: list[StitchedConversation] = []
    for item in items:
        if item.cue_dialogue in seen_cues:
            log.note("duplicate_cue", f"plus-{item.index:04d} = plus-{seen_cues[item.cue_dialogue]:04d}")
        seen_cues.setdefault(item.cue_dialogue, item.index)
        stitched.append(stitch_item(item, hosts[item.index % len(hosts)], log))
    return stitched, log.report()


def load_locomo_plus_qa(
    locomo_path: Path, plus_path: Path, *, limit: int | None = None
) -> tuple[list[QAExample], DefectReport]:
    """The LoCoMo-Plus questions (one per item; evidence = the cue's turn ids), writing nothing."""
    stitched, report = stitch_all(locomo_path, plus_path, limit=limit)
    return [s.example for s in stitched], report


def stitch_locomo_plus(
    locomo_path: Path, plus_path: Path, out_dir: Path, *, limit: int | None = None
) -> tuple[list[Path], list[QAExample], DefectReport]:
    """Write one JSON Lines archive per item (``out_dir/plus-0007.jsonl``) for ``tmem ingest``;
    returns the paths and questions in item order, and the defect report."""
    stitched, report = stitch_all(locomo_path, plus_path, limit=limit)
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    paths: list[Path] = []
    for conv in stitched:
        path = out / f"{conv.conversation_id}.jsonl"
        tmp = path.with_suffix(".jsonl.tmp")
        tmp.write_text(conv.jsonl(), encoding="utf-8")
        tmp.replace(path)
        paths.append(path)
    return paths, [s.example for s in stitched], report

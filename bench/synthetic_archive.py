"""Synthetic LoCoMo-format archives shaped like LoCoMo, for the archive-scale benchmarks.

Each conversation has two speakers and ``sessions`` sessions; a session's number of turns and a
turn's number of words are drawn from LoCoMo's own (``locomo10.json``: 272 sessions of 10-47 turns,
mean 21.6; turns of 1-100+ words, median 20). Words are pronounceable pseudo-words over a
Zipf-distributed vocabulary (``bench/scale_store.py``'s :class:`Texts`), so no two conversations
share a turn (nothing is answered by another conversation's cache), with now and then an English
cue the scripted responders know ("I love", "my sister", "I started") so personas have content.
Sessions are a few days apart, in order; the same seed always writes the same archive, and the
archive with ``sessions + 1`` sessions starts with exactly the sessions of the one with
``sessions`` (an append-only grown archive, as ``tmem ingest`` expects).
"""

from __future__ import annotations

import json
import random
from dataclasses import dataclass
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]
DEFAULT_LOCOMO = REPO.parent / "shared" / "datasets" / "locomo" / "locomo10.json"
CUES = ("I love", "I really enjoy", "My sister said", "My friend and I", "I started", "I'm a", "I moved to",
        "My kids", "I work as a", "My favorite is")
T0 = datetime(2023, 3, 1, 10, 0, tzinfo=UTC)


@dataclass(frozen=True)
class LocomoShape:
    """LoCoMo's empirical session lengths (turns) and turn lengths (words)."""

    session_turns: tuple[int, ...]
    turn_words: tuple[int, ...]

    @classmethod
    def load(cls, locomo: Path = DEFAULT_LOCOMO) -> LocomoShape:
        sessions: list[int] = []
        words: list[int] = []
        for sample in json.loads(locomo.read_text(encoding="utf-8")):
            for key, value in sample["conversation"].items():
                if key.startswith("session_") and not key.endswith("date_time") and isinstance(value, list):
                    sessions.append(len(value))
                    words += [max(1, len(str(t.get("text", "")).split())) for t in value]
        return cls(tuple(sessions), tuple(words))


def _date(at: datetime) -> str:
    """LoCoMo's ``h:mm am/pm on D Month, YYYY``."""
    hour = at.hour % 12 or 12
    return f"{hour}:{at.minute:02d} {'am' if at.hour < 12 else 'pm'} on {at.day} {at.strftime('%B')}, {at.year}"


def conversation_id(n: int) -> str:
    return f"syn-{n:05d}"


def synthetic_samples(count: int, sessions: int, shape: LocomoShape, seed: int = 14) -> list[dict[str, Any]]:
    """``count`` LoCoMo samples of ``sessions`` sessions each (deterministic in ``seed``)."""
    import sys

    sys.path.insert(0, str(REPO))
    from bench.scale_store import Texts

    texts = Texts(seed, vocabulary=6000, phrases=200_000)
    samples: list[dict[str, Any]] = []
    for n in range(count):
        rng = random.Random(f"{seed}/{n}")  # per conversation: growing `sessions` keeps earlier sessions
        speakers = (f"Ava{n}", f"Ben{n}")
        conv: dict[str, Any] = {"speaker_a": speakers[0], "speaker_b": speakers[1]}
        at = T0 + timedelta(hours=rng.randrange(0, 24 * 30))
        for s in range(1, sessions + 1):
            turns = []
            for k in range(rng.choice(shape.session_turns)):
                words = rng.choice(shape.turn_words)
                text = texts.text(max(1, words - 2), words + 2).capitalize() + "."
                if rng.random() < 0.15:
                    text = f"{rng.choice(CUES)} {texts.text(2, 4)}. {text}"
                turns.append({"speaker": speakers[k % 2], "dia_id": f"D{s}:{k + 1}", "text": text})
            conv[f"session_{s}_date_time"] = _date(at)
            conv[f"session_{s}"] = turns
            at += timedelta(days=rng.randint(2, 9), minutes=rng.randrange(0, 600))
        samples.append({"sample_id": conversation_id(n), "conversation": conv, "qa": []})
    return samples


def write_archives(root: Path, count: int, sessions: int, seed: int = 14) -> tuple[Path, Path, dict[str, Any]]:
    """The archive with ``sessions`` sessions per conversation, the one grown by one session, and facts."""
    shape = LocomoShape.load()
    grown = synthetic_samples(count, sessions + 1, shape, seed)
    first = [
        {**s, "conversation": {k: v for k, v in s["conversation"].items()
                               if not k.startswith(f"session_{sessions + 1}")}}
        for s in grown
    ]
    paths = root / "archive.json", root / "archive-grown.json"
    for path, samples in zip(paths, (first, grown), strict=True):
        path.write_text(json.dumps(samples, ensure_ascii=False), encoding="utf-8")

    def turns(samples: list[dict[str, Any]]) -> int:
        return sum(len(v) for s in samples for k, v in s["conversation"].items()
                   if k.startswith("session_") and isinstance(v, list))

    facts = {"conversations": count, "sessions": sessions, "seed": seed, "turns": turns(first),
             "turns_grown": turns(grown), "locomo_session_turns_mean": round(sum(shape.session_turns) / len(shape.session_turns), 1),
             "locomo_turn_words_median": sorted(shape.turn_words)[len(shape.turn_words) // 2]}
    return paths[0], paths[1], facts

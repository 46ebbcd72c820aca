"""Deterministic responders for the scripted development LLM (tests and benchmarks only).

One function per prompt operation, ``(operation, request_json) -> JSON content``. Each reads the
prompt's input block and writes a plausible, schema-valid answer from the input's own words:
no randomness, no clock, the same request always gives the same answer. They prove that the
pipeline runs and what it costs in calls; they say nothing about the quality a real model gives.

Importing this module registers every responder with :mod:`tmem.devtools.scripted_llm`.
"""

from __future__ import annotations

import hashlib
import json
import re
from collections import Counter
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass
from typing import Any

from tmem.devtools.responders import input_message, register_responder, request_input
from tmem.prompts.common import parse_context

Responder = Callable[[str, dict[str, Any]], str]

MIN_TURNS_AT_SESSION_END = 4  # a scene this long closes where its session ends
SCENE_LENGTHS = (8, 14)  # otherwise a scene closes after 8..14 turns, chosen by a content hash
ADMIT_OVERLAP = 2  # a topic admits a scene sharing this many content words, plus one per 15 topic words
TOPIC_KEYWORDS = 12
LIST_CAP = 12

_WORD = re.compile(r"[A-Za-z][A-Za-z'-]*")
_LOWER_WORD = re.compile(r"(?<![A-Za-z'-])[a-z][a-z'-]{2,}(?![A-Za-z])")  # words of 3+ letters not capitalised
_SENTENCE_END = re.compile(r"(?<=[.!?])\s+")
STOPWORDS = frozenset(
    """
    a about above after again against all also am an and any are aren't as at be because been before
    being below between both but by can can't cannot could couldn't did didn't do does doesn't doing don't
    down during each even ever few for from further get gets getting got had hadn't has hasn't have haven't
    having he he'd he'll he's her here here's hers herself him himself his how how's i i'd i'll i'm i've if
    in into is isn't it it's its itself just know let's like lot lots me more most much must mustn't my
    myself no nor not now of off oh on once one only or other ought our ours ourselves out over own really
    same say said she she'd she'll she's should shouldn't so some such sure than thank thanks that that's
    the their theirs them themselves then there there's these they they'd they'll they're they've thing
    things think this those though through to too totally under until up upon us very was wasn't way we
    we'd we'll we're we've well were weren't what what's when when's where where's which while who who's
    whom why why's will with won't would wouldn't yeah yes yet you you'd you'll you're you've your yours
    yourself yourselves going go great good glad awesome amazing cool wow hey hi hello definitely always
    make made take took feel felt lately time times see seen want wanted bit kind many every something
    anything everything someone anyone new old tell told sounds sound looks look looking keep
    talked talk shares share photo said last since still super
    """.split()
)
EMOTIONS: tuple[tuple[str, frozenset[str]], ...] = (
    (
        "They felt joyful and proud.",
        frozenset({"happy", "proud", "excited", "love", "loved", "fun", "joy", "thrilled"}),
    ),
    (
        "They felt worried and uneasy.",
        frozenset({"worried", "scared", "stress", "stressed", "anxious", "hard", "tough"}),
    ),
    ("They felt sad and reflective.", frozenset({"sad", "miss", "lost", "sorry", "cry", "grief", "lonely"})),
    ("They felt grateful and supported.", frozenset({"grateful", "support", "supportive", "thankful", "appreciate"})),
)
# Cue phrases, matched as whole words against a sentence's lower-cased words.
FAMILY = tuple(
    f" {w} "
    for w in "kids kid children husband wife mom mother dad father sister brother friend friends family partner son daughter parents".split()
)
LIKES = (" love ", " like ", " enjoy ", " favorite ", " favourite ", " passion ", " into ")
IDENTITY = (" i'm a ", " i am a ", " i work ", " as a ", " my job ", " i'm from ", " i moved ")
CHANGES = (" started ", " moved ", " joined ", " began ")


def _hash(*parts: Any) -> int:
    digest = hashlib.sha256(json.dumps(parts, sort_keys=True, default=str).encode()).hexdigest()
    return int(digest[:12], 16)


def content_words(text: str) -> list[str]:
    """Lower-case content words; capitalised tokens (names, sentence starts) and stopwords dropped."""
    return [w for w in _LOWER_WORD.findall(text) if w not in STOPWORDS]


def top_words(texts: Iterable[str], n: int, exclude: Iterable[str] = ()) -> list[str]:
    """The ``n`` most frequent content words, ties broken by first appearance."""
    banned = {w.lower() for w in exclude}
    counts = Counter(w for w in content_words("\n".join(texts)) if w not in banned)  # keeps first-seen order
    order = {word: index for index, word in enumerate(counts)}
    return sorted(counts, key=lambda w: (-counts[w], order[w]))[:n]


def sentences(text: str) -> list[str]:
    return [s.strip() for s in _SENTENCE_END.split(text) if s.strip()]


def third_person(sentence: str, speaker: str) -> str:
    """Crude first-to-third person: enough for a readable synthetic fact."""
    out = sentence
    for pattern, repl in (
        (r"\bI'm\b", f"{speaker} is"),
        (r"\bI've\b", f"{speaker} has"),
        (r"\bI'll\b", f"{speaker} will"),
        (r"\bI'd\b", f"{speaker} would"),
        (r"\bI\b", speaker),
        (r"\bmyself\b", "themself"),
        (r"\b[Mm]y\b", f"{speaker}'s"),
        (r"\bme\b", "them"),
    ):
        out = re.sub(pattern, repl, out)
    return out


def _day(date: str) -> str:
    return date[:10]


@dataclass(frozen=True)
class _Turn:
    id: str
    session: str | None
    date: str
    speaker: str
    text: str


def _turns(blocks: list[dict[str, Any]], speaker: str = "") -> Iterator[_Turn]:
    for block in blocks:
        for turn in block["turns"]:
            yield _Turn(turn["id"], block.get("session"), block["date"], turn.get("speaker", speaker), turn["text"])


def _lead_sentence(text: str, limit: int = 30) -> str:
    """The first sentence of at least five words (else the text), at most ``limit`` words."""
    chosen = next((s for s in sentences(text) if len(s.split()) >= 5), text)
    words = chosen.split()
    return " ".join(words[:limit]).rstrip(",;") + ("" if len(words) <= limit else "...")


def _pack(turns: list[_Turn]) -> dict[str, str]:
    speakers = list(dict.fromkeys(t.speaker for t in turns))
    who = " and ".join(speakers)
    words = top_words((t.text for t in turns), 3, exclude=speakers) or ["their day"]
    longest = sorted(turns, key=lambda t: (-len(t.text), t.id))[:3]
    lines = [
        f"{t.speaker} said that {third_person(_lead_sentence(t.text), t.speaker)}"
        for t in sorted(longest, key=turns.index)
    ]
    return {
        "title": f"{who} on {' and '.join(words[:2])}",
        "summary": f"{who} talked about {', '.join(words)}.",
        "narrative": f"On {_day(turns[0].date)}, {who} talked. " + " ".join(line.rstrip(".") + "." for line in lines),
    }


def scene_boundaries(operation: str, request_json: dict[str, Any]) -> str:
    """Close at a session change (when the scene has a few turns), after 8-14 turns, and at the end."""
    data = request_input(request_json)
    scene = list(_turns(data["open_scene"]))
    new = list(_turns(data["new_turns"]))
    closed: list[dict[str, str]] = []
    for index, turn in enumerate(new):
        scene.append(turn)
        following = new[index + 1] if index + 1 < len(new) else None
        low, high = SCENE_LENGTHS
        target = low + _hash(scene[0].id, scene[0].text) % (high - low + 1)
        session_ends = following is not None and following.session != turn.session
        if (
            (following is None and data["final"])
            or len(scene) >= target
            or (session_ends and len(scene) >= MIN_TURNS_AT_SESSION_END)
        ):
            closed.append({"last_turn": turn.id, **_pack(scene)})
            scene = []
    return json.dumps({"closed": closed})


def scene_pack(operation: str, request_json: dict[str, Any]) -> str:
    data = request_input(request_json)
    return json.dumps({"scenes": [{"ref": s["ref"], **_pack(list(_turns(s["dialogue"])))} for s in data["scenes"]]})


def _scene_text(scene: dict[str, Any]) -> list[str]:
    return [scene["title"], scene["summary"], scene["narrative"]]


def _topic_draft(scene: dict[str, Any]) -> dict[str, Any]:
    keywords = top_words(_scene_text(scene), TOPIC_KEYWORDS)
    extra = (w.lower() for w in _WORD.findall(" ".join(_scene_text(scene))) if w.lower() not in keywords)
    for word in extra:  # short scenes: fall back to any word, so there are always ten
        if len(keywords) >= 10:
            break
        keywords.append(word)
    keywords += [f"{scene['date']} #{n}" for n in range(10 - len(keywords))]
    return {"title": scene["title"], "keywords": keywords}


def topic_create(operation: str, request_json: dict[str, Any]) -> str:
    return json.dumps(_topic_draft(request_input(request_json)["scene"]))


def topic_match(operation: str, request_json: dict[str, Any]) -> str:
    """Admit by shared content words (multi-label); propose a topic when allowed and none admits."""
    data = request_input(request_json)
    scene_words = top_words(_scene_text(data["scene"]), 20)
    admitted = []
    for label in data["topics"]:
        label_words = set(content_words(" ".join([label["title"], *label["keywords"]])))
        if len(label_words.intersection(scene_words)) >= ADMIT_OVERLAP + len(label_words) // 15:
            fresh = [w for w in scene_words if w not in label_words][:3]
            admitted.append({"ref": label["ref"], "new_keywords": fresh})
    new_topic = _topic_draft(data["scene"]) if data["may_open_new"] and not admitted and not data.get("already_admitted") else None
    return json.dumps({"admitted": admitted, "new_topic": new_topic})


def item_extract(operation: str, request_json: dict[str, Any]) -> str:
    """Atomic items from each scene's two longest turns; connected items over consecutive scenes."""
    data = request_input(request_json)
    items: list[dict[str, Any]] = []
    texts: list[list[_Turn]] = []
    for scene in data["scenes"]:
        turns = list(_turns(scene["dialogue"]))
        texts.append(turns)
        for turn in sorted(sorted(turns, key=lambda t: (-len(t.text), t.id))[:2], key=turns.index):
            sentence = _lead_sentence(turn.text)
            items.append(
                {
                    "kind": "atomic",
                    "content": third_person(sentence, turn.speaker),
                    "sources": [scene["ref"]],
                    "said_in": turn.id,
                    "when": _day(turn.date),
                    "keywords": top_words([sentence], 4, exclude=[turn.speaker]) or [turn.speaker],
                }
            )
    for index in range(min(2, len(texts) - 1)):
        before, after = texts[index], texts[index + 1]
        speaker = Counter(t.speaker for t in after).most_common(1)[0][0]
        earlier = set(top_words((t.text for t in before), 20))
        shared = [w for w in top_words((t.text for t in after), 20) if w in earlier]
        subject = " and ".join(shared[:2]) or data["topic"]
        items.append(
            {
                "kind": "connected",
                "content": f"{speaker} came back to {subject} on {_day(after[0].date)}, "
                f"after talking about it on {_day(before[0].date)}.",
                "sources": [data["scenes"][index]["ref"], data["scenes"][index + 1]["ref"]],
                "said_in": after[0].id,
                "when": _day(after[0].date),
                "keywords": shared[:4] or [speaker],
            }
        )
    return json.dumps({"items": items})


def item_triggers(operation: str, request_json: dict[str, Any]) -> str:
    data = request_input(request_json)
    answers = []
    for item in data["items"]:
        words = top_words([item["content"]], 3) or ["this memory"]
        second = words[1] if len(words) > 1 else words[0]
        answers.append(
            {
                "ref": item["ref"],
                "entities": words,
                "bridges": [
                    {
                        "situation": f"planning something that involves {words[0]}",
                        "rationale": f"what happened with {words[0]} matters",
                    },
                    {
                        "situation": f"giving advice to a friend about {second}",
                        "rationale": f"past experience with {second} applies",
                    },
                ],
            }
        )
    return json.dumps({"items": answers})


def _emotion(words: Iterable[str]) -> str:
    present = set(words)
    for sentence, cues in EMOTIONS:
        if present & cues:
            return sentence
    return "They felt calm and engaged."


def scene_triggers(operation: str, request_json: dict[str, Any]) -> str:
    data = request_input(request_json)
    answers = []
    for scene in data["scenes"]:
        who = " and ".join(scene["speakers"]) or "The speakers"
        lead = scene["speakers"][0] if scene["speakers"] else "The speaker"
        words = [*top_words([scene["narrative"]], 3), "daily life", "plans", "memories"][:3]
        first = (sentences(scene["narrative"]) or [scene["title"]])[0]
        seed = _hash(scene["title"], scene["narrative"])
        answers.append(
            {
                "ref": scene["ref"],
                "situation": f"{who} talk about {words[0]} and {words[1]} on {scene['date']}.",
                "object": f"The {words[0]} that {lead} mentions.",
                "event": first,
                "emotion": _emotion(content_words(scene["narrative"])),
                "personal_arc": f"{lead} may keep building a part of life around {words[0]}.",
                "avoidance_habit": f"{lead} may hold back from {words[2]} for a while." if seed % 3 == 0 else "",
                "goal_arc": f"{lead} may take a next step with {words[1]}.",
                "belief_in_action": f"{lead}'s care for {words[0]} may guide a later choice." if seed % 2 == 0 else "",
                "legacy_anchor": f"{lead} may pass on {words[2]} to others." if seed % 5 < 2 else "",
            }
        )
    return json.dumps({"scenes": answers})


def _cue_sentences(turn: _Turn) -> list[tuple[str, str]]:
    """The turn's sentences of four words or more, each beside its padded lower-case words."""
    return [(s, " " + " ".join(_WORD.findall(s.lower())) + " ") for s in sentences(turn.text) if len(s.split()) >= 4]


def _pick(
    turns: list[_Turn], speaker: str, cues: tuple[str, ...], limit: int, cache: dict[int, list[tuple[str, str]]]
) -> list[tuple[str, str]]:
    """Up to ``limit`` (third-person sentence, day) pairs, one per turn, containing one of the cues.
    Turns are split into sentences lazily (``cache``), so a long chunk is read only as far as needed."""
    found: list[tuple[str, str]] = []
    for index, turn in enumerate(turns):
        if index not in cache:
            cache[index] = _cue_sentences(turn)
        hit = next((sentence for sentence, lowered in cache[index] if any(cue in lowered for cue in cues)), None)
        if hit is not None:
            found.append((third_person(hit, speaker)[:160], _day(turn.date)))
            if len(found) >= limit:
                break
    return found


def persona(operation: str, request_json: dict[str, Any]) -> str:
    """Profile from the speaker's own sentences; a prior profile is kept and extended (capped)."""
    data = request_input(request_json)
    speaker = data["speaker"]
    turns = list(_turns(data["turns"], speaker))
    prior = data.get("persona_so_far") or {}
    cache: dict[int, list[tuple[str, str]]] = {}
    identity = [s for s, _ in _pick(turns, speaker, IDENTITY, 4, cache)] or [f"{speaker}, one of the two speakers"]
    preferences = [s for s, _ in _pick(turns, speaker, LIKES, 5, cache)]
    relations = [s for s, _ in _pick(turns, speaker, FAMILY, 5, cache)]
    traits = [f"cares about {w}" for w in top_words((t.text for t in turns), 3)]
    timeline = [{"fact": s, "since": day[:7]} for s, day in _pick(turns, speaker, IDENTITY + CHANGES, 4, cache)]

    def merged(key: str, fresh: list[Any]) -> list[Any]:
        out: list[Any] = []
        for entry in [*prior.get(key, []), *fresh]:
            if entry not in out:
                out.append(entry)
        return out[:LIST_CAP]

    return json.dumps(
        {
            "identity": merged("identity", identity),
            "preferences": merged("preferences", preferences),
            "traits": merged("traits", traits),
            "relations": merged("relations", relations),
            "timeline": merged("timeline", timeline),
        }
    )


def answer(operation: str, request_json: dict[str, Any]) -> str:
    """Extractive stand-in for a QA model: the first words of the context line sharing most words
    with the question (ties: the earlier line). Deterministic; it proves the plumbing, not QA skill."""
    data = request_input(request_json)
    question = set(content_words(str(data.get("question", "")).lower()))
    best, best_overlap = "", 0
    context = parse_context(input_message(request_json)) or str(data.get("context", ""))
    for line in context.splitlines():
        text = line.strip().lstrip("-").strip()
        if not text or text.startswith("#"):
            continue
        overlap = len(question & set(content_words(text.lower())))
        if overlap > best_overlap:
            best, best_overlap = text, overlap
    words = best.split()
    return json.dumps({"answer": " ".join(words[:12]) if words else "Not mentioned"})


RESPONDERS: dict[str, Responder] = {
    "answer": answer,
    "scene_boundaries": scene_boundaries,
    "scene_pack": scene_pack,
    "topic_create": topic_create,
    "topic_match": topic_match,
    "item_extract": item_extract,
    "item_triggers": item_triggers,
    "scene_triggers": scene_triggers,
    "persona": persona,
}

for _operation, _responder in RESPONDERS.items():
    register_responder(_operation, _responder)

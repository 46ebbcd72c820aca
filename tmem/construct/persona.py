"""Persona per speaker (paper Algorithm 3, last stage), bounded by chunk-and-fold.

The speaker's turns, in order, are cut into chunks of at most ``chunk_turns`` turns and
``chunk_chars`` characters of text. The first chunk is read from nothing; each later chunk is
read together with the persona so far, and the answer replaces it. A speaker with a few
hundred turns costs one call; one with thousands costs one call per chunk, with a prompt
that never grows.

A chunk whose answer is cut at its completion budget is folded again as its two halves, in
order, down to one turn (noted ``split``); lists longer than the stated ``MAX_ENTRIES`` are cut to
it (``clipped``). When a fold's answer stays invalid, :func:`persona_outcome` quarantines the
speaker's persona (a ``speaker`` unit: a half-folded profile is not kept) and :func:`persona`
raises.
"""

from __future__ import annotations

from collections.abc import Sequence

from tmem.construct.common import DEFAULT_REASKS, Rejected, ask_checked, clean, unique_phrases
from tmem.construct.outcome import BuildNote, StageLog, StageOutcome, ask_in_halves, clip
from tmem.construct.segment import ordered_turns
from tmem.domain import Persona, PersonaFact, Turn
from tmem.errors import LLMOutputError
from tmem.ports import ChatModel, scoped
from tmem.prompts import persona as persona_prompt
from tmem.prompts.common import dialogue_blocks

CHUNK_TURNS = 250
CHUNK_CHARS = 24_000
LISTS = ("identity", "preferences", "traits", "relations", "timeline")


class _Unfinished(Exception):
    """A fold failed: the persona of the speaker is left out (internal to :func:`persona_outcome`)."""


@scoped  # its LLM calls are attributed to the conversation (tmem forget)
def persona(
    conversation_id: str,
    speaker: str,
    turns: Sequence[Turn],
    chat: ChatModel,
    *,
    chunk_turns: int = CHUNK_TURNS,
    chunk_chars: int = CHUNK_CHARS,
    reasks: int = DEFAULT_REASKS,
) -> Persona:
    """The persona of ``speaker`` from their turns among ``turns`` (the conversation's turns)."""
    found = persona_outcome(
        conversation_id, speaker, turns, chat, chunk_turns=chunk_turns, chunk_chars=chunk_chars, reasks=reasks,
        isolate=False,
    ).value
    assert found is not None  # strict: a failed fold raised
    return found


@scoped  # its LLM calls are attributed to the conversation (tmem forget)
def persona_outcome(
    conversation_id: str,
    speaker: str,
    turns: Sequence[Turn],
    chat: ChatModel,
    *,
    chunk_turns: int = CHUNK_TURNS,
    chunk_chars: int = CHUNK_CHARS,
    reasks: int = DEFAULT_REASKS,
    isolate: bool = True,
) -> StageOutcome[Persona | None]:
    """As :func:`persona`, with notes; ``None`` (and the speaker quarantined) when a fold's answer stays
    invalid and ``isolate``."""
    own = [t for t in ordered_turns(conversation_id, turns) if t.speaker == speaker]
    if not own:
        raise ValueError(f"speaker {speaker!r} has no turns in conversation {conversation_id!r}")
    log = StageLog(isolate=isolate)
    draft: persona_prompt.PersonaDraft | None = None

    def fold(part: Sequence[Turn]) -> None:
        nonlocal draft
        payload = persona_prompt.PersonaInput(
            conversation_id=conversation_id,
            speaker=speaker,
            persona_so_far=draft,
            turns=dialogue_blocks(part, with_speaker=False, with_session=False),
        )
        input_ref = persona_prompt.build(payload).input_ref
        draft, notes = ask_checked(chat, persona_prompt.build, payload, lambda a: _check(a, input_ref), reasks=reasks)
        log.extend(notes)

    def failed(part: Sequence[Turn], exc: LLMOutputError) -> None:
        log.quarantine("speaker", speaker, exc)  # raises when strict
        raise _Unfinished

    try:
        for chunk in chunks(own, chunk_turns, chunk_chars):
            ask_in_halves(chunk, fold, failed, log, what="turns")
    except _Unfinished:
        return log.outcome(None)
    assert draft is not None  # there was at least one chunk
    return log.outcome(Persona(
        conversation_id=conversation_id,
        speaker=speaker,
        identity=tuple(draft.identity),
        preferences=tuple(draft.preferences),
        traits=tuple(draft.traits),
        relations=tuple(draft.relations),
        timeline=tuple(PersonaFact(fact=entry.fact, since=entry.since) for entry in draft.timeline),
    ))


def _check(answer: persona_prompt.PersonaDraft, input_ref: str) -> tuple[persona_prompt.PersonaDraft, list[BuildNote]]:
    """Cleaned, deduplicated and clipped to ``MAX_ENTRIES`` per list; a profile with nothing in it is rejected."""
    notes = StageLog(isolate=False)  # this answer's own: a rejected answer leaves no note
    timeline = [
        persona_prompt.TimelineEntry(fact=clean(e.fact), since=clean(e.since) if e.since else None)
        for e in answer.timeline
        if clean(e.fact)
    ]
    lists: dict[str, list[object]] = {
        "identity": list(unique_phrases(answer.identity)),
        "preferences": list(unique_phrases(answer.preferences)),
        "traits": list(unique_phrases(answer.traits)),
        "relations": list(unique_phrases(answer.relations)),
        "timeline": list(timeline),
    }
    if not any(lists.values()):
        raise Rejected("the profile is empty; list what the turns say about the speaker.")
    clipped = {
        name: clip(values, persona_prompt.MAX_ENTRIES, notes, persona_prompt.OPERATION, input_ref, name)
        for name, values in lists.items()
    }
    return persona_prompt.PersonaDraft.model_validate(clipped), notes.notes


def chunks(turns: Sequence[Turn], max_turns: int, max_chars: int) -> list[list[Turn]]:
    """Consecutive chunks within both bounds (a single over-long turn forms a chunk of its own)."""
    if max_turns < 1 or max_chars < 1:
        raise ValueError("chunk bounds must be >= 1")
    out: list[list[Turn]] = []
    size = 0
    for turn in turns:
        length = len(turn.text)
        if not out or len(out[-1]) >= max_turns or size + length > max_chars:
            out.append([])
            size = 0
        out[-1].append(turn)
        size += length
    return out

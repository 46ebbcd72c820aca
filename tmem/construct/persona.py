"""Persona per speaker (paper Algorithm 3, last stage), bounded by chunk-and-fold.

The speaker's turns, in order, are cut into chunks of at most ``chunk_turns`` turns and
``chunk_chars`` characters of text. The first chunk is read from nothing; each later chunk is
read together with the persona so far, and the answer replaces it. A speaker with a few
hundred turns costs one call; one with thousands costs one call per chunk, with a prompt
that never grows.
"""

from __future__ import annotations

from collections.abc import Sequence

from tmem.construct.common import DEFAULT_REASKS, Rejected, ask_checked, clean, unique_phrases
from tmem.construct.segment import ordered_turns
from tmem.domain import Persona, PersonaFact, Turn
from tmem.prompts import persona as persona_prompt
from tmem.prompts.common import dialogue_blocks
from tmem.providers.base import ChatModel
from tmem.providers.scope import scoped

CHUNK_TURNS = 250
CHUNK_CHARS = 24_000


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
    own = [t for t in ordered_turns(conversation_id, turns) if t.speaker == speaker]
    if not own:
        raise ValueError(f"speaker {speaker!r} has no turns in conversation {conversation_id!r}")
    draft: persona_prompt.PersonaDraft | None = None
    for chunk in chunks(own, chunk_turns, chunk_chars):
        payload = persona_prompt.PersonaInput(
            conversation_id=conversation_id,
            speaker=speaker,
            persona_so_far=draft,
            turns=dialogue_blocks(chunk, with_speaker=False, with_session=False),
        )
        draft = ask_checked(chat, persona_prompt.build, payload, _check, reasks=reasks)
    assert draft is not None  # there was at least one chunk
    return Persona(
        conversation_id=conversation_id,
        speaker=speaker,
        identity=tuple(draft.identity),
        preferences=tuple(draft.preferences),
        traits=tuple(draft.traits),
        relations=tuple(draft.relations),
        timeline=tuple(PersonaFact(fact=entry.fact, since=entry.since) for entry in draft.timeline),
    )


def _check(answer: persona_prompt.PersonaDraft) -> persona_prompt.PersonaDraft:
    """Cleaned and deduplicated; a profile with nothing in it is rejected."""
    timeline = [
        persona_prompt.TimelineEntry(fact=clean(e.fact), since=clean(e.since) if e.since else None)
        for e in answer.timeline
        if clean(e.fact)
    ]
    draft = persona_prompt.PersonaDraft(
        identity=list(unique_phrases(answer.identity)),
        preferences=list(unique_phrases(answer.preferences)),
        traits=list(unique_phrases(answer.traits)),
        relations=list(unique_phrases(answer.relations)),
        timeline=timeline,
    )
    if not (draft.identity or draft.preferences or draft.traits or draft.relations or draft.timeline):
        raise Rejected("the profile is empty; list what the turns say about the speaker.")
    return draft


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

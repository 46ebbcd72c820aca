"""Stage 1: cut a conversation's turns into scenes (DESIGN §2, paper §3.2.1 and Algorithm 3).

One ``scene_boundaries`` call per window of ``window`` new turns; the turns of the scene still
open are carried into the next call as context, so a scene may span windows and sessions. The
same call describes every scene it closes (title, summary, narrative). Two kinds of scene are
left without a description and are packed afterwards, several per ``scene_pack`` call:

* the runaway guard: when the open scene grows beyond ``max_scene_turns`` (default 40), its
  first ``max_scene_turns`` turns are cut into a scene of their own. So the context carried
  into a call never exceeds ``max_scene_turns`` turns, and no scene exceeds
  ``max_scene_turns + window`` (a scene the model closes may add a window to its carried part);
* the tail: the scene still open after the last window when the model did not close it there.

Calls for N turns: ceil(N / window) boundary calls + ceil(unpacked / pack_batch) packing calls.

An answer cut at its completion budget (a window that closes many scenes) is asked again with
the window of new turns halved, down to one turn; the turns left out start the next window, which
is full-sized again (noted ``split``). A packing batch is halved likewise. Segmentation is the
spine of a conversation's build: an answer that stays invalid, or a single turn whose answer
still does not fit, fails the conversation.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from tmem.construct.common import DEFAULT_REASKS, Rejected, ask_checked, batched, check_refs, clean, local_refs
from tmem.construct.outcome import StageLog, StageOutcome, ask_in_halves
from tmem.domain import Scene, Turn
from tmem.errors import LLMOutputError, LLMTruncatedError
from tmem.ids import content_id
from tmem.ports import ChatModel, scoped
from tmem.prompts import scene_boundaries, scene_pack
from tmem.prompts.common import dialogue_blocks

MAX_SCENE_TURNS = 40
PACK_BATCH = 4


@dataclass(frozen=True)
class _Pack:
    title: str
    summary: str
    narrative: str


@dataclass(frozen=True)
class _Span:
    turns: tuple[Turn, ...]
    pack: _Pack | None


def ordered_turns(conversation_id: str, turns: Sequence[Turn]) -> list[Turn]:
    """The conversation's turns by ``seq``; foreign or duplicated turns are a caller error."""
    foreign = [t.turn_id for t in turns if t.conversation_id != conversation_id]
    if foreign:
        raise ValueError(f"turns {foreign[:5]} do not belong to conversation {conversation_id!r}")
    ordered = sorted(turns, key=lambda t: t.seq)
    ids = [t.turn_id for t in ordered]
    if len(set(ids)) != len(ids):
        raise ValueError(f"conversation {conversation_id!r} has duplicated turn ids")
    return ordered


@scoped  # its LLM calls are attributed to the conversation (tmem forget)
def segment(
    conversation_id: str,
    turns: Sequence[Turn],
    chat: ChatModel,
    *,
    window: int = 16,
    max_scene_turns: int = MAX_SCENE_TURNS,
    pack_batch: int = PACK_BATCH,
    reasks: int = DEFAULT_REASKS,
) -> list[Scene]:
    """Scenes of the conversation in order, each described, with content-derived ids."""
    return segment_outcome(
        conversation_id, turns, chat, window=window, max_scene_turns=max_scene_turns, pack_batch=pack_batch,
        reasks=reasks,
    ).value


@scoped  # its LLM calls are attributed to the conversation (tmem forget)
def segment_outcome(
    conversation_id: str,
    turns: Sequence[Turn],
    chat: ChatModel,
    *,
    window: int = 16,
    max_scene_turns: int = MAX_SCENE_TURNS,
    pack_batch: int = PACK_BATCH,
    reasks: int = DEFAULT_REASKS,
) -> StageOutcome[list[Scene]]:
    """As :func:`segment`, with the notes of its splits."""
    if window < 1 or max_scene_turns < 1:
        raise ValueError("window and max_scene_turns must be >= 1")
    ordered = ordered_turns(conversation_id, turns)
    log = StageLog(isolate=False)
    spans: list[_Span] = []
    open_scene: list[Turn] = []
    start, size = 0, window
    while start < len(ordered):
        new = ordered[start : start + size]
        final = start + len(new) >= len(ordered)
        try:
            closes = _ask_boundaries(conversation_id, open_scene, new, final, chat, reasks)
        except LLMTruncatedError as exc:
            if len(new) < 2:
                raise
            size = len(new) // 2
            log.note(exc.operation, exc.input_ref, "split", f"answer cut at its budget: window of {len(new)} new "
                     f"turns from {new[0].turn_id} asked again as {size}")
            continue
        start, size = start + len(new), window
        taken = 0
        for last, pack in closes:
            span = tuple(open_scene + new[taken : last + 1])
            if span:  # a close at the open scene's last turn with nothing open is no scene
                spans.append(_Span(span, pack))
            open_scene, taken = [], last + 1
        open_scene += new[taken:]
        while len(open_scene) > max_scene_turns:  # runaway guard
            spans.append(_Span(tuple(open_scene[:max_scene_turns]), None))
            open_scene = open_scene[max_scene_turns:]
    if open_scene:
        spans.append(_Span(tuple(open_scene), None))
    packs = _pack_missing(conversation_id, spans, chat, pack_batch, reasks, log)
    return log.outcome([
        _scene(conversation_id, seq, span, packs.get(seq) or span.pack, chat.model_name)
        for seq, span in enumerate(spans)
    ])


def _pack(title: str, summary: str, narrative: str) -> _Pack:
    pack = _Pack(clean(title), clean(summary), clean(narrative))
    if not (pack.title and pack.summary and pack.narrative):
        raise Rejected("a scene has a blank title, summary or narrative.")
    return pack


def _ask_boundaries(
    conversation_id: str, open_scene: list[Turn], new: list[Turn], final: bool, chat: ChatModel, reasks: int
) -> list[tuple[int, _Pack]]:
    """(index in ``new`` of each closing turn, its description), in order; index -1 closes the open
    scene at its own last turn (nothing of ``new`` joins it)."""
    position = {t.turn_id: i for i, t in enumerate(new)}
    open_ids = {t.turn_id for t in open_scene}
    payload = scene_boundaries.BoundaryInput(
        conversation_id=conversation_id,
        open_scene=dialogue_blocks(open_scene),
        new_turns=dialogue_blocks(new),
        final=final,
    )

    last_open = open_scene[-1].turn_id if open_scene else None

    def check(answer: scene_boundaries.BoundaryResponse) -> list[tuple[int, _Pack]]:
        closes: list[tuple[int, _Pack]] = []
        for scene in answer.closed:
            turn_id = clean(scene.last_turn)
            if turn_id == last_open:  # the open scene was finished already: it closes as it is
                closes.append((-1, _pack(scene.title, scene.summary, scene.narrative)))
                continue
            if turn_id in open_ids:
                raise Rejected(
                    f"last_turn {turn_id!r} is inside the open scene; a scene closes at the open scene's last turn "
                    f"{last_open!r} or at a new turn."
                )
            if turn_id not in position:
                raise Rejected(
                    f"last_turn {turn_id!r} is not one of the new turns {new[0].turn_id}..{new[-1].turn_id}"
                    + (f" nor the open scene's last turn {last_open!r}." if last_open else ".")
                )
            closes.append((position[turn_id], _pack(scene.title, scene.summary, scene.narrative)))
        closes.sort(key=lambda close: close[0])
        indexes = [index for index, _ in closes]
        if len(set(indexes)) != len(indexes):
            raise Rejected("the same last_turn was given for two scenes.")
        return closes

    return ask_checked(chat, scene_boundaries.build, payload, check, reasks=reasks)


def _pack_missing(
    conversation_id: str, spans: list[_Span], chat: ChatModel, pack_batch: int, reasks: int, log: StageLog
) -> dict[int, _Pack]:
    """Descriptions of the spans that have none, by span position, ``pack_batch`` per call."""
    missing = [seq for seq, span in enumerate(spans) if span.pack is None]

    def ask(group: Sequence[int]) -> dict[int, _Pack]:
        refs = local_refs("S", group)
        payload = scene_pack.PackInput(
            conversation_id=conversation_id,
            scenes=[
                scene_pack.SceneToPack(ref=ref, dialogue=dialogue_blocks(spans[seq].turns)) for ref, seq in refs.items()
            ],
        )

        def check(answer: scene_pack.PackResponse) -> dict[int, _Pack]:
            check_refs("scene", [clean(s.ref) for s in answer.scenes], list(refs))
            return {refs[clean(s.ref)]: _pack(s.title, s.summary, s.narrative) for s in answer.scenes}

        return ask_checked(chat, scene_pack.build, payload, check, reasks=reasks)

    def failed(group: Sequence[int], exc: LLMOutputError) -> None:
        raise exc  # the spine: no scene is left without its description

    packs: dict[int, _Pack] = {}
    for group in batched(missing, pack_batch):
        for answered in ask_in_halves(group, ask, failed, log, what="scenes"):
            packs.update(answered)
    return packs


def scene_id(conversation_id: str, turn_ids: Sequence[str], model_name: str) -> str:
    """Content-derived: conversation, turn ids, the versions of both describing prompts, model."""
    return content_id("scn", conversation_id, list(turn_ids), scene_boundaries.VERSION, scene_pack.VERSION, model_name)


def _scene(conversation_id: str, seq: int, span: _Span, pack: _Pack | None, model_name: str) -> Scene:
    assert pack is not None  # every span without a pack was packed by _pack_missing
    turn_ids = tuple(t.turn_id for t in span.turns)
    times = [t.event_time for t in span.turns]
    return Scene(
        conversation_id=conversation_id,
        scene_id=scene_id(conversation_id, turn_ids, model_name),
        seq=seq,
        title=pack.title,
        summary=pack.summary,
        narrative=pack.narrative,
        turn_ids=turn_ids,
        start_time=min(times),
        end_time=max(times),
    )

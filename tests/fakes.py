"""A typed fake :class:`tmem.ports.ChatModel` for unit tests, plus small turn builders.

The fake renders each prompt into the request body an OpenAI-compatible server would receive
(messages + JSON schema), hands it to a responder ``(operation, request_json) -> content`` (a
per-test script first, else the deterministic synth responder of the operation), validates the
content against the prompt's response model like the real adapter, and records every call.
No HTTP, no threads.

With ``budgets=True`` it also enforces each prompt's completion budget as a hosted model does: an
answer longer than the budget (at 4 characters a token, the budget resolved like the adapter's:
``output_budgets`` overrides, then the prompt's ``max_tokens``, capped by ``max_tokens``) is cut
there, and the fake raises exactly what the adapter raises for a ``finish_reason == "length"``
answer (:func:`tmem.providers.openai_chat.truncation_error`).
"""

from __future__ import annotations

import json
from collections import Counter
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from datetime import UTC, datetime, timedelta
from typing import Any, TypeVar

from pydantic import BaseModel, SecretStr, ValidationError

from tmem.devtools import synth
from tmem.devtools.responders import input_message, request_input, sequence_responder
from tmem.domain import Scene, Turn
from tmem.errors import CallSpend, LLMOutputError
from tmem.ids import content_id
from tmem.ports import Completion, TokenUsage
from tmem.prompts.base import Prompt
from tmem.prompts.common import parse_context
from tmem.providers.openai_chat import ChatConfig, truncation_error

CHARS_PER_TOKEN = 4

R = TypeVar("R", bound=BaseModel)
Responder = Callable[[str, dict[str, Any]], str]


@dataclass(frozen=True)
class Call:
    operation: str
    prompt: Prompt[Any]
    request: dict[str, Any]
    content: str
    truncated: bool = False  # cut at the prompt's budget (the fake raised LLMTruncatedError)

    @property
    def input(self) -> Any:
        """The prompt's input block, as data."""
        return request_input(self.request)

    @property
    def context(self) -> str:
        """The recalled context the prompt carries as plain text ("" when none)."""
        return parse_context(input_message(self.request))


class FakeChatModel:
    """Implements ``ChatModel``: scripted or synth answers, validated, recorded."""

    def __init__(
        self,
        scripts: Mapping[str, Responder] | None = None,
        *,
        model_name: str = "fake-model",
        use_synth: bool = True,
        budgets: bool = False,
        max_tokens: int | None = None,
        output_budgets: Mapping[str, int] | None = None,
    ) -> None:
        self.scripts = dict(scripts or {})
        self.use_synth = use_synth
        self._model_name = model_name
        self.calls: list[Call] = []
        self.budgets = budgets
        self.config = ChatConfig(base_url="fake://", api_key=SecretStr(""), model=model_name, max_tokens=max_tokens,
                                 output_budgets=tuple(sorted((output_budgets or {}).items())))

    @property
    def model_name(self) -> str:
        return self._model_name

    def complete(self, prompt: Prompt[R]) -> R:
        request = {
            "model": self._model_name,
            "messages": [{"role": m.role, "content": m.content} for m in prompt.messages],
            "response_format": {
                "type": "json_schema",
                "json_schema": {"name": prompt.operation, "schema": prompt.json_schema()},
            },
        }
        responder = self.scripts.get(prompt.operation)
        if responder is None and self.use_synth:
            responder = synth.RESPONDERS.get(prompt.operation)
        if responder is None:
            raise AssertionError(f"no script or synth responder for operation {prompt.operation!r}")
        content = responder(prompt.operation, request)
        budget = self.config.max_tokens_for(prompt)
        if self.budgets and len(content) > budget * CHARS_PER_TOKEN:
            cut = content[: budget * CHARS_PER_TOKEN]
            self.calls.append(Call(prompt.operation, prompt, request, cut, truncated=True))
            spent = CallSpend(1, 0, sum(len(m.content) for m in prompt.messages) // CHARS_PER_TOKEN, budget)
            raise truncation_error(prompt, cut, budget, spent)
        self.calls.append(Call(prompt.operation, prompt, request, content))
        try:
            return prompt.response_model.model_validate_json(content)
        except ValidationError as exc:
            raise LLMOutputError(prompt.operation, prompt.input_ref, str(exc), raw_output=content,
                                 input_digest=prompt.input_digest(), input_excerpt=prompt.input_excerpt()) from exc

    def complete_metered(self, prompt: Prompt[R]) -> Completion[R]:
        """``complete`` as a metered adapter (one request, tokens at 4 characters each), so the fake can
        sit under :class:`~tmem.llm.response_cache.CachedChatModel`."""
        value = self.complete(prompt)
        sent = sum(len(m.content) for m in prompt.messages) // CHARS_PER_TOKEN
        return Completion(value, TokenUsage(sent, len(self.calls[-1].content) // CHARS_PER_TOKEN), requests=1)

    def count(self, operation: str) -> int:
        return sum(1 for call in self.calls if call.operation == operation)

    def truncations(self, operation: str) -> int:
        return sum(1 for call in self.calls if call.operation == operation and call.truncated)

    def counts(self) -> Counter[str]:
        return Counter(call.operation for call in self.calls)

    def of(self, operation: str) -> list[Call]:
        return [call for call in self.calls if call.operation == operation]


def replies(*contents: str | dict[str, Any]) -> Responder:
    """A script answering the given contents in order, then repeating the last one."""
    return sequence_responder(*(c if isinstance(c, str) else json.dumps(c) for c in contents))


def edited(operation: str, edit: Callable[[dict[str, Any], dict[str, Any]], dict[str, Any]]) -> Responder:
    """A script that takes the synth answer and changes it: ``edit(answer, input) -> answer``."""
    base = synth.RESPONDERS[operation]

    def respond(op: str, request_json: dict[str, Any]) -> str:
        return json.dumps(edit(json.loads(base(op, request_json)), request_input(request_json)))

    return respond


T0 = datetime(2023, 5, 8, 13, 56, tzinfo=UTC)

SENTENCES = (
    "I adopted a puppy from the shelter near the river and named her Biscuit",
    "My pottery class meets every Tuesday and I made a blue bowl for my mother",
    "We drove to the mountains for a camping trip with the kids last weekend",
    "I am studying counseling because I want to support young people in crisis",
    "The marathon training plan says I should run twenty miles on Sunday morning",
    "Our book club picked a novel about sailing across the Atlantic ocean",
    "I started volunteering at the community garden planting tomatoes and beans",
    "My sister is moving to Lisbon for a new engineering job in the autumn",
)


def dialogue(
    conversation_id: str = "conv-t",
    sessions: Sequence[int] = (10, 10),
    speakers: tuple[str, str] = ("Ana", "Ben"),
    start: datetime = T0,
) -> list[Turn]:
    """Turns of ``len(sessions)`` sessions (a week apart) with the given numbers of turns,
    ids ``D<session>:<n>``, alternating speakers, varied content."""
    turns: list[Turn] = []
    for s, count in enumerate(sessions, start=1):
        began = start + timedelta(days=7 * (s - 1))
        for n in range(1, count + 1):
            seq = len(turns)
            turns.append(
                Turn(
                    conversation_id=conversation_id,
                    session_id=f"session_{s}",
                    turn_id=f"D{s}:{n}",
                    seq=seq,
                    speaker=speakers[seq % 2],
                    text=f"{SENTENCES[seq % len(SENTENCES)]}. That was turn {seq}.",
                    event_time=began + timedelta(seconds=n - 1),
                )
            )
    return turns


def scene(
    seq: int,
    title: str,
    narrative: str = "",
    *,
    conversation_id: str = "conv-t",
    turn_ids: Sequence[str] = (),
    start: datetime = T0,
) -> Scene:
    """A hand-made scene (its id from its seq and title), starting ``seq`` days after ``start``."""
    began = start + timedelta(days=seq)
    return Scene(
        conversation_id=conversation_id,
        scene_id=content_id("scn", conversation_id, seq, title),
        seq=seq,
        title=title,
        summary=title + ".",
        narrative=narrative or title + ".",
        turn_ids=tuple(turn_ids) or (f"D{seq + 1}:1",),
        start_time=began,
        end_time=began + timedelta(minutes=5),
    )

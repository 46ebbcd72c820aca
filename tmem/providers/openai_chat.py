"""The real chat adapter: any OpenAI-compatible endpoint through the ``openai`` client.

One :meth:`OpenAIChatModel.complete` call is: send the prompt asking for JSON that matches
the response model's schema, with the operation's completion budget as ``max_tokens``; retry
transient HTTP failures with backoff; validate; re-ask a bounded number of times with the
validation errors; return the model or raise a typed error. An answer the server cut at the
budget (``finish_reason == "length"``) is not repaired — the same request would be cut again —
but raised at once as :class:`~tmem.errors.LLMTruncatedError`, for the caller to split its input.

Structured output: ``json_schema`` response format where the server has it; in ``auto`` mode
a server that refuses it (HTTP 400/422 naming response_format/json_schema) is remembered and
asked in JSON mode from then on, with the schema appended to the system message.
"""

from __future__ import annotations

import json
import logging
import random
import re
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Literal, TypeVar

import openai
from pydantic import BaseModel, SecretStr, ValidationError

from tmem import errors as tmem_errors
from tmem.errors import CallSpend, LLMError, LLMOutputError, LLMTransportError, LLMTruncatedError
from tmem.ports import Completion, TokenUsage
from tmem.prompts.base import Prompt
from tmem.prompts.budgets import FALLBACK_BUDGET
from tmem.settings import Role, RoleEndpoint, Settings, StructuredMode

R = TypeVar("R", bound=BaseModel)

log = logging.getLogger(__name__)

OPERATION_HEADER = "X-Tmem-Operation"

# The two generic instructions of the structured-output protocol (not task prose).
SCHEMA_INSTRUCTION = (
    "Reply with one JSON object and nothing else. It must validate against this JSON schema:\n{schema}"
)
REPAIR_INSTRUCTION = (
    "Your previous reply was not valid: {errors}\n"
    "Reply again with only the corrected JSON object, matching the schema."
)
_MAX_ERROR_CHARS = 600


@dataclass(frozen=True)
class ChatConfig:
    """Everything the adapter needs; build it at the edge (see :meth:`from_settings`)."""

    base_url: str
    api_key: SecretStr
    model: str
    timeout_s: float = 120.0
    max_retries: int = 5
    backoff_s: float = 1.0  # first retry delay, doubled per retry, with jitter
    backoff_max_s: float = 30.0
    retry_after_cap_s: float = 60.0  # a server's Retry-After is honoured up to this
    repair_attempts: int = 1
    structured_mode: StructuredMode = "auto"
    max_tokens: int | None = None  # ceiling on every request's budget (None: the operation's own)
    output_budgets: tuple[tuple[str, int], ...] = ()  # per-operation overrides of the prompts' budgets
    temperature: float = 0.0

    def max_tokens_for(self, prompt: Prompt[Any]) -> int:
        """The request's ``max_tokens``: the override of its operation, else the prompt's budget (else
        the fallback), capped by ``max_tokens``."""
        budget = dict(self.output_budgets).get(prompt.operation) or prompt.max_tokens or FALLBACK_BUDGET
        return min(budget, self.max_tokens) if self.max_tokens is not None else budget

    @classmethod
    def from_endpoint(cls, endpoint: RoleEndpoint, **knobs: Any) -> ChatConfig:
        return cls(base_url=endpoint.base_url, api_key=endpoint.api_key, model=endpoint.model, **knobs)

    @classmethod
    def from_settings(cls, settings: Settings, role: Role) -> ChatConfig:
        return cls.from_endpoint(
            settings.endpoint(role),
            timeout_s=settings.llm_timeout_s,
            max_retries=settings.llm_max_retries,
            backoff_s=settings.llm_backoff_s,
            repair_attempts=settings.llm_repair_attempts,
            structured_mode=settings.llm_structured_mode,
            max_tokens=settings.llm_max_tokens,
            output_budgets=tuple(sorted(settings.output_budgets.items())),
            temperature=settings.llm_temperature,
        )


def _is_transient(exc: openai.APIError) -> bool:
    if isinstance(exc, openai.APIConnectionError):  # includes APITimeoutError
        return True
    return isinstance(exc, openai.APIStatusError) and (exc.status_code in (408, 429) or exc.status_code >= 500)


def _refuses_json_schema(exc: openai.APIStatusError) -> bool:
    if exc.status_code not in (400, 422):
        return False
    text = f"{exc.message} {exc.body}".lower()
    return "response_format" in text or "json_schema" in text or "response format" in text


def _retry_after_s(exc: openai.APIError) -> float | None:
    if not isinstance(exc, openai.APIStatusError):
        return None
    headers = exc.response.headers
    for name, scale in (("retry-after-ms", 0.001), ("retry-after", 1.0)):
        value = headers.get(name)
        if value is None:
            continue
        try:
            return max(0.0, float(value) * scale)
        except ValueError:
            continue  # an HTTP date: fall back to our own backoff
    return None


def _schema_name(operation: str) -> str:
    """OpenAI requires ``^[a-zA-Z0-9_-]{1,64}$`` for the schema name."""
    return re.sub(r"[^A-Za-z0-9_-]", "_", operation)[:64] or "response"


def _reply_json(text: str) -> dict[str, Any] | None:
    """A chat completion's JSON body, or None when the endpoint sent something else."""
    try:
        reply = json.loads(text)
    except ValueError:
        return None
    return reply if isinstance(reply, dict) else None


def _strip_fence(content: str) -> str:
    """Remove one markdown code fence wrapping the whole reply (small models add it)."""
    text = content.strip()
    if text.startswith("```") and text.endswith("```") and len(text) >= 6:
        text = text[3:-3]
        first_line, _, rest = text.partition("\n")
        text = rest if first_line.strip().isalpha() or not first_line.strip() else text
    return text.strip()


def truncation_error(prompt: Prompt[Any], content: str, budget: int, spend: CallSpend | None) -> LLMTruncatedError:
    """What the adapter raises for an answer cut at ``budget`` tokens (typed fakes raise the same)."""
    error = LLMTruncatedError(
        prompt.operation,
        prompt.input_ref,
        f"answer cut at the completion budget of {budget} tokens (finish_reason length, {len(content)} "
        f"characters); split the input or raise TMEM_LLM_OUTPUT_BUDGETS for {prompt.operation}",
        raw_output=content,
        input_digest=prompt.input_digest(),
        input_excerpt=prompt.input_excerpt(),
        max_tokens=budget,
    )
    error.spend = spend
    return error


def _spend(usage: TokenUsage, requests: int, repairs: int) -> CallSpend:
    return CallSpend(requests, repairs, usage.prompt_tokens, usage.completion_tokens, usage.estimated)


def _describe_errors(exc: ValidationError) -> str:
    parts = [f"{'.'.join(str(p) for p in err['loc']) or '<root>'}: {err['msg']}" for err in exc.errors()[:8]]
    text = "; ".join(parts)
    return text if len(text) <= _MAX_ERROR_CHARS else text[:_MAX_ERROR_CHARS] + "..."


class OpenAIChatModel:
    """:class:`~tmem.ports.ChatModel` over an OpenAI-compatible endpoint. Thread-safe."""

    def __init__(
        self,
        config: ChatConfig,
        *,
        sleep: Callable[[float], None] = time.sleep,
        rng: random.Random | None = None,
    ) -> None:
        self.config = config
        self._sleep = sleep
        self._rng = rng or random.Random()
        self._rng_lock = threading.Lock()
        self._client = openai.OpenAI(
            base_url=config.base_url,
            api_key=config.api_key.get_secret_value(),
            timeout=config.timeout_s,
            max_retries=0,  # retries are ours, below; the client's would multiply them
        )
        self._mode_lock = threading.Lock()
        self._mode: Literal["json_schema", "json_object"] = (
            "json_object" if config.structured_mode == "json_object" else "json_schema"
        )

    @property
    def model_name(self) -> str:
        return self.config.model

    @property
    def structured_mode(self) -> Literal["json_schema", "json_object"]:
        """The response format in use now (``auto`` starts at json_schema and may fall back)."""
        with self._mode_lock:
            return self._mode

    def complete(self, prompt: Prompt[R]) -> R:
        return self.complete_metered(prompt).value

    def request_body(self, prompt: Prompt[Any], extra: list[dict[str, str]] | None = None) -> dict[str, Any]:
        """The chat-completions request body this adapter sends for ``prompt`` now (Batch API lines too)."""
        mode = self.structured_mode
        return {
            "model": self.config.model,
            "messages": self._messages(prompt, extra or [], mode),
            "response_format": self._response_format(prompt, mode),
            "max_tokens": self.config.max_tokens_for(prompt),
            "temperature": self.config.temperature,
        }

    def complete_metered(
        self, prompt: Prompt[R], first: tuple[str, TokenUsage, str | None] | None = None
    ) -> Completion[R]:
        """Ask, validate, repair. ``first``: an answer obtained elsewhere (a Batch API line: content,
        usage, finish reason) to start from; it counts as one request, and repairs of it are asked
        synchronously. A failure raises with :attr:`~tmem.errors.LLMError.spend` set."""
        extra: list[dict[str, str]] = []  # bad answers and repair requests, in order
        usage = TokenUsage()
        requests = 0
        content = ""
        errors = ""
        for answer in range(self.config.repair_attempts + 1):
            if first is not None:
                (content, call_usage, finish), sent, first = first, 1, None
            else:
                content, call_usage, sent, finish = self._send(prompt, extra)
            usage, requests = usage + call_usage, requests + sent
            try:
                value = prompt.response_model.model_validate_json(_strip_fence(content))
            except ValidationError as exc:
                if finish == "length":  # cut at the budget: a repair would be cut again
                    raise self._truncated(prompt, content, usage, requests, answer) from None
                errors = _describe_errors(exc)
                log.warning("invalid answer for %s on %s: %s", prompt.operation, prompt.input_ref, errors)
                extra += [
                    {"role": "assistant", "content": content},
                    {"role": "user", "content": REPAIR_INSTRUCTION.format(errors=errors)},
                ]
                continue
            # A "length" answer that validates ended exactly at the budget: it is whole, keep it.
            return Completion(value=value, usage=usage, requests=requests, repairs=answer)
        answers = self.config.repair_attempts + 1
        failure = LLMOutputError(
            prompt.operation,
            prompt.input_ref,
            f"answer invalid after {answers} attempt(s) ({requests} requests): {errors}",
            raw_output=content,
            input_digest=prompt.input_digest(),
            input_excerpt=prompt.input_excerpt(),
        )
        failure.spend = _spend(usage, requests, answers - 1)
        raise failure

    def _truncated(
        self, prompt: Prompt[Any], content: str, usage: TokenUsage, requests: int, repairs: int
    ) -> LLMTruncatedError:
        budget = self.config.max_tokens_for(prompt)
        log.warning("answer for %s on %s cut at its budget of %d tokens (%d characters)",
                    prompt.operation, prompt.input_ref, budget, len(content))
        return truncation_error(prompt, content, budget, _spend(usage, requests, repairs))

    def _messages(self, prompt: Prompt[Any], extra: list[dict[str, str]], mode: str) -> list[dict[str, str]]:
        messages = [{"role": m.role, "content": m.content} for m in prompt.messages]
        if mode == "json_object":
            schema = SCHEMA_INSTRUCTION.format(schema=json.dumps(prompt.json_schema(), ensure_ascii=False))
            # Joined to the prompt's system message: many chat templates accept only one, first.
            if messages and messages[0]["role"] == "system":
                messages[0] = {"role": "system", "content": f"{messages[0]['content']}\n\n{schema}"}
            else:
                messages.insert(0, {"role": "system", "content": schema})
        return messages + extra

    def _response_format(self, prompt: Prompt[Any], mode: str) -> dict[str, Any]:
        if mode == "json_object":
            return {"type": "json_object"}
        return {
            "type": "json_schema",
            "json_schema": {"name": _schema_name(prompt.operation), "schema": prompt.json_schema(), "strict": False},
        }

    def _send(self, prompt: Prompt[Any], extra: list[dict[str, str]]) -> tuple[str, TokenUsage, int, str | None]:
        """One answer from the endpoint: (content, usage, requests sent, finish reason). Retries
        transient errors."""
        requests = 0
        retries = 0
        while True:
            mode = self.structured_mode
            body = self.request_body(prompt, extra)
            messages = body["messages"]
            requests += 1
            try:
                # The client's own POST (auth, base URL, timeout, typed errors), the body as we built it
                # and the reply as text: chat.completions.create walks every message through its
                # parameter types and builds a pydantic model of the reply, ~1 ms of CPU per call.
                text = self._client.post("/chat/completions", body=body, cast_to=str,
                                         options={"headers": {OPERATION_HEADER: prompt.operation}})
            except openai.APIError as exc:
                failure = exc
            else:
                reply = _reply_json(text)
                if reply is None:
                    raise tmem_errors.LLMRequestRejectedError(
                        prompt.operation, prompt.input_ref,
                        f"endpoint answered with something other than a chat completion: {self._scrub(text[:200])!r}", 200,
                    )
                return self._read(reply, messages, requests)
            # Decided outside the except block, so a suppressed cause leaves no __context__ either.
            if self._falls_back(failure, mode, prompt.operation):
                continue
            if not _is_transient(failure):
                raise self._rejected(prompt, failure) from self._safe_cause(failure)
            if retries >= self.config.max_retries:
                reason = f"endpoint failed {requests} time(s), last: {self._describe(failure)}"
                raise LLMTransportError(prompt.operation, prompt.input_ref, reason) from self._safe_cause(failure)
            delay = self._delay(retries, _retry_after_s(failure))
            log.warning(
                "%s on %s: %s; retry %d/%d in %.2fs",
                prompt.operation, prompt.input_ref, self._describe(failure), retries + 1, self.config.max_retries, delay,
            )
            self._sleep(delay)
            retries += 1

    def _read(
        self, reply: dict[str, Any], messages: list[dict[str, str]], requests: int
    ) -> tuple[str, TokenUsage, int, str | None]:
        content = ""
        finish: str | None = None
        choices = reply.get("choices") or []
        if choices and isinstance(choices[0], dict):
            message = choices[0].get("message") or {}
            content = (message.get("content") if isinstance(message, dict) else None) or ""
            finish = choices[0].get("finish_reason")
        used = reply.get("usage")
        if isinstance(used, dict):
            usage = TokenUsage(int(used.get("prompt_tokens") or 0), int(used.get("completion_tokens") or 0))
        else:  # some servers send no usage: estimate at ~4 characters per token, and say so
            prompt_chars = sum(len(m["content"]) for m in messages)
            usage = TokenUsage(prompt_chars // 4, len(content) // 4, estimated=True)
        return content, usage, requests, finish

    def _falls_back(self, exc: openai.APIError, mode: str, operation: str) -> bool:
        """In auto mode, switch to JSON mode for good when the server refuses json_schema."""
        if not (isinstance(exc, openai.APIStatusError) and mode == "json_schema" and _refuses_json_schema(exc)):
            return False
        if self.config.structured_mode != "auto":
            return False
        with self._mode_lock:
            if self._mode == "json_schema":
                log.warning(
                    "%s refused response_format json_schema (seen on %s): using JSON mode with the schema in the prompt",
                    self.config.base_url, operation,
                )
            self._mode = "json_object"
        return True

    def _delay(self, retries: int, retry_after: float | None) -> float:
        if retry_after is not None:
            return min(retry_after, self.config.retry_after_cap_s)
        base = min(self.config.backoff_s * (2**retries), self.config.backoff_max_s)
        with self._rng_lock:
            return base * (0.5 + 0.5 * self._rng.random())  # equal jitter: spreads synchronized retries

    def _scrub(self, text: str) -> str:
        secret = self.config.api_key.get_secret_value()
        return text.replace(secret, "***") if secret else text

    def _describe(self, exc: openai.APIError) -> str:
        if isinstance(exc, openai.APITimeoutError):
            return f"timeout after {self.config.timeout_s}s"
        if isinstance(exc, openai.APIStatusError):
            return self._scrub(f"HTTP {exc.status_code}: {exc.message}")
        return self._scrub(f"{type(exc).__name__}: {exc.message}")

    def _safe_cause(self, exc: openai.APIError) -> BaseException | None:
        """Chain the client's error unless it quotes the key (a server may echo it back)."""
        secret = self.config.api_key.get_secret_value()
        if secret and (secret in str(exc) or secret in str(exc.body)):
            return None
        return exc

    def _rejected(self, prompt: Prompt[Any], exc: openai.APIError) -> LLMError:
        status = exc.status_code if isinstance(exc, openai.APIStatusError) else 0
        return tmem_errors.LLMRequestRejectedError(
            prompt.operation, prompt.input_ref, f"endpoint rejected the request: {self._describe(exc)}", status
        )



def adapter_from_settings(settings: Settings, role: Role) -> OpenAIChatModel:
    """The registered factory of provider ``openai`` (tmem.providers.registry)."""
    return OpenAIChatModel(ChatConfig.from_settings(settings, role))


def endpoint_reachable(config: ChatConfig, *, timeout_s: float = 3.0) -> bool:
    """True when something OpenAI-compatible answers at ``config.base_url`` (any HTTP status counts:
    a server without ``/models`` still answers); False on connection errors and timeouts."""
    client = openai.OpenAI(
        base_url=config.base_url, api_key=config.api_key.get_secret_value(), timeout=timeout_s, max_retries=0
    )
    try:
        client.models.list()
    except openai.APIStatusError:
        return True
    except (openai.APIConnectionError, openai.APITimeoutError):
        return False
    finally:
        client.close()
    return True

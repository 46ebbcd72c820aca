"""Completion-token budgets per LLM operation: the ``max_tokens`` each request is sent with.

One cap for every operation either cuts the long answers of a capable model or lets a runaway
answer of a cheap one burn tokens. Each operation gets a budget (declared with the operation, :mod:`tmem.prompts.operations`) sized from what capable models
actually answered (``fixtures/real-model/conv26-s1-6-cues/build_calls.jsonl``: 67 build answers;
sizes below at ~4 characters a token, as the model bridge and the scripted server count them) —
about three times the largest answer seen at the default batch sizes, so a dense input still
fits and a degenerate answer is stopped early. An answer that does not fit is cut by the server
(``finish_reason == "length"``) and raised as :class:`tmem.errors.LLMTruncatedError`; the
construction stages then split their input (never fail the conversation), so a budget set too
low costs calls, not memory.

| operation | budget | largest answer seen (tokens) | why |
|---|---:|---:|---|
| scene_boundaries | 3072 | 610 (4 scenes closed in a 16-turn window) | ~150 per closed scene; a window of short exchanges may close 8+, a larger ``TMEM_SEGMENT_WINDOW`` more |
| scene_pack | 2048 | (no call in the fixture) | 4 scenes a call at ~160 each; a runaway-guarded scene (40 turns) has a longer narrative |
| topic_match | 1024 | 98 | refs and up to 5 keywords per admitted topic, an optional proposal |
| topic_create | 1024 | 84 | a title and 10-20 keywords |
| item_extract | 4096 | 1,730 (23 items); 3,300 (46 items) on a whole LoCoMo conversation | ~75 per item; the whole-conversation answers of 28-46 items ran past the old 2,048 cap |
| item_triggers | 3072 | 830 (6 items) | up to 171 per item: 6 x 171 x 3 |
| scene_triggers | 3072 | 1,030 (4 scenes) | ~260 per scene, 4 per call |
| persona | 3072 | 740 | the whole profile is re-stated on every fold, so halving the turns does not shrink it: room for its 5 lists of 12 entries |
| answer, memory_reply | 1024 | short answers (a sentence) | room for an optional short reasoning field |
| judge_locomo, judge_memory_awareness | 1024 | a verdict and a reason | |

``TMEM_LLM_OUTPUT_BUDGETS`` overrides any of them (``item_extract=6000,persona=2000``) and
``TMEM_LLM_MAX_TOKENS`` caps them all (the embedded local model's profile sets 640); see
:meth:`tmem.providers.openai_chat.ChatConfig.max_tokens_for`.
"""

from __future__ import annotations

from collections.abc import Mapping
from types import MappingProxyType

from tmem.prompts.operations import OPERATIONS

DEFAULT_BUDGETS: Mapping[str, int] = MappingProxyType({op.name: op.budget for op in OPERATIONS})

# An operation missing from the table (a new prompt module not yet measured): the former global cap.
FALLBACK_BUDGET = 2048
MIN_BUDGET = 64


def budget_for(operation: str) -> int:
    """The default completion-token budget of ``operation``."""
    return DEFAULT_BUDGETS.get(operation, FALLBACK_BUDGET)


def parse_budgets(text: str, setting: str = "TMEM_LLM_OUTPUT_BUDGETS") -> dict[str, int]:
    """``"item_extract=6000, persona=2000"`` as ``{operation: tokens}``; a :class:`ValueError`
    naming ``setting`` for an unknown operation, a malformed pair or a budget below ``MIN_BUDGET``."""
    out: dict[str, int] = {}
    for part in (p.strip() for p in text.split(",")):
        if not part:
            continue
        name, sep, value = (s.strip() for s in part.partition("="))
        if not sep or not name:
            raise ValueError(f"{setting}: {part!r} is not operation=tokens (e.g. item_extract=6000)")
        if name not in DEFAULT_BUDGETS:
            raise ValueError(f"{setting}: unknown operation {name!r}; known: {', '.join(sorted(DEFAULT_BUDGETS))}")
        try:
            tokens = int(value)
        except ValueError:
            raise ValueError(f"{setting}: {name}={value!r} is not a whole number of tokens") from None
        if tokens < MIN_BUDGET:
            raise ValueError(f"{setting}: {name}={tokens} is below the minimum of {MIN_BUDGET} tokens")
        if name in out:
            raise ValueError(f"{setting}: {name} is given twice")
        out[name] = tokens
    return out

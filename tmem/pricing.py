"""A small model price table for cost estimates in build reports (USD per 1M tokens).

The defaults are list prices of a few common hosted models (OpenAI, as published in 2025);
they change, so a deployment overrides or extends them with the build flow's ``prices``
parameter (``{"model": {"input": 0.15, "output": 0.6}}``). A model that matches no entry has
no estimate ("n/a"): tmem never invents a price. Tokens answered through the OpenAI Batch API
(``TMEM_LLM_BATCH=on``) are billed at ``BATCH_PRICE_FACTOR`` (50 %) of the listed price. Names match exactly, else by the longest
entry that prefixes the model name (``gpt-4o-mini-2024-07-18`` is priced as ``gpt-4o-mini``).
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass


@dataclass(frozen=True)
class ModelPrice:
    input_per_mtok: float  # USD per 1M prompt tokens
    output_per_mtok: float  # USD per 1M completion tokens

    def __post_init__(self) -> None:
        if self.input_per_mtok < 0 or self.output_per_mtok < 0:
            raise ValueError("prices must be >= 0")

    def cost(self, prompt_tokens: int, completion_tokens: int) -> float:
        return (prompt_tokens * self.input_per_mtok + completion_tokens * self.output_per_mtok) / 1_000_000


DEFAULT_PRICES: Mapping[str, ModelPrice] = {
    "gpt-4o-mini": ModelPrice(0.15, 0.60),
    "gpt-4o": ModelPrice(2.50, 10.00),
    "gpt-4.1": ModelPrice(2.00, 8.00),
    "gpt-4.1-mini": ModelPrice(0.40, 1.60),
    "gpt-4.1-nano": ModelPrice(0.10, 0.40),
    "o4-mini": ModelPrice(1.10, 4.40),
    "o3-mini": ModelPrice(1.10, 4.40),
}

PriceOverrides = Mapping[str, ModelPrice | Mapping[str, float]]

BATCH_PRICE_FACTOR = 0.5  # the Batch API's discount: half the synchronous price, input and output


def price_table(overrides: PriceOverrides | None = None) -> dict[str, ModelPrice]:
    """The defaults with ``overrides`` applied (``{"input": .., "output": ..}`` or :class:`ModelPrice`)."""
    table = dict(DEFAULT_PRICES)
    for model, price in (overrides or {}).items():
        if isinstance(price, ModelPrice):
            table[model] = price
            continue
        missing = {"input", "output"} - set(price)
        if missing:
            raise ValueError(f"price of {model!r} lacks {sorted(missing)} (USD per 1M tokens)")
        table[model] = ModelPrice(float(price["input"]), float(price["output"]))
    return table


def price_for(model: str, table: Mapping[str, ModelPrice]) -> ModelPrice | None:
    if model in table:
        return table[model]
    prefixes = [name for name in table if model.startswith(name)]
    return table[max(prefixes, key=len)] if prefixes else None


def estimate_cost(
    model: str, prompt_tokens: int, completion_tokens: int, table: Mapping[str, ModelPrice] | None = None,
    *, batch_prompt_tokens: int = 0, batch_completion_tokens: int = 0,
) -> float | None:
    """USD for the tokens at ``model``'s price, or None when the model has no price.

    ``batch_*`` are the part of the totals answered through the Batch API, billed at the batch price.
    """
    if not (0 <= batch_prompt_tokens <= prompt_tokens and 0 <= batch_completion_tokens <= completion_tokens):
        raise ValueError("batch tokens must be a part of the total tokens")
    price = price_for(model, table if table is not None else DEFAULT_PRICES)
    if price is None:
        return None
    sync = price.cost(prompt_tokens - batch_prompt_tokens, completion_tokens - batch_completion_tokens)
    return sync + BATCH_PRICE_FACTOR * price.cost(batch_prompt_tokens, batch_completion_tokens)


def format_usd(cost: float | None) -> str:
    return "n/a" if cost is None else f"${cost:,.4f}"


def cost_markdown(
    model: str, prompt_tokens: int, completion_tokens: int, table: Mapping[str, ModelPrice],
    *, batch_prompt_tokens: int = 0, batch_completion_tokens: int = 0,
) -> str:
    """The report section: the model, its price, and this run's estimated cost (batch tokens discounted)."""
    price = price_for(model, table)
    rate = "no price listed" if price is None else f"${price.input_per_mtok:g} in / ${price.output_per_mtok:g} out per 1M"
    cost = estimate_cost(model, prompt_tokens, completion_tokens, table, batch_prompt_tokens=batch_prompt_tokens,
                         batch_completion_tokens=batch_completion_tokens)
    batch_note = (
        f"Of these, {batch_prompt_tokens} prompt and {batch_completion_tokens} completion tokens went through the "
        f"Batch API, priced at {BATCH_PRICE_FACTOR:.0%} of the list price. "
        if batch_prompt_tokens or batch_completion_tokens else ""
    )
    return "\n".join([
        "## Cost estimate",
        "",
        "| model | price (USD per 1M tokens) | prompt tokens | completion tokens | estimated cost |",
        "|---|---|---:|---:|---:|",
        f"| {model} | {rate} | {prompt_tokens} | {completion_tokens} | {format_usd(cost)} |",
        "",
        "Tokens of calls sent to the model this run (cache hits cost nothing). " + batch_note
        + "Override prices with the build flow's `prices` parameter.",
        "",
    ])

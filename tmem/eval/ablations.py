"""Named evaluation configurations: the paper's Table 4 ablations and Figure 4 budget sweeps.

An :class:`EvalConfig` is a retrieval preset (:mod:`tmem.retrieval.config`) plus budget
overrides, with a name that is also its results-folder name. Table 4 switches one component off
at a time on the same memory; Figure 4 varies one budget at a time with the others at their
defaults ``(kT, kS, kI, R) = (15, 5, 15, 10)``.
"""

from __future__ import annotations

import re
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from types import MappingProxyType
from typing import Any

from tmem.errors import ConfigError
from tmem.retrieval.config import ABLATIONS, RetrievalConfig, config_from_settings
from tmem.settings import Settings

BASELINE = "default"

# Table 4 rows in the paper's order: preset name → the paper's label.
TABLE4: Mapping[str, str] = MappingProxyType(
    {
        "no-scene-layer": "w/o SL",
        "no-item-channel": "w/o IC",
        "no-item-triggers": "w/o ET+BT",
        "no-persona": "w/o PS",
        "no-topic-filter": "w/o TF",
        "no-scene-trigger": "w/o ST",
        "no-horizon": "w/o HT",
        "no-scene-horizon": "w/o ST+HT",
    }
)

# Figure 4 budgets: the paper's symbol → (settings/RetrievalConfig field, default, values swept).
SWEEP_PARAMS: Mapping[str, tuple[str, int, tuple[int, ...]]] = MappingProxyType(
    {
        "kT": ("k_topics", 15, (5, 10, 15, 20)),
        "kS": ("k_scenes", 5, (1, 3, 5, 10)),
        "kI": ("k_items", 15, (5, 10, 15, 20)),
        "R": ("trigger_cap", 10, (0, 5, 10, 15)),
    }
)
_ALIASES = {"p": "kT", "kt": "kT", "k_topics": "kT", "s": "kS", "ks": "kS", "k_scenes": "kS",
            "i": "kI", "ki": "kI", "k_items": "kI", "r": "R", "trigger_cap": "R"}  # fmt: skip
_NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9_.+=-]*")


class EvalConfigError(ConfigError, ValueError):
    """An evaluation configuration that cannot exist (unknown preset, parameter or value)."""


@dataclass(frozen=True)
class EvalConfig:
    """A retrieval preset with budget overrides (settings field names, e.g. ``k_scenes``)."""

    name: str
    preset: str = BASELINE
    overrides: Mapping[str, int] = field(default_factory=dict)
    label: str = ""  # how reports print it (e.g. "w/o HT", "kS=3"); defaults to the name

    def __post_init__(self) -> None:
        if not _NAME.fullmatch(self.name):
            raise EvalConfigError(f"config name {self.name!r} must be letters, digits and . _ + = - (it names a folder)")
        bad = sorted(set(self.overrides) - {f for f, _, _ in SWEEP_PARAMS.values()})
        if bad:
            raise EvalConfigError(f"config {self.name!r}: cannot override {bad}; budgets: k_topics, k_scenes, k_items, trigger_cap")

    @property
    def display(self) -> str:
        return self.label or self.name

    def settings(self, base: Settings) -> Settings:
        """``base`` with this config's budgets."""
        return base.model_copy(update=dict(self.overrides)) if self.overrides else base

    def retrieval(self, base: Settings) -> RetrievalConfig:
        """The resolved retrieval configuration (raises UnknownPresetError for a bad preset)."""
        return config_from_settings(self.settings(base), self.preset)

    def as_dict(self) -> dict[str, Any]:
        return {"name": self.name, "preset": self.preset, "overrides": dict(self.overrides), "label": self.display}

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> EvalConfig:
        return cls(
            name=str(data["name"]), preset=str(data.get("preset", BASELINE)),
            overrides={str(k): int(v) for k, v in dict(data.get("overrides") or {}).items()},
            label=str(data.get("label", "")),
        )


def baseline(preset: str = BASELINE) -> EvalConfig:
    return EvalConfig(name=preset.replace("+", "_"), preset=preset, label="T-Mem" if preset == BASELINE else preset)


def ablation_configs(base_preset: str = BASELINE, only: Sequence[str] | None = None) -> list[EvalConfig]:
    """The baseline, then one config per Table 4 row (all eight, or the ``only`` ones), on ``base_preset``."""
    names = list(TABLE4) if not only else list(only)
    unknown = [n for n in names if n not in ABLATIONS]
    if unknown:
        raise EvalConfigError(f"unknown ablation {unknown[0]!r}; known: {', '.join(TABLE4)}")
    configs = [baseline(base_preset)]
    for name in names:
        preset = name if base_preset == BASELINE else f"{base_preset}+{name}"
        configs.append(EvalConfig(name=preset.replace("+", "_"), preset=preset, label=TABLE4.get(name, name)))
    return configs


def sweep_param(symbol: str) -> str:
    """The canonical Figure 4 symbol (kT, kS, kI, R) for a user's spelling; raises EvalConfigError."""
    canonical = symbol if symbol in SWEEP_PARAMS else _ALIASES.get(symbol.lower())
    if canonical is None:
        raise EvalConfigError(f"unknown sweep parameter {symbol!r}; choose one of {', '.join(SWEEP_PARAMS)}")
    return canonical


def parse_values(text: str) -> list[int]:
    """``"1,3,5,10"`` → ``[1, 3, 5, 10]`` (non-negative integers, no repeats)."""
    try:
        values = [int(part) for part in text.split(",") if part.strip()]
    except ValueError as exc:
        raise EvalConfigError(f"sweep values must be integers separated by commas, got {text!r}") from exc
    if not values or any(v < 0 for v in values) or len(set(values)) != len(values):
        raise EvalConfigError(f"sweep values must be distinct non-negative integers, got {text!r}")
    return values


def sweep_configs(symbol: str, values: Sequence[int] | None = None, preset: str = BASELINE) -> list[EvalConfig]:
    """One config per value of one budget (the paper's values when ``values`` is None)."""
    canonical = sweep_param(symbol)
    field_name, _default, paper_values = SWEEP_PARAMS[canonical]
    configs: list[EvalConfig] = []
    for value in values if values is not None else paper_values:
        if value < 0 or (field_name == "k_topics" and value < 1):
            raise EvalConfigError(f"{canonical}={value} is out of range")
        prefix = "" if preset == BASELINE else preset.replace("+", "_") + "_"
        configs.append(
            EvalConfig(name=f"{prefix}{canonical}={value}", preset=preset, overrides={field_name: value},
                       label=f"{canonical}={value}")
        )
    return configs


def sweep_of(config: EvalConfig) -> tuple[str, int] | None:
    """``(symbol, value)`` when ``config`` is a one-budget sweep point, else None."""
    if len(config.overrides) != 1:
        return None
    (field_name, value), = config.overrides.items()
    for symbol, (name, _, _) in SWEEP_PARAMS.items():
        if name == field_name:
            return symbol, value
    return None


EVAL_MODES = ("single", "ablate", "sweep")


def eval_configs(
    mode: str, preset: str = BASELINE, *, param: str | None = None, values: str | None = None,
    only: Sequence[str] | None = None,
) -> tuple[str, list[EvalConfig]]:
    """The configurations of one evaluation mode, and the name of its results folder: ``single`` (the
    baseline of ``preset``), ``ablate`` (Table 4, or the ``only`` rows) or ``sweep`` (Figure 4: one
    budget ``param`` over ``values``, default the paper's). ``tmem eval`` and the ``evaluate`` flow
    both dispatch here."""
    if mode == "single":
        return preset.replace("+", "_"), [baseline(preset)]
    if mode == "ablate":
        return "ablate", ablation_configs(preset, only)
    if mode == "sweep":
        if param is None:
            raise EvalConfigError("mode 'sweep' needs sweep_param (kT, kS, kI or R)")
        symbol = sweep_param(param)
        return f"sweep-{symbol}", sweep_configs(symbol, parse_values(values) if values else None, preset)
    raise EvalConfigError(f"unknown mode {mode!r}; choose {', '.join(EVAL_MODES[:-1])} or {EVAL_MODES[-1]}")

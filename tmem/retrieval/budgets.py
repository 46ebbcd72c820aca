"""The cascade's budgets and gate thresholds, declared once (DESIGN §4; the paper's defaults).

Both the retrieval configuration (:class:`tmem.retrieval.config.RetrievalConfig`) and the settings
(``TMEM_K_TOPICS`` …, :class:`tmem.settings.Settings`) inherit these fields from
:class:`CascadeBudgets`, so a default or a bound is stated here and nowhere else. A budget of 0
turns its stage's output off (a sweep's lower end); the prefilter keeps at least one topic.
"""

from __future__ import annotations

from typing import Any

from pydantic import BaseModel, Field

RRF_K0 = 60
"""RRF smoothing constant (Cormack, Clarke & Büttcher 2009, "Reciprocal rank fusion outperforms
Condorcet and individual rank learning methods", SIGIR)."""


class CascadeBudgets(BaseModel):
    """How much each stage of the cascade keeps, and how TrigRecall gates."""

    k_topics: int = Field(default=15, ge=1, description="kT: topics kept by the prefilter.")
    k_scenes: int = Field(default=5, ge=0, description="kS: scenes returned.")
    k_items: int = Field(default=15, ge=0, description="kI: items returned.")
    k_cue: int = Field(default=10, ge=0, description="Scenes recalled by SceneCue (A_S), ungated.")
    trigger_cap: int = Field(default=10, ge=0, description="R: at most this many trigger-recalled items (A_I).")
    trigger_gate: float = Field(
        default=0.85, ge=-1.0, le=1.0,
        description="τ of the 'cosine' rule (the paper preset's raw-cosine TrigRecall gate): min NaN-aware max cosine.",
    )
    trigger_gate_z: float = Field(
        default=3.0, ge=0.0,
        description="z of the 'robust_z' rule (the default standardised TrigRecall gate): "
        "(score − median) / (1.4826 · MAD) ≥ z.",
    )


def rrf_k0_field() -> Any:
    """RRF's k0 as a field: ``RetrievalConfig.k0`` and ``Settings.rrf_k0`` (``TMEM_RRF_K0``)."""
    return Field(default=RRF_K0, ge=1, description="RRF smoothing constant.")

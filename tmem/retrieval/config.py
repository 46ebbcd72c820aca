"""Typed retrieval configuration and its named presets (STYLE §10: strategies are named configs).

Presets:

* ``paper`` — the paper's cascade, literally: summed RRF (Eq. 2) at every stage (SceneCue too),
  TrigRecall gated at raw cosine τ = 0.85, no near-duplicate suppression, every component on.
* ``default`` — the product's choice, measured on memory built by a capable model (LoCoMo evidence
  recall and LoCoMo-Plus cue recall together, ``bench/real_model.py``): best-rank fusion
  (:data:`DEFAULT_FUSION`) at scene selection, item selection and inside SceneCue; the standardised
  TrigRecall gate (:data:`DEFAULT_GATE`, the same on any encoder); near-duplicate items kept apart
  (:data:`DEFAULT_DEDUPE`); scene selection reads each SceneCue view as a list of its own
  (:data:`DEFAULT_CUE_LISTS`); a scene's dialogue scored by its best and its mean window
  (:data:`DEFAULT_DIALOGUE_POOL`).
* ``best-rank`` / ``reserved`` / ``rrf`` — ``default`` with that fusion rule, for comparisons.
* one preset per ablation of the paper's Table 4, on top of ``default``: ``no-scene-layer``,
  ``no-item-channel``, ``no-item-triggers`` (w/o ET+BT), ``no-persona``, ``no-topic-filter``,
  ``no-scene-trigger``, ``no-horizon`` and ``no-scene-horizon`` (w/o ST+HT).

Names compose with ``+``: ``preset("paper+no-horizon")`` is the paper's cascade without horizon
triggers.
"""

from __future__ import annotations

from collections.abc import Mapping
from types import MappingProxyType
from typing import Any, Literal

from pydantic import ConfigDict, Field, model_validator

from tmem.errors import TmemError
from tmem.retrieval.scoring import FusionRule, GateRule
from tmem.settings import CascadeBudgets, Settings, rrf_k0_field

DEFAULT_FUSION: FusionRule = "best_rank"
"""Fusion rule of the ``default`` preset for scene and item selection (to be settled by measurement)."""

DEFAULT_DEDUPE = 0.92
"""Near-duplicate items (cosine ≥ this) never share a context (measured: 51 of 219 items of a real-model
LoCoMo build have a twin at ≥ .92, e.g. the same fact extracted under two topics)."""

DEFAULT_CUE_LISTS: Literal["fused", "views"] = "views"
"""How scene selection reads SceneCue in every preset but ``paper``: one list per view (dialogue, scene
trigger, horizon), so a scene that one associative view ranks first is not averaged away before it meets
the similarity lists (measured on real-model memory, ``bench/real_model.py``: LoCoMo-Plus cue recall@5
.19 → .31 on conv-30 with 16 cues, .38 → .50 on the fixture; evidence recall@5 .89 → .92 and .94 → .94)."""

DEFAULT_DIALOGUE_POOL: Literal["max", "mean", "max_mean"] = "max_mean"
"""How SceneCue scores a scene's dialogue windows in every preset but ``paper`` (which keeps the best
window, the closest to its one dialogue vector): the mean of the best window and of all windows. Measured
on four real-model memories (``bench/real_model.py``), LoCoMo-Plus cue recall@5, each cue alone: conv-30
.63 → .75 and fixture .75 → .88 (segmentation v3), .75 → .81 and .50 → .56 on older memories; evidence
recall@5 unchanged on three, −.02 on one."""

DEFAULT_GATE: GateRule = "robust_z"
"""TrigRecall gate of every preset but ``paper`` (which keeps the paper's raw-cosine τ = 0.85)."""


class UnknownPresetError(TmemError, ValueError):
    """A retrieval preset name that does not exist."""


class RetrievalConfig(CascadeBudgets):
    """Budgets, fusion rules and the ablation switches of the retrieval cascade (DESIGN §4)."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    name: str = Field(default="custom", description="Preset name this config came from (for reports and traces).")
    trigger_gate_rule: GateRule = Field(
        default="robust_z",
        description=(
            "How TrigRecall gates: 'robust_z' keeps items whose trigger score stands ≥ trigger_gate_z robust "
            "standard deviations above the median over the conversation's items for this query (means the same "
            "whatever the encoder); 'cosine' keeps items whose raw cosine is ≥ trigger_gate (the paper's τ)."
        ),
    )
    k0: int = rrf_k0_field()
    scene_fusion: FusionRule = Field(default=DEFAULT_FUSION, description="How scene selection combines its lists.")
    item_fusion: FusionRule = Field(default=DEFAULT_FUSION, description="How item selection combines its lists.")
    reserved_scene_slots: int = Field(default=2, ge=0, description="Slots kept for SceneCue hits under 'reserved'.")
    reserved_item_slots: int = Field(default=5, ge=0, description="Slots kept for TrigRecall hits under 'reserved'.")
    cue_fusion: FusionRule = Field(
        default="best_rank",
        description="How SceneCue fuses its dlg, scn and hor rankings (the paper: RRF, which buries a scene "
        "that one view ranks first and the others do not).",
    )
    cue_lists: Literal["fused", "views"] = Field(
        default=DEFAULT_CUE_LISTS,
        description="Scene selection reads SceneCue as one list per view (a scene one view ranks first competes "
        "with the similarity lists on its own) or as its fused list (the paper).",
    )
    dialogue_pool: Literal["max", "mean", "max_mean"] = Field(
        default=DEFAULT_DIALOGUE_POOL,
        description="How SceneCue scores a scene's dialogue from its windows' cosines: the best window, their "
        "mean, or the mean of both (a scene about the query above one that touches it once).",
    )
    item_dedupe_cosine: float | None = Field(
        default=0.92, ge=0.0, le=1.0,
        description=(
            "An item whose content vector has at least this cosine with a better-ranked selected item is a "
            "near-duplicate and gives its slot to the next item (None: off; lexical mode compares token sets)."
        ),
    )
    # The seven switches of the paper's Table 4 (ST+HT is both trigger switches off).
    scene_layer: bool = Field(default=True, description="SL: return scenes (off: items chosen over all items).")
    item_channel: bool = Field(default=True, description="IC: return items.")
    item_triggers: bool = Field(default=True, description="ET+BT: entity and bridge trigger recall (TrigRecall).")
    persona: bool = Field(default=True, description="PS: append personas.")
    topic_filter: bool = Field(default=True, description="TF: topic prefilter (off: every scene is a candidate).")
    scene_trigger: bool = Field(default=True, description="ST: the scn view in SceneCue.")
    horizon_trigger: bool = Field(default=True, description="HT: the hor views in SceneCue.")

    @model_validator(mode="after")
    def _reserved_needs_the_fused_cue_list(self) -> RetrievalConfig:
        if self.scene_fusion == "reserved" and self.cue_lists != "fused" and self.reserved_scene_slots > 0:
            raise ValueError(
                "scene_fusion 'reserved' holds slots for the fused SceneCue list: set cue_lists='fused' "
                "(or reserved_scene_slots=0)"
            )
        return self

    def with_(self, **changes: Any) -> RetrievalConfig:
        """A validated copy with some fields changed."""
        return RetrievalConfig.model_validate({**self.model_dump(), **changes})


ABLATIONS: Mapping[str, Mapping[str, bool]] = MappingProxyType(
    {
        "no-scene-layer": {"scene_layer": False},
        "no-item-channel": {"item_channel": False},
        "no-item-triggers": {"item_triggers": False},
        "no-persona": {"persona": False},
        "no-topic-filter": {"topic_filter": False},
        "no-scene-trigger": {"scene_trigger": False},
        "no-horizon": {"horizon_trigger": False},
        "no-scene-horizon": {"scene_trigger": False, "horizon_trigger": False},
    }
)

_BASES: Mapping[str, Mapping[str, Any]] = MappingProxyType(
    {
        "paper": {"scene_fusion": "rrf", "item_fusion": "rrf", "cue_fusion": "rrf", "cue_lists": "fused",
                  "dialogue_pool": "max", "trigger_gate_rule": "cosine", "item_dedupe_cosine": None},
        "default": {},
        "rrf": {"scene_fusion": "rrf", "item_fusion": "rrf"},
        "best-rank": {"scene_fusion": "best_rank", "item_fusion": "best_rank"},
        "reserved": {"scene_fusion": "reserved", "item_fusion": "reserved", "cue_lists": "fused"},
    }
)


def preset_names() -> tuple[str, ...]:
    """Every single-word preset name (bases, then ablations on ``default``)."""
    return (*_BASES, *ABLATIONS)


def preset(name: str, base: RetrievalConfig | None = None) -> RetrievalConfig:
    """The named configuration; ``"a+b+c"`` applies ablations b, c on base a.

    ``base`` supplies budgets (e.g. from :func:`config_from_settings`); fusion rules and switches
    come from the name. Raises :class:`UnknownPresetError` listing the known names.
    """
    parts = [p.strip() for p in name.split("+")]
    if parts[0] in ABLATIONS:  # a bare ablation name applies to "default"
        parts.insert(0, "default")
    head, *ablations = parts
    if head not in _BASES or any(a not in ABLATIONS for a in ablations):
        bad = [p for p in parts if p not in _BASES and p not in ABLATIONS] or [head]
        raise UnknownPresetError(
            f"unknown retrieval preset {bad[0]!r} in {name!r}; bases: {', '.join(_BASES)}; "
            f"ablations (add with '+'): {', '.join(ABLATIONS)}"
        )
    changes: dict[str, Any] = {
        "scene_fusion": DEFAULT_FUSION, "item_fusion": DEFAULT_FUSION, "cue_fusion": DEFAULT_FUSION,
        "trigger_gate_rule": DEFAULT_GATE, "item_dedupe_cosine": DEFAULT_DEDUPE, "cue_lists": DEFAULT_CUE_LISTS,
        "dialogue_pool": DEFAULT_DIALOGUE_POOL, **_BASES[head],
    }
    for ablation in ablations:
        changes.update(ABLATIONS[ablation])
    return (base or RetrievalConfig()).with_(name=name, **changes)


def config_from_settings(settings: Settings, name: str = "default") -> RetrievalConfig:
    """The preset ``name`` with the budgets of ``settings`` (``TMEM_K_TOPICS`` etc.)."""
    budgets = RetrievalConfig(**{name: getattr(settings, name) for name in CascadeBudgets.model_fields},
                              k0=settings.rrf_k0)
    return preset(name, budgets)

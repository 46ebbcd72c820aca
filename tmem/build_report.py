"""The summary of one build run: figures for the CLI, DuckDB and the Prefect artifact."""

from __future__ import annotations

from dataclasses import asdict, dataclass, field
from typing import Any

from tmem.providers.llm_ledger import OperationUsage


@dataclass(frozen=True)
class Failure:
    conversation_id: str
    error_type: str
    message: str
    operation: str | None = None
    input_ref: str | None = None
    quarantined: bool = False  # invalid LLM output after the bounded repair (table `quarantine`)
    input_digest: str | None = None
    raw_output_excerpt: str | None = None


@dataclass(frozen=True)
class BuildSummary:
    run_id: str
    status: str  # completed | partial | failed
    conversations_requested: list[str]
    conversations_built: list[str]
    failures: list[Failure]
    counts: dict[str, int]
    usage: dict[str, OperationUsage]
    snapshot_id: str | None
    seconds: float
    extra: dict[str, Any] = field(default_factory=dict)

    @property
    def quarantined(self) -> list[str]:
        return sorted(f.conversation_id for f in self.failures if f.quarantined)

    @property
    def llm_calls(self) -> int:
        return sum(u.calls - u.cache_hits for u in self.usage.values())

    @property
    def llm_cache_hits(self) -> int:
        return sum(u.cache_hits for u in self.usage.values())

    @property
    def prompt_tokens(self) -> int:
        return sum(u.prompt_tokens for u in self.usage.values())

    @property
    def completion_tokens(self) -> int:
        return sum(u.completion_tokens for u in self.usage.values())

    @property
    def batch_calls(self) -> int:
        return sum(u.batch_calls for u in self.usage.values())

    @property
    def batch_prompt_tokens(self) -> int:
        return sum(u.batch_prompt_tokens for u in self.usage.values())

    @property
    def batch_completion_tokens(self) -> int:
        return sum(u.batch_completion_tokens for u in self.usage.values())

    def usage_totals(self) -> dict[str, int]:
        return {
            "llm_calls": self.llm_calls,
            "llm_cache_hits": self.llm_cache_hits,
            "prompt_tokens": self.prompt_tokens,
            "completion_tokens": self.completion_tokens,
        }

    def to_json(self) -> dict[str, Any]:
        """The object `tmem build --json` prints: store counts plus this run's usage."""
        out: dict[str, Any] = dict(self.counts)
        out.update(self.usage_totals())
        out.update(
            run_id=self.run_id,
            status=self.status,
            snapshot_id=self.snapshot_id,
            conversations_built=self.conversations_built,
            failures=[asdict(f) for f in self.failures],
            quarantined=self.quarantined,
            seconds=round(self.seconds, 3),
            batch_calls=self.batch_calls,
            batch_prompt_tokens=self.batch_prompt_tokens,
            batch_completion_tokens=self.batch_completion_tokens,
            usage_by_operation={
                op: {"calls": u.calls - u.cache_hits, "cache_hits": u.cache_hits, "prompt_tokens": u.prompt_tokens,
                     "completion_tokens": u.completion_tokens, "batch_calls": u.batch_calls}
                for op, u in self.usage.items()
            },
        )
        return out


def render_markdown(summary: BuildSummary) -> str:
    """The build report published as a Prefect markdown artifact."""
    lines = [
        f"# tmem build `{summary.run_id}`",
        "",
        f"**Status:** {summary.status} · **snapshot:** `{summary.snapshot_id or 'not published'}` · "
        f"**wall time:** {summary.seconds:.1f} s",
        "",
        f"Conversations built: {len(summary.conversations_built)} of {len(summary.conversations_requested)}",
        "",
        "## Memory (whole store after publish)",
        "",
        "| figure | count |",
        "|---|---:|",
        *[f"| {k} | {v} |" for k, v in summary.counts.items()],
        "",
        "## LLM usage of this run",
        "",
        "| operation | calls | cache hits | of the calls, via Batch API | prompt tokens | completion tokens "
        "| mean latency ms |",
        "|---|---:|---:|---:|---:|---:|---:|",
        *[
            f"| {op} | {u.calls - u.cache_hits} | {u.cache_hits} | {u.batch_calls} | {u.prompt_tokens} | "
            f"{u.completion_tokens} | {u.mean_latency_ms:.0f} |"
            for op, u in summary.usage.items()
        ],
        f"| **total** | {summary.llm_calls} | {summary.llm_cache_hits} | {summary.batch_calls} | "
        f"{summary.prompt_tokens} | {summary.completion_tokens} | |",
        "",
        "## Failures",
        "",
    ]
    if not summary.failures:
        lines.append("None.")
    else:
        lines += ["| conversation | error | operation | message |", "|---|---|---|---|"]
        lines += [
            f"| {f.conversation_id} | {f.error_type} | {f.operation or ''} | {f.message.replace('|', '/')[:300]} |"
            for f in summary.failures
        ]
    quarantined = [f for f in summary.failures if f.quarantined]
    if quarantined:
        lines += [
            "",
            "## Quarantined",
            "",
            "Invalid LLM output after the bounded repair; previous memory kept; full record: `tmem quarantine`.",
            "",
            "| conversation | operation | input | input digest | raw output (start) |",
            "|---|---|---|---|---|",
        ]
        lines += [
            f"| {f.conversation_id} | {f.operation or ''} | {_cell(f.input_ref or '')} | `{(f.input_digest or '')[:16]}` "
            f"| {_cell(f.raw_output_excerpt or '')} |"
            for f in quarantined
        ]
    return "\n".join(lines) + "\n"


def _cell(text: str, limit: int = 200) -> str:
    """Text safe inside a markdown table cell."""
    flat = " ".join(text.split()).replace("|", "/").replace("`", "'")
    return flat if len(flat) <= limit else flat[:limit] + "..."

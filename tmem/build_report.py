"""The summary of one build run: figures for the CLI, DuckDB and the Prefect artifact.

Besides counts and usage it names what is missing and why: conversations that failed or were
quarantined whole (:class:`Failure`), and units left out of a published conversation
(:class:`MissingUnit`); and it shows construction health per operation (:class:`OperationHealth`:
calls, checked re-asks, adapter repairs, truncations, splits, clipped lists, reclassified items,
dropped refs, quarantined units).
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field
from typing import Any

from tmem.ports import OperationUsage


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
class MissingUnit:
    """A unit quarantined out of a published conversation (table ``quarantine``)."""

    conversation_id: str
    operation: str
    unit_kind: str  # topic_chunk | item | scene | speaker
    unit_id: str
    input_ref: str
    error_type: str
    reason: str
    input_digest: str
    raw_output_excerpt: str | None = None


@dataclass(frozen=True)
class OperationHealth:
    """How one operation's construction went in a run."""

    operation: str
    calls: int = 0  # answered by the model (cache hits excluded); failed calls included
    cache_hits: int = 0
    checked_reasks: int = 0  # calls that re-asked with a construction check's rejection
    repairs: int = 0  # the adapter's repair re-asks (invalid JSON or schema)
    truncations: int = 0  # answers cut at the completion budget
    output_errors: int = 0  # calls that ended in invalid output (truncations included)
    splits: int = 0
    clipped: int = 0
    reclassified: int = 0
    dropped_refs: int = 0
    quarantined_units: int = 0


NOTE_FIELDS = {"split": "splits", "clipped": "clipped", "reclassified": "reclassified", "dropped_ref": "dropped_refs",
               "quarantined": "quarantined_units"}


def health_table(usage: dict[str, OperationUsage], notes: dict[str, dict[str, int]]) -> dict[str, OperationHealth]:
    """Usage-ledger totals and note counts (``{operation: {kind: count}}``) per operation, sorted."""
    out: dict[str, OperationHealth] = {}
    for op in sorted(set(usage) | set(notes)):
        u = usage.get(op, OperationUsage(op))
        counts = {field: notes.get(op, {}).get(kind, 0) for kind, field in NOTE_FIELDS.items()}
        out[op] = OperationHealth(op, calls=u.calls - u.cache_hits, cache_hits=u.cache_hits,
                                  checked_reasks=u.checked_reasks, repairs=u.repairs, truncations=u.truncations,
                                  output_errors=u.output_errors, **counts)
    return out


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
    quarantined_units: list[MissingUnit] = field(default_factory=list)  # left out of published conversations
    notes: dict[str, dict[str, int]] = field(default_factory=dict)  # {operation: {note kind: count}}

    @property
    def quarantined(self) -> list[str]:
        return sorted(f.conversation_id for f in self.failures if f.quarantined)

    @property
    def health(self) -> dict[str, OperationHealth]:
        return health_table(self.usage, self.notes)

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
            quarantined_units=[asdict(u) for u in self.quarantined_units],
            notes_by_operation=self.notes,
            construction_health={op: asdict(h) for op, h in self.health.items()},
            seconds=round(self.seconds, 3),
            batch_calls=self.batch_calls,
            batch_prompt_tokens=self.batch_prompt_tokens,
            batch_completion_tokens=self.batch_completion_tokens,
            usage_by_operation={
                op: {"calls": u.calls - u.cache_hits, "cache_hits": u.cache_hits, "prompt_tokens": u.prompt_tokens,
                     "completion_tokens": u.completion_tokens, "batch_calls": u.batch_calls, "repairs": u.repairs,
                     "checked_reasks": u.checked_reasks, "truncations": u.truncations,
                     "output_errors": u.output_errors}
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
    lines += _health_markdown(summary)
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
    if summary.quarantined_units:
        lines += [
            "",
            "## Quarantined units",
            "",
            "Left out of a published conversation: invalid LLM output after the repair, the re-asks and the "
            "splits; the rest of the conversation is published; full record: `tmem quarantine`.",
            "",
            "| conversation | operation | unit | input | input digest | reason | raw output (start) |",
            "|---|---|---|---|---|---|---|",
        ]
        lines += [
            f"| {u.conversation_id} | {u.operation} | {u.unit_kind} `{_cell(u.unit_id, 60)}` | {_cell(u.input_ref)} "
            f"| `{u.input_digest[:16]}` | {_cell(u.reason)} | {_cell(u.raw_output_excerpt or '')} |"
            for u in summary.quarantined_units
        ]
    return "\n".join(lines) + "\n"


def _health_markdown(summary: BuildSummary) -> list[str]:
    health = summary.health
    if not health:
        return []
    lines = [
        "",
        "## Construction health",
        "",
        "| operation | calls | checked re-asks | repairs | truncations | splits | clipped lists | reclassified "
        "| dropped refs | quarantined units |",
        "|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    lines += [
        f"| {h.operation} | {h.calls} | {h.checked_reasks} | {h.repairs} | {h.truncations} | {h.splits} | {h.clipped} "
        f"| {h.reclassified} | {h.dropped_refs} | {h.quarantined_units} |"
        for h in health.values()
    ]
    return lines


def _cell(text: str, limit: int = 200) -> str:
    """Text safe inside a markdown table cell."""
    flat = " ".join(text.split()).replace("|", "/").replace("`", "'")
    return flat if len(flat) <= limit else flat[:limit] + "..."

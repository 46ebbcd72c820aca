"""Incremental construction cost: tokens of adding one session to a built conversation vs a full rebuild.

For each conversation (default conv-41, which has 32 sessions), against the scripted LLM
(synth responders) with an ephemeral Prefect in a temporary home, all in this process:

  1. incremental store: ingest sessions 1..B (default B=20) and build; then ingest 1..B+1 and
     build with ``only_changed=True``. The second build's LLM tokens are the incremental cost;
  2. fresh store: ingest sessions 1..B+1 and build once. Its tokens are the full-rebuild cost;
  3. check that both stores published the same memory (``tmem.store.memory_image``).

Tokens are prompt + completion tokens of the calls that reached the server, from each run's
usage ledger (cache hits cost 0). The ratio incremental / full is what the nightly rebuild saves.

    HF_HUB_OFFLINE=1 python bench/incremental.py [--conversations conv-41 conv-42] [--base-sessions 20]
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import subprocess
import sys
import tempfile
import time
from contextlib import AbstractContextManager
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

from tmem.settings import environ_overlay

REPO = Path(__file__).resolve().parents[1]
DEFAULT_LOCOMO = REPO.parent / "shared" / "datasets" / "locomo" / "locomo10.json"
DEFAULT_OUT = REPO / "bench" / "results" / "incremental.json"
INGEST_NOW = datetime(2024, 1, 1, 12, 0, tzinfo=UTC)


def write_slice(locomo: Path, out: Path, conversation_id: str, sessions: int) -> Path:
    """A LoCoMo file with sessions 1..``sessions`` of one conversation (no QA)."""
    samples = {s["sample_id"]: s for s in json.loads(locomo.read_text(encoding="utf-8"))}
    full = samples[conversation_id]["conversation"]
    conversation: dict[str, Any] = {"speaker_a": full["speaker_a"], "speaker_b": full["speaker_b"]}
    for n in range(1, sessions + 1):
        if f"session_{n}" not in full:
            raise SystemExit(f"{conversation_id} has fewer than {sessions} sessions")
        conversation[f"session_{n}_date_time"] = full[f"session_{n}_date_time"]
        conversation[f"session_{n}"] = full[f"session_{n}"]
    out.write_text(json.dumps([{"sample_id": conversation_id, "conversation": conversation, "qa": []}]))
    return out


def llm_env(url: str, concurrency: int) -> AbstractContextManager[None]:
    return environ_overlay(
        {"TMEM_LLM_BASE_URL": url, "TMEM_LLM_API_KEY": "sk-bench", "TMEM_LLM_CONCURRENCY": str(concurrency)}
    )


def bench_environment(root: Path) -> dict[str, str]:
    """A private Prefect home under ``root``, offline and quiet, patient with a busy machine."""
    return {"PREFECT_HOME": str(root / "prefect-home"), "PREFECT_SERVER_ANALYTICS_ENABLED": "false",
            "DO_NOT_TRACK": "1", "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1",
            "PREFECT_LOGGING_LEVEL": "WARNING", "PREFECT_SERVER_EPHEMERAL_STARTUP_TIMEOUT_SECONDS": "300"}


def tokens(summary: dict[str, Any]) -> int:
    return int(summary["prompt_tokens"]) + int(summary["completion_tokens"])


def by_operation(summary: dict[str, Any]) -> dict[str, dict[str, int]]:
    return {
        op: {"calls": u["calls"], "cache_hits": u["cache_hits"], "tokens": u["prompt_tokens"] + u["completion_tokens"]}
        for op, u in summary["usage_by_operation"].items()
    }


def run_conversation(locomo: Path, root: Path, cid: str, base: int) -> dict[str, Any]:
    from tmem.flows.build_memory import build_memory
    from tmem.ingest import ingest_archives
    from tmem.store.memory_image import diff_images, memory_image
    from tmem.store.snapshot.published import current_snapshot

    def build(store: Path, only_changed: bool, label: str) -> tuple[dict[str, Any], float]:
        started = time.perf_counter()
        out: dict[str, Any] = build_memory(store=str(store), only_changed=only_changed, label=label)
        if out["status"] != "completed":
            raise SystemExit(f"{cid} {label}: build {out['status']}: {out['failures']}")
        return out, time.perf_counter() - started

    inc, fresh = root / f"{cid}-incremental", root / f"{cid}-fresh"
    ingest_archives([write_slice(locomo, root / f"{cid}-{base}.json", cid, base)], inc, now=INGEST_NOW)
    first, first_s = build(inc, False, f"{cid}-sessions-1-{base}")
    ingest_archives([write_slice(locomo, root / f"{cid}-{base + 1}.json", cid, base + 1)], inc, now=INGEST_NOW)
    incremental, incremental_s = build(inc, True, f"{cid}-plus-session-{base + 1}")
    ingest_archives([write_slice(locomo, root / f"{cid}-{base + 1}.json", cid, base + 1)], fresh, now=INGEST_NOW)
    full, full_s = build(fresh, False, f"{cid}-fresh-1-{base + 1}")

    inc_snap, fresh_snap = current_snapshot(inc), current_snapshot(fresh)
    assert inc_snap is not None and fresh_snap is not None
    differences = diff_images(memory_image(inc_snap, cid), memory_image(fresh_snap, cid))
    return {
        "conversation": cid,
        "base_sessions": base,
        "turns_after": full["turns"],
        "turns_added": full["turns"] - first["turns"],
        "first_build": {"tokens": tokens(first), "llm_calls": first["llm_calls"], "seconds": round(first_s, 1)},
        "incremental": {"tokens": tokens(incremental), "llm_calls": incremental["llm_calls"],
                        "cache_hits": incremental["llm_cache_hits"], "seconds": round(incremental_s, 1),
                        "by_operation": by_operation(incremental)},
        "full": {"tokens": tokens(full), "llm_calls": full["llm_calls"], "seconds": round(full_s, 1),
                 "by_operation": by_operation(full)},
        "token_ratio": round(tokens(incremental) / tokens(full), 4),
        "call_ratio": round(incremental["llm_calls"] / full["llm_calls"], 4),
        "same_memory": not differences,
        "differences": differences[:20],
    }


def machine_info() -> dict[str, Any]:
    commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=REPO, capture_output=True, text=True,
                            check=False).stdout.strip()
    return {"date": datetime.now(UTC).isoformat(timespec="seconds"), "cpu_count": os.cpu_count(),
            "python": platform.python_version(), "platform": platform.platform(), "git_head": commit or None}


def print_table(rows: list[dict[str, Any]]) -> None:
    print(f"{'conversation':<13}{'sessions':>10}{'turns+':>8}{'inc tokens':>12}{'full tokens':>13}"
          f"{'ratio':>8}{'inc calls':>11}{'full calls':>12}{'same':>6}")
    for r in rows:
        print(f"{r['conversation']:<13}{str(r['base_sessions']) + '+1':>10}{r['turns_added']:>8}"
              f"{r['incremental']['tokens']:>12}{r['full']['tokens']:>13}{r['token_ratio']:>8.3f}"
              f"{r['incremental']['llm_calls']:>11}{r['full']['llm_calls']:>12}{'yes' if r['same_memory'] else 'NO':>6}")
    print("\nincremental tokens by operation (calls / tokens; full rebuild in brackets):")
    for r in rows:
        parts = [f"{op} {u['calls']}/{u['tokens']} [{r['full']['by_operation'].get(op, {}).get('tokens', 0)}]"
                 for op, u in r["incremental"]["by_operation"].items()]
        print(f"  {r['conversation']}: " + "; ".join(parts))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--locomo", type=Path, default=DEFAULT_LOCOMO)
    parser.add_argument("--conversations", nargs="+", default=["conv-41"], metavar="ID")
    parser.add_argument("--base-sessions", type=int, default=20)
    parser.add_argument("--llm-concurrency", type=int, default=4)
    parser.add_argument("--out", type=Path, default=DEFAULT_OUT)
    args = parser.parse_args()

    with tempfile.TemporaryDirectory(prefix="tmem-bench-incremental-") as tmp:
        root = Path(tmp)
        os.environ.update(bench_environment(root))
        sys.path.insert(0, str(REPO))
        import tmem.devtools.synth  # noqa: F401 -- registers the deterministic responders
        from tmem.devtools.scripted_llm import ScriptedLLM

        info = machine_info() | {"loadavg_start": [round(x, 2) for x in os.getloadavg()]}
        rows: list[dict[str, Any]] = []
        with ScriptedLLM() as server, llm_env(server.url, args.llm_concurrency):
            for cid in args.conversations:
                rows.append(run_conversation(args.locomo, root, cid, args.base_sessions))
        info["loadavg_end"] = [round(x, 2) for x in os.getloadavg()]

    result = {"benchmark": "incremental", "machine": info, "llm": "scripted (tmem.devtools.synth)",
              "definition": "tokens = prompt + completion tokens of calls sent to the LLM (ledger, cache hits are 0); "
                            "ratio = incremental build adding session B+1 to a store built with 1..B / "
                            "fresh build of sessions 1..B+1",
              "conversations": rows}
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(result, indent=1) + "\n")
    print_table(rows)
    print(f"\nwrote {args.out}")


if __name__ == "__main__":
    main()

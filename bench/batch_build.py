"""Batch API builds: how many construction calls move to batches, and what the cost estimate becomes.

Against the scripted LLM (synth responders) with an ephemeral Prefect in a temporary home, all in
this process: ingest one LoCoMo conversation (default conv-26, all sessions) and build it with
``TMEM_LLM_BATCH=on``; with ``--compare``, also build it in a fresh store with batching off and
check both published the same memory (``tmem.store.memory_image``).

Figures: calls and tokens through the Batch API vs in total (ledger), batches submitted (server),
and the cost estimate at the build model's list price (default ``gpt-4o-mini``) with batch tokens
at 50 %, as a ratio to the same tokens all at the synchronous price.

    HF_HUB_OFFLINE=1 python bench/batch_build.py [--conversation conv-26] [--compare]
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))
from bench.incremental import DEFAULT_LOCOMO, INGEST_NOW, bench_environment, llm_env, machine_info  # noqa: E402

DEFAULT_OUT = REPO / "bench" / "results" / "batch_build.json"
BATCH_ENV = {"TMEM_LLM_BATCH": "on", "TMEM_LLM_BATCH_LINGER_S": "1.0", "TMEM_LLM_BATCH_POLL_S": "0.2",
             "TMEM_LLM_BATCH_POLL_MAX_S": "1.0"}


def one_conversation(locomo: Path, out: Path, cid: str) -> Path:
    samples = {s["sample_id"]: s for s in json.loads(locomo.read_text(encoding="utf-8"))}
    if cid not in samples:
        raise SystemExit(f"{locomo}: no conversation {cid!r}")
    out.write_text(json.dumps([samples[cid] | {"qa": []}]))
    return out


def build(store: Path, archive: Path, label: str, env: dict[str, str]) -> tuple[dict[str, Any], float]:
    from tmem.flows.build_memory import build_memory
    from tmem.ingest import ingest_archives
    from tmem.settings import environ_overlay

    ingest_archives([archive], store, now=INGEST_NOW)
    with environ_overlay(env):
        started = time.perf_counter()
        summary: dict[str, Any] = build_memory(store=str(store), label=label)
        seconds = time.perf_counter() - started
    if summary["status"] != "completed":
        raise SystemExit(f"{label}: build {summary['status']}: {summary['failures']}")
    return summary, seconds


def figures(summary: dict[str, Any], seconds: float) -> dict[str, Any]:
    from tmem.pricing import estimate_cost

    model = summary["model"]
    sync_cost = estimate_cost(model, summary["prompt_tokens"], summary["completion_tokens"])
    return {
        "llm_calls": summary["llm_calls"], "batch_calls": summary["batch_calls"],
        "prompt_tokens": summary["prompt_tokens"], "completion_tokens": summary["completion_tokens"],
        "batch_prompt_tokens": summary["batch_prompt_tokens"],
        "batch_completion_tokens": summary["batch_completion_tokens"],
        "model": model, "cost_usd": summary["cost_usd"], "cost_usd_all_sync": sync_cost,
        "cost_ratio": round(summary["cost_usd"] / sync_cost, 4) if sync_cost else None,
        "calls_by_operation": {op: [u["calls"], u["batch_calls"]] for op, u in summary["usage_by_operation"].items()},
        "seconds": round(seconds, 1),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--locomo", type=Path, default=DEFAULT_LOCOMO)
    parser.add_argument("--conversation", default="conv-26")
    parser.add_argument("--compare", action="store_true", help="also build with batching off and compare memory")
    parser.add_argument("--out", type=Path, default=DEFAULT_OUT)
    args = parser.parse_args()

    with tempfile.TemporaryDirectory(prefix="tmem-bench-batch-") as tmp:
        root = Path(tmp)
        os.environ.update(bench_environment(root))
        import tmem.devtools.synth  # noqa: F401 -- registers the deterministic responders
        from tmem.devtools.scripted_llm import ScriptedLLM
        from tmem.store.memory_image import diff_images, memory_image
        from tmem.store.snapshot.published import current_snapshot

        archive = one_conversation(args.locomo, root / "conversation.json", args.conversation)
        info = machine_info() | {"loadavg_start": [round(x, 2) for x in os.getloadavg()]}
        result: dict[str, Any] = {"benchmark": "batch_build", "conversation": args.conversation,
                                  "llm": "scripted (tmem.devtools.synth), 0 ms per answer"}
        with ScriptedLLM() as server, llm_env(server.url, 4):
            on, on_s = build(root / "on", archive, "batch-on", BATCH_ENV)
            result["batch_on"] = figures(on, on_s) | {
                "batches": len(server.batches.created),
                "batch_sizes": [b["request_counts"]["total"] for b in server.batches.created],
                "sync_requests": sum(1 for r in server.requests if r.via == "chat"),
            }
            if args.compare:
                off, off_s = build(root / "off", archive, "batch-off", {"TMEM_LLM_BATCH": "off"})
                result["batch_off"] = figures(off, off_s)
                on_snap, off_snap = current_snapshot(root / "on"), current_snapshot(root / "off")
                assert on_snap is not None and off_snap is not None
                result["same_memory"] = not diff_images(memory_image(on_snap, args.conversation),
                                                        memory_image(off_snap, args.conversation))
        info["loadavg_end"] = [round(x, 2) for x in os.getloadavg()]
        result["machine"] = info

    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(result, indent=1) + "\n")
    b = result["batch_on"]
    print(f"{'build':<10}{'calls':>7}{'batched':>9}{'share':>7}{'tokens':>10}{'batched tok':>13}"
          f"{'cost $':>10}{'all-sync $':>12}{'ratio':>7}{'s':>7}")
    for name in ("batch_on", "batch_off"):
        if name in result:
            f = result[name]
            tokens = f["prompt_tokens"] + f["completion_tokens"]
            batched = f["batch_prompt_tokens"] + f["batch_completion_tokens"]
            print(f"{name:<10}{f['llm_calls']:>7}{f['batch_calls']:>9}{f['batch_calls'] / max(1, f['llm_calls']):>7.2f}"
                  f"{tokens:>10}{batched:>13}{f['cost_usd']:>10.4f}{f['cost_usd_all_sync']:>12.4f}"
                  f"{f['cost_ratio']:>7.3f}{f['seconds']:>7.1f}")
    print(f"batches: {b['batches']} of sizes {b['batch_sizes']}; synchronous requests with batching on: "
          f"{b['sync_requests']}" + (f"; same memory as batching off: {result['same_memory']}" if args.compare else ""))
    print(f"\nwrote {args.out}")


if __name__ == "__main__":
    main()

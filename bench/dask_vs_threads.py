"""Wall time of a full build on Prefect's Dask task runner (local cluster) vs the thread-pool runner.

Steps, in fresh temporary stores and one Prefect home:
  1. start the scripted OpenAI-compatible server in this process (synth responders, every answer
     delayed by --latency-ms);
  2. ``python -m tmem ingest locomo10.json`` into two stores;
  3. for each repeat, in turn: ``python -m tmem build --json`` with ``TMEM_TASK_RUNNER=threads``
     into the threads store, then with ``TMEM_TASK_RUNNER=dask`` (a temporary LocalCluster of
     --workers processes x --threads-per-worker threads) into the dask store — each timed from
     outside, and each repeat after the first with the Prefect and LLM caches of both stores cleared,
     so every build asks every question again;
  4. compare the published memories of the two stores (tmem.store.memory_image: every memory row
     and vector row) — they must be the same.

Each process caps LLM calls in flight at TMEM_LLM_CONCURRENCY, so the Dask build has --workers
times the thread-pool build's in-flight calls: that is the point of scaling out, and it is
reported. The Dask wall time includes starting the cluster (worker processes importing tmem,
Prefect and torch, and loading the embedding model once per worker).

    HF_HUB_OFFLINE=1 python bench/dask_vs_threads.py [--latency-ms 200] [--workers 2]
        [--threads-per-worker 4] [--conversations conv-26 ...] [--repeats 1] [--equal-in-flight] [--out PATH]
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import sys
import tempfile
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

from tmem.devtools import synth
from tmem.devtools.scripted_llm import ScriptedLLM
from tmem.store.duck import connect
from tmem.store.memory_image import diff_images, memory_image
from tmem.store.snapshot.published import current_snapshot

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))
from bench.benchstats import loadavg  # noqa: E402
from bench.construction import run_cli  # noqa: E402

DEFAULT_LOCOMO = REPO.parent / "shared" / "datasets" / "locomo" / "locomo10.json"
DEFAULT_OUT = REPO / "bench" / "results" / "dask_vs_threads.json"
RUNNERS = ("threads", "dask")


def forget_caches(store: Path) -> None:
    """Clear Prefect's task cache and the LLM/embedding caches so the next build starts cold."""
    shutil.rmtree(store / "prefect", ignore_errors=True)
    con = connect(store)
    try:
        con.execute("DELETE FROM llm_cache")
        con.execute("DELETE FROM embedding_cache")
    finally:
        con.close()


def same_memory(a: Path, b: Path, conversations: list[str]) -> list[str]:
    info_a, info_b = current_snapshot(a), current_snapshot(b)
    if info_a is None or info_b is None:
        return ["a store published nothing"]
    return [f"{cid}: {d}" for cid in conversations for d in diff_images(memory_image(info_a, cid),
                                                                        memory_image(info_b, cid))]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--locomo", type=Path, default=DEFAULT_LOCOMO)
    parser.add_argument("--latency-ms", type=float, default=200.0)
    parser.add_argument("--llm-concurrency", type=int, default=4, help="TMEM_LLM_CONCURRENCY per process")
    parser.add_argument("--workers", type=int, default=2)
    parser.add_argument("--threads-per-worker", type=int, default=4)
    parser.add_argument("--conversations", nargs="+", metavar="ID", help="build only these (default: all)")
    parser.add_argument("--repeats", type=int, default=1)
    parser.add_argument("--equal-in-flight", action="store_true",
                        help="give the thread-pool build --llm-concurrency x --workers calls in flight, as many as "
                             "the Dask build has in all (isolates what scaling out adds beyond concurrency)")
    parser.add_argument("--timeout-s", type=float, default=3600.0)
    parser.add_argument("--out", type=Path, default=DEFAULT_OUT)
    args = parser.parse_args()

    tmp = Path(tempfile.mkdtemp(prefix="tmem-bench-dask-"))
    (tmp / "prefect").mkdir()
    stores = {r: tmp / f"store-{r}" for r in RUNNERS}
    server = ScriptedLLM(synth.RESPONDERS, use_registry=False, latency_ms=args.latency_ms).start()
    runs: dict[str, list[dict[str, Any]]] = {r: [] for r in RUNNERS}
    in_flight = {"threads": args.llm_concurrency * (args.workers if args.equal_in_flight else 1),
                 "dask": args.llm_concurrency * args.workers}
    started = {"date": datetime.now(UTC).isoformat(timespec="seconds"), "loadavg": loadavg()}
    try:
        base_env = dict(os.environ) | {
            "TMEM_LLM_BASE_URL": server.url, "TMEM_LLM_CONCURRENCY": str(args.llm_concurrency),
            "TMEM_DASK_WORKERS": str(args.workers), "TMEM_DASK_THREADS_PER_WORKER": str(args.threads_per_worker),
            "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1", "PREFECT_HOME": str(tmp / "prefect"),
            "PREFECT_SERVER_ANALYTICS_ENABLED": "false", "DO_NOT_TRACK": "1",
        }
        base_env.setdefault("PREFECT_SERVER_EPHEMERAL_STARTUP_TIMEOUT_SECONDS", "120")
        for runner, store in stores.items():
            run_cli(["ingest", str(args.locomo), "--store", str(store)], base_env, args.timeout_s,
                    tmp / f"ingest-{runner}.log")
        build_args = [a for cid in args.conversations or [] for a in ("--conversation", cid)]
        for n in range(args.repeats):
            for runner, store in stores.items():
                if n:
                    forget_caches(store)
                env = base_env | {"TMEM_TASK_RUNNER": runner, "TMEM_STORE": str(store)}
                if runner == "threads":
                    env["TMEM_LLM_CONCURRENCY"] = str(in_flight["threads"])
                before, load_before = len(server.requests), loadavg()
                out, seconds = run_cli(["build", "--store", str(store), *build_args], env, args.timeout_s,
                                       tmp / f"build-{runner}-{n}.log")
                row = {"command_s": round(seconds, 2), "flow_s": out["seconds"], "status": out["status"],
                       "llm_calls": out["llm_calls"], "llm_cache_hits": out["llm_cache_hits"],
                       "prompt_tokens": out["prompt_tokens"], "completion_tokens": out["completion_tokens"],
                       "http_requests": len(server.requests) - before, "failures": out["failures"],
                       "loadavg_before": load_before, "loadavg_after": loadavg()}
                runs[runner].append(row)
                print(f"{runner:<8} repeat {n + 1}: {row['status']}, {row['llm_calls']} calls, "
                      f"{seconds:.1f} s (load {load_before[0]} -> {row['loadavg_after'][0]})", flush=True)
        built = sorted(current_conversations(stores["threads"]))
        differences = same_memory(stores["threads"], stores["dask"], built)
    except BaseException:
        print(f"stores and logs kept in {tmp}", file=sys.stderr)
        raise
    finally:
        server.stop()
    shutil.rmtree(tmp, ignore_errors=True)

    report = {
        "benchmark": "dask_vs_threads",
        "settings": {"latency_ms": args.latency_ms, "llm_concurrency_per_process": args.llm_concurrency,
                     "dask_workers": args.workers, "dask_threads_per_worker": args.threads_per_worker,
                     "llm_calls_in_flight": in_flight, "equal_in_flight": args.equal_in_flight,
                     "conversations": built, "locomo": str(args.locomo), "repeats": args.repeats,
                     "llm": "scripted (tmem.devtools.synth)"},
        "median_command_s": {r: statistics.median(x["command_s"] for x in runs[r]) for r in RUNNERS},
        "median_flow_s": {r: statistics.median(float(x["flow_s"]) for x in runs[r]) for r in RUNNERS},
        "same_memory": not differences, "memory_differences": differences[:20],
        "runs": runs,
        "machine": {"cpu_count": os.cpu_count(), "python": sys.version.split()[0], "start": started,
                    "loadavg_end": loadavg()},
    }
    print_table(report)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(report, indent=2) + "\n", encoding="utf-8")
    print(f"wrote {args.out}")
    ok = all(x["status"] == "completed" for r in RUNNERS for x in runs[r])
    if not ok or differences:
        raise SystemExit("FAILED: a build was incomplete or the two runners published different memories")


def current_conversations(store: Path) -> list[str]:
    con = connect(store, read_only=True)
    try:
        return [str(r[0]) for r in con.execute("SELECT conversation_id FROM memory_builds").fetchall()]
    finally:
        con.close()


def print_table(r: dict[str, Any]) -> None:
    s = r["settings"]
    print(f"\ndask vs threads: {len(s['conversations'])} conversations, latency {s['latency_ms']:g} ms, "
          f"{s['dask_workers']} workers x {s['dask_threads_per_worker']} threads, repeats {s['repeats']}")
    print(f"{'runner':<8} {'command s':>10} {'flow s':>8} {'calls':>6} {'requests':>9} {'in flight':>10} "
          f"{'load before':>12}")
    for runner in RUNNERS:
        last = r["runs"][runner][-1]
        print(f"{runner:<8} {r['median_command_s'][runner]:>10.1f} {r['median_flow_s'][runner]:>8.1f} "
              f"{last['llm_calls']:>6} {last['http_requests']:>9} {s['llm_calls_in_flight'][runner]:>10} "
              f"{last['loadavg_before'][0]:>12}")
    ratio = r["median_command_s"]["dask"] / r["median_command_s"]["threads"]
    print(f"dask / threads (command): {ratio:.2f}; same memory: {r['same_memory']}")


if __name__ == "__main__":
    main()

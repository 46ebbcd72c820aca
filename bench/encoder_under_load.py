"""The build encoder beside other work: torch threads x OpenMP wait policy x a competing process.

A build embeds while its other threads (LLM calls, DuckDB, Prefect) and the processes beside it
(the Prefect server, its database) take CPU. This times MiniLM embedding ``--texts`` texts from
LoCoMo (single turns and three-turn windows, like the dialogue views) in a fresh process per cell
(the OpenMP wait policy is read when OpenMP starts), with torch at 1 or 2 threads, the wait policy
unset (libgomp's default: spin, then sleep) or ``PASSIVE`` (sleep at once), and a competing process
busy ``--loads`` of one core (a 10 ms duty cycle). Reported per cell: wall seconds, the CPU seconds
of the embedding process, and the slowdown against 2 threads with nothing beside them.

    HF_HUB_OFFLINE=1 python bench/encoder_under_load.py [--texts 768] [--loads 0,0.6,1.0] [--repeats 1]

Writes a table and ``bench/results/encoder_under_load.json``. Time it alone: the cells are the load.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import statistics
import subprocess
import sys
from datetime import UTC, datetime
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))
from bench.benchstats import loadavg, machine_info  # noqa: E402

LOCOMO = REPO.parent / "shared" / "datasets" / "locomo" / "locomo10.json"
RESULTS = REPO / "bench" / "results"

CELL = r"""
import json, os, subprocess, sys, time
sys.path.insert(0, sys.argv[1])
from tmem.providers.sentence_transformer import SentenceTransformerEmbedder
texts = json.loads(open(sys.argv[2]).read())
threads, load = int(sys.argv[3]), float(sys.argv[4])
embedder = SentenceTransformerEmbedder("all-MiniLM-L6-v2", batch_size=64, threads=threads)
embedder.embed(texts[:64])  # load and warm up
busy = None
if load > 0:
    loop = ("import time\nwhile True:\n t = time.perf_counter()\n while time.perf_counter() - t < %r: pass\n"
            " time.sleep(%r)" % (load * 0.01, (1 - load) * 0.01 + 1e-9))
    busy = subprocess.Popen([sys.executable, "-c", loop])
    time.sleep(0.5)
started, cpu = time.perf_counter(), os.times()
embedder.embed(texts)
wall, after = time.perf_counter() - started, os.times()
if busy is not None:
    busy.kill()
print(json.dumps({"wall_s": wall, "cpu_s": (after.user + after.system) - (cpu.user + cpu.system)}))
"""


def locomo_texts(n: int, seed: int) -> list[str]:
    data = json.loads(LOCOMO.read_text())
    turns = [t["text"] for conv in data for key, session in conv["conversation"].items()
             if key.startswith("session_") and isinstance(session, list) for t in session if t.get("text")]
    windows = [" ".join(turns[i:i + 3]) for i in range(0, len(turns) - 3, 3)]
    pool = turns + windows
    return random.Random(seed).sample(pool, n)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--texts", type=int, default=768)
    parser.add_argument("--loads", default="0,0.6,1.0")
    parser.add_argument("--repeats", type=int, default=1)
    parser.add_argument("--seed", type=int, default=8)
    parser.add_argument("--out", type=Path, default=RESULTS / "encoder_under_load.json")
    args = parser.parse_args()
    texts_file = RESULTS / ".encoder_under_load-texts.json"
    RESULTS.mkdir(parents=True, exist_ok=True)
    texts_file.write_text(json.dumps(locomo_texts(args.texts, args.seed)))
    report: dict[str, object] = {"started_at": datetime.now(UTC).isoformat(), "machine": machine_info(),
                                 "loadavg_start": loadavg(), "texts": args.texts, "repeats": args.repeats, "cells": []}
    cells: list[dict[str, object]] = []
    try:
        for policy in ("", "PASSIVE"):
            for threads in (2, 1):
                for load in (float(x) for x in args.loads.split(",")):
                    env = {k: v for k, v in os.environ.items() if k != "OMP_WAIT_POLICY"} | {"HF_HUB_OFFLINE": "1"}
                    if policy:
                        env["OMP_WAIT_POLICY"] = policy
                    runs = [json.loads(subprocess.run([sys.executable, "-c", CELL, str(REPO), str(texts_file), str(threads),
                                                       str(load)], env=env, capture_output=True, text=True,
                                                      check=True).stdout.strip().splitlines()[-1])
                            for _ in range(args.repeats)]
                    cell = {"policy": policy or "default", "threads": threads, "load": load,
                            "wall_s": round(statistics.median(r["wall_s"] for r in runs), 2),
                            "cpu_s": round(statistics.median(r["cpu_s"] for r in runs), 2)}
                    cells.append(cell)
                    print(cell, flush=True)
    finally:
        texts_file.unlink(missing_ok=True)
    base = next(c for c in cells if c["policy"] == "default" and c["threads"] == 2 and c["load"] == 0)
    print(f"\n{'wait policy':<12} {'threads':>7} {'load':>5} {'wall s':>7} {'cpu s':>6} {'x free 2 threads':>17}")
    for c in cells:
        c["slowdown"] = round(float(c["wall_s"]) / float(base["wall_s"]), 2)  # type: ignore[arg-type]
        print(f"{c['policy']:<12} {c['threads']:>7} {c['load']:>5} {c['wall_s']:>7} {c['cpu_s']:>6} {c['slowdown']:>17}")
    report["cells"] = cells
    report["loadavg_end"] = loadavg()
    args.out.write_text(json.dumps(report, indent=1))
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()

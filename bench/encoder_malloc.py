"""The encoder's malloc: glibc's defaults, Dask's environment, and the encoder child's own tuning.

A local Dask cluster's nanny writes ``MALLOC_TRIM_THRESHOLD_=65536`` into the environment of the
process that starts it (the build's flow), and an encoder child started after the cluster inherits
it. Each variant below is a fresh single-threaded process embedding the same texts with the build's
sentence-transformers embedder, with or without that variable, with or without
:func:`tmem.providers.encoder_process.tune_malloc` (what an encoder child calls first); it reports
its wall time, user and system CPU and minor page faults for the embedding alone (after a warm-up).

    python bench/encoder_malloc.py [--texts 1500] [--rounds 1] [--out bench/results/encoder_malloc.json]

Run it alone on the machine: the variants run one after another, round after round.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import resource
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]
DASK_ENV = {"MALLOC_TRIM_THRESHOLD_": "65536"}
VARIANTS: list[tuple[str, dict[str, str], bool]] = [
    ("glibc defaults", {}, False),
    ("Dask's environment", DASK_ENV, False),
    ("tuned (encoder child)", {}, True),
    ("tuned, Dask's environment", DASK_ENV, True),
]
WORDS = ("the a we my her his trip cooking dog school music painting friend family garden weekend new job moving "
         "city pottery marathon Berlin class bowl glazed ran first").split()


def texts(n: int, seed: int = 14) -> list[str]:
    """``n`` texts of 5-120 words (a nightly's views: triggers and items short, dialogue windows long)."""
    rng = random.Random(seed)
    return [" ".join(rng.choice(WORDS) for _ in range(rng.randint(5, 120))) for _ in range(n)]


def child(n: int, tune: bool) -> None:
    tuned = False
    if tune:
        from tmem.providers.encoder_process import tune_malloc

        tuned = tune_malloc()
    from tmem.providers.sentence_transformer import SentenceTransformerEmbedder

    embedder = SentenceTransformerEmbedder("all-MiniLM-L6-v2", threads=1)
    embedder.embed(texts(64, seed=1))  # warm-up: the model and its first allocations
    batch = texts(n)
    before, started = resource.getrusage(resource.RUSAGE_SELF), time.perf_counter()
    embedder.embed(batch)
    wall, after = time.perf_counter() - started, resource.getrusage(resource.RUSAGE_SELF)
    print(json.dumps({"tuned": tuned, "wall_s": round(wall, 2), "user_s": round(after.ru_utime - before.ru_utime, 2),
                      "sys_s": round(after.ru_stime - before.ru_stime, 2), "minor_faults": after.ru_minflt - before.ru_minflt}))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--texts", type=int, default=1500)
    parser.add_argument("--rounds", type=int, default=1)
    parser.add_argument("--out", type=Path, default=REPO / "bench" / "results" / "encoder_malloc.json")
    parser.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--tune", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        child(args.texts, args.tune)
        return
    base = {k: v for k, v in os.environ.items() if not k.startswith("MALLOC_")}
    base |= {"HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1", "PYTHONPATH": str(REPO)}
    rows: list[dict[str, Any]] = []
    for round_no in range(args.rounds):
        for name, extra, tune in VARIANTS:
            command = [sys.executable, __file__, "--child", "--texts", str(args.texts), *(["--tune"] if tune else [])]
            done = subprocess.run(command, env=base | extra, capture_output=True, text=True, check=True, cwd=REPO)
            found = json.loads([line for line in done.stdout.splitlines() if line.startswith("{")][-1])
            rows.append({"variant": name, "round": round_no, "environment": extra} | found)
            print(f"{name:<28} wall {found['wall_s']:6.1f} s  user {found['user_s']:6.1f}  sys {found['sys_s']:5.1f}  "
                  f"minor faults {found['minor_faults']:>9,}  tuned {found['tuned']}", flush=True)
    report = {"texts": args.texts, "rounds": args.rounds, "loadavg": os.getloadavg(), "rows": rows}
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(report, indent=1))
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()

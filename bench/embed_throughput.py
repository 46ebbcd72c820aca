"""Embedding throughput of the shipped MiniLM on this machine (sentences per second).

Workloads (1000 texts each, real LoCoMo text):
  short   - sentences of 8-12 words cut from LoCoMo turns (~10 words)
  turns   - the first 1000 LoCoMo turns, whole
and, for reference, the same turns through CachedEmbedder when every text is already cached.

Median of 3 timed runs after one warm-up call. Prints a table and writes
bench/results/embed_throughput.json.

    HF_HUB_OFFLINE=1 python bench/embed_throughput.py [--locomo PATH] [--batch-size 64] [--runs 3] [--n 1000]
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import re
import statistics
import time
from collections.abc import Callable
from datetime import UTC, datetime
from pathlib import Path

import numpy as np

from tmem.llm.cached_embedder import CachedEmbedder, InMemoryEmbeddingCache
from tmem.providers.sentence_transformer import SentenceTransformerEmbedder

ROOT = Path(__file__).resolve().parent
DEFAULT_LOCOMO = Path(__file__).resolve().parents[1].parent / "shared" / "datasets" / "locomo" / "locomo10.json"
_SESSION_KEY = re.compile(r"^session_(\d+)$")


def locomo_turns(path: Path) -> list[str]:
    """Turn texts in dataset order: conversations as listed, sessions by number (not as strings)."""
    data = json.loads(path.read_text(encoding="utf-8"))
    texts: list[str] = []
    for sample in data:
        conversation = sample["conversation"]
        sessions = sorted(
            (int(m.group(1)), key) for key in conversation if (m := _SESSION_KEY.match(key))
        )
        for _, key in sessions:
            texts.extend(turn["text"] for turn in conversation[key] if turn.get("text"))
    return texts


def short_sentences(turns: list[str], n: int) -> list[str]:
    """Sentences of 8-12 words split from the turns, first ``n``."""
    out: list[str] = []
    for turn in turns:
        for sentence in re.split(r"(?<=[.!?])\s+", turn):
            if 8 <= len(sentence.split()) <= 12:
                out.append(sentence)
                if len(out) == n:
                    return out
    raise SystemExit(f"only {len(out)} short sentences found, wanted {n}")


def median_rate(embed: Callable[[list[str]], np.ndarray], texts: list[str], runs: int) -> tuple[float, list[float]]:
    embed(texts[:128])  # warm-up (first calls at new sequence lengths are slow)
    seconds = []
    for _ in range(runs):
        start = time.perf_counter()
        out = embed(texts)
        seconds.append(time.perf_counter() - start)
        assert out.shape[0] == len(texts)
    return len(texts) / statistics.median(seconds), seconds


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--locomo", type=Path, default=DEFAULT_LOCOMO)
    parser.add_argument("--batch-size", type=int, default=64)
    parser.add_argument("--runs", type=int, default=3)
    parser.add_argument("--n", type=int, default=1000)
    parser.add_argument("--out", type=Path, default=ROOT / "results" / "embed_throughput.json")
    args = parser.parse_args()

    load_before = os.getloadavg()[0]
    turns = locomo_turns(args.locomo)
    workloads = {"short": short_sentences(turns, args.n), "turns": turns[: args.n]}

    load_start = time.perf_counter()
    embedder = SentenceTransformerEmbedder(batch_size=args.batch_size)
    embedder.embed(["load"])
    load_s = time.perf_counter() - load_start

    rows = []
    for name, texts in workloads.items():
        rate, seconds = median_rate(embedder.embed, texts, args.runs)
        rows.append(
            {
                "workload": name,
                "texts": len(texts),
                "mean_words": round(statistics.fmean(len(t.split()) for t in texts), 1),
                "batch_size": args.batch_size,
                "sentences_per_s": round(rate, 1),
                "run_seconds": [round(s, 3) for s in seconds],
            }
        )
    cached = CachedEmbedder(embedder, InMemoryEmbeddingCache())
    cached.embed(workloads["turns"])  # fill the cache
    rate, seconds = median_rate(cached.embed, workloads["turns"], args.runs)
    rows.append(
        {
            "workload": "turns, all cached",
            "texts": len(workloads["turns"]),
            "mean_words": rows[1]["mean_words"],
            "batch_size": args.batch_size,
            "sentences_per_s": round(rate, 1),
            "run_seconds": [round(s, 3) for s in seconds],
        }
    )

    import torch  # already loaded by the embedder; only read its thread count

    report = {
        "measured_at": datetime.now(UTC).isoformat(timespec="seconds"),
        "model": embedder.model_name,
        "dim": embedder.dim,
        "device": embedder.device,
        "model_load_s_incl_import": round(load_s, 2),
        "runs": args.runs,
        "statistic": "median",
        "cpu_count": os.cpu_count(),
        "torch_threads": torch.get_num_threads(),
        "python": platform.python_version(),
        # 1-min load average before/after: other work on these 2 cores slows the runs
        "loadavg_1min": [round(load_before, 2), round(os.getloadavg()[0], 2)],
        "results": rows,
    }
    print(f"model {report['model']} ({report['dim']}-d, {report['device']}), load+import {load_s:.1f} s, "
          f"{report['cpu_count']} CPUs, torch threads {report['torch_threads']}, load avg {report['loadavg_1min']}")
    print(f"{'workload':<20} {'texts':>6} {'words':>6} {'batch':>6} {'sent/s':>9}   runs (s)")
    for r in rows:
        runs = ", ".join(f"{s:.2f}" for s in r["run_seconds"])
        print(f"{r['workload']:<20} {r['texts']:>6} {r['mean_words']:>6} {r['batch_size']:>6} {r['sentences_per_s']:>9.1f}   {runs}")
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(report, indent=2) + "\n", encoding="utf-8")
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()

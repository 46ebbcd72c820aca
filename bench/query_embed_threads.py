"""Torch threads for query embedding: one short text per call vs a build-time batch.

Times MiniLM (the shipped all-MiniLM-L6-v2) embedding single queries with ``threads`` = 1 and with
torch's default, alternating per query so both see the same machine load, then a batch of texts
with the default and with 1 thread (what the query-side setting would cost a build if it leaked),
and checks that torch's thread count is restored after query calls.

    python bench/query_embed_threads.py [--queries 200] [--batch 512]
"""

from __future__ import annotations

import argparse
import json
import random
import time
from pathlib import Path
from typing import Any

from benchstats import loadavg, machine_info, summary_ms, table

from tmem.providers.sentence_transformer import SentenceTransformerEmbedder

RESULTS = Path(__file__).resolve().parent / "results"
WORDS = ("pottery class hiking trail adoption agency guitar concert marathon training garden tomatoes painting "
         "sunset camping lake birthday dinner sister moved city job interview dog vet weekend").split()


def _texts(rng: random.Random, n: int, lo: int, hi: int) -> list[str]:
    return [" ".join(rng.choice(WORDS) for _ in range(rng.randint(lo, hi))) + "?" for _ in range(n)]


def run(args: argparse.Namespace) -> dict[str, Any]:
    import torch

    info = machine_info()
    default_threads = torch.get_num_threads()
    one = SentenceTransformerEmbedder(threads=1)
    dflt = SentenceTransformerEmbedder()
    rng = random.Random(args.seed)
    one.embed(["warm up"]), dflt.embed(["warm up"])
    times: dict[str, list[float]] = {"threads=1": [], f"default ({default_threads})": []}
    for i, q in enumerate(_texts(rng, args.queries, 4, 14)):
        pair = [("threads=1", one), (f"default ({default_threads})", dflt)]
        for name, emb in pair if i % 2 else pair[::-1]:
            t0 = time.perf_counter()
            emb.embed([q])
            times[name].append(time.perf_counter() - t0)
    restored = torch.get_num_threads() == default_threads
    batch = _texts(rng, args.batch, 8, 40)
    batch_s: dict[str, float] = {}
    for name, emb in ((f"default ({default_threads})", dflt), ("threads=1", one)):
        t0 = time.perf_counter()
        emb.embed(batch)
        batch_s[name] = time.perf_counter() - t0
    return {
        "benchmark": "query_embed_threads", "machine": info | {"loadavg_end": loadavg()},
        "model": one.model_name, "torch_default_threads": default_threads, "queries": args.queries,
        "query_embed_ms": {k: summary_ms(v) for k, v in times.items()},
        "batch_texts": args.batch,
        "batch_texts_per_s": {k: round(args.batch / v, 1) for k, v in batch_s.items()},
        "threads_restored_after_query_calls": restored,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--queries", type=int, default=200)
    parser.add_argument("--batch", type=int, default=512)
    parser.add_argument("--seed", type=int, default=3)
    parser.add_argument("--out", type=Path, default=RESULTS / "query_embed_threads.json")
    args = parser.parse_args()
    result = run(args)
    rows = [[k, v["n"], v["p50"], v["p95"], v["mean"]] for k, v in result["query_embed_ms"].items()]
    print(f"load avg {result['machine']['loadavg_start']} -> {result['machine']['loadavg_end']}")
    print(table(rows, ["query embedding (1 text)", "n", "p50 ms", "p95 ms", "mean ms"]))
    print(table([[k, v] for k, v in result["batch_texts_per_s"].items()],
                [f"batch of {args.batch} texts", "texts/s"]))
    print(f"torch threads restored after query calls: {result['threads_restored_after_query_calls']}")
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(result, indent=1) + "\n")
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()

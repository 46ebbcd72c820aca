"""The build's embedding queue over the encoder pool, alone: calls one at a time against pipelined.

A nightly's conversations hand the queue ~26 new texts each (and ask for ~200 views) from many
threads; the queue embeds what waits in calls of the build's pool of encoder children. One call at a
time, a child that ended its last share idled until the other ended theirs, then while the queue
answered the callers, stored the vectors and looked up the next texts; pipelined
(:class:`tmem.ports.PipelinedEmbedder`), the next call is handed over once every share of the
current one is with a child. Here requests of ``--per-request`` LoCoMo turns (``--texts`` in all)
arrive at ``--rate`` texts per second (above what the encoder embeds alone, so a backlog waits, as
in an encoder-bound nightly), each from a thread of its own that waits for its rows, with nothing
else running, so the encoder's idle time between calls shows in the wall time. Each mode runs ``--runs`` times,
alternating, after one warm-up; the median wall time per mode, the calls and the children's busy
share are printed and written to ``bench/results/encoder_pipeline.json``.

    HF_HUB_OFFLINE=1 python bench/encoder_pipeline.py [--texts 4000] [--rate 300] [--per-request 26] [--runs 3]
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from datetime import UTC, datetime
from pathlib import Path

import numpy as np
import numpy.typing as npt

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))
from bench.embed_throughput import DEFAULT_LOCOMO, locomo_turns  # noqa: E402
from tmem.llm.embed_queue import CoalescingEmbedder  # noqa: E402
from tmem.llm.embedder_wrapper import EmbedderWrapper  # noqa: E402
from tmem.providers.encoder_process import EncoderPool, EncoderSpec  # noqa: E402

ROOT = Path(__file__).resolve().parent


class OneCallAtATime(EmbedderWrapper):
    """The pool seen as a plain :class:`tmem.ports.Embedder` (no ``submit``): the queue's old path."""

    def embed_texts(self, texts: list[str]) -> npt.NDArray[np.float32]:
        return self.inner.embed(texts)


def run(pool: EncoderPool, pipelined: bool, texts: list[str], rate: float, per_request: int) -> dict[str, float]:
    queue = CoalescingEmbedder(pool if pipelined else OneCallAtATime(pool))
    requests = [texts[n:n + per_request] for n in range(0, len(texts), per_request)]
    started = time.perf_counter()
    with ThreadPoolExecutor(len(requests)) as senders:
        futures = []
        for n, request in enumerate(requests):
            time.sleep(max(0.0, started + n * per_request / rate - time.perf_counter()))
            futures.append(senders.submit(queue.embed, request))
        rows = [f.result() for f in futures]
    wall = time.perf_counter() - started
    queue.close()
    assert sum(len(r) for r in rows) == len(texts)
    return {"wall_s": round(wall, 2), "calls": queue.usage.calls, "model_s": round(queue.usage.seconds, 2)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--locomo", type=Path, default=DEFAULT_LOCOMO)
    parser.add_argument("--texts", type=int, default=4000)
    parser.add_argument("--rate", type=float, default=300.0, help="texts per second sent")
    parser.add_argument("--per-request", type=int, default=26)
    parser.add_argument("--runs", type=int, default=3)
    parser.add_argument("--processes", type=int, default=2)
    parser.add_argument("--out", type=Path, default=ROOT / "results" / "encoder_pipeline.json")
    args = parser.parse_args()
    turns = locomo_turns(args.locomo)
    pool = EncoderPool(EncoderSpec("all-MiniLM-L6-v2", 64, "cpu", 1, 2048), args.processes)
    pool.start()
    pool.embed(turns[:512])  # warm-up: the model loaded and run once in every child
    results: dict[str, list[dict[str, float]]] = {"one_call_at_a_time": [], "pipelined": []}
    for n in range(args.runs):
        for mode in (("one_call_at_a_time", "pipelined") if n % 2 == 0 else ("pipelined", "one_call_at_a_time")):
            # distinct texts per run (the queue's memo is per queue, the pool has no cache): each run embeds all
            chosen = [f"{t} ({n})" for t in turns[:args.texts]]
            results[mode].append(run(pool, mode == "pipelined", chosen, args.rate, args.per_request))
            print(mode, results[mode][-1], flush=True)
    pool.close()
    summary = {mode: {"median_wall_s": statistics.median(r["wall_s"] for r in runs),
                      "median_calls": statistics.median(r["calls"] for r in runs)} for mode, runs in results.items()}
    ratio = summary["pipelined"]["median_wall_s"] / summary["one_call_at_a_time"]["median_wall_s"]
    print("\n| mode | median wall s | median calls |\n|---|---:|---:|")
    for mode, s in summary.items():
        print(f"| {mode} | {s['median_wall_s']} | {s['median_calls']} |")
    print(f"pipelined / one at a time: {ratio:.3f}; load average {os.getloadavg()}")
    args.out.write_text(json.dumps({
        "at": datetime.now(UTC).isoformat(), "machine": {"cores": os.cpu_count(), "python": platform.python_version(),
                                                         "loadavg_end": os.getloadavg()},
        "settings": {k: str(v) for k, v in vars(args).items()}, "runs": results, "summary": summary,
        "pipelined_over_one_at_a_time": round(ratio, 3)}, indent=1))


if __name__ == "__main__":
    main()

"""Micro-benchmark of the query path on a synthetic LoCoMo-sized conversation (no model, no store).

25 topics, 40 scenes (15 turns and 5 horizon sentences each), 300 items with con/brg/joint
views, 384-d random unit vectors, texts drawn from a Zipf-distributed vocabulary. Times
``build_index`` once and ``search`` per query in lexical mode (no query vector), hybrid mode and
hybrid with trace, plus ``format_context``. Writes bench/results/query_micro.json.

    python bench/query_micro.py [--queries 500] [--seed 7]
"""

from __future__ import annotations

import argparse
import json
import platform
import time
from datetime import UTC, datetime, timedelta
from pathlib import Path

import numpy as np

from tmem.domain import HORIZON_CHANNELS, Item, Persona, Scene, SceneTriggers, Topic, Turn
from tmem.retrieval.cascade import search
from tmem.retrieval.config import preset
from tmem.retrieval.context import format_context
from tmem.retrieval.index import VectorBundle, build_index

CID = "bench"
N_TOPICS, N_SCENES, N_ITEMS, TURNS_PER_SCENE, DIM = 25, 40, 300, 15, 384


def build(rng: np.random.Generator):
    vocab = [f"w{i}" for i in range(3000)]
    p = 1.0 / np.arange(1, len(vocab) + 1)
    p /= p.sum()

    def text(n: int) -> str:
        return " ".join(rng.choice(vocab, size=n, p=p))

    t0 = datetime(2023, 5, 8, tzinfo=UTC)
    turns, scenes = [], []
    for s in range(N_SCENES):
        ids = []
        for k in range(TURNS_PER_SCENE):
            tid = f"D{s}:{k}"
            ids.append(tid)
            turns.append(
                Turn(
                    conversation_id=CID,
                    session_id=f"session_{s}",
                    turn_id=tid,
                    seq=s * TURNS_PER_SCENE + k,
                    speaker=("Caroline", "Melanie")[k % 2],
                    text=text(25),
                    event_time=t0 + timedelta(days=s),
                )
            )
        when = t0 + timedelta(days=s)
        scenes.append(
            Scene(
                conversation_id=CID,
                scene_id=f"s{s}",
                seq=s,
                title=text(6),
                summary=text(30),
                narrative=text(80),
                turn_ids=tuple(ids),
                start_time=when,
                end_time=when,
            )
        )
    topics = [
        Topic(
            conversation_id=CID,
            topic_id=f"t{t}",
            seq=t,
            title=text(4),
            keywords=tuple(text(12).split()),
            scene_ids=tuple(f"s{s}" for s in rng.choice(N_SCENES, size=3, replace=False)),
        )
        for t in range(N_TOPICS)
    ]
    items = [
        Item(
            conversation_id=CID,
            item_id=f"i{i}",
            topic_id=f"t{i % N_TOPICS}",
            kind="atomic",
            content=text(18),
            source_scene_ids=(f"s{i % N_SCENES}",),
            event_time=t0,
            keywords=tuple(text(5).split()),
        )
        for i in range(N_ITEMS)
    ]
    scene_triggers = [
        SceneTriggers(
            conversation_id=CID,
            scene_id=f"s{s}",
            situation=text(8),
            object=text(8),
            event=text(8),
            emotion=text(8),
            horizons={ch: text(12) for ch in HORIZON_CHANNELS},
        )
        for s in range(N_SCENES)
    ]
    personas = [
        Persona(
            conversation_id=CID,
            speaker=name,
            identity=(text(8),),
            preferences=(text(8),),
            traits=(text(8),),
            relations=(),
            timeline=(),
        )
        for name in ("Caroline", "Melanie")
    ]
    kinds, owners, views, ords = [], [], [], []
    for kind, view, ids in (
        ("topic", "summary", [t.topic_id for t in topics]),
        ("scene", "summary", [s.scene_id for s in scenes]),
        ("scene", "dlg", [s.scene_id for s in scenes]),
        ("scene", "scn", [s.scene_id for s in scenes]),
        ("item", "content", [i.item_id for i in items]),
        ("item", "con", [i.item_id for i in items]),
        ("item", "brg", [i.item_id for i in items]),
        ("item", "joint", [i.item_id for i in items]),
    ):
        kinds += [kind] * len(ids)
        owners += ids
        views += [view] * len(ids)
        ords += [0] * len(ids)
    for s in scenes:
        for o in range(len(HORIZON_CHANNELS)):
            kinds.append("scene")
            owners.append(s.scene_id)
            views.append("hor")
            ords.append(o)
    vectors = rng.standard_normal((len(owners), DIM)).astype(np.float32)
    bundle = VectorBundle.from_columns(kinds, owners, views, ords, vectors)
    t = time.perf_counter()
    index = build_index(CID, scenes, topics, items, [], scene_triggers, personas, turns, bundle)
    build_ms = (time.perf_counter() - t) * 1e3
    queries = [text(8) for _ in range(1000)]
    return index, queries, build_ms


def percentiles(samples: list[float]) -> dict[str, float]:
    a = np.asarray(samples) * 1e3
    return {"p50_ms": round(float(np.percentile(a, 50)), 3), "p95_ms": round(float(np.percentile(a, 95)), 3)}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--queries", type=int, default=500)
    ap.add_argument("--seed", type=int, default=7)
    args = ap.parse_args()
    rng = np.random.default_rng(args.seed)
    index, queries, build_ms = build(rng)
    config = preset("default")
    qvecs = rng.standard_normal((args.queries, DIM)).astype(np.float32)
    timings: dict[str, list[float]] = {"lexical": [], "hybrid": [], "hybrid_trace": [], "format_context": []}
    for i in range(min(50, args.queries)):  # warm-up
        search(index, queries[i], qvecs[i], config)
    for i in range(args.queries):
        q = queries[i % len(queries)]
        t = time.perf_counter()
        search(index, q, None, config)
        timings["lexical"].append(time.perf_counter() - t)
        t = time.perf_counter()
        res = search(index, q, qvecs[i], config, speaker="Caroline")
        timings["hybrid"].append(time.perf_counter() - t)
        t = time.perf_counter()
        search(index, q, qvecs[i], config, trace=True)
        timings["hybrid_trace"].append(time.perf_counter() - t)
        t = time.perf_counter()
        format_context(res, 6000)
        timings["format_context"].append(time.perf_counter() - t)
    report = {
        "benchmark": "query_micro",
        "when": datetime.now(UTC).isoformat(timespec="seconds"),
        "machine": f"{platform.machine()} {platform.python_implementation()} {platform.python_version()}",
        "sizes": {
            "topics": N_TOPICS,
            "scenes": N_SCENES,
            "items": N_ITEMS,
            "turns": N_SCENES * TURNS_PER_SCENE,
            "horizon_rows": N_SCENES * len(HORIZON_CHANNELS),
            "dim": DIM,
            "bm25_docs": index.n_docs,
        },
        "queries": args.queries,
        "config": config.name,
        "build_index_ms": round(build_ms, 2),
        "search": {name: percentiles(v) for name, v in timings.items()},
    }
    out = Path(__file__).parent / "results" / "query_micro.json"
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(report, indent=2) + "\n")
    print(json.dumps(report, indent=2))


if __name__ == "__main__":
    main()

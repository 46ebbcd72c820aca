"""Query latency: the full cascade on a LoCoMo memory, and at 1M-item scale on a synthetic store.

``--part locomo`` (writes bench/results/query.json)
    A memory built from locomo10.json with the scripted LLM (``--store`` reuses a built store; else
    one is built into a temporary directory, ~5-15 min). Every conversation is loaded once first
    (cold load times per conversation, by phase), then all LoCoMo questions of categories 1-4 run
    through ``Memory.search`` in three passes:
      (a) with query embedding: MiniLM ``embed_query`` timed on its own, then the cascade (total = both);
      (b) lexical only (``embed=False``);
      (c) the precomputed query vector of (a) (cascade only).
    The flat baseline (``tmem.eval.baselines``: BM25 + dense RRF over raw turns) runs the same
    questions: BM25 only, with the precomputed vector, and with embedding.
``--part scale`` (writes bench/results/query_scale.json)
    A synthetic store of 10,000 conversations x 100 items (``bench/scale_store.py``; ``--scale-store``
    reuses one), then cold (first touch: DuckDB + Lance read + index build) and warm searches over
    random conversations, RSS after N conversations loaded, and a profile of the cold read.
``--part all``
    Both, each in its own process (so one part's memory does not inflate the other's RSS).

    HF_HUB_OFFLINE=1 python bench/query.py --part locomo [--store DIR]
    HF_HUB_OFFLINE=1 python bench/query.py --part scale [--scale-store DIR] [--queries 1000]
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import numpy as np
from benchstats import Stopwatch, loadavg, machine_info, summary_ms, table

from tmem.eval.baselines import BaselineRetriever
from tmem.eval.examples import QAExample
from tmem.eval.retrieval_metrics import VectorMemo
from tmem.ports import Embedder
from tmem.query.memory import Memory
from tmem.retrieval.scoring import bm25_scores, rank_positions, select, tokenize

REPO = Path(__file__).resolve().parents[1]
DEFAULT_LOCOMO = REPO.parent / "shared" / "datasets" / "locomo" / "locomo10.json"
RESULTS = REPO / "bench" / "results"
CATEGORIES = (1, 2, 3, 4)
FLAT_K = 25  # turns returned by the flat baseline (about the turns of tmem's 5 scenes)
TARGET_LOCOMO_P50_MS = 10.0


def locomo_questions(path: Path) -> list[QAExample]:
    """The LoCoMo questions of categories 1-4, in file order."""
    out: list[QAExample] = []
    for sample in json.loads(path.read_text(encoding="utf-8")):
        cid = sample["sample_id"]
        for n, qa in enumerate(sample["qa"]):
            if qa.get("category") in CATEGORIES:
                out.append(QAExample(qid=f"{cid}#{n}", dataset="locomo", conversation_id=cid,
                                     question=str(qa["question"]), answer=str(qa.get("answer", "")), category="",
                                     category_id=int(qa["category"]), evidence=(), question_date=None, speaker=None))
    return out


class SavedVectorMemo(VectorMemo):
    """A :class:`VectorMemo` that starts from vectors saved by an earlier run (``.npz``) and can be
    given vectors already computed (the questions', from pass (a)). Embedding LoCoMo's 5,882 turns
    takes about a minute on an idle machine and ten on a busy one; it is index build, not query time."""

    def __init__(self, embedder: Embedder, path: Path) -> None:
        super().__init__(embedder)
        self.path = path
        self.loaded = 0
        if path.exists():
            with np.load(path, allow_pickle=False) as data:
                for text, row in zip(data["texts"].tolist(), data["vectors"], strict=True):
                    self._rows[str(text)] = row
            self.loaded = len(self._rows)

    def put(self, text: str, vector: np.ndarray) -> None:
        self._rows[text] = np.asarray(vector, dtype=np.float32)

    def save(self) -> None:
        self.path.parent.mkdir(parents=True, exist_ok=True)
        texts = list(self._rows)
        np.savez(self.path, texts=np.asarray(texts, dtype=str), vectors=np.vstack([self._rows[t] for t in texts]))


def flat_lexical_order(retriever: BaselineRetriever, example: QAExample, k: int) -> list[int]:
    """The flat baseline's lexical half alone: BM25 over the turns, top ``k``."""
    corpus = retriever.corpus(example.conversation_id)
    n = len(corpus.units)
    ranks = rank_positions(bm25_scores(corpus.bm25, n, tokenize(example.question)), positive_only=True)
    chosen, _ = select(ranks[None, :], k, "rrf", retriever.k0)
    return [int(i) for i in chosen]


def run_locomo(args: argparse.Namespace) -> dict[str, Any]:
    info = machine_info()
    build: dict[str, Any] | None = None
    store = args.store
    if store is None:
        from locomo_store import build_locomo_store

        store = Path(tempfile.mkdtemp(prefix="tmem-bench-query-")) / "store"
        print(f"building the LoCoMo memory into {store} (scripted LLM) ...", flush=True)
        build = build_locomo_store(store, args.locomo, llm_concurrency=args.llm_concurrency)
    mem = Memory.open(store)
    snap = mem.snapshot()
    present = sorted(snap.info.conversations)
    examples = [e for e in locomo_questions(args.locomo) if e.conversation_id in snap.info.conversations]
    skipped = sum(1 for e in locomo_questions(args.locomo) if e.conversation_id not in snap.info.conversations)
    if args.max_questions:
        examples = examples[:: max(1, len(examples) // args.max_questions)][: args.max_questions]
    print(f"snapshot {snap.snapshot_id}: {len(present)} conversations, {len(examples)} questions "
          f"({skipped} skipped: conversation not built)", flush=True)

    # Cold loads: each conversation once (DuckDB read, Lance read, index build).
    cold: dict[str, dict[str, Any]] = {}
    for cid in present:
        with Stopwatch() as sw:
            index = snap.index(cid, vectors=True)
        last = mem.cache_stats().last_load
        assert last is not None and last.conversation_id == cid
        cold[cid] = {"total_ms": round(sw.s * 1000, 2), "read_memory_ms": round(last.read_memory_s * 1000, 2),
                     "read_vectors_ms": round(last.read_vectors_s * 1000, 2),
                     "build_index_ms": round(last.build_index_s * 1000, 2), "vector_rows": last.vector_rows,
                     "topics": index.n_topics, "scenes": index.n_scenes, "items": index.n_items,
                     "questions": sum(1 for e in examples if e.conversation_id == cid)}
    print(f"cold loads done ({sum(c['total_ms'] for c in cold.values()) / 1000:.1f} s); loading the embedder ...",
          flush=True)
    with Stopwatch() as model_load:
        mem.embed_query("warm up the embedder")
    for e in examples[:: max(1, len(examples) // 30)]:  # warm-up: numpy/bm25s code paths, not timed
        v = mem.embed_query(e.question)
        mem.search(e.question, conversation_id=e.conversation_id, query_vector=v)
        mem.search(e.question, conversation_id=e.conversation_id, embed=False)
    loads_before = mem.cache_stats().misses
    print("timing tmem passes (a) embedding, (b) lexical, (c) precomputed vector ...", flush=True)

    embed_s, cascade_s, total_s, vectors = [], [], [], []
    for e in examples:  # (a) with query embedding
        t0 = time.perf_counter()
        v = mem.embed_query(e.question)
        t1 = time.perf_counter()
        mem.search(e.question, conversation_id=e.conversation_id, query_vector=v)
        t2 = time.perf_counter()
        embed_s.append(t1 - t0)
        cascade_s.append(t2 - t1)
        total_s.append(t2 - t0)
        vectors.append(v)
    lexical_s = []
    for e in examples:  # (b) lexical only
        t0 = time.perf_counter()
        mem.search(e.question, conversation_id=e.conversation_id, embed=False)
        lexical_s.append(time.perf_counter() - t0)
    vector_s = []
    for e, v in zip(examples, vectors, strict=True):  # (c) precomputed vector, cascade only
        t0 = time.perf_counter()
        mem.search(e.question, conversation_id=e.conversation_id, query_vector=v)
        vector_s.append(time.perf_counter() - t0)
    assert mem.cache_stats().misses == loads_before, "a conversation was reloaded during the timed passes"
    # (d) the query embedding again with one intra-op torch thread: on 2 busy cores torch's default
    # (a thread per core) makes single-text embedding wait on the slower thread.
    import torch

    default_threads = torch.get_num_threads()
    torch.set_num_threads(1)
    embed_1t_s = []
    for e in examples:
        t0 = time.perf_counter()
        mem.embed_query(e.question)
        embed_1t_s.append(time.perf_counter() - t0)
    torch.set_num_threads(default_threads)

    # The flat baseline over raw turns (tmem.eval.baselines), with the same embedder.
    print("flat baseline: embedding the turns ...", flush=True)
    memo = SavedVectorMemo(mem.embedder(), args.vector_cache / f"{mem.settings.embedding_model}.npz")
    for e, v in zip(examples, vectors, strict=True):
        memo.put(e.question, v)
    flat = BaselineRetriever("flat", "turn", lambda cid: snap.reader.read_conversation(cid)[1], memo)
    with Stopwatch() as flat_build:
        for cid in present:
            flat.corpus(cid)
    memo.save()
    print(f"flat baseline built in {flat_build.s:.1f} s; timing ...", flush=True)
    flat_lex_s, flat_vec_s, flat_total_s, flat_embed_s = [], [], [], []
    for e in examples[:: max(1, len(examples) // 30)]:
        flat.order(e, FLAT_K)
        flat_lexical_order(flat, e, FLAT_K)
    for e in examples:
        t0 = time.perf_counter()
        flat_lexical_order(flat, e, FLAT_K)
        flat_lex_s.append(time.perf_counter() - t0)
    for e in examples:
        t0 = time.perf_counter()
        flat.order(e, FLAT_K)  # the question's vector is in the memo: dense + BM25 + RRF only
        flat_vec_s.append(time.perf_counter() - t0)
    embedder = mem.embedder()
    for e in examples:
        t0 = time.perf_counter()
        embedder.embed([e.question])
        t1 = time.perf_counter()
        flat.order(e, FLAT_K)
        t2 = time.perf_counter()
        flat_embed_s.append(t1 - t0)
        flat_total_s.append(t2 - t0)

    latency = {
        "tmem_lexical": summary_ms(lexical_s),
        "tmem_precomputed_vector": summary_ms(vector_s),
        "tmem_with_embedding_total": summary_ms(total_s),
        "tmem_with_embedding_cascade_part": summary_ms(cascade_s),
        "query_embedding_only": summary_ms(embed_s),
        "query_embedding_only_torch_1_thread": summary_ms(embed_1t_s),
        "flat_lexical": summary_ms(flat_lex_s),
        "flat_precomputed_vector": summary_ms(flat_vec_s),
        "flat_with_embedding_total": summary_ms(flat_total_s),
        "flat_query_embedding_only": summary_ms(flat_embed_s),
    }
    cold_totals = [c["total_ms"] / 1000 for c in cold.values()]
    return {
        "benchmark": "query", "part": "locomo", "machine": info | {"loadavg_end": loadavg()},
        "store": str(store), "build": build, "snapshot_id": snap.snapshot_id, "locomo": str(args.locomo),
        "conversations": len(present), "questions": len(examples), "questions_skipped": skipped,
        "preset": "default", "flat_k": FLAT_K,
        "cold_load_ms": cold,
        "cold_load_summary_ms": {"first (includes LanceDB import, DuckDB open)": cold[present[0]]["total_ms"],
                                 "rest": summary_ms(cold_totals[1:])},
        "embedder_load_ms": round(model_load.s * 1000, 1),
        "torch_threads_default": default_threads,
        "flat_index_build_s": round(flat_build.s, 2),
        "flat_vectors_from_cache": memo.loaded,
        "latency_ms": latency,
        "target": {"lexical_p50_ms_max": TARGET_LOCOMO_P50_MS,
                   "met": latency["tmem_lexical"]["p50"] <= TARGET_LOCOMO_P50_MS},
    }


def print_locomo(result: dict[str, Any]) -> None:
    lat = result["latency_ms"]
    labels = {
        "tmem_lexical": "tmem cascade, lexical only (embed=False)",
        "tmem_precomputed_vector": "tmem cascade, precomputed query vector",
        "tmem_with_embedding_total": "tmem cascade + query embedding (total)",
        "tmem_with_embedding_cascade_part": "  of which cascade",
        "query_embedding_only": "  of which MiniLM query embedding",
        "query_embedding_only_torch_1_thread": "MiniLM query embedding, torch 1 thread",
        "flat_lexical": "flat turns, BM25 only",
        "flat_precomputed_vector": "flat turns, BM25+dense RRF, precomputed vector",
        "flat_with_embedding_total": "flat turns, BM25+dense RRF + embedding (total)",
        "flat_query_embedding_only": "  of which MiniLM query embedding",
    }
    rows = [[labels[k], v["n"], v["p50"], v["p95"], v["mean"], v["max"]] for k, v in lat.items()]
    print(f"\nLoCoMo: {result['questions']} questions over {result['conversations']} conversations "
          f"(load avg {result['machine']['loadavg_start']} -> {result['machine']['loadavg_end']})")
    print(table(rows, ["mode (per query, ms)", "n", "p50", "p95", "mean", "max"]))
    cold = result["cold_load_ms"]
    rows = [[cid, c["scenes"], c["items"], c["vector_rows"], c["read_memory_ms"], c["read_vectors_ms"],
             c["build_index_ms"], c["total_ms"]] for cid, c in cold.items()]
    print("\ncold load per conversation (the first includes opening the snapshot; memory and vectors come from "
          "the conversation's image, or the tables and LanceDB for older snapshots)")
    print(table(rows, ["conversation", "scenes", "items", "vectors", "memory ms", "vectors ms", "index ms", "total ms"]))
    print(f"target p50 <= {TARGET_LOCOMO_P50_MS} ms lexical: {'met' if result['target']['met'] else 'NOT met'}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--part", choices=("locomo", "scale", "all"), default="all")
    parser.add_argument("--store", type=Path, help="a built LoCoMo store to reuse (default: build one)")
    parser.add_argument("--locomo", type=Path, default=DEFAULT_LOCOMO)
    parser.add_argument("--llm-concurrency", type=int, default=8)
    parser.add_argument("--vector-cache", type=Path, default=Path(tempfile.gettempdir()) / "tmem-bench-query",
                        help="where the flat baseline keeps its turn vectors between runs")
    parser.add_argument("--max-questions", type=int, help="locomo: only the first N questions (quick checks)")
    parser.add_argument("--scale-store", type=Path, help="a synthetic store to reuse (default: generate one)")
    parser.add_argument("--conversations", type=int, default=10_000, help="scale: conversations to generate")
    parser.add_argument("--queries", type=int, default=1000, help="scale: cold and warm queries each")
    parser.add_argument("--seed", type=int, default=7)
    parser.add_argument("--before", type=Path,
                        help="scale: an earlier result (e.g. before a store-layer change) to embed for comparison")
    parser.add_argument("--compare-snapshot", metavar="ID",
                        help="scale: also time the DuckDB cold read on this older snapshot of the same store (A/B)")
    parser.add_argument("--results-dir", type=Path, default=RESULTS)
    parser.add_argument("--out", type=Path, help="result file (default: RESULTS_DIR/query[_scale].json)")
    args = parser.parse_args()
    if args.part == "all":  # each part in its own process: clean RSS and caches
        base = [sys.executable, str(Path(__file__).resolve()), "--seed", str(args.seed),
                "--results-dir", str(args.results_dir)]
        locomo = [*base, "--part", "locomo", "--locomo", str(args.locomo), "--vector-cache", str(args.vector_cache)]
        if args.store:
            locomo += ["--store", str(args.store)]
        if args.max_questions:
            locomo += ["--max-questions", str(args.max_questions)]
        scale = [*base, "--part", "scale", "--queries", str(args.queries), "--conversations", str(args.conversations)]
        for flag, value in (("--scale-store", args.scale_store), ("--before", args.before),
                            ("--compare-snapshot", args.compare_snapshot)):
            if value:
                scale += [flag, str(value)]
        for cmd in (locomo, scale):
            subprocess.run(cmd, check=True)
        return
    if args.part == "locomo":
        result = run_locomo(args)
        print_locomo(result)
        out = args.out or args.results_dir / "query.json"
    else:
        from query_scale import print_scale, run_scale

        result = run_scale(args)
        print_scale(result)
        out = args.out or args.results_dir / "query_scale.json"
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(result, indent=1, default=str) + "\n")
    print(f"\nwrote {out}")


if __name__ == "__main__":
    main()

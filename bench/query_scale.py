"""The scale part of bench/query.py: search latency and memory on a 1M-item synthetic store.

Cold = the first query of a conversation in this process (memory, turns, vectors and prebuilt BM25
from the snapshot's conversation image; for snapshots of older formats DuckDB and Lance at the
pinned version; index build, then the search); warm = a query of a conversation
already in the index cache. Query texts come from the store's own vocabulary (same seed), query
vectors are random unit vectors. RSS is read from /proc after N conversations are loaded.
A profile of the cold read times each of its DuckDB queries and the Lance read, the latter also
at the table version before the conversation_id index existed (when the store records it).
"""

from __future__ import annotations

import argparse
import json
import tempfile
import time
from pathlib import Path
from typing import Any

import duckdb
import numpy as np
from benchstats import Stopwatch, loadavg, machine_info, rss_bytes, summary_ms, table
from scale_store import FACTS, VECTOR_TABLE, Texts, build_scale_store

from tmem.query.loader import _vector_bundle, load_index
from tmem.query.memory import Memory
from tmem.retrieval.cascade import search
from tmem.retrieval.config import config_from_settings
from tmem.retrieval.index import build_index
from tmem.settings import load_settings
from tmem.store.conversations import load_turns
from tmem.store.lance import VectorStore
from tmem.store.memory_rows import read_memory
from tmem.store.migrations import MEMORY_TABLES
from tmem.store.snapshot.published import read_snapshot
from tmem.store.snapshot.reader import SnapshotReader, resolve_lance_uri

TARGET_SCALE_P95_MS = 50.0
RSS_CHECKPOINTS = (1, 10, 100, 250, 500, 1000, 2000)
PROFILE_CONVERSATIONS = 40
AB_CONVERSATIONS = 300  # per snapshot, in the cold-path A/B
UNINDEXED_SAMPLES = 3


def _unit(rng: np.random.Generator, dim: int) -> np.ndarray:
    v = rng.standard_normal(dim).astype(np.float32)
    return v / np.linalg.norm(v)


def _scalar(con: duckdb.DuckDBPyConnection, sql: str) -> Any:
    row = con.execute(sql).fetchone()
    assert row is not None, sql
    return row[0]


def profile_cold_read(mem: Memory, cids: list[str], facts: dict[str, Any]) -> dict[str, Any]:
    """Time the parts of a cold read on conversations not loaded yet."""
    snap = mem.snapshot()
    con = duckdb.connect(str(snap.info.memory_db), read_only=True)
    con.execute("SET TimeZone = 'UTC'")
    per_table: dict[str, list[float]] = {name: [] for name in (*MEMORY_TABLES, "turns")}
    read_memory_s, load_turns_s = [], []
    try:
        for cid in cids:
            for name in per_table:
                t0 = time.perf_counter()
                con.execute(f"SELECT * FROM {name} WHERE conversation_id = ?", [cid]).fetchall()  # noqa: S608
                per_table[name].append(time.perf_counter() - t0)
            t0 = time.perf_counter()
            read_memory(con, cid)
            read_memory_s.append(time.perf_counter() - t0)
            t0 = time.perf_counter()
            load_turns(con, cid)
            load_turns_s.append(time.perf_counter() - t0)
        rows = {name: int(_scalar(con, f"SELECT count(*) FROM {name}")) for name in per_table}  # noqa: S608
        clustered = {
            name: bool(_scalar(con,
                f"SELECT coalesce(bool_and(ok), true) FROM (SELECT conversation_id >= lag(conversation_id) "  # noqa: S608
                f"OVER (ORDER BY rowid) AS ok FROM {name})"))
            for name in ("items", "item_triggers", "turns")
        }
    finally:
        con.close()
    uri = resolve_lance_uri(snap.info, mem.store)
    version = snap.info.lance_versions[VECTOR_TABLE]
    probe = VectorStore(uri, int(facts.get("shape", {}).get("dim", 384)))
    lance_s = []
    for cid in cids:
        t0 = time.perf_counter()
        probe.load_conversation(VECTOR_TABLE, cid, version=version)
        lance_s.append(time.perf_counter() - t0)
    unindexed: dict[str, Any] | None = None
    if facts.get("unindexed_version"):
        samples = []
        for cid in cids[:UNINDEXED_SAMPLES]:
            t0 = time.perf_counter()
            probe.load_conversation(VECTOR_TABLE, cid, version=int(facts["unindexed_version"]))
            samples.append(time.perf_counter() - t0)
        unindexed = {"version": facts["unindexed_version"], "load_conversation_ms": summary_ms(samples)}
    return {
        "conversations": len(cids),
        "table_rows": rows,
        "stored_in_conversation_order": clustered,
        "duckdb_select_star_ms": {name: summary_ms(v) for name, v in per_table.items()},
        "duckdb_read_memory_ms": summary_ms(read_memory_s),
        "duckdb_load_turns_ms": summary_ms(load_turns_s),
        "lance_load_conversation_ms": {"version": version, **summary_ms(lance_s)},
        "lance_without_scope_index": unindexed,
        "image_parts": image_parts(snap.reader, cids),
    }


def image_parts(reader: SnapshotReader, cids: list[str]) -> dict[str, Any]:
    """The vector rows from the image vs from Lance, and the index build with the BM25 stored at
    publish vs built at load (alternating order)."""
    times: dict[str, list[float]] = {k: [] for k in ("vectors_image", "vectors_lance", "index_prebuilt_bm25",
                                                     "index_built_bm25")}
    for n, cid in enumerate(cids):
        cold = reader.read_cold(cid)
        m, bundle = cold.memory, _vector_bundle(cold.vectors)
        for name in (("vectors_image", "vectors_lance") if n % 2 else ("vectors_lance", "vectors_image")):
            t0 = time.perf_counter()
            reader.read_vector_rows(cid, from_lance=name == "vectors_lance")
            times[name].append(time.perf_counter() - t0)
        for name in (("index_prebuilt_bm25", "index_built_bm25") if n % 2 else ("index_built_bm25", "index_prebuilt_bm25")):
            t0 = time.perf_counter()
            build_index(cid, m.scenes, m.topics, m.items, m.item_triggers, m.scene_triggers, m.personas, cold.turns,
                        bundle, bm25=cold.bm25 if name == "index_prebuilt_bm25" else None)
            times[name].append(time.perf_counter() - t0)
    return {k: summary_ms(v) for k, v in times.items()}


def compare_layouts(store: Path, other_id: str, current_id: str, cids: list[str]) -> dict[str, Any]:
    """A/B of the DuckDB cold read (``read_conversation``: memory + turns) on two snapshots of the
    same memory, alternating per conversation so both see the same machine load."""
    readers = {sid: SnapshotReader(read_snapshot(store, sid), store) for sid in (other_id, current_id)}
    times: dict[str, list[float]] = {sid: [] for sid in readers}
    for n, cid in enumerate(cids):
        order = list(readers) if n % 2 else list(readers)[::-1]
        for sid in order:
            t0 = time.perf_counter()
            readers[sid].read_conversation(cid)
            times[sid].append(time.perf_counter() - t0)
    for reader in readers.values():
        reader.retire()
    return {sid: {"stored_in_conversation_order": sid == current_id, "read_conversation_ms": summary_ms(v)}
            for sid, v in times.items()}


def compare_cold_loads(store: Path, other_id: str, current_id: str, cids: list[str], texts: Texts,
                       rng: np.random.Generator, dim: int) -> dict[str, Any]:
    """A/B of the whole cold path (load_index: DuckDB + Lance + index build, then one hybrid search)
    on two snapshots of the same memory. The snapshots take turns, each on conversations neither has
    touched (so each read is cold for both), after one warm-up load each (process-level opens)."""
    config = config_from_settings(load_settings(store=store), "default")
    readers = {sid: SnapshotReader(read_snapshot(store, sid), store, VECTOR_TABLE) for sid in (other_id, current_id)}
    for n, reader in enumerate(readers.values()):
        load_index(reader, cids[n])
    parts: dict[str, dict[str, list[float]]] = {
        sid: {"cold_total": [], "read_memory": [], "read_vectors": [], "build_index": []} for sid in readers
    }
    order = list(readers)
    for n, cid in enumerate(cids[2:]):
        sid = order[n % 2]
        q, v = texts.query(int(rng.integers(4, 11))), _unit(rng, dim)
        t0 = time.perf_counter()
        index, timing = load_index(readers[sid], cid)
        search(index, q, v, config)
        parts[sid]["cold_total"].append(time.perf_counter() - t0)
        parts[sid]["read_memory"].append(timing.read_memory_s)
        parts[sid]["read_vectors"].append(timing.read_vectors_s)
        parts[sid]["build_index"].append(timing.build_index_s)
    for reader in readers.values():
        reader.retire()
    return {sid: {"image_format": readers[sid].info.image_format} | {k: summary_ms(v) for k, v in parts[sid].items()}
            for sid in readers}


def run_scale(args: argparse.Namespace) -> dict[str, Any]:
    info = machine_info()
    store: Path | None = args.scale_store
    generated: dict[str, Any] | None = None
    if store is None:
        store = Path(tempfile.mkdtemp(prefix="tmem-bench-scale-")) / "store"
        print(f"generating {args.conversations} synthetic conversations into {store} ...", flush=True)
        generated = build_scale_store(store, conversations=args.conversations)
    facts_path = store / FACTS
    facts: dict[str, Any] = json.loads(facts_path.read_text()) if facts_path.exists() else {}
    n = args.queries
    with Stopwatch() as opened:
        mem = Memory.open(store, load_settings(store=store, query_cache_size=n + 64))
    snap = mem.snapshot()
    cids = sorted(snap.info.conversations)
    rng = np.random.default_rng(args.seed)
    ab = 2 * (AB_CONVERSATIONS + 1) if getattr(args, "compare_snapshot", None) else 0
    picks = [cids[i] for i in rng.choice(len(cids), size=n + 1 + PROFILE_CONVERSATIONS + ab, replace=False)]
    first, cold_set = picks[0], picks[1 : n + 1]
    profile_set, ab_set = picks[n + 1 : n + 1 + PROFILE_CONVERSATIONS], picks[n + 1 + PROFILE_CONVERSATIONS :]
    texts = Texts(int(facts.get("seed", 11)))
    texts.rng.seed(args.seed)
    dim = int(facts.get("shape", {}).get("dim", 384))
    print(f"snapshot {snap.snapshot_id}: {len(cids)} conversations; {n} cold + {n} warm queries", flush=True)

    rss_open = rss_bytes()
    with Stopwatch() as first_load:  # one-time process costs: LanceDB import, DuckDB open, Lance table open
        mem.search(texts.query(), conversation_id=first, query_vector=_unit(rng, dim))
    rss: dict[int, int] = {1: rss_bytes()}
    cold_s, cold_load_s, cold_search_s = [], [], []
    phases: dict[str, list[float]] = {"read_memory": [], "read_vectors": [], "build_index": []}
    for i, cid in enumerate(cold_set, start=2):
        q, v = texts.query(int(rng.integers(4, 11))), _unit(rng, dim)
        t0 = time.perf_counter()
        mem.search(q, conversation_id=cid, query_vector=v)
        cold_s.append(time.perf_counter() - t0)
        last = mem.cache_stats().last_load
        assert last is not None and last.conversation_id == cid
        cold_load_s.append(last.total_s)
        cold_search_s.append(cold_s[-1] - last.total_s)
        phases["read_memory"].append(last.read_memory_s)
        phases["read_vectors"].append(last.read_vectors_s)
        phases["build_index"].append(last.build_index_s)
        if i in RSS_CHECKPOINTS:
            rss[i] = rss_bytes()
    rss[len(cold_set) + 1] = rss_bytes()
    loads = mem.cache_stats().misses
    warm_hybrid_s, warm_lexical_s = [], []
    for _ in range(n):
        cid = cold_set[int(rng.integers(0, len(cold_set)))]
        q, v = texts.query(int(rng.integers(4, 11))), _unit(rng, dim)
        t0 = time.perf_counter()
        mem.search(q, conversation_id=cid, query_vector=v)
        warm_hybrid_s.append(time.perf_counter() - t0)
    for _ in range(n):
        cid = cold_set[int(rng.integers(0, len(cold_set)))]
        q = texts.query(int(rng.integers(4, 11)))
        t0 = time.perf_counter()
        mem.search(q, conversation_id=cid, embed=False)
        warm_lexical_s.append(time.perf_counter() - t0)
    assert mem.cache_stats().misses == loads, "warm queries reloaded a conversation"
    print("profiling the cold read ...", flush=True)
    profile = profile_cold_read(mem, profile_set, facts)
    layouts = cold_ab = None
    if getattr(args, "compare_snapshot", None):
        print(f"A/B of the cold path against snapshot {args.compare_snapshot} ...", flush=True)
        cold_ab = compare_cold_loads(store, args.compare_snapshot, snap.snapshot_id, ab_set, texts, rng, dim)
        print(f"A/B of the DuckDB read against snapshot {args.compare_snapshot} ...", flush=True)
        layouts = compare_layouts(store, args.compare_snapshot, snap.snapshot_id, cold_set[:400])

    loaded = sorted(rss)
    per_conv = (rss[loaded[-1]] - rss[1]) / max(1, loaded[-1] - 1)
    latency = {
        "cold_total": summary_ms(cold_s),
        "cold_load_part": summary_ms(cold_load_s),
        "cold_search_part": summary_ms(cold_search_s),
        "cold_read_memory": summary_ms(phases["read_memory"]),
        "cold_read_vectors": summary_ms(phases["read_vectors"]),
        "cold_build_index": summary_ms(phases["build_index"]),
        "warm_precomputed_vector": summary_ms(warm_hybrid_s),
        "warm_lexical": summary_ms(warm_lexical_s),
    }
    before: dict[str, Any] | None = None
    if getattr(args, "before", None):
        earlier = json.loads(Path(args.before).read_text())
        before = {k: earlier.get(k) for k in ("snapshot_id", "latency_ms", "cold_read_profile",
                                              "rss_mib_per_loaded_conversation", "target")}
        before["loadavg"] = [earlier["machine"].get("loadavg_start"), earlier["machine"].get("loadavg_end")]
    return {
        "benchmark": "query", "part": "scale", "before": before, "machine": info | {"loadavg_end": loadavg()},
        "store": str(store), "generated": generated or facts, "snapshot_id": snap.snapshot_id,
        "image_format": snap.info.image_format,
        "conversations_in_store": len(cids), "queries": n, "seed": args.seed,
        "memory_open_ms": round(opened.s * 1000, 1),
        "first_query_ms (one-time imports and opens)": round(first_load.s * 1000, 1),
        "latency_ms": latency,
        "rss_mib_after_n_loaded": {k: round(v / 2**20, 1) for k, v in sorted(rss.items())},
        "rss_mib_after_open": round(rss_open / 2**20, 1),
        "rss_mib_per_loaded_conversation": round(per_conv / 2**20, 3),
        "cold_read_profile": profile,
        "snapshot_layout_ab": layouts,
        "cold_path_ab": cold_ab,
        "target": {"p95_ms_max": TARGET_SCALE_P95_MS,
                   "warm_met": latency["warm_precomputed_vector"]["p95"] <= TARGET_SCALE_P95_MS,
                   "cold_met": latency["cold_total"]["p95"] <= TARGET_SCALE_P95_MS},
    }


def print_scale(result: dict[str, Any]) -> None:
    gen = result["generated"].get("counts", {})
    lat = result["latency_ms"]
    print(f"\nscale: {result['conversations_in_store']} conversations, {gen.get('items', '?')} items, "
          f"{gen.get('vector_rows', '?')} vectors; {result['queries']} queries per pass "
          f"(load avg {result['machine']['loadavg_start']} -> {result['machine']['loadavg_end']})")
    labels = {
        "cold_total": "cold: first touch, total",
        "cold_load_part": "  of which load",
        "cold_read_memory": "    memory + turns read (image, else DuckDB tables)",
        "cold_read_vectors": "    vector read (image section, else Lance)",
        "cold_build_index": "    index build (arrays; BM25 loaded or built)",
        "cold_search_part": "  of which search",
        "warm_precomputed_vector": "warm: hybrid, precomputed vector",
        "warm_lexical": "warm: lexical only",
    }
    rows = [[labels[k], lat[k]["n"], lat[k]["p50"], lat[k]["p95"], lat[k]["mean"], lat[k]["max"]] for k in labels]
    print(table(rows, ["search (per query, ms)", "n", "p50", "p95", "mean", "max"]))
    print("\nRSS after N conversations loaded (MiB): "
          + ", ".join(f"{k}: {v}" for k, v in result["rss_mib_after_n_loaded"].items())
          + f"  (~{result['rss_mib_per_loaded_conversation']} MiB per conversation)")
    prof = result["cold_read_profile"]
    rows = [[name, prof["table_rows"][name], s["p50"], s["p95"]] for name, s in prof["duckdb_select_star_ms"].items()]
    rows.append(["read_memory()", "", prof["duckdb_read_memory_ms"]["p50"], prof["duckdb_read_memory_ms"]["p95"]])
    rows.append(["load_turns()", "", prof["duckdb_load_turns_ms"]["p50"], prof["duckdb_load_turns_ms"]["p95"]])
    lance = prof["lance_load_conversation_ms"]
    rows.append([f"Lance load_conversation @v{lance['version']}", "", lance["p50"], lance["p95"]])
    if prof["lance_without_scope_index"]:
        un = prof["lance_without_scope_index"]
        rows.append([f"  same @v{un['version']} (no scope index)", "", un["load_conversation_ms"]["p50"],
                     un["load_conversation_ms"]["p95"]])
    if prof.get("image_parts"):
        parts = prof["image_parts"]
        labels2 = {"vectors_image": "vector rows from the image section", "vectors_lance": "vector rows from Lance",
                   "index_prebuilt_bm25": "index build, BM25 stored at publish",
                   "index_built_bm25": "index build, BM25 built at load"}
        rows.extend([[labels2[k], "", v["p50"], v["p95"]] for k, v in parts.items()])
    print(f"\ncold read profile over {prof['conversations']} unloaded conversations "
          f"(stored in conversation order: {prof['stored_in_conversation_order']})")
    print(table(rows, ["read", "table rows", "p50 ms", "p95 ms"]))
    if result.get("snapshot_layout_ab"):
        rows = [[sid, ab["read_conversation_ms"]["n"],
                 ab["read_conversation_ms"]["p50"], ab["read_conversation_ms"]["p95"], ab["read_conversation_ms"]["mean"]]
                for sid, ab in result["snapshot_layout_ab"].items()]
        print("\nDuckDB cold read (read_conversation), same conversations, alternating snapshots")
        print(table(rows, ["snapshot", "n", "p50 ms", "p95 ms", "mean ms"]))
    if result.get("cold_path_ab"):
        rows = [[sid, ab["image_format"], ab["cold_total"]["n"]]
                + [f"{ab[k]['p50']} / {ab[k]['p95']}" for k in ("cold_total", "read_memory", "read_vectors", "build_index")]
                for sid, ab in result["cold_path_ab"].items()]
        print("\ncold path A/B (load + one hybrid search; snapshots take turns on fresh conversations), p50 / p95 ms")
        print(table(rows, ["snapshot", "image format", "n", "total", "memory read", "vector read", "index build"]))
    t = result["target"]
    print(f"target p95 <= {t['p95_ms_max']} ms: warm {'met' if t['warm_met'] else 'NOT met'}, "
          f"cold {'met' if t['cold_met'] else 'NOT met'}")

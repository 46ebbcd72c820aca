"""The build's embedding, before and after, in one run: what the embedder is asked and how long it takes.

Two parts, each alternating the code versions (``--before`` and ``--after``, two checkouts) round by
round on the same machine, so the shared machine's load drifts over both alike:

* ``queue`` — the embedding of ``--conversations`` conversations of a built store (``--store``: a
  store built by ``bench/nightly_scale.py --keep``, e.g. its ``store`` directory) as a build does it:
  each variant in a process of its own opens the build runtime over a copy of the store whose
  embedding cache was emptied, and builds every conversation from ``--threads`` threads. Every
  stage comes from the stage cache, so the process only embeds, through the build's queue
  (``tmem/llm/embed_queue.py``) and the real MiniLM. Reported: wall seconds, texts asked for, texts
  the model embedded, seconds inside the model.
* ``padding`` — no clock: the word pieces the model processes (each batch of ``--batch-size`` padded to
  its longest text, texts sorted by length inside a call as sentence-transformers does) when each
  call of the queue carries the texts of 1, 5 (what ``max_texts`` = 512 gathers: ~100 texts a
  conversation), 20 or all conversations, against the texts' own word pieces. Deterministic: it
  says how call composition changes the work, free of the machine's load.
* ``dask`` — two processes (a local Dask cluster's two workers) embedding ``--texts`` of the store's
  texts each at the same moment, torch at its default (as every worker did before) and at the
  worker's share of the cores (``tmem.build.runtime.embedding_threads``).

    HF_HUB_OFFLINE=1 python bench/embed_build.py --store STORE --before ../before [--after .]
        [--conversations 20] [--threads 64] [--rounds 2] [--parts queue,dask,padding]

Writes ``bench/results/embed_build.json`` and prints a table.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]
RESULTS = REPO / "bench" / "results"


def _child_env(repo: Path, store: Path) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith(("TMEM_", "PREFECT_"))}
    return env | {"PYTHONPATH": str(repo), "TMEM_STORE": str(store), "TMEM_LLM_BASE_URL": "http://127.0.0.1:9/v1",
                  "TMEM_LLM_API_KEY": "sk-bench", "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1"}


def queue_child(store: Path, conversations: int, threads: int) -> dict[str, Any]:
    """In a process of the code under test: embed ``conversations`` conversations as a build does."""
    from concurrent.futures import ThreadPoolExecutor

    from tmem.build.conversation import build_conversation
    from tmem.build.runtime import release, runtime_for
    from tmem.build.spec import BuildSpec

    spec = BuildSpec.resolve(store)
    rt = runtime_for(spec, "bench-embed")
    ids = [str(r[0]) for r in rt.con.execute("SELECT DISTINCT conversation_id FROM turns ORDER BY 1").fetchall()]
    ids = ids[:conversations]
    queue = rt.embed_queue
    assert queue is not None
    queue.inner.embed(["warm up the model"])  # loaded before the clock starts, as in a long build
    started = time.perf_counter()
    with ThreadPoolExecutor(threads) as pool:
        built = list(pool.map(lambda cid: build_conversation(rt, cid), ids))
    wall = time.perf_counter() - started
    release(spec, "bench-embed")
    usage = queue.usage
    asked = sum(len({v.text for v in b.vectors}) for b in built)
    return {"conversations": len(ids), "wall_s": round(wall, 2), "texts_asked": asked,
            "texts_embedded": usage.texts - 1, "model_calls": usage.calls - 1, "model_s": round(usage.seconds, 2),
            "vectors": sum(len(b.vectors) for b in built)}


def dask_child(texts_path: Path, threads: int, go: Path) -> dict[str, Any]:
    """One of two 'workers': embed the texts when ``go`` appears; seconds."""
    from tmem.providers.sentence_transformer import SentenceTransformerEmbedder

    texts = json.loads(texts_path.read_text(encoding="utf-8"))
    embedder = SentenceTransformerEmbedder("all-MiniLM-L6-v2", batch_size=64, threads=threads)
    embedder.embed(texts[:8])
    while not go.exists():
        time.sleep(0.01)
    started = time.perf_counter()
    embedder.embed(texts)
    return {"seconds": round(time.perf_counter() - started, 2)}


def fresh_copy(store: Path, into: Path) -> Path:
    """The store with an empty embedding cache (the stage cache and the LLM cache kept)."""
    import duckdb

    shutil.rmtree(into, ignore_errors=True)
    shutil.copytree(store, into, ignore=shutil.ignore_patterns("exchange"))
    con = duckdb.connect(str(into / "work.duckdb"))
    try:
        con.execute("DELETE FROM embedding_cache")
        con.execute("CHECKPOINT")
    finally:
        con.close()
    return into


def run_child(repo: Path, store: Path, argv: list[str], timeout_s: float = 3600) -> dict[str, Any]:
    proc = subprocess.run([sys.executable, str(Path(__file__).resolve()), *argv], env=_child_env(repo, store),
                          capture_output=True, text=True, timeout=timeout_s, check=False)
    if proc.returncode != 0:
        raise SystemExit(f"child {argv[0]} ({repo}) exited {proc.returncode}:\n{proc.stderr[-3000:]}")
    out: dict[str, Any] = json.loads(proc.stdout.strip().splitlines()[-1])
    return out


def store_texts(store: Path, n: int) -> list[str]:
    import random

    import lancedb

    sys.path.insert(0, str(REPO))
    from tmem.store.snapshot.published import current_snapshot

    info = current_snapshot(store)
    if info is None:
        raise SystemExit(f"{store}: no published snapshot")
    table = lancedb.connect(info.lance_uri).open_table("vectors", version=info.lance_versions["vectors"])
    texts = list(dict.fromkeys(table.to_arrow().column("text").to_pylist()))
    random.Random(14).shuffle(texts)
    return texts[:n]


def padding(store: Path, batch_size: int, seed: int = 14) -> list[dict[str, Any]]:
    """Padded word pieces per real word piece, by how many conversations' texts one call carries."""
    import random

    import lancedb

    from tmem.providers.sentence_transformer import SentenceTransformerEmbedder
    from tmem.store.snapshot.published import current_snapshot

    info = current_snapshot(store)
    if info is None:
        raise SystemExit(f"{store}: no published snapshot")
    table = lancedb.connect(info.lance_uri).open_table("vectors", version=info.lance_versions["vectors"]).to_arrow()
    by_conversation: dict[str, list[str]] = {}
    for text, cid in zip(table.column("text").to_pylist(), table.column("conversation_id").to_pylist(), strict=True):
        by_conversation.setdefault(cid, []).append(text)
    model = SentenceTransformerEmbedder("all-MiniLM-L6-v2")._load()
    limit = int(model.max_seq_length)
    distinct = sorted({t for texts in by_conversation.values() for t in texts})
    pieces = dict(zip(distinct, (min(limit, len(ids)) for ids in model.tokenizer(distinct)["input_ids"]), strict=True))
    conversations = [list(dict.fromkeys(texts)) for _, texts in sorted(by_conversation.items())]
    random.Random(seed).shuffle(conversations)  # the order conversations finish in
    real = sum(pieces[t] for texts in conversations for t in texts)

    def call_cost(texts: list[str]) -> int:
        ordered = sorted(texts, key=len, reverse=True)  # sentence-transformers sorts a call by characters
        return sum(len(b) * max(pieces[t] for t in b) for i in range(0, len(ordered), batch_size)
                   if (b := ordered[i : i + batch_size]))

    rows = []
    for per_call in (1, 5, 20, len(conversations)):
        cost = sum(call_cost([t for texts in conversations[i : i + per_call] for t in texts])
                   for i in range(0, len(conversations), per_call))
        rows.append({"conversations_per_call": per_call, "batch_size": batch_size, "padded_pieces": cost,
                     "real_pieces": real, "ratio": round(cost / real, 3)})
    return rows


def main() -> None:
    if len(sys.argv) > 1 and sys.argv[1].startswith("_"):
        kind, rest = sys.argv[1], sys.argv[2:]
        if kind == "_queue":
            print(json.dumps(queue_child(Path(rest[0]), int(rest[1]), int(rest[2]))))
        else:
            print(json.dumps(dask_child(Path(rest[0]), int(rest[1]), Path(rest[2]))))
        return
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--store", type=Path, required=True, help="a built store (bench/nightly_scale.py --keep)")
    parser.add_argument("--before", type=Path, required=True, help="checkout of the code before")
    parser.add_argument("--after", type=Path, default=REPO, help="checkout of the code after (default: this one)")
    parser.add_argument("--conversations", type=int, default=20)
    parser.add_argument("--threads", type=int, default=64, help="conversations built at once")
    parser.add_argument("--texts", type=int, default=300, help="texts per Dask 'worker'")
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--parts", default="queue,dask,padding")
    parser.add_argument("--batch-size", type=int, default=64, help="the build's TMEM_EMBEDDING_BATCH_SIZE (padding)")
    parser.add_argument("--out", type=Path, default=RESULTS / "embed_build.json")
    args = parser.parse_args()
    sys.path.insert(0, str(REPO))
    from bench.benchstats import loadavg, machine_info

    versions = {"before": args.before.resolve(), "after": args.after.resolve()}
    commits = {name: subprocess.run(["git", "-C", str(path), "rev-parse", "--short", "HEAD"], capture_output=True,
                                    text=True, check=False).stdout.strip() or path.name
               for name, path in versions.items()}
    report: dict[str, Any] = {"machine": machine_info(), "settings": {k: str(v) for k, v in vars(args).items()},
                              "commits": commits, "queue": [], "dask": [], "padding": []}
    parts = args.parts.split(",")
    if "padding" in parts:
        report["padding"] = padding(args.store, args.batch_size)
        for row in report["padding"]:
            print(f"padding {row['conversations_per_call']:4d} conversations a call: {row['ratio']:.2f} x the real word pieces",
                  flush=True)
    tmp = Path(tempfile.mkdtemp(prefix="tmem-embed-build-"))
    try:
        for rnd in range(args.rounds):
            if "queue" in parts:
                order = list(versions.items()) if rnd % 2 == 0 else list(versions.items())[::-1]  # neither always first
                for name, repo in order:
                    copy = fresh_copy(args.store, tmp / "store")
                    load = loadavg()
                    row = run_child(repo, copy, ["_queue", str(copy), str(args.conversations), str(args.threads)])
                    row |= {"round": rnd, "version": name, "loadavg": load}
                    report["queue"].append(row)
                    print(f"queue  round {rnd} {name:<6} wall {row['wall_s']:6.1f} s  asked {row['texts_asked']:5d}  "
                          f"embedded {row['texts_embedded']:5d}  in model {row['model_s']:6.1f} s  load {load[0]}",
                          flush=True)
            if "dask" in parts:
                texts_path = tmp / "texts.json"
                texts_path.write_text(json.dumps(store_texts(args.store, args.texts)), encoding="utf-8")
                variants = [("torch default x 2 workers", 0), ("share of cores x 2 workers", max(1, (os.cpu_count() or 2) // 2))]
                for name, threads in variants if rnd % 2 == 0 else variants[::-1]:
                    go = tmp / "go"
                    go.unlink(missing_ok=True)
                    procs = [subprocess.Popen([sys.executable, str(Path(__file__).resolve()), "_dask", str(texts_path),
                                               str(threads), str(go)], env=_child_env(args.after, tmp),
                                              stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True)
                             for _ in range(2)]
                    time.sleep(20)  # both loaded the model
                    load = loadavg()
                    started = time.perf_counter()
                    go.touch()
                    each = [json.loads(p.communicate(timeout=1800)[0].strip().splitlines()[-1])["seconds"] for p in procs]
                    row = {"round": rnd, "variant": name, "threads": threads, "both_s": round(time.perf_counter() - started, 2),
                           "each_s": each, "texts_each": args.texts, "loadavg": load}
                    report["dask"].append(row)
                    print(f"dask   round {rnd} {name:<28} both done in {row['both_s']:6.1f} s  each {each}  load {load[0]}",
                          flush=True)
            args.out.parent.mkdir(parents=True, exist_ok=True)
            args.out.write_text(json.dumps(report, indent=1))
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    report["summary"] = summarise(report)
    report["loadavg_end"] = loadavg()
    args.out.write_text(json.dumps(report, indent=1))
    print(table(report))
    print(f"wrote {args.out}")


def summarise(report: dict[str, Any]) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for version in ("before", "after"):
        rows = [r for r in report["queue"] if r["version"] == version]
        if rows:
            out[f"queue_{version}"] = {k: statistics.median(r[k] for r in rows)
                                       for k in ("wall_s", "texts_asked", "texts_embedded", "model_s")}
    for threads in sorted({r["threads"] for r in report["dask"]}):
        rows = [r for r in report["dask"] if r["threads"] == threads]
        out[f"dask_threads_{threads}"] = {"both_s": statistics.median(r["both_s"] for r in rows), "rounds": len(rows)}
    return out


def table(report: dict[str, Any]) -> str:
    lines = ["| part | variant (commit) | median wall s | texts asked | texts embedded | s in the model | rounds | load avg |",
             "|---|---|---:|---:|---:|---:|---:|---:|"]
    for version in ("before", "after"):
        rows = [r for r in report["queue"] if r["version"] == version]
        if rows:
            s = report["summary"][f"queue_{version}"]
            loads = "-".join(f"{x:.1f}" for x in sorted({r['loadavg'][0] for r in rows}))
            lines.append(f"| build's embedding, {rows[0]['conversations']} conv. | {version} ({report['commits'][version]}) | "
                         f"{s['wall_s']:.1f} | {s['texts_asked']:,.0f} | {s['texts_embedded']:,.0f} | {s['model_s']:.1f} | "
                         f"{len(rows)} | {loads} |")
    for threads in sorted({r["threads"] for r in report["dask"]}):
        rows = [r for r in report["dask"] if r["threads"] == threads]
        loads = "-".join(f"{x:.1f}" for x in sorted({r['loadavg'][0] for r in rows}))
        lines.append(f"| 2 workers embedding at once, {rows[0]['texts_each']} texts each | {rows[0]['variant']} | "
                     f"{report['summary'][f'dask_threads_{threads}']['both_s']:.1f} | – | – | – | {len(rows)} | {loads} |")
    for row in report.get("padding", []):
        lines.append(f"| word pieces processed ÷ real, batch {row['batch_size']} | {row['conversations_per_call']} conversations "
                     f"a call | {row['ratio']:.2f} | – | – | – | – | – |")
    return "\n".join(lines)


if __name__ == "__main__":
    main()

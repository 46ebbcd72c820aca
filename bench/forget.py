"""Cost of ``tmem forget`` at production scale: time per step and what it rewrites.

On the synthetic 10,000-conversation store of ``bench/scale_store.py`` (1M items, 5.25M vectors,
one published snapshot with 9 GB of images), forget ``--runs`` conversations one after another
(each run consumes one: the store is changed for good) and record per run the seconds of each
step and what it wrote: the working database copied (bytes), the snapshot republished (images
copied byte for byte), the Lance rows of other conversations re-written out of the fragments that
held the forgotten rows, versions dropped. The dry run before each forget is timed too.

``--prepare`` first runs the nightly maintenance (``tmem.store.maintenance.optimize_vectors``:
compaction and version cleanup) once, timed separately: a production store has been compacted
by its nightly run, and LanceDB's version cleanup compacts small fragments too, so without it the
first forget would pay for the whole table's compaction.

    python bench/scale_store.py S                      # once (about 25-45 min here)
    python bench/forget.py S --prepare [--runs 3]      # writes bench/results/forget.json
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from bench.benchstats import loadavg, machine_info, table  # noqa: E402
from tmem.store.forget import forget_conversation  # noqa: E402
from tmem.store.maintenance import optimize_vectors  # noqa: E402
from tmem.store.snapshot.published import current_snapshot  # noqa: E402

DEFAULT_OUT = REPO / "bench" / "results" / "forget.json"
STEPS = ("work", "files", "vectors", "snapshot", "prune", "vector-versions", "rewrite")


def dir_bytes(root: Path) -> int:
    return sum(p.stat().st_size for p in root.rglob("*") if p.is_file())


def lance_files(root: Path) -> tuple[int, int]:
    data = list((root / "vectors.lance" / "data").glob("*.lance"))
    return len(data), sum(p.stat().st_size for p in data)


def one_forget(store: Path, conversation_id: str) -> dict[str, Any]:
    lance = store / "lance"
    started_load = loadavg()
    t0 = time.perf_counter()
    dry = forget_conversation(store, conversation_id, now=datetime.now(UTC), lance_uri=str(lance), dry_run=True)
    dry_s = time.perf_counter() - t0
    before = {"lance_bytes": dir_bytes(lance), "lance_data_files": lance_files(lance)[0],
              "snapshots_bytes": dir_bytes(store / "snapshots"), "work_db_bytes": (store / "work.duckdb").stat().st_size}
    marks: list[tuple[str, float]] = []
    t0 = time.perf_counter()
    report = forget_conversation(store, conversation_id, now=datetime.now(UTC), lance_uri=str(lance),
                                 progress=lambda step, n, total: marks.append((step, time.perf_counter())))
    total_s = time.perf_counter() - t0
    after = {"lance_bytes": dir_bytes(lance), "lance_data_files": lance_files(lance)[0],
             "snapshots_bytes": dir_bytes(store / "snapshots"), "work_db_bytes": (store / "work.duckdb").stat().st_size}
    steps = report["steps"]
    vectors = steps.get("vectors", {}).get("vectors", {})
    snap = steps.get("snapshot", {})
    rows_removed = int(vectors.get("rows_removed", 0))
    return {
        "conversation_id": conversation_id,
        "loadavg_start": started_load, "loadavg_end": loadavg(),
        "dry_run_s": round(dry_s, 2), "forget_s": round(total_s, 2), "step_s": report["seconds"],
        "work_rows_removed": sum(steps["work"]["rows"].values()),
        "vector_rows_removed": rows_removed,
        "fragments_rewritten": vectors.get("fragments_rewritten"),
        "other_vector_rows_rewritten": vectors.get("other_rows_rewritten"),
        "images_copied": snap.get("images_copied"), "image_bytes_copied": snap.get("image_bytes_copied"),
        "work_db_bytes_before": steps["rewrite"]["work_db_bytes_before"],
        "work_db_bytes_after": steps["rewrite"]["work_db_bytes_after"],
        "lance_versions": steps.get("vector-versions", {}).get("vectors"),
        "snapshots_removed": len(steps.get("prune", {}).get("removed", [])),
        "disk_before": before, "disk_after": after,
        "dry_run_would_remove": {"work_rows": sum(dry["would_remove"]["work"]["rows"].values()),
                                 "vector_rows": dry["would_remove"]["vector_rows"]},
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("store", type=Path)
    parser.add_argument("--runs", type=int, default=3)
    parser.add_argument("--prepare", action="store_true", help="run the nightly Lance maintenance first (timed apart)")
    parser.add_argument("--out", type=Path, default=DEFAULT_OUT)
    args = parser.parse_args()
    store = args.store.resolve()
    info = current_snapshot(store)
    if info is None:
        raise SystemExit(f"{store}: nothing published; run bench/scale_store.py first")
    out: dict[str, Any] = {"machine": machine_info(), "store": str(store),
                           "conversations_before": len(info.conversations), "runs": []}
    if args.prepare:
        t0 = time.perf_counter()
        done = optimize_vectors(store, str(store / "lance"), now=datetime.now(UTC))
        out["prepare"] = {"seconds": round(time.perf_counter() - t0, 1),
                          "tables": [{"table": m.table, "versions_before": len(m.versions_before),
                                      "versions_after": len(m.versions_after)} for m in done],
                          "lance_data_files": lance_files(store / "lance")[0]}
        print(f"nightly maintenance first: {out['prepare']['seconds']} s", flush=True)
    ids = sorted(info.conversations)
    picks = [ids[(2 * k + 1) * len(ids) // (2 * args.runs)] for k in range(args.runs)]
    for cid in picks:
        run = one_forget(store, cid)
        out["runs"].append(run)
        print(f"forgot {cid} in {run['forget_s']} s (load {run['loadavg_start']})", flush=True)
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps(out, indent=1) + "\n")
    out["machine"]["loadavg_end"] = loadavg()
    args.out.write_text(json.dumps(out, indent=1) + "\n")
    rows = [[r["conversation_id"], r["forget_s"], *(r["step_s"].get(s, 0.0) for s in STEPS), r["dry_run_s"],
             r["other_vector_rows_rewritten"], round(r["image_bytes_copied"] / 2**30, 2),
             round(r["work_db_bytes_after"] / 2**30, 2), r["loadavg_start"][0]] for r in out["runs"]]
    print(table(rows, ["conversation", "total s", *STEPS, "dry run s", "vector rows rewritten", "images GiB copied",
                       "work.duckdb GiB", "load"]))
    print(f"wrote {args.out} (pid {os.getpid()})")


if __name__ == "__main__":
    main()

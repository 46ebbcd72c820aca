"""A publish's conversation images, alone: every image of a built store's current snapshot written afresh.

The last step of a publish (``write_conversation_images``) turns each conversation's rows into its
image: per run of ``IMAGE_BATCH`` conversations one SQL statement (the documents) and one Lance read
(the vector rows), then per conversation in Python a decode, its BM25 section and zlib. In a nightly
that rebuilt every conversation none is reused, and this is the tail of the run, after the encoder
has ended. Here each checkout (``--repo``, default this one; ``--before DIR`` another, e.g. a worktree
of the commit before) writes the images of the store's current snapshot afresh into a temporary
directory, ``--runs`` times each, alternating, in a process of its own with ``PYTHONHASHSEED=0``
(BM25's vocabulary order follows the hash seed), so the files of the two checkouts can be compared
byte for byte. The snapshot is only read: its tables are copied into a temporary database first.

    HF_HUB_OFFLINE=1 python bench/publish_images.py --store DIR [--before DIR] [--runs 3]

``DIR`` is a store built by ``bench/nightly_scale.py`` (``--save-state`` keeps one: its ``store``).
Prints the median seconds and CPU seconds per checkout and writes ``bench/results/publish_images.json``.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))
from bench.benchstats import loadavg, machine_info  # noqa: E402

# Run in a fresh interpreter with the checkout under test first on sys.path.
ONE_RUN = r"""
import hashlib, json, resource, sys, tempfile, time
from pathlib import Path
sys.path.insert(0, sys.argv[1])
import duckdb
from tmem.retrieval.lexical import BM25Section
from tmem.store.snapshot.image import IMAGE_FILE, IMAGE_TABLE, write_conversation_images
from tmem.store.snapshot.image_vectors import lance_source
from tmem.store.snapshot.published import current_snapshot, snapshot_tables
from tmem.store.snapshot.reader import resolve_lance_uri

store = Path(sys.argv[2])
info = current_snapshot(store)
out = Path(tempfile.mkdtemp(prefix="tmem-publish-images-"))
con = duckdb.connect(str(out / "copy.duckdb"))
con.execute("SET TimeZone = 'UTC'")
con.execute("ATTACH ? AS snap (READ_ONLY)", [str(info.memory_db)])
for name in snapshot_tables(con, "snap"):  # as the snapshot upgrade copies them, its image index left out
    if name != IMAGE_TABLE:
        con.execute(f'CREATE TABLE main."{name}" AS SELECT * FROM snap."{name}"')
con.execute("DETACH snap")
source = lance_source(resolve_lance_uri(info, store), info.lance_versions)
usage = resource.getrusage(resource.RUSAGE_SELF)
started = time.perf_counter()
written, reused = write_conversation_images(con, "main", out, vectors=source, lexical=BM25Section())
seconds = time.perf_counter() - started
after = resource.getrusage(resource.RUSAGE_SELF)
con.close()
digest = hashlib.sha256((out / IMAGE_FILE).read_bytes()).hexdigest()
print(json.dumps({"seconds": round(seconds, 2),
                  "cpu_s": round(after.ru_utime + after.ru_stime - usage.ru_utime - usage.ru_stime, 2),
                  "images": written, "reused": reused, "sha256": digest[:16]}))
import shutil; shutil.rmtree(out)
"""


def one_run(repo: Path, store: Path) -> dict[str, Any]:
    env = os.environ | {"PYTHONHASHSEED": "0", "HF_HUB_OFFLINE": "1"}
    done = subprocess.run([sys.executable, "-c", ONE_RUN, str(repo), str(store)], env=env, capture_output=True,
                          text=True, check=False)
    if done.returncode != 0:
        raise SystemExit(f"publish_images: the run of {repo} failed:\n{done.stderr[-3000:]}")
    return dict(json.loads(done.stdout.strip().splitlines()[-1]))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--store", type=Path, required=True)
    parser.add_argument("--repo", type=Path, default=REPO)
    parser.add_argument("--before", type=Path, default=None, help="another checkout to run beside --repo")
    parser.add_argument("--runs", type=int, default=3)
    parser.add_argument("--out", type=Path, default=REPO / "bench" / "results" / "publish_images.json")
    args = parser.parse_args()
    checkouts = {"before": args.before, "after": args.repo} if args.before else {"this": args.repo}
    runs: dict[str, list[dict[str, Any]]] = {name: [] for name in checkouts}
    load = loadavg()
    for _ in range(args.runs):
        for name, repo in checkouts.items():
            runs[name].append(one_run(repo.resolve(), args.store.resolve()))
            print(f"  {name:<6} {runs[name][-1]}", flush=True)
    rows = {name: {"median_s": statistics.median(r["seconds"] for r in got),
                   "median_cpu_s": statistics.median(r["cpu_s"] for r in got),
                   "images": got[0]["images"], "sha256": sorted({r["sha256"] for r in got})}
            for name, got in runs.items()}
    print("\n| checkout | images | median s | median CPU s | file sha256 |\n|---|---:|---:|---:|---|")
    for name, row in rows.items():
        print(f"| {name} | {row['images']:,} | {row['median_s']:.2f} | {row['median_cpu_s']:.2f} | {', '.join(row['sha256'])} |")
    same = len({h for row in rows.values() for h in row["sha256"]}) == 1
    print(f"\nsame bytes in every run: {same}")
    report = {"when": datetime.now(UTC).isoformat(timespec="seconds"), "machine": machine_info(),
              "loadavg_start": load, "loadavg_end": loadavg(), "store": str(args.store),
              "checkouts": {k: str(v) for k, v in checkouts.items()}, "runs": runs, "summary": rows,
              "same_bytes": same}
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(report, indent=1))
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()

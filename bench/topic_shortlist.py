"""Would the topic shortlist have offered what full matching admitted? Read from recorded builds.

A recorded build (``python bench/real_model.py record QUEUE --out calls.jsonl``, or a fixture's
``build_calls.jsonl``) of the paper's batched matching (``topic_shortlist`` 0) holds, per scene,
every topic label the pool offered and the ones the model admitted. For each scene whose pool held
more than ``--batch`` topics this replays tmem's own ``shortlist_topics`` over that pool and counts
the admitted topics it lists with keywords, names by title only, or leaves out; and the matching
calls the build made against the one call per scene the shortlist makes. Zero model calls: this is
a counterfactual on the answers given (with fewer topics shown a model may answer differently), the
cheap check before a real-model build with the shortlist on.

    python bench/topic_shortlist.py CALLS.jsonl [CALLS.jsonl ...] [--batch 10] [--shortlist 40]
"""

from __future__ import annotations

import argparse
import json
import sys
from collections import OrderedDict
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))
from bench.benchstats import machine_info  # noqa: E402
from tmem.construct.topics import shortlist_topics  # noqa: E402
from tmem.devtools.responders import request_input  # noqa: E402
from tmem.domain import Topic  # noqa: E402
from tmem.prompts.topic_create import SceneView  # noqa: E402

RESULTS = REPO / "bench" / "results"


def _answer(record: dict[str, Any]) -> dict[str, Any]:
    answer = record["response"]
    return answer if isinstance(answer, dict) else json.loads(answer)


def scenes_of(path: Path) -> list[dict[str, Any]]:
    """Per scene, in build order: its view, the labels offered (pool order) and the titles admitted."""
    scenes: OrderedDict[tuple[str, str], dict[str, Any]] = OrderedDict()
    for line in path.read_text().splitlines():
        record = json.loads(line)
        if record["operation"] != "topic_match":
            continue
        data = request_input(record)
        if data.get("other_topics"):
            raise SystemExit(f"{path}: record {record.get('n')} was built with the shortlist on; give a batched build")
        view = data["scene"]
        entry = scenes.setdefault((view["date"], view["title"]), {"view": view, "offered": [], "admitted": [], "calls": 0})
        by_ref = {t["ref"]: t for t in data["topics"]}
        entry["offered"] += data["topics"]
        entry["calls"] += 1
        entry["admitted"] += [by_ref[a["ref"]]["title"] for a in _answer(record).get("admitted", []) if a["ref"] in by_ref]
    return list(scenes.values())


def measure(path: Path, batch: int, shortlist: int) -> dict[str, Any]:
    listed = by_title = left_out = scenes_over = 0
    calls_batched = calls_short = 0
    missed: list[dict[str, Any]] = []
    for entry in scenes_of(path):
        calls_batched += entry["calls"]
        pool = [
            Topic(conversation_id="c", topic_id=f"t{n}", seq=n, title=t["title"], keywords=tuple(t["keywords"]),
                  scene_ids=("s",))
            for n, t in enumerate(entry["offered"])
        ]
        if len(pool) <= batch:
            calls_short += entry["calls"]
            continue
        calls_short += 1
        scenes_over += 1
        view = SceneView(**{k: entry["view"][k] for k in ("date", "title", "summary", "narrative")})
        shown, titled = shortlist_topics(view, pool, batch, shortlist)
        shown_titles, titled_titles = {t.title for t in shown}, {t.title for t in titled}
        for title in entry["admitted"]:
            if title in shown_titles:
                listed += 1
            elif title in titled_titles:
                by_title += 1
            else:
                left_out += 1
                missed.append({"scene": entry["view"]["title"], "topic": title, "pool": len(pool)})
    admitted = listed + by_title + left_out
    return {
        "calls": str(path), "scenes_with_pool_over_batch": scenes_over, "admissions": admitted,
        "listed_with_keywords": listed, "named_by_title": by_title, "left_out": left_out,
        "offered_share": round((listed + by_title) / admitted, 3) if admitted else None,
        "listed_share": round(listed / admitted, 3) if admitted else None,
        "topic_match_calls_batched": calls_batched, "topic_match_calls_shortlist": calls_short, "missed": missed,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("calls", type=Path, nargs="+")
    parser.add_argument("--batch", type=int, default=10)
    parser.add_argument("--shortlist", type=int, default=40)
    parser.add_argument("--out", type=Path, default=RESULTS / "topic_shortlist.json")
    args = parser.parse_args()
    rows = [measure(path, args.batch, args.shortlist) for path in args.calls]
    print(f"batch {args.batch}, shortlist {args.shortlist}: admitted topics of scenes whose pool exceeded the batch")
    print("| recording | scenes | admitted | listed | by title | left out | topic_match calls batched → shortlist |")
    print("|---|---:|---:|---:|---:|---:|---|")
    for row in rows:
        print(f"| {Path(row['calls']).name} | {row['scenes_with_pool_over_batch']} | {row['admissions']} | "
              f"{row['listed_with_keywords']} | {row['named_by_title']} | {row['left_out']} | "
              f"{row['topic_match_calls_batched']} → {row['topic_match_calls_shortlist']} |")
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps({"batch": args.batch, "shortlist": args.shortlist, "machine": machine_info(),
                                    "recordings": rows}, indent=1))
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()

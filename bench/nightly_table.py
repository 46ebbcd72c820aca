"""The README's table of ``bench/nightly_scale.py`` results: one row per configuration and phase.

    python bench/nightly_table.py bench/results/nightly_scale-threads-postgres-1000.json [...]
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path
from typing import Any

PHASES = ("first", "warm", "nochange", "nightly")
HEADER = ("| configuration (N, commit) | phase | wall s | s / conv. | LLM calls | LLM bound s | embedding s (texts) "
          "| wall ÷ bound | in-build model s (texts) | Prefect HTTP + ws | load avg |")


def rows(report: dict[str, Any]) -> list[str]:
    n = report["settings"]["conversations"]
    out = []
    for phase in PHASES:
        row = report["phases"].get(phase)
        if row is None:
            continue
        emb = row["embedding"]
        ratio = f"{row['ratio_to_bound']:.2f}" if row.get("ratio_to_bound") else "–"
        inside = row.get("build_embedding") or {}
        in_build = f"{inside['model_s']:.1f} ({inside['texts']:,})" if inside.get("texts") else "–"
        out.append(f"| {report['label']} ({n}, {report['commit']}) | {phase} | {row['wall_s']:.1f} | "
                   f"{row['wall_per_conversation_s']:.3f} | {row['llm_calls']:,} | {row['llm_bound_s']:.1f} | "
                   f"{emb['seconds']:.1f} ({emb['texts']:,}) | {ratio} | {in_build} | {row['prefect_http']:,} + "
                   f"{row['prefect_ws_messages']:,} | {row['loadavg'][0]:.1f} |")
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("reports", nargs="+", type=Path)
    args = parser.parse_args()
    print(HEADER)
    print("|---|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|")
    for path in args.reports:
        for line in rows(json.loads(path.read_text(encoding="utf-8"))):
            print(line)


if __name__ == "__main__":
    main()

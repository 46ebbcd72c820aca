"""Serve tmem's deployments from this process (no work pool, no worker): `python deployments/serve.py`.

The alternative to `prefect deploy --all` + `prefect worker start --pool tmem-pool` (see
docs/operations.md). The served deployments match prefect.yaml: nightly-rebuild (cron), backfill,
evaluate and build-all; trigger the unscheduled ones with `prefect deployment run <flow>/<name>`.
Runs execute one at a time (``limit=1``): the store has a single writer.
"""

from __future__ import annotations

import argparse
from typing import Any

from prefect import serve
from prefect.deployments.runner import RunnerDeployment

from tmem.flows.backfill import backfill
from tmem.flows.build_memory import build_memory
from tmem.flows.evaluate import evaluate
from tmem.flows.nightly_rebuild import nightly_rebuild


def _built(deployment: Any) -> RunnerDeployment:
    """``to_deployment`` is typed sync-or-async; called from sync code it returns the deployment."""
    if not isinstance(deployment, RunnerDeployment):
        raise TypeError(f"expected a RunnerDeployment, got {type(deployment).__name__}")
    return deployment


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--store", default="./tmem-store")
    parser.add_argument("--cron", default="0 2 * * *", help="nightly rebuild schedule (UTC)")
    parser.add_argument("--archives", default="./archives/**/*.json", help="backfill glob")
    parser.add_argument("--eval-data", default="../shared/datasets/locomo/locomo10.json")
    args = parser.parse_args()
    nightly = nightly_rebuild.to_deployment(
        name="nightly-rebuild", cron=args.cron, tags=["tmem", "nightly"],
        parameters={"store": args.store, "keep_snapshots": 3, "lance_margin_s": 300, "label": "nightly"},
    )
    fill = backfill.to_deployment(
        name="backfill", tags=["tmem", "backfill"],
        parameters={"store": args.store, "glob": args.archives, "chunk_size": 5, "label": "archives"},
    )
    evaluation = evaluate.to_deployment(
        name="evaluate", tags=["tmem", "evaluate"],
        parameters={"data": args.eval_data, "out": "./eval-results/locomo", "store": args.store, "build": True},
    )
    manual = build_memory.to_deployment(
        name="build-all", tags=["tmem"], parameters={"store": args.store, "only_changed": False, "label": "manual"},
    )
    serve(*(_built(d) for d in (nightly, fill, evaluation, manual)), limit=1)


if __name__ == "__main__":
    main()

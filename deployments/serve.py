"""Serve tmem's deployments from this process (no work pool needed): `python deployments/serve.py`.

The alternative to `prefect deploy --all` + a worker; see README "Operations".
"""

from __future__ import annotations

import argparse

from prefect import serve

from flows.build_memory import build_memory


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--store", default="./tmem-store")
    parser.add_argument("--cron", default="0 2 * * *", help="nightly rebuild schedule (UTC)")
    args = parser.parse_args()
    nightly = build_memory.to_deployment(
        name="nightly-rebuild",
        cron=args.cron,
        parameters={"store": args.store, "only_changed": True, "label": "nightly"},
        tags=["tmem", "nightly"],
    )
    manual = build_memory.to_deployment(
        name="build-all", parameters={"store": args.store, "only_changed": False, "label": "manual"}, tags=["tmem"]
    )
    serve(nightly, manual)


if __name__ == "__main__":
    main()

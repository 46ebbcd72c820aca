"""What one Prefect task run costs a Dask worker and the flow that submits it: prefect-dask's runner vs the build's.

A build at archive scale sends its conversations to Dask workers in task runs (125 of them for 1,000
conversations); what a task run costs before its conversations start is paid on the same cores as the
encoder. This measures that cost alone: a flow on a local cluster of one worker process with --threads
threads (a build's worker runs as many as it has LLM calls in flight: 32 in ``bench/nightly_scale.py``)
submits --tasks task runs whose body does nothing (as a build submits them: the Prefect settings
sent as the model itself, ``settings_serialized_once``), against a real Prefect server (SQLite, in a temporary
home), with

- ``prefect``: prefect-dask's ``DaskTaskRunner`` as it ships: two new API clients per task run on the
  worker (each loading certifi's CA bundle into a TLS context) and a ``tokenize`` of every submission;
- ``tmem``: the build's ``BuildDaskTaskRunner`` (``tasks/dask_runner.py``) of the checkout given by
  --repo (default this one): since stop 30 the worker process's one API client (stop 29: one per
  worker thread), and submissions keyed by a UUID.

The worker's CPU is read inside it (``getrusage`` of the worker process, by a task run before the first
measured one and by one after the last), the flow's around the submissions and results. Each round runs
both, in turn, each in a fresh process and cluster; medians over the rounds.

    HF_HUB_OFFLINE=1 python bench/dask_task_runs.py [--tasks 100] [--threads 1] [--rounds 3] [--repo PATH] [--out PATH]
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]
if str(REPO) not in sys.path:  # not again in a worker this module's run spawned: --repo's tmem stays ahead
    sys.path.insert(0, str(REPO))
from bench.benchstats import loadavg, table  # noqa: E402

DEFAULT_OUT = REPO / "bench" / "results" / "dask_task_runs.json"
RUNNERS = ("prefect", "tmem")


def _worker_cpu_s() -> float:
    used = resource.getrusage(resource.RUSAGE_SELF)
    return used.ru_utime + used.ru_stime


def _nothing(n: int) -> int:
    return n


def run(runner: str, tasks: int, threads: int) -> dict[str, Any]:
    """One flow of ``tasks`` empty task runs on a one-worker local cluster of ``threads`` threads; CPU
    seconds of the worker and the flow."""
    from distributed import LocalCluster
    from prefect import flow, task
    from prefect_dask import DaskTaskRunner

    from tmem.tasks.build import settings_serialized_once
    from tmem.tasks.dask_runner import BuildDaskTaskRunner

    kind = BuildDaskTaskRunner if runner == "tmem" else DaskTaskRunner
    cpu, nothing = task(_worker_cpu_s, name="worker-cpu"), task(_nothing, name="nothing")

    @flow(task_runner=kind(cluster_class=LocalCluster, cluster_kwargs={
        "n_workers": 1, "threads_per_worker": threads, "processes": True, "dashboard_address": None}))
    def empty_task_runs() -> dict[str, Any]:
        before = cpu.submit().result()  # the worker started, its first task run (imports) done
        flow_before, started = time.process_time(), time.perf_counter()
        with settings_serialized_once():  # as a build submits its units: the settings model sent as it is
            futures = [nothing.submit(n) for n in range(tasks)]
        assert [f.result() for f in futures] == list(range(tasks))
        wall, flow_cpu = time.perf_counter() - started, time.process_time() - flow_before
        after = cpu.submit().result()
        return {"runner": runner, "tasks": tasks, "threads": threads, "wall_s": round(wall, 2),
                "worker_cpu_ms_per_task_run": round(1000 * (after - before) / (tasks + 1), 1),
                "flow_cpu_ms_per_task_run": round(1000 * flow_cpu / tasks, 1)}

    return empty_task_runs()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tasks", type=int, default=100)
    parser.add_argument("--threads", type=int, default=1, help="the worker's threads")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--repo", type=Path, default=REPO, help="the tmem checkout whose runner is measured")
    parser.add_argument("--out", type=Path, default=DEFAULT_OUT)
    parser.add_argument("--run", choices=RUNNERS, help=argparse.SUPPRESS)  # one measurement, in this process
    args = parser.parse_args()
    if args.run:
        sys.path.insert(0, str(args.repo.resolve()))  # the measured checkout's tmem, ahead of this one's
        print(json.dumps(run(args.run, args.tasks, args.threads)))
        return

    from bench.prefect_servers import PrefectServer

    rows: list[dict[str, Any]] = []
    with tempfile.TemporaryDirectory(prefix="tmem-dask-task-runs-") as tmp:
        env = os.environ | {"PREFECT_HOME": tmp, "PREFECT_SERVER_ANALYTICS_ENABLED": "false", "DO_NOT_TRACK": "1",
                            "PREFECT_LOGGING_LEVEL": "WARNING"}
        server = PrefectServer(env, Path(tmp) / "server.log")
        try:
            for n in range(args.rounds):
                for runner in RUNNERS:
                    done = subprocess.run([sys.executable, __file__, "--run", runner, "--tasks", str(args.tasks),
                                           "--threads", str(args.threads), "--repo", str(args.repo.resolve())],
                                          env=env | {"PREFECT_API_URL": server.api_url, "PYTHONPATH": str(args.repo.resolve())},
                                          cwd=args.repo, capture_output=True,
                                          text=True, check=False)
                    if done.returncode != 0:
                        raise SystemExit(f"round {n + 1}, {runner}: exit {done.returncode}\n{done.stderr[-3000:]}")
                    rows.append(json.loads(done.stdout.strip().splitlines()[-1]) | {"round": n + 1})
                    print(rows[-1], flush=True)
        finally:
            server.stop()
    medians = {r: {k: statistics.median(x[k] for x in rows if x["runner"] == r)
                   for k in ("wall_s", "worker_cpu_ms_per_task_run", "flow_cpu_ms_per_task_run")} for r in RUNNERS}
    print(table([[r, m["worker_cpu_ms_per_task_run"], m["flow_cpu_ms_per_task_run"], m["wall_s"]]
                 for r, m in medians.items()],
                ["runner", "worker CPU ms / task run", "flow CPU ms / task run", f"wall s ({args.tasks} runs)"]))
    commit = subprocess.run(["git", "-C", str(args.repo), "rev-parse", "--short", "HEAD"], capture_output=True,
                            text=True, check=False).stdout.strip()
    result = {"tasks": args.tasks, "threads": args.threads, "repo_commit": commit, "rounds": args.rounds, "runs": rows, "medians": medians, "loadavg": loadavg()}
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(result, indent=2) + "\n")
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()

"""The nightly at archive scale: N synthetic conversations, a first full build, a warm rebuild, a
no-change nightly, then a nightly in which every conversation gained one session.

Steps, in a fresh temporary store and Prefect home:
  1. write two LoCoMo-format archives (``bench/synthetic_archive.py``): N conversations of
     ``--sessions`` sessions shaped like LoCoMo's (turns per session, words per turn), and the same
     archive with one more session per conversation;
  2. start the scripted OpenAI-compatible server in this process (synth responders, every answer
     delayed by ``--latency-ms``) and a real Prefect server (``bench/prefect_servers.py``: the app
     ``prefect server start`` runs, its API requests and websocket messages counted) on SQLite, or
     ``--database postgres`` on a PostgreSQL cluster started here;
  3. the phases, each a process of the code under test (``--repo``, default this checkout) with
     ``TMEM_LLM_CONCURRENCY`` / ``TMEM_BUILD_CONCURRENCY`` giving ``--in-flight`` LLM calls in flight
     (``--runner dask``: a local cluster of ``--workers`` processes, the in-flight calls split
     between them): ``first`` (``tmem build``), ``warm`` (``tmem build`` again: no LLM call),
     ``nochange`` (the ``nightly-rebuild`` flow with nothing changed), then ``tmem ingest`` of the
     grown archive and ``nightly`` (the nightly flow rebuilding every conversation).

Per phase: wall time (outside the process), LLM calls (requests the server answered), the LLM
throughput bound (calls x latency / in flight), the measured embedding time (the texts this phase
embedded for the first time, read from the snapshot's vector rows and the embedding cache,
embedded here after the phase, alone, with the build's model and batch size: all of them with the
build's encoder layout (``--layout-sample N``: a random sample of N, scaled to all), and a sample of
at most ``--embed-sample`` in this process at torch's default threads, scaled; the bound is the
faster), Prefect API requests and websocket messages, and for the phases with no LLM call the wall
time per conversation.

Why all texts: the phase's wall time averages the machine's speed over minutes, a 3,000-text sample
(~30 s) over half a minute, and on this shared 2-core machine that half minute moved ±14 % between
runs minutes apart (the build layout's sample: 233-308 s at 1,000 for the same texts) while the walls
of the same code moved ±4 %. The samples of earlier results (``layout_sampled`` < ``texts`` in their
JSON) are kept as they were.

    HF_HUB_OFFLINE=1 python bench/nightly_scale.py [--conversations 1000] [--sessions 3]
        [--latency-ms 300] [--in-flight 64] [--runner threads|dask] [--workers 2]
        [--database sqlite|postgres] [--repo PATH] [--label NAME] [--out PATH] [--keep]
        [--save-state DIR] [--from-state DIR]

A first build at 1,000 conversations takes one to two hours here (its embedding alone ~45 min on
two cores). ``--save-state DIR`` copies the store and Prefect home as the first build left them
(after the phases before ``nightly``) to DIR; ``--from-state DIR`` starts from such a copy instead
of ingesting and building (same ``--conversations``, ``--sessions`` and ``--seed``: the grown
archive is written again from them), so the nightly on another runner costs only its own time:

    python bench/nightly_scale.py --conversations 1000 --database postgres --save-state /data/n1000
    python bench/nightly_scale.py --conversations 1000 --database postgres --runner dask \
        --from-state /data/n1000 --phases nightly
"""

from __future__ import annotations

import argparse
import json
import os
import random
import shutil
import subprocess
import sys
import tempfile
import time
from collections import Counter
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))
from bench.benchstats import CpuAccount, loadavg, machine_info, processes_named, processes_running  # noqa: E402
from bench.prefect_servers import Postgres, PrefectServer  # noqa: E402
from bench.synthetic_archive import write_archives  # noqa: E402
from tmem.devtools import synth  # noqa: E402
from tmem.devtools.scripted_llm import ScriptedLLM  # noqa: E402

RESULTS = REPO / "bench" / "results"
NIGHTLY = (
    "import json, sys\n"
    "from tmem.settings import apply_process_defaults\n"
    "apply_process_defaults()\n"
    "from tmem.flows.nightly_rebuild import nightly_rebuild\n"
    "result = nightly_rebuild(store=sys.argv[1], label='bench')\n"
    "print(json.dumps(result, default=str))\n"
)
EMBED_MODEL = "all-MiniLM-L6-v2"


def phase_env(args: argparse.Namespace, store: Path, llm_url: str, api_url: str, home: Path) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith(("TMEM_", "OPENAI_", "PREFECT_"))}
    env |= dict(item.split("=", 1) for item in args.setting)  # --setting TMEM_X=Y, on top of what follows
    per_process = args.in_flight // (args.workers if args.runner == "dask" else 1)
    env |= {
        "PYTHONPATH": str(args.repo), "TMEM_STORE": str(store), "TMEM_LLM_BASE_URL": llm_url,
        "TMEM_LLM_API_KEY": "sk-bench", "TMEM_LLM_CONCURRENCY": str(per_process),
        "TMEM_BUILD_CONCURRENCY": str(args.in_flight), "TMEM_TASK_RUNNER": args.runner,
        "TMEM_DASK_WORKERS": str(args.workers), "TMEM_DASK_THREADS_PER_WORKER": str(per_process),
        "PREFECT_API_URL": api_url, "PREFECT_HOME": str(home), "PREFECT_SERVER_ANALYTICS_ENABLED": "false",
        "DO_NOT_TRACK": "1", "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1",
    }
    return env


def run(command: list[str], env: dict[str, str], log: Path, cwd: Path, timeout_s: float) -> tuple[dict[str, Any], float]:
    """Run ``command``; its stdout parsed as JSON and its wall seconds (stderr kept in ``log``)."""
    started = time.perf_counter()
    proc = subprocess.run(command, env=env, cwd=cwd, capture_output=True, text=True, timeout=timeout_s, check=False)
    seconds = time.perf_counter() - started
    log.write_text(proc.stderr, encoding="utf-8")
    lines = [line for line in proc.stdout.splitlines() if line.startswith("{")]  # the JSON among other output (py-spy)
    try:
        out: dict[str, Any] = json.loads(lines[-1])
    except (json.JSONDecodeError, IndexError):
        raise SystemExit(f"{' '.join(command[:4])} exited {proc.returncode}:\n{proc.stderr[-4000:]}\n"
                         f"{proc.stdout[-1000:]}") from None
    out["returncode"] = proc.returncode
    return out, seconds


def embedded_texts(store: Path) -> dict[str, str]:
    """Embedding-cache key -> text of every vector row the current snapshot pins."""
    import lancedb

    from tmem.llm.cached_embedder import embedding_key
    from tmem.store.snapshot.published import current_snapshot

    info = current_snapshot(store)
    if info is None:
        return {}
    table = lancedb.connect(info.lance_uri).open_table("vectors", version=info.lance_versions["vectors"])
    texts = table.to_arrow().column("text").to_pylist()
    return {embedding_key(EMBED_MODEL, t): t for t in texts}


def cached_keys(store: Path) -> set[str]:
    from tmem.store.duck import open_read_only

    con = open_read_only(store / "work.duckdb", "benchmark")
    try:
        return {str(r[0]) for r in con.execute("SELECT text_hash FROM embedding_cache").fetchall()}
    finally:
        con.close()


def embedding_seconds(texts: list[str], sample: int, seed: int, settings: list[str],
                      layout_sample: int = 0) -> dict[str, Any]:
    """Embed ``texts`` alone, seconds scaled to all: a random sample of at most ``sample`` with
    sentence-transformers in this process at torch's default threads (``in_process``), and all of them
    (``layout_sample`` > 0: a random sample of that many) with the encoder the build uses under
    ``settings`` (``build_layout``: e.g. its pool of encoder processes). ``seconds``, the bound, is the
    faster of the two."""
    from tmem.build.runtime import _embedder, encoder_layout
    from tmem.providers.encoder_process import EncoderPool
    from tmem.providers.sentence_transformer import SentenceTransformerEmbedder
    from tmem.settings import load_settings

    if not texts:
        return {"texts": 0, "seconds": 0.0, "sampled": 0}
    shuffled = random.Random(seed).sample(texts, len(texts))
    chosen = shuffled[:sample]
    layout = shuffled[:layout_sample] if layout_sample > 0 else shuffled
    values = dict(item.split("=", 1) for item in settings)
    build = load_settings(**{k.removeprefix("TMEM_").lower(): v for k, v in values.items()}, embedding_model=EMBED_MODEL)
    result: dict[str, Any] = {"texts": len(texts), "sampled": len(chosen), "layout_sampled": len(layout),
                              "build_layout": dict(zip(("processes", "threads"), encoder_layout(build, worker=False),
                                                       strict=True))}
    for name, embedder, share in (("in_process", SentenceTransformerEmbedder(EMBED_MODEL, batch_size=64), chosen),
                                  ("build_layout", _embedder(build, worker=False), layout)):
        if isinstance(embedder, EncoderPool):
            embedder.start()  # every child, not only the one the warm-up call reaches
        embedder.embed(share[:512])  # load the model and warm up (every child of a pool: a share each)
        started = time.perf_counter()
        embedder.embed(share)
        took = time.perf_counter() - started
        result[f"{name}_sample_seconds"] = round(took, 2)
        result[f"{name}_seconds"] = round(took * len(texts) / len(share), 1)
        if isinstance(embedder, EncoderPool):
            embedder.close()  # its children would otherwise embed beside the next measurement's
    result["seconds"] = min(result["in_process_seconds"], result["build_layout_seconds"])
    return result


def save_state(target: Path, store: Path, home: Path, facts: dict[str, Any], commit: str,
               phases: dict[str, Any]) -> None:
    """The store and Prefect home as the phases so far left them, for ``--from-state`` runs."""
    if target.exists():
        shutil.rmtree(target)
    target.mkdir(parents=True)
    shutil.copytree(store, target / "store", symlinks=True)
    shutil.copytree(home, target / "prefect-home", symlinks=True)
    (target / "state.json").write_text(json.dumps(
        {"archive": facts, "commit": commit, "saved_at": datetime.now(UTC).isoformat(),
         "phases": {k: {f: v.get(f) for f in ("wall_s", "llm_calls", "status")} for k, v in phases.items()}},
        indent=1))
    print(f"  saved the state to {target}", flush=True)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--conversations", type=int, default=1000)
    parser.add_argument("--sessions", type=int, default=3, help="sessions per conversation before the nightly")
    parser.add_argument("--latency-ms", type=float, default=300.0)
    parser.add_argument("--in-flight", type=int, default=64, help="LLM calls in flight, over all processes")
    parser.add_argument("--runner", choices=("threads", "dask"), default="threads")
    parser.add_argument("--workers", type=int, default=2, help="Dask worker processes (--runner dask)")
    parser.add_argument("--database", choices=("sqlite", "postgres"), default="sqlite")
    parser.add_argument("--repo", type=Path, default=REPO, help="the tmem checkout to measure")
    parser.add_argument("--phases", default="first,warm,nochange,nightly")
    parser.add_argument("--embed-sample", type=int, default=3000, help="texts the in-process bound embeds")
    parser.add_argument("--layout-sample", type=int, default=0,
                        help="texts the build-layout bound embeds (0: all the phase's new texts)")
    parser.add_argument("--seed", type=int, default=14)
    parser.add_argument("--timeout-s", type=float, default=4 * 3600)
    parser.add_argument("--label", default=None)
    parser.add_argument("--out", type=Path, default=None)
    parser.add_argument("--keep", action="store_true", help="leave the temporary directory on disk")
    parser.add_argument("--profile", default=None, metavar="PHASES",
                        help="comma-separated phases to run under py-spy (its CPU-busy samples, collapsed stacks in "
                             "<out>.<phase>.pyspy.txt; py-spy must be on PATH); the profiler slows the phase")
    parser.add_argument("--setting", action="append", default=[], metavar="TMEM_NAME=VALUE",
                        help="a tmem setting for the phases (repeatable), e.g. TMEM_EMBEDDING_PROCESSES=0")
    parser.add_argument("--save-state", type=Path, default=None,
                        help="copy the store and Prefect home, as the phases before 'nightly' left them, to this directory")
    parser.add_argument("--from-state", type=Path, default=None,
                        help="start from a --save-state copy (same --conversations/--sessions/--seed) instead of "
                             "ingesting and running 'first'")
    args = parser.parse_args()
    args.repo = args.repo.resolve()
    label = args.label or f"{args.runner}-{args.database}-{args.conversations}"
    out_path = args.out or RESULTS / f"nightly_scale-{label}.json"
    phases = args.phases.split(",")
    profiled = set(args.profile.split(",")) if args.profile else set()
    commit = subprocess.run(["git", "-C", str(args.repo), "rev-parse", "--short", "HEAD"], capture_output=True,
                            text=True, check=False).stdout.strip()
    report: dict[str, Any] = {
        "label": label, "repo": str(args.repo), "commit": commit, "started_at": datetime.now(UTC).isoformat(),
        "machine": machine_info(), "loadavg_start": loadavg(),
        "settings": {k: str(v) if isinstance(v, Path) else v for k, v in vars(args).items() if k not in {"out", "repo"}},
        "phases": {},
    }
    tmp = Path(tempfile.mkdtemp(prefix="tmem-nightly-scale-"))
    tmp.chmod(0o755)  # the postgres user runs its cluster under it
    store, home = tmp / "store", tmp / "prefect-home"
    archive, grown, facts = write_archives(tmp, args.conversations, args.sessions, args.seed)
    report["archive"] = facts
    if args.from_state is not None:
        saved = json.loads((args.from_state / "state.json").read_text())
        if saved["archive"] != facts:
            raise SystemExit(f"{args.from_state}: saved for archive {saved['archive']}, not {facts}")
        if "first" in phases:
            raise SystemExit("--from-state: the first build is in the saved state; leave 'first' out of --phases")
        shutil.copytree(args.from_state / "store", store, symlinks=True)
        shutil.copytree(args.from_state / "prefect-home", home, symlinks=True)
        report["from_state"] = {"dir": str(args.from_state), "saved": saved}
    else:
        home.mkdir()
    print(f"{label}: {facts['conversations']} conversations, {facts['turns']} turns (+{facts['turns_grown'] - facts['turns']} "
          f"in the grown archive); code {args.repo} @ {commit}", flush=True)
    postgres = Postgres(tmp / "postgres") if args.database == "postgres" else None
    server_env = {k: v for k, v in os.environ.items() if not k.startswith("PREFECT_")} | {
        "PREFECT_HOME": str(home), "PREFECT_SERVER_ANALYTICS_ENABLED": "false", "DO_NOT_TRACK": "1",
        "PREFECT_SERVER_DATABASE_CONNECTION_URL": postgres.url if postgres else f"sqlite+aiosqlite:///{home}/prefect.db",
    }
    prefect = PrefectServer(server_env, tmp / "prefect-server.log")
    llm = ScriptedLLM(synth.RESPONDERS, use_registry=False, latency_ms=args.latency_ms).start()
    env = phase_env(args, store, llm.url, prefect.api_url, home)
    python = sys.executable

    # where the cores went during a phase: the phase's process (and what it waited for), this process
    # (the scripted LLM server), the Prefect server, PostgreSQL, and the machine as a whole
    cpu = CpuAccount({"prefect_server": lambda: [prefect.proc.pid], "postgres": lambda: processes_named("postgres")},
                     polled={"encoders": lambda: processes_running("tmem.providers.encoder_process"),
                             # a local Dask cluster's worker processes (multiprocessing spawns them), their own CPU
                             "dask_workers": lambda: processes_running("from multiprocessing.spawn import spawn_main")},
                     own=frozenset({"dask_workers"}))

    def phase(name: str, command: list[str], conversations: int) -> dict[str, Any]:
        before_keys, before_requests, before_api = (cached_keys(store) if (store / "work.duckdb").exists() else set(),
                                                    len(llm.requests), prefect.counts())
        load = loadavg()
        cpu.start()
        if name in profiled:
            command = ["py-spy", "record", "--format", "raw", "--rate", "40", "--subprocesses", "--nonblocking", *(["--gil"] if os.environ.get("BENCH_PYSPY_GIL") else []),
                       "-o", str(out_path.with_suffix(f".{name}.pyspy.txt")), "--", *command]
        out, wall = run(command, env, tmp / f"{name}.log", args.repo, args.timeout_s)
        cpu_s = cpu.stop() | {"wall_x_cores": round(wall * (os.cpu_count() or 1), 1)}
        api = prefect.counts() - before_api
        calls = len(llm.requests) - before_requests
        texts = embedded_texts(store)
        new = [t for k, t in texts.items() if k not in before_keys]
        build = out.get("build", out) if name in {"nochange", "nightly"} else out
        # the bound's measurement has the machine to itself only if nothing else still works after the
        # phase (e.g. the Prefect server's backlog of the phase's events, PostgreSQL): what each group spent
        # while it ran ("self" is the measurement in this process, "encoders" its pool's children)
        cpu.start()
        embedding = embedding_seconds(new, args.embed_sample, args.seed, args.setting, args.layout_sample)
        embedding["cpu_s"] = cpu.stop()
        row: dict[str, Any] = {
            "wall_s": round(wall, 1), "flow_s": (build or {}).get("seconds"), "conversations": conversations,
            "llm_calls": calls, "llm_bound_s": round(calls * args.latency_ms / 1000 / args.in_flight, 1),
            "embedding": embedding,
            "prefect_http": api.get("http", 0), "prefect_ws_messages": api.get("ws_messages", 0),
            "prefect_top": dict(Counter({k: v for k, v in api.items() if k not in {"http", "ws_messages"}}).most_common(8)),
            "status": (build or {}).get("status", "no build"), "returncode": out["returncode"], "loadavg": load,
            "failures": len((build or {}).get("failures", [])),
            # what the build's own embedding queue did (the flow process; on Dask it also serves the workers on
            # its machine, TMEM_DASK_SHARED_ENCODER; a worker with an encoder of its own is not counted)
            "build_embedding": (build or {}).get("embedding"),
            "uptime": subprocess.run(["uptime"], capture_output=True, text=True, check=False).stdout.strip(),
            # CPU seconds during the phase: "children" is the phase's process (with its Dask workers),
            # "self" the benchmark's process serving the scripted LLM, "encoders" the build's encoder
            # children (also inside "children" once waited for), "dask_workers" a local Dask cluster's worker
            # processes without their children (inside "children" too)
            "cpu_s": cpu_s,
        }
        row["bound_s"] = max(row["llm_bound_s"], row["embedding"]["seconds"])
        row["ratio_to_bound"] = round(wall / row["bound_s"], 2) if row["bound_s"] else None
        row["wall_per_conversation_s"] = round(wall / max(1, conversations), 3)
        report["phases"][name] = row
        out_path.parent.mkdir(parents=True, exist_ok=True)
        out_path.write_text(json.dumps(report, indent=1))
        inside = row["build_embedding"] or {}
        print(f"  {name:<9} wall {wall:7.1f} s  calls {calls:6d}  LLM bound {row['llm_bound_s']:6.1f} s  embedding "
              f"{row['embedding']['seconds']:6.1f} s (in process {row['embedding'].get('in_process_seconds', '-')}, "
              f"build's layout {row['embedding'].get('build_layout_seconds', '-')}; {len(new)} texts; in the build {inside.get('model_s', '-')} s for "
              f"{inside.get('texts', '-')})  Prefect {row['prefect_http']} http + "
              f"{row['prefect_ws_messages']} ws  {row['wall_per_conversation_s']:.3f} s/conversation  "
              f"[{row['status']}, load {load[0]}]", flush=True)
        print("            CPU s: " + ", ".join(f"{k} {v}" for k, v in cpu_s.items()), flush=True)
        print("            CPU s while the bound was measured: "
              + ", ".join(f"{k} {v}" for k, v in embedding["cpu_s"].items()), flush=True)
        return row

    try:
        tmem = [python, "-m", "tmem"]
        if args.from_state is None:
            _, seconds = run([*tmem, "ingest", str(archive), "--store", str(store), "--json"], env,
                             tmp / "ingest.log", args.repo, args.timeout_s)
            report["ingest_s"] = round(seconds, 1)
        n = args.conversations
        if "first" in phases:
            phase("first", [*tmem, "build", "--store", str(store), "--json"], n)
        if "warm" in phases:
            phase("warm", [*tmem, "build", "--store", str(store), "--json"], n)
        if "nochange" in phases:
            phase("nochange", [python, "-c", NIGHTLY, str(store)], n)
        if args.save_state is not None:
            save_state(args.save_state, store, home, facts, commit, report["phases"])
        if "nightly" in phases:
            run([*tmem, "ingest", str(grown), "--store", str(store), "--json"], env, tmp / "ingest-grown.log",
                args.repo, args.timeout_s)
            phase("nightly", [python, "-c", NIGHTLY, str(store)], n)
    finally:
        llm.stop()
        prefect.stop()
        if postgres is not None:
            postgres.stop()
        report["loadavg_end"] = loadavg()
        out_path.write_text(json.dumps(report, indent=1))
        if not args.keep:
            shutil.rmtree(tmp, ignore_errors=True)
        else:
            print(f"kept {tmp}")
    print(f"wrote {out_path}")


if __name__ == "__main__":
    main()

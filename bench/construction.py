"""Memory construction cost: a full Prefect build of LoCoMo against the scripted LLM at a fixed latency.

Steps, in a fresh temporary store and Prefect home:
  1. start the scripted OpenAI-compatible server in this process (synth responders, every answer
     delayed by --latency-ms) so that every HTTP request it serves is recorded;
  2. ``python -m tmem ingest locomo10.json``;
  3. cold build: ``python -m tmem build --json [--conversation ID ...]`` in a subprocess (its own
     ephemeral Prefect), timed from outside; the flow also reports its own seconds;
  4. warm build: the same command again; it must make zero LLM calls (answers come from the cache).

Reported: LLM calls per 100 turns by operation (target: total <= 60), prompt/completion tokens,
wall time, structure per 100 turns, and wall time over two lower bounds:
  * critical path = max over conversations of serial(c) x latency, where
      serial(c) = scene_boundaries + scene_pack calls of c   (segmentation: one window after the other)
                + topic_match + topic_create calls of c      (admission: one scene after the other)
                + 2                                          (one item_extract, then one item_triggers)
    since everything else (the other topics' extractions, trigger batches, scene triggers,
    personas) fans out beside that chain. The other chains of c (segmentation + 1 scene_triggers
    call; the per-speaker persona chain) are reported too and are never longer here.
  * throughput = total calls x latency / llm_concurrency (the process-wide cap on calls in flight).
Per-conversation call counts come from the server's recorded requests: each request's input block
(``request_input``) is matched against texts the build stored with their conversation id (turn
id + text, else scene titles/summaries/narratives, topic titles, item contents); a request is
attributed when the conversations holding its matched texts intersect in exactly one. Requests that
do not resolve are counted and reported (none expected).

    HF_HUB_OFFLINE=1 python bench/construction.py [--latency-ms 200] [--llm-concurrency 4]
        [--conversations conv-26 conv-30 ...] [--locomo PATH] [--out PATH] [--keep-store]
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import subprocess
import sys
import tempfile
import time
from collections import Counter, defaultdict
from collections.abc import Iterator
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

from tmem.devtools import synth
from tmem.devtools.responders import input_message, request_input
from tmem.devtools.scripted_llm import RecordedRequest, ScriptedLLM
from tmem.store.duck import connect

REPO = Path(__file__).resolve().parents[1]
DEFAULT_LOCOMO = REPO.parent / "shared" / "datasets" / "locomo" / "locomo10.json"
DEFAULT_OUT = REPO / "bench" / "results" / "construction.json"
OPERATIONS = ("scene_boundaries", "scene_pack", "topic_match", "topic_create", "item_extract", "item_triggers",
              "scene_triggers", "persona")
STRUCTURE_SQL = {
    "turns": "SELECT conversation_id, count(*) FROM turns GROUP BY 1",
    "scenes": "SELECT conversation_id, count(*) FROM scenes GROUP BY 1",
    "topics": "SELECT conversation_id, count(*) FROM topics GROUP BY 1",
    "items": "SELECT conversation_id, count(*) FROM items GROUP BY 1",
    "atomic_items": "SELECT conversation_id, count(*) FROM items WHERE kind = 'atomic' GROUP BY 1",
    "connected_items": "SELECT conversation_id, count(*) FROM items WHERE kind = 'connected' GROUP BY 1",
    "entity_triggers": "SELECT conversation_id, count(*) FROM item_triggers WHERE family = 'entity' GROUP BY 1",
    "bridge_triggers": "SELECT conversation_id, count(*) FROM item_triggers WHERE family = 'bridge' GROUP BY 1",
    "scene_triggers": "SELECT conversation_id, count(*) FROM scene_triggers WHERE family = 'scene' GROUP BY 1",
    "horizon_triggers": "SELECT conversation_id, count(*) FROM scene_triggers "
                        "WHERE family = 'horizon' AND text <> '' GROUP BY 1",
    "personas": "SELECT conversation_id, count(*) FROM personas GROUP BY 1",
}
# Texts the build stores with their conversation id: what a request's input block is matched against.
# (Turns are keyed by id and text together: see attribution_index.)
ATTRIBUTION_SQL = (
    "SELECT conversation_id, title FROM scenes",
    "SELECT conversation_id, summary FROM scenes",
    "SELECT conversation_id, narrative FROM scenes",
    "SELECT conversation_id, title FROM topics",
    "SELECT conversation_id, content FROM items",
)


def run_cli(args: list[str], env: dict[str, str], timeout_s: float, log: Path) -> tuple[dict[str, Any], float]:
    """Run ``python -m tmem ARGS --json``: its JSON output and the wall seconds it took.

    ``tmem build`` exits 1 with a JSON summary when a conversation failed: that summary is
    returned (the report shows the failures); no JSON at all stops the benchmark.
    """
    started = time.perf_counter()
    proc = subprocess.run([sys.executable, "-m", "tmem", *args, "--json"], env=env, cwd=REPO, capture_output=True,
                          text=True, timeout=timeout_s, check=False)
    seconds = time.perf_counter() - started
    log.write_text(proc.stderr, encoding="utf-8")
    try:
        out: dict[str, Any] = json.loads(proc.stdout)
    except json.JSONDecodeError:
        raise SystemExit(
            f"`tmem {' '.join(args)}` exited {proc.returncode}\n{proc.stderr[-4000:]}\n{proc.stdout[-2000:]}"
        ) from None
    # Prefect API errors the run survived or died of (e.g. the ephemeral server's SQLite busy -> 503).
    out["prefect_api_errors"] = sum(1 for line in proc.stderr.splitlines() if "PrefectHTTPStatusError: Server error" in line)
    return out, seconds


def _keys(value: Any) -> Iterator[str]:
    """Matchable keys of an input block: ``turn|id|text`` for dialogue turns, else every bare string."""
    if isinstance(value, str):
        yield value
    elif isinstance(value, dict):
        if isinstance(value.get("id"), str) and isinstance(value.get("text"), str):
            yield f"turn|{value['id']}|{value['text']}"
            return
        for v in value.values():
            yield from _keys(v)
    elif isinstance(value, list):
        for v in value:
            yield from _keys(v)


def attribution_index(store: Path) -> dict[str, frozenset[str]]:
    owners: dict[str, set[str]] = defaultdict(set)
    con = connect(store, read_only=True)
    try:
        for cid, turn_id, text in con.execute("SELECT conversation_id, turn_id, text FROM turns").fetchall():
            owners[f"turn|{turn_id}|{text}"].add(str(cid))
        for sql in ATTRIBUTION_SQL:
            for cid, text in con.execute(sql).fetchall():
                if text:
                    owners[str(text)].add(str(cid))
    finally:
        con.close()
    return {text: frozenset(cids) for text, cids in owners.items()}


def attribute(request: RecordedRequest, index: dict[str, frozenset[str]]) -> str | None:
    """The one conversation holding every stored text the request's input contains, else None.

    A request that carries dialogue turns is matched on its (turn id, text) pairs only: its other
    strings (a persona so far, a scene's title) are model output that may repeat another
    conversation's stored text by chance.
    """
    keys = list(_keys(request_input(request.body)))
    turn_keys = [k for k in keys if k.startswith("turn|")]
    found: frozenset[str] | None = None
    for key in turn_keys or keys:
        owners = index.get(key)
        if owners is not None:
            found = owners if found is None else found & owners
    return next(iter(found)) if found is not None and len(found) == 1 else None


def structure_by_conversation(store: Path) -> dict[str, dict[str, int]]:
    out: dict[str, dict[str, int]] = defaultdict(lambda: dict.fromkeys(STRUCTURE_SQL, 0))
    con = connect(store, read_only=True)
    try:
        for key, sql in STRUCTURE_SQL.items():
            for cid, n in con.execute(sql).fetchall():
                out[str(cid)][key] = int(n)
    finally:
        con.close()
    return dict(out)


def per_100(n: float, turns: int) -> float:
    return round(100.0 * n / turns, 2) if turns else 0.0


def chains(calls: Counter[str], persona_chain: int) -> dict[str, int]:
    seg = calls["scene_boundaries"] + calls["scene_pack"]
    admit = calls["topic_match"] + calls["topic_create"]
    tail = int(calls["item_extract"] > 0) + int(calls["item_triggers"] > 0)
    return {"segmentation": seg, "admission": admit, "serial": seg + admit + tail,
            "scene_trigger_chain": seg + int(calls["scene_triggers"] > 0), "persona_chain": persona_chain}


def machine_info() -> dict[str, Any]:
    def git(*cmd: str) -> str:
        return subprocess.run(["git", *cmd], cwd=REPO, capture_output=True, text=True, check=False).stdout.rstrip()

    # The numbers belong to the working tree as it was: name the uncommitted changes to the build code.
    dirty = git("status", "--porcelain", "--", "tmem", "flows", "tasks").splitlines()
    return {"date": datetime.now(UTC).isoformat(timespec="seconds"), "cpu_count": os.cpu_count(),
            "python": platform.python_version(), "platform": platform.platform(),
            "git_head": git("rev-parse", "--short", "HEAD") or None,
            "uncommitted_build_code": sorted(line[3:] for line in dirty)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--locomo", type=Path, default=DEFAULT_LOCOMO)
    parser.add_argument("--latency-ms", type=float, default=200.0, help="scripted latency per call (default 200)")
    parser.add_argument("--llm-concurrency", type=int, default=4, help="TMEM_LLM_CONCURRENCY (default 4)")
    parser.add_argument("--conversations", nargs="+", metavar="ID", help="build only these (default: all)")
    parser.add_argument("--out", type=Path, default=DEFAULT_OUT)
    parser.add_argument("--timeout-s", type=float, default=3600.0, help="per build command")
    parser.add_argument("--prefect-client-retries", type=int, default=None,
                        help="PREFECT_CLIENT_MAX_RETRIES for the builds (default: Prefect's own, 5); the ephemeral "
                             "server answers 503 while its SQLite is busy, which a loaded machine can make last")
    parser.add_argument("--keep-store", action="store_true", help="leave the temporary store and build logs on disk")
    args = parser.parse_args()
    if not args.locomo.is_file():
        raise SystemExit(f"LoCoMo file not found: {args.locomo}")

    info = machine_info() | {"loadavg_start": [round(x, 2) for x in os.getloadavg()]}
    tmp = Path(tempfile.mkdtemp(prefix="tmem-bench-construction-"))
    store, prefect_home = tmp / "store", tmp / "prefect"
    prefect_home.mkdir()
    server = ScriptedLLM(synth.RESPONDERS, use_registry=False, latency_ms=args.latency_ms).start()
    try:
        env = dict(os.environ) | {
            "TMEM_LLM_BASE_URL": server.url, "TMEM_STORE": str(store),
            "TMEM_LLM_CONCURRENCY": str(args.llm_concurrency), "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1",
            "PREFECT_HOME": str(prefect_home), "PREFECT_SERVER_ANALYTICS_ENABLED": "false", "DO_NOT_TRACK": "1",
        }
        # On a loaded shared machine the ephemeral Prefect server can take longer than its default 20 s to start.
        env.setdefault("PREFECT_SERVER_EPHEMERAL_STARTUP_TIMEOUT_SECONDS", "120")
        if args.prefect_client_retries is not None:
            env["PREFECT_CLIENT_MAX_RETRIES"] = str(args.prefect_client_retries)
        ingest, ingest_s = run_cli(["ingest", str(args.locomo), "--store", str(store)], env, args.timeout_s,
                                   tmp / "ingest.log")
        print(f"ingested {ingest['conversations']} conversations, {ingest['turns']} turns in {ingest_s:.1f} s; "
              f"building at {args.latency_ms:g} ms/call, llm concurrency {args.llm_concurrency} ...", flush=True)
        build_args = ["build", "--store", str(store)]
        for cid in args.conversations or []:
            build_args += ["--conversation", cid]
        server.reset()
        cold, cold_s = run_cli(build_args, env, args.timeout_s, tmp / "cold-build.log")
        cold_requests = server.requests
        print(f"cold build: {cold['status']}, {cold['llm_calls']} calls, {cold_s:.1f} s", flush=True)
        server.reset()
        warm, warm_s = run_cli(build_args, env, args.timeout_s, tmp / "warm-build.log")
        warm_requests = server.requests
        print(f"warm build: {warm['status']}, {warm['llm_calls']} calls, {warm_s:.1f} s", flush=True)
        index = attribution_index(store)
        structure = structure_by_conversation(store)
    except BaseException:
        print(f"store and build logs kept in {tmp}", file=sys.stderr)
        raise
    finally:
        server.stop()
    info["loadavg_end"] = [round(x, 2) for x in os.getloadavg()]
    if not args.keep_store:
        import shutil

        shutil.rmtree(tmp, ignore_errors=True)

    report = analyse(args, cold, cold_s, cold_requests, warm, warm_s, warm_requests, index, structure)
    report["machine"] = info
    report["store"] = str(tmp) if args.keep_store else None
    print_table(report)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(report, indent=2) + "\n", encoding="utf-8")
    print(f"wrote {args.out}")
    if cold["status"] != "completed" or warm["status"] != "completed" or warm["llm_calls"] != 0 or warm_requests:
        raise SystemExit("FAILED: a build was incomplete or the warm build made LLM calls (see the report)")


def analyse(args: argparse.Namespace, cold: dict[str, Any], cold_s: float, cold_requests: list[RecordedRequest],
            warm: dict[str, Any], warm_s: float, warm_requests: list[RecordedRequest],
            index: dict[str, frozenset[str]], structure: dict[str, dict[str, int]]) -> dict[str, Any]:
    built: list[str] = sorted(cold["conversations_built"])
    turns = sum(structure[c]["turns"] for c in built)
    latency_s = args.latency_ms / 1000.0
    ok = [r for r in cold_requests if r.status == 200]
    calls_by_conv: dict[str, Counter[str]] = defaultdict(Counter)
    persona_calls: dict[tuple[str, str], int] = Counter()
    unattributed: Counter[str] = Counter()
    for request in ok:
        cid = attribute(request, index)
        if cid is None:
            unattributed[request.operation] += 1
            continue
        calls_by_conv[cid][request.operation] += 1
        if request.operation == "persona":
            persona_calls[(cid, str(request_input(request.body).get("speaker")))] += 1
    per_conv: dict[str, dict[str, Any]] = {}
    for cid in built:
        calls = calls_by_conv[cid]
        persona_chain = max((n for (c, _), n in persona_calls.items() if c == cid), default=0)
        per_conv[cid] = {"turns": structure[cid]["turns"], "calls": sum(calls.values()),
                         "calls_by_operation": dict(sorted(calls.items())), **chains(calls, persona_chain)}
    slowest = max(built, key=lambda c: per_conv[c]["serial"])
    serial = per_conv[slowest]["serial"]
    longest_other = max(max(v["scene_trigger_chain"], v["persona_chain"]) for v in per_conv.values())
    usage = cold["usage_by_operation"]
    total_calls = int(cold["llm_calls"])
    critical_s = serial * latency_s
    throughput_s = total_calls * latency_s / args.llm_concurrency
    binding_s = max(critical_s, throughput_s)
    flow_s = float(cold["seconds"])
    structure_keys = [k for k in STRUCTURE_SQL if k != "turns"]
    totals = {k: sum(structure[c][k] for c in built) for k in structure_keys}
    return {
        "benchmark": "construction",
        "settings": {"latency_ms": args.latency_ms, "llm_concurrency": args.llm_concurrency,
                     "conversations": built, "locomo": str(args.locomo), "llm": "scripted (tmem.devtools.synth)",
                     "prefect_client_max_retries": args.prefect_client_retries or "prefect default (5)"},
        "turns": turns,
        "status": cold["status"],
        "failures": cold["failures"],
        "llm_calls": {
            "total": total_calls, "per_100_turns": per_100(total_calls, turns), "target_per_100_turns": 60,
            "by_operation": {op: {"calls": u["calls"], "per_100_turns": per_100(u["calls"], turns)}
                             for op, u in sorted(usage.items())},
            "http_requests_served": len(cold_requests), "http_requests_failed": len(cold_requests) - len(ok),
            "attributed_to_conversations": sum(sum(c.values()) for c in calls_by_conv.values()),
            # the same operation asked the same input twice in one build (a cache that did not hold)
            "duplicate_requests": len(ok) - len({(r.operation, input_message(r.body)) for r in ok}),
            "reasks": sum(1 for r in ok if any(m.get("role") == "assistant" for m in r.body.get("messages", []))),
        },
        "tokens": {
            "prompt": cold["prompt_tokens"], "completion": cold["completion_tokens"],
            "prompt_per_100_turns": per_100(cold["prompt_tokens"], turns),
            "completion_per_100_turns": per_100(cold["completion_tokens"], turns),
            "by_operation": {op: {"prompt": u["prompt_tokens"], "completion": u["completion_tokens"]}
                             for op, u in sorted(usage.items())},
        },
        "structure": {"totals": totals, "per_100_turns": {k: per_100(v, turns) for k, v in totals.items()}},
        "time": {
            "cold_command_s": round(cold_s, 2), "cold_flow_s": round(flow_s, 2),
            "warm_command_s": round(warm_s, 2), "warm_flow_s": round(float(warm["seconds"]), 2),
            "warm_llm_calls": warm["llm_calls"], "warm_cache_hits": warm["llm_cache_hits"],
            "warm_http_requests": len(warm_requests), "warm_status": warm["status"],
            "warm_failures": warm["failures"],
            "prefect_api_error_lines": {"cold": cold["prefect_api_errors"], "warm": warm["prefect_api_errors"]},
        },
        "critical_path": {
            "definition": "serial(c) = scene_boundaries + scene_pack + topic_match + topic_create calls of c "
                          "+ 1 item_extract + 1 item_triggers; bound = max_c serial(c) x latency",
            "slowest_conversation": slowest, "serial_calls": serial,
            "longest_other_chain_calls": longest_other,
            "bound_s": round(critical_s, 2),
            "ratio_flow": round(flow_s / critical_s, 2), "ratio_command": round(cold_s / critical_s, 2),
            "throughput_bound_s": round(throughput_s, 2),
            "binding_bound_s": round(binding_s, 2),
            "ratio_flow_to_binding": round(flow_s / binding_s, 2),
            "attribution": "server-recorded requests matched to conversations by the stored texts in their input",
            "unattributed_requests": dict(unattributed),
        },
        "per_conversation": per_conv,
    }


def print_table(r: dict[str, Any]) -> None:
    s, calls, tok, t, cp = r["settings"], r["llm_calls"], r["tokens"], r["time"], r["critical_path"]
    m = r["machine"]
    print(f"\nconstruction benchmark: {len(s['conversations'])} conversations, {r['turns']} turns, "
          f"latency {s['latency_ms']:g} ms, llm concurrency {s['llm_concurrency']}, status {r['status']}")
    print(f"machine: {m['cpu_count']} CPUs, load avg {m['loadavg_start']} -> {m['loadavg_end']}, "
          f"python {m['python']}, {m['date']}")
    print(f"\n{'operation':<18} {'calls':>6} {'/100 turns':>11} {'prompt tok':>11} {'compl tok':>10}")
    for op, u in calls["by_operation"].items():
        print(f"{op:<18} {u['calls']:>6} {u['per_100_turns']:>11.2f} {tok['by_operation'][op]['prompt']:>11} "
              f"{tok['by_operation'][op]['completion']:>10}")
    print(f"{'total':<18} {calls['total']:>6} {calls['per_100_turns']:>11.2f} {tok['prompt']:>11} "
          f"{tok['completion']:>10}   (target <= {calls['target_per_100_turns']} calls/100 turns)")
    print(f"{'per 100 turns':<18} {'':>6} {'':>11} {tok['prompt_per_100_turns']:>11.0f} "
          f"{tok['completion_per_100_turns']:>10.0f}")
    print(f"\n{'structure':<18} {'total':>6} {'/100 turns':>11}")
    for key, n in r["structure"]["totals"].items():
        print(f"{key:<18} {n:>6} {r['structure']['per_100_turns'][key]:>11.2f}")
    print(f"\ncold build: {t['cold_command_s']:.1f} s command ({t['cold_flow_s']:.1f} s inside the flow)")
    print(f"warm build: {t['warm_command_s']:.1f} s command ({t['warm_flow_s']:.1f} s flow), "
          f"{t['warm_llm_calls']} LLM calls, {t['warm_cache_hits']} cache hits")
    print(f"critical path: {cp['slowest_conversation']} {cp['serial_calls']} serial calls -> {cp['bound_s']:.1f} s; "
          f"wall/critical = {cp['ratio_flow']:.2f} (flow), {cp['ratio_command']:.2f} (command)")
    print(f"throughput bound: {calls['total']} calls x latency / {s['llm_concurrency']} = "
          f"{cp['throughput_bound_s']:.1f} s; flow / max(bounds) = {cp['ratio_flow_to_binding']:.2f}")
    if t["warm_failures"] or r["failures"]:
        print(f"FAILURES cold: {[f['conversation_id'] + ': ' + f['message'][:90] for f in r['failures']]}")
        print(f"FAILURES warm: {[f['conversation_id'] + ': ' + f['message'][:90] for f in t['warm_failures']]}")
    if cp["unattributed_requests"]:
        print(f"unattributed requests: {cp['unattributed_requests']}")
    print(f"\n{'conversation':<12} {'turns':>6} {'calls':>6} {'seg':>5} {'admit':>6} {'serial':>7}")
    for cid, c in r["per_conversation"].items():
        print(f"{cid:<12} {c['turns']:>6} {c['calls']:>6} {c['segmentation']:>5} {c['admission']:>6} {c['serial']:>7}")


if __name__ == "__main__":
    main()

"""The query load of the soak test (tests/test_soak.py): threads posting ``/search`` until told to stop.

Used in the test process (threads) and as a second OS process::

    python -m tests.soak_client --url URL --plan PLAN.json --out OUT.jsonl --stop STOPFILE [--threads 2]

``PLAN.json`` is a list of ``{"conversation_id", "query", "embed"}`` requests; each thread walks it
from its own offset. Every response becomes one :class:`Observation` (status, snapshot id, the
scene/item/turn ids it returned, latency); the process writes them as JSON Lines when the stop
file appears. Transport errors are observations too (status 0), never skipped.
"""

from __future__ import annotations

import argparse
import json
import sys
import threading
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import httpx


@dataclass(frozen=True)
class Observation:
    source: str  # "thread-2", "process-0"
    conversation_id: str
    status: int  # 0: transport error
    snapshot_id: str | None
    scene_ids: tuple[str, ...]
    item_ids: tuple[str, ...]
    source_scene_ids: tuple[str, ...]  # scenes the returned items cite
    turn_ids: tuple[str, ...]
    latency_ms: float
    error: str | None = None

    @classmethod
    def from_dict(cls, raw: dict[str, Any]) -> Observation:
        ids = {k: tuple(str(x) for x in raw[k]) for k in ("scene_ids", "item_ids", "source_scene_ids", "turn_ids")}
        return cls(
            source=str(raw["source"]), conversation_id=str(raw["conversation_id"]), status=int(raw["status"]),
            snapshot_id=raw["snapshot_id"], latency_ms=float(raw["latency_ms"]), error=raw["error"], **ids,
        )


def observe(source: str, request: dict[str, Any], response: httpx.Response | None, latency_ms: float,
            error: str | None = None) -> Observation:
    cid = str(request["conversation_id"])
    if response is None:
        return Observation(source, cid, 0, None, (), (), (), (), latency_ms, error)
    try:
        body = response.json()
    except ValueError:
        body = {}
    if response.status_code != 200 or not isinstance(body, dict):
        return Observation(source, cid, response.status_code, None, (), (), (), (), latency_ms, response.text[:200])
    scenes = body.get("scenes", [])
    items = body.get("items", [])
    return Observation(
        source=source,
        conversation_id=str(body.get("conversation_id")),
        status=200,
        snapshot_id=body.get("snapshot_id"),
        scene_ids=tuple(s["scene_id"] for s in scenes),
        item_ids=tuple(i["item_id"] for i in items),
        source_scene_ids=tuple(sid for i in items for sid in i["source_scene_ids"]),
        turn_ids=tuple(t["turn_id"] for s in scenes for t in s["turns"]),
        latency_ms=latency_ms,
    )


def query_loop(url: str, plan: list[dict[str, Any]], offset: int, source: str, stop: Callable[[], bool],
               sink: Callable[[Observation], None], *, interval_s: float = 0.0,
               headers: dict[str, str] | None = None) -> None:
    """Post ``plan`` round-robin (starting at ``offset``) until ``stop()``; every outcome to ``sink``.

    ``interval_s`` paces the loop (one request per interval at most), so the clients leave CPU
    to the builds running beside them on a small machine."""
    n = offset
    next_at = time.perf_counter()
    with httpx.Client(base_url=url, timeout=30, headers=headers) as client:
        while not stop():
            next_at += interval_s
            if (wait := next_at - time.perf_counter()) > 0:
                time.sleep(wait)
            request = plan[n % len(plan)]
            n += 1
            started = time.perf_counter()
            try:
                response: httpx.Response | None = client.post("/search", json=request)
                error = None
            except httpx.HTTPError as exc:
                response, error = None, f"{type(exc).__name__}: {exc}"
            sink(observe(source, request, response, (time.perf_counter() - started) * 1000, error))


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--url", required=True)
    parser.add_argument("--plan", type=Path, required=True)
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--stop", type=Path, required=True, help="stop once this file exists")
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--interval-s", type=float, default=0.0, help="per thread, at most one request per interval")
    args = parser.parse_args(argv)
    plan = json.loads(args.plan.read_text(encoding="utf-8"))
    observations: list[Observation] = []
    lock = threading.Lock()

    def sink(obs: Observation) -> None:
        with lock:
            observations.append(obs)

    def stop() -> bool:
        return bool(args.stop.exists())

    threads = [
        threading.Thread(target=query_loop, args=(args.url, plan, 7919 * (i + 1), f"process-{i}", stop, sink),
                         kwargs={"interval_s": args.interval_s})
        for i in range(args.threads)
    ]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    with args.out.open("w", encoding="utf-8") as out:
        for obs in observations:
            out.write(json.dumps(asdict(obs)) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())

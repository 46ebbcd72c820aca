"""Build a LoCoMo memory store with the scripted LLM (for query benchmarks), or reuse one.

The scripted OpenAI-compatible server (``tmem.devtools.scripted_llm`` with the deterministic
``synth`` responders) runs in this process on 127.0.0.1; ``tmem ingest`` and ``tmem build`` run as
subprocesses in an ephemeral Prefect home. Embeddings are the configured local MiniLM.

    HF_HUB_OFFLINE=1 python bench/locomo_store.py STORE_DIR [--locomo PATH] [--llm-concurrency 8]
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from tmem.devtools import synth
from tmem.devtools.scripted_llm import ScriptedLLM

REPO = Path(__file__).resolve().parents[1]
DEFAULT_LOCOMO = REPO.parent / "shared" / "datasets" / "locomo" / "locomo10.json"


def _cli(args: list[str], env: dict[str, str], log: Path, timeout_s: float) -> dict[str, Any]:
    proc = subprocess.run([sys.executable, "-m", "tmem", *args, "--json"], env=env, cwd=REPO, capture_output=True,
                          text=True, timeout=timeout_s, check=False)
    log.write_text(proc.stderr, encoding="utf-8")
    try:
        out: dict[str, Any] = json.loads(proc.stdout)
    except json.JSONDecodeError:
        raise SystemExit(f"`tmem {' '.join(args)}` exited {proc.returncode}\n{proc.stderr[-4000:]}") from None
    if proc.returncode != 0 and not out.get("failures"):
        raise SystemExit(f"`tmem {' '.join(args)}` exited {proc.returncode}: {json.dumps(out)[:2000]}")
    return out


def build_locomo_store(store: Path, locomo: Path = DEFAULT_LOCOMO, *, llm_concurrency: int = 8,
                       timeout_s: float = 3600.0, build_retries: int = 3) -> dict[str, Any]:
    """Ingest ``locomo`` into ``store`` and build + publish its memory; returns build facts."""
    store.parent.mkdir(parents=True, exist_ok=True)
    work = Path(tempfile.mkdtemp(prefix="tmem-bench-locomo-"))
    prefect_home = work / "prefect"
    prefect_home.mkdir()
    server = ScriptedLLM(synth.RESPONDERS, use_registry=False).start()
    try:
        env = dict(os.environ) | {
            "TMEM_LLM_BASE_URL": server.url, "TMEM_STORE": str(store), "TMEM_LLM_CONCURRENCY": str(llm_concurrency),
            "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1", "PREFECT_HOME": str(prefect_home),
            "PREFECT_SERVER_ANALYTICS_ENABLED": "false", "DO_NOT_TRACK": "1",
            "PREFECT_SERVER_EPHEMERAL_STARTUP_TIMEOUT_SECONDS": "180",
        }
        started = time.perf_counter()
        _cli(["ingest", str(locomo), "--store", str(store)], env, work / "ingest.log", timeout_s)
        ingest_s = time.perf_counter() - started
        built = _cli(["build", "--store", str(store)], env, work / "build.log", timeout_s)
        # On a loaded machine Prefect's ephemeral API server can answer 503 and fail a conversation;
        # build those again (answers already made come from the LLM cache).
        for attempt in range(build_retries):
            failed = [f["conversation_id"] for f in built.get("failures", [])]
            if not failed:
                break
            args = ["build", "--store", str(store)]
            for cid in failed:
                args += ["--conversation", cid]
            built = _cli(args, env, work / f"build-retry{attempt + 1}.log", timeout_s)
        if built.get("failures"):
            raise SystemExit(f"building {store} failed: {json.dumps(built['failures'])[:2000]}")
        build_s = time.perf_counter() - started - ingest_s
    finally:
        server.stop()
    return {"store": str(store), "work_dir": str(work), "ingest_s": round(ingest_s, 1), "build_s": round(build_s, 1),
            "snapshot_id": built.get("snapshot_id"), "llm_calls": built.get("llm_calls"),
            "scenes": built.get("scenes"), "topics": built.get("topics"), "items": built.get("items")}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("store", type=Path)
    parser.add_argument("--locomo", type=Path, default=DEFAULT_LOCOMO)
    parser.add_argument("--llm-concurrency", type=int, default=8)
    args = parser.parse_args()
    print(json.dumps(build_locomo_store(args.store, args.locomo, llm_concurrency=args.llm_concurrency), indent=1))


if __name__ == "__main__":
    main()

"""Incremental construction == full construction, under the Prefect harness (issue 7, point 1).

"Same memory" is :mod:`tmem.store.memory_image`: every memory table's rows of the conversation
(all columns) and its vector rows (ids, owners, views, texts; vectors within 1e-5) in the
published snapshot. The property: with the deterministic scripted LLM, ingesting sessions 1..k,
building, ingesting k+1..N and building with ``only_changed`` publishes the same memory as
building 1..N in a fresh store — and the incremental build never repeats a request.
"""

from __future__ import annotations

import os
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest

from tests.flow_helpers import ingest_slice, published, set_llm_env
from tmem.devtools.scripted_llm import ScriptedLLM
from tmem.store.memory_image import diff_images, memory_image
from tmem.store.snapshot.published import read_snapshot

pytestmark = [pytest.mark.prefect, pytest.mark.slow]

A, B = "conv-30", "conv-26"  # A grows; B is ingested once and never changes


@dataclass
class Builds:
    root: Path
    server: ScriptedLLM
    summaries: dict[str, dict[str, Any]]
    requests: dict[str, list[str]]  # build name -> request bodies it sent

    def run(self, name: str, store: Path, sessions: dict[str, int], only_changed: bool) -> dict[str, Any]:
        from tmem.flows.build_memory import build_memory

        ingest_slice(store, self.root / f"{name}.json", sessions)
        before = len(self.server.requests)
        out: dict[str, Any] = build_memory(store=str(store), only_changed=only_changed, label=name)
        assert out["status"] == "completed", out["failures"]
        self.summaries[name] = out
        self.requests[name] = [repr(r.body["messages"]) for r in self.server.requests[before:]]
        return out


@pytest.fixture(scope="module")
def builds(prefect_harness: None, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Builds]:
    root = tmp_path_factory.mktemp("incremental")
    server = ScriptedLLM().start()
    try:
        with pytest.MonkeyPatch.context() as mp:
            for name in [n for n in os.environ if n.startswith(("TMEM_", "OPENAI_"))]:
                mp.delenv(name)
            set_llm_env(mp, server)
            b = Builds(root, server, {}, {})
            chain = root / "chain"
            b.run("chain-1", chain, {A: 1, B: 1}, only_changed=False)
            b.run("chain-2", chain, {A: 2, B: 1}, only_changed=True)
            b.run("chain-3", chain, {A: 3, B: 1}, only_changed=True)
            b.run("full-2", root / "full-2", {A: 2}, only_changed=False)
            b.run("full-3", root / "full-3", {A: 3}, only_changed=False)
            yield b
    finally:
        server.stop()


@pytest.mark.parametrize(
    ("incremental", "full"), [("chain-2", "full-2"), ("chain-3", "full-3")], ids=["k=1,N=2", "k=2,N=3 (after k=1)"]
)
def test_incremental_build_publishes_the_same_memory_as_a_full_build(
    builds: Builds, incremental: str, full: str
) -> None:
    store = builds.root / "chain"
    # The snapshot this build published (chain-2's was superseded by chain-3's, and is still on disk).
    inc_image = memory_image(read_snapshot(store, builds.summaries[incremental]["snapshot_id"]), A)
    full_image = memory_image(published(builds.root / full), A)

    assert diff_images(inc_image, full_image) == []
    assert inc_image.rows["scenes"] and inc_image.rows["items"] and inc_image.rows["item_triggers"]
    assert sum(len(k) for k in inc_image.vector_keys.values()) > 0


def test_incremental_builds_rebuild_only_the_changed_conversation_and_never_repeat_a_request(
    builds: Builds,
) -> None:
    for name, earlier in (("chain-2", ["chain-1"]), ("chain-3", ["chain-1", "chain-2"])):
        summary = builds.summaries[name]
        assert summary["conversations_built"] == [A], name
        asked_before = {body for e in earlier for body in builds.requests[e]}
        repeated = [body for body in builds.requests[name] if body in asked_before]
        assert repeated == [], f"{name} re-asked {len(repeated)} requests answered by an earlier build"
        assert summary["llm_cache_hits"] > 0, name  # the unchanged prefix came from the cache
    # Adding a session costs less than building from scratch.
    assert builds.summaries["chain-2"]["llm_calls"] < builds.summaries["full-2"]["llm_calls"]
    assert builds.summaries["chain-3"]["llm_calls"] < builds.summaries["full-3"]["llm_calls"]
    # B never changed: built once, then left alone, and still published unchanged.
    assert builds.summaries["chain-1"]["conversations_built"] == sorted([A, B])
    first = memory_image(read_snapshot(builds.root / "chain", builds.summaries["chain-1"]["snapshot_id"]), B)
    assert diff_images(memory_image(published(builds.root / "chain"), B), first) == []

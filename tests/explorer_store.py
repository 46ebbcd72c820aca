"""A published store for the explorer tests: themed conversations (some with hostile ids), build
records and quarantine written by the store's own functions before the publish, and turns
ingested after a conversation's build.

- ``conv-a`` (mark ``alpha``) and ``conv-b`` (``beta``; two turns ingested after its build);
- :data:`HOSTILE` ids, each its own conversation marked ``qzx<n>mark`` (tests/test_isolation.py's
  scheme), among them near misses of ``conv-a``;
- ``conv-q``: ingested, never built — quarantined by ``run-old``, so it has no published memory;
- runs: ``run-older`` (failed), ``run-old`` (partial: conv-q quarantined), ``run-test`` (running:
  the one whose publish made the snapshot; query_store.publish records its builds).
"""

from __future__ import annotations

from dataclasses import dataclass
from datetime import timedelta
from pathlib import Path

from tests.query_store import NOW, Conv, HashEmbedder, ingest_turns, make_conv, publish
from tmem.domain import Turn
from tmem.errors import LLMOutputError
from tmem.store.duck import connect
from tmem.store.quarantine import clear_quarantine, record_quarantine
from tmem.store.runs import finish_run, start_run
from tmem.store.snapshot.published import SnapshotInfo

HOSTILE = (
    "it's <script>window.__pwned = 1</script>",
    'x" onmouseover="window.__pwned=1',
    "<img src=x onerror=window.__pwned=1>",
    "conv-a ",  # a near miss: trailing space
    "../conv-a",
    "50% off/_",
    "nul\x00byte\u202e",
)
RAW_OUTPUT = '{"closed": "not a list of scenes <b>bold</b>"}'
LATE_TURNS = 2


@dataclass(frozen=True)
class ExplorerStore:
    path: Path
    convs: dict[str, Conv]  # published conversations by id
    info: SnapshotInfo

    def mark(self, conversation_id: str) -> str:
        return MARKS[conversation_id]


MARKS = {"conv-a": "alpha", "conv-b": "beta", **{cid: f"qzx{n}mark" for n, cid in enumerate(HOSTILE)}}


def _late_turns(conv: Conv, n: int) -> tuple[Turn, ...]:
    last = conv.turns[-1]
    return tuple(
        Turn(conversation_id=conv.conversation_id, session_id="S99", turn_id=f"L{k}", seq=last.seq + 1 + k,
             speaker=last.speaker, text=f"late turn {k} about the harvest", event_time=last.event_time + timedelta(days=30))
        for k in range(n)
    )


def build_explorer_store(path: Path, *, hostile: bool = True) -> ExplorerStore:
    ids = ["conv-a", "conv-b", *(HOSTILE if hostile else ())]
    convs = {cid: make_conv(cid, mark=MARKS[cid], scenes=6 if cid.startswith("conv-") else 3, items_per_scene=2)
             for cid in ids}
    late_b = Conv(convs["conv-b"].memory, convs["conv-b"].turns + _late_turns(convs["conv-b"], LATE_TURNS))
    quarantined = make_conv("conv-q", mark="qmark", scenes=2, turns_per_scene=2)  # ingested, never built
    ingest_turns(path, [late_b if c is convs["conv-b"] else c for c in convs.values()] + [quarantined])
    con = connect(path)
    try:
        earlier = NOW - timedelta(days=2)
        start_run(con, "run-older", {"label": "all", "conversation_ids": ["conv-b"]}, earlier)
        record_quarantine(con, "run-older", "conv-b", LLMOutputError("topic_match", "conv-b scene 1", "bad ids"), earlier)
        finish_run(con, "run-older", status="failed", counts={}, usage={"llm_calls": 4},
                   failures=[{"conversation_id": "conv-b", "error_type": "LLMOutputError", "message": "bad ids",
                              "operation": "topic_match", "quarantined": True}], snapshot_id=None, at=earlier)
        old = NOW - timedelta(days=1)
        start_run(con, "run-old", {"label": "all", "conversation_ids": ["conv-b", "conv-q"], "only_changed": True}, old)
        record_quarantine(con, "run-old", "conv-q", LLMOutputError(
            "scene_boundaries", "conv-q turns D1:1-D2:2", "closed: input should be a valid list", raw_output=RAW_OUTPUT,
            input_digest="d" * 64, input_excerpt="<input>\nqmark turns"), old)
        clear_quarantine(con, "conv-b", "run-old", old)
        finish_run(con, "run-old", status="partial", counts={"scenes": 6}, usage={
            "llm_calls": 12, "llm_cache_hits": 3, "prompt_tokens": 3400, "completion_tokens": 560},
            failures=[{"conversation_id": "conv-q", "error_type": "LLMOutputError", "message": "closed: ...",
                       "operation": "scene_boundaries", "quarantined": True}], snapshot_id=None, at=old)
        start_run(con, "run-test", {"label": "all", "conversation_ids": ids}, NOW)
    finally:
        con.close()
    info = publish(path, list(convs.values()), HashEmbedder())
    return ExplorerStore(path, convs, info)

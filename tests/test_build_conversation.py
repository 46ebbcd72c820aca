"""One conversation's build in the library (tmem/build/conversation.py), without Prefect: the stage
cache answers a rebuild without running a unit, a unit that quarantined runs again next build, a
failing unit is retried twice and then fails the conversation, and the progress events name every
stage. The chat model is the typed fake with synth's answers, uncached, so every call it records is
a unit that ran."""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from tests.fakes import FakeChatModel
from tests.flow_helpers import ingest_slice
from tests.query_store import HashEmbedder
from tmem.build.conversation import build_conversation
from tmem.build.runtime import BuildRuntime
from tmem.build.spec import BuildSpec, build_fingerprint
from tmem.build.stages import RETRY_DELAYS_S, StageEvent
from tmem.errors import LLMTransportError
from tmem.settings import load_settings
from tmem.store.duck import connect
from tmem.store.stage_cache import StageCache

CID = "conv-30"  # Jon and Gina, session 1
STAGES = ["segment", "topics", "items", "persona", "item-triggers", "scene-triggers", "embed"]


@dataclass
class Events:
    done: list[StageEvent] = field(default_factory=list)
    retries: list[tuple[str, int, str, float]] = field(default_factory=list)

    def stage_done(self, event: StageEvent) -> None:
        self.done.append(event)

    def stage_retry(self, conversation_id: str, stage: str, unit: str, attempt: int, error: BaseException,
                    delay_s: float) -> None:
        self.retries.append((stage, attempt, type(error).__name__, delay_s))


@pytest.fixture
def store(tmp_path: Path) -> Iterator[Path]:
    root = tmp_path / "store"
    ingest_slice(root, tmp_path / "slice.json", {CID: 1})
    yield root


def runtime(store: Path, chat: FakeChatModel) -> BuildRuntime:
    settings = load_settings(store=store)
    return BuildRuntime(spec=BuildSpec.resolve(store, settings), settings=settings, run_id="r1", con=connect(store),
                        chat=chat, embedder=HashEmbedder(), stages=StageCache.of_store(store),
                        fingerprint=build_fingerprint(settings, chat.model_name))


def test_a_rebuild_of_the_same_turns_runs_no_unit_and_gives_the_same_memory(store: Path) -> None:
    chat = FakeChatModel()
    rt = runtime(store, chat)
    first_events, again_events = Events(), Events()
    try:
        first = build_conversation(rt, CID, first_events)
        calls = len(chat.calls)
        again = build_conversation(rt, CID, again_events)
    finally:
        rt.con.close()
    assert calls > 0 and first.memory.items and first.memory.item_triggers and len(first.memory.personas) == 2
    assert len(chat.calls) == calls  # every unit came from the stage cache
    assert again.memory == first.memory  # decoded from JSON: the same objects
    assert [(v.row_id, v.text) for v in again.vectors] == [(v.row_id, v.text) for v in first.vectors]
    assert [e.stage for e in first_events.done] == STAGES == [e.stage for e in again_events.done]
    assert all(e.cached == 0 for e in first_events.done)
    assert all(e.cached == e.units for e in again_events.done if e.stage != "embed")  # the embedder's own cache
    assert next(e for e in first_events.done if e.stage == "segment").detail == f"{len(first.memory.scenes)} scenes"


def test_a_unit_that_quarantined_runs_again_in_the_next_build_and_only_it(store: Path) -> None:
    def broken_persona(operation: str, request: dict[str, Any]) -> str:
        return '{"identity": 7}'  # valid JSON, never the schema

    chat = FakeChatModel({"persona": broken_persona})
    rt = runtime(store, chat)
    try:
        first = build_conversation(rt, CID, Events())
        before = chat.counts()
        second = build_conversation(rt, CID, Events())
    finally:
        rt.con.close()
    assert {u.unit_kind for u in first.quarantined} == {"speaker"} and not first.memory.personas
    assert {u.unit_id for u in first.quarantined} == {"Jon", "Gina"}
    assert len(second.quarantined) == 2
    asked_again = chat.counts() - before
    assert set(asked_again) == {"persona"} and asked_again["persona"] == before["persona"]


def test_a_failing_unit_is_retried_twice_and_then_fails_the_conversation(store: Path) -> None:
    failures = {"left": 2}

    def flaky(operation: str, request: dict[str, Any]) -> str:
        from tmem.devtools import synth

        if failures["left"] > 0:
            failures["left"] -= 1
            raise LLMTransportError(operation, "test", "endpoint down")
        return synth.scene_boundaries(operation, request)

    slept: list[float] = []
    chat = FakeChatModel({"scene_boundaries": flaky})
    rt = runtime(store, chat)
    events = Events()
    try:
        built = build_conversation(rt, CID, events, sleep=slept.append)
        assert built.memory.scenes
        assert events.retries == [("segment", 1, "LLMTransportError", RETRY_DELAYS_S[0]),
                                  ("segment", 2, "LLMTransportError", RETRY_DELAYS_S[1])]
        assert slept == list(RETRY_DELAYS_S)

        failures["left"] = 99
        rt.stages.root.rename(rt.stages.root.with_name("forgotten"))  # nothing cached: segmentation must run
        with pytest.raises(LLMTransportError, match="endpoint down"):
            build_conversation(rt, CID, Events(), sleep=slept.append)
        assert failures["left"] == 99 - 3  # three attempts, no more
    finally:
        rt.con.close()


def test_a_conversation_grown_by_a_session_embeds_only_its_new_texts(store: Path, tmp_path: Path) -> None:
    """A nightly rebuilds a grown conversation over all its turns; the embedder is asked only for the
    texts its previous build did not embed (everything else comes from the embedding cache)."""
    from tests.test_embed import CountingEmbedder
    from tmem.llm.cached_embedder import CachedEmbedder
    from tmem.store.embed_cache import DuckEmbeddingCache

    chat, counting = FakeChatModel(), CountingEmbedder(HashEmbedder())
    rt = runtime(store, chat)
    rt = BuildRuntime(spec=rt.spec, settings=rt.settings, run_id=rt.run_id, con=rt.con, chat=chat,
                      embedder=CachedEmbedder(counting, DuckEmbeddingCache(rt.con)), stages=rt.stages,
                      fingerprint=rt.fingerprint)
    try:
        first = build_conversation(rt, CID)
        first_texts = {v.text for v in first.vectors}
        assert counting.texts_embedded == len(first_texts)
        counting.calls.clear()
        ingest_slice(store, tmp_path / "grown.json", {CID: 2})
        grown = build_conversation(rt, CID)
    finally:
        rt.con.close()
    new_texts = {v.text for v in grown.vectors} - first_texts
    assert len(grown.memory.scenes) > len(first.memory.scenes) and new_texts
    assert sorted(t for call in counting.calls for t in call) == sorted(new_texts)


def test_a_conversation_s_usage_rows_are_committed_when_it_is_built(store: Path) -> None:
    """The build's ledger defers its rows (one transaction for many); a built conversation's rows are
    committed before it is reported built, so a reader of the store sees every call it made."""
    from tmem.llm.response_cache import CachedChatModel
    from tmem.store.llm_cache import DuckResponseCache, DuckUsageLedger

    fake = FakeChatModel()
    con = connect(store)
    ledger = DuckUsageLedger(con, deferred=True, linger_s=60.0)  # nothing commits by lingering in this test
    settings = load_settings(store=store)
    chat = CachedChatModel(fake, cache=DuckResponseCache(con), ledger=ledger, run_id="r1")
    rt = BuildRuntime(spec=BuildSpec.resolve(store, settings), settings=settings, run_id="r1", con=con, chat=chat,
                      embedder=HashEmbedder(), stages=StageCache.of_store(store),
                      fingerprint=build_fingerprint(settings, fake.model_name), ledger=ledger)
    try:
        build_conversation(rt, CID)
        reader = con.cursor()
        try:
            row = reader.execute("SELECT count(*) FROM llm_usage WHERE run_id = 'r1' AND conversation_id = ?",
                                 [CID]).fetchone()
        finally:
            reader.close()
    finally:
        con.close()
    assert row == (len(fake.calls),) and len(fake.calls) > 0


def test_scene_views_are_queued_for_the_encoder_after_segmentation_and_embedded_once(store: Path) -> None:
    """The build's queue gets a conversation's scene views (summaries, dialogue windows) as soon as
    segmentation is done, ahead of the conversation's embed stage; every text is embedded once and
    the vectors are those of the views."""
    from tests.test_embed import CountingEmbedder
    from tmem.llm.embed_queue import CoalescingEmbedder

    chat, counting = FakeChatModel(), CountingEmbedder(HashEmbedder())
    queue = CoalescingEmbedder(counting, linger_s=0.0)
    base = runtime(store, chat)
    rt = BuildRuntime(spec=base.spec, settings=base.settings, run_id=base.run_id, con=base.con, chat=chat,
                      embedder=queue, stages=base.stages, fingerprint=base.fingerprint, embed_queue=queue)
    try:
        built = build_conversation(rt, CID)
    finally:
        queue.close()
        rt.con.close()
    scene_texts = [v.text for v in built.vectors if v.owner_kind == "scene" and v.view in {"summary", "dlg"}]
    assert scene_texts and queue.usage.prefetched == len(scene_texts)
    assert counting.calls[0] == list(dict.fromkeys(scene_texts))  # the first model call: the scene views alone
    embedded = [t for call in counting.calls for t in call]
    assert sorted(embedded) == sorted({v.text for v in built.vectors})  # each text once
    assert all(np.array_equal(v.vector, HashEmbedder().embed([v.text])[0]) for v in built.vectors)

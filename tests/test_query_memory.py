"""The Python query API over real published snapshots (DuckDB + LanceDB in a temp store)."""

from __future__ import annotations

import json
import statistics
import threading
import time
from collections.abc import Callable
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from tests.query_store import HashEmbedder, build_store, make_conv, publish
from tmem.devtools.responders import input_message, request_input
from tmem.devtools.scripted_llm import ScriptedLLM
from tmem.errors import ScopeError, StoreError
from tmem.prompts import answer as answer_prompt
from tmem.prompts.base import parse_input
from tmem.prompts.common import parse_context
from tmem.query.loader import IndexCache, load_index
from tmem.query.memory import Memory, NoSnapshotError
from tmem.retrieval.config import UnknownPresetError
from tmem.retrieval.index import QueryVectorError
from tmem.settings import Settings
from tmem.store.snapshot.reader import SnapshotReader

LATER = datetime(2026, 1, 6, 9, 0, tzinfo=UTC)

CRAFTED_IDS = [
    "conv-a",
    "x' OR '1'='1",
    "' OR 1=1 --",
    "%",
    "_",
    "*",
    '"',
    "''",
    "会话-🙂",
    "../conv-a",
    "conv-a/..",
    "back\\slash",
    "tab\tid",
    "new\nline",
    "x'); DELETE FROM scenes; --",
]


def settings_for(store: Path, **overrides: Any) -> Settings:
    return Settings(store=store, **overrides)


@pytest.fixture(scope="module")
def crafted_store(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """One store holding a conversation per crafted id; conversation n's texts carry ``ownerN``."""
    store = tmp_path_factory.mktemp("crafted") / "store"
    build_store(store, [make_conv(cid, mark=f"owner{n}") for n, cid in enumerate(CRAFTED_IDS)], HashEmbedder())
    return store


@pytest.fixture
def two_convs(tmp_path: Path) -> tuple[Path, HashEmbedder]:
    store = tmp_path / "store"
    embedder = HashEmbedder()
    build_store(store, [make_conv("conv-a", mark="alpha"), make_conv("conv-b", mark="beta")], embedder)
    return store, embedder


def scripted_answer(operation: str, request_json: dict[str, Any]) -> str:
    """Deterministic answer responder: the first fact line of the context, at most six words."""
    facts = [line.split("] ", 1)[1] for line in parse_context(input_message(request_json)).splitlines()
             if line.startswith("- [")]
    words = (facts[0] if facts else "Not mentioned").split()[:6]
    return json.dumps({"answer": " ".join(words)})


# ---- scope -----------------------------------------------------------------------------------


@pytest.mark.parametrize("n", range(len(CRAFTED_IDS)))
def test_a_query_only_ever_returns_its_own_conversation(crafted_store: Path, n: int) -> None:
    cid = CRAFTED_IDS[n]
    memory = Memory.open(crafted_store, settings_for(crafted_store), embedder=HashEmbedder())
    # The same words occur in every conversation: only the scope can keep the others out.
    for embed in (True, False):
        result = memory.search("pottery bowl glaze fact", conversation_id=cid, embed=embed)
        assert result.conversation_id == cid
        assert result.scenes and result.items
        for item in result.items:
            marks = {w for w in item.content.replace(".", " ").split() if w.startswith("owner")}
            assert marks == {f"owner{n}"}
        for scene in result.scenes:
            assert {t.conversation_id for t in scene.turns} == {cid}
            assert f"owner{n}" in scene.title.split()
        assert {p.conversation_id for p in result.personas} == {cid}


@pytest.mark.parametrize("cid", ["conv-a'", "conv-", "CONV-A", "conv-a ", "%conv%", "' OR 1=1 --x", "会话", "conv-a\x00"])
def test_unknown_or_near_miss_ids_raise_scope_error(crafted_store: Path, cid: str) -> None:
    memory = Memory.open(crafted_store, settings_for(crafted_store), embedder=HashEmbedder())
    with pytest.raises(ScopeError):
        memory.search("pottery", conversation_id=cid)
    with pytest.raises(ScopeError):
        memory.answer("pottery?", conversation_id=cid)


@pytest.mark.parametrize("cid", [None, "", 42])
def test_a_missing_conversation_id_is_a_scope_error(crafted_store: Path, cid: Any) -> None:
    memory = Memory.open(crafted_store, settings_for(crafted_store), embedder=HashEmbedder())
    with pytest.raises(ScopeError):
        memory.search("pottery", conversation_id=cid)


def test_conversation_id_is_keyword_only_and_required(crafted_store: Path) -> None:
    memory = Memory.open(crafted_store, settings_for(crafted_store), embedder=HashEmbedder())
    with pytest.raises(TypeError):
        memory.search("pottery")  # type: ignore[call-arg]
    with pytest.raises(TypeError):
        memory.search("pottery", "conv-a")  # type: ignore[misc]


def test_conversations_lists_the_snapshot(crafted_store: Path) -> None:
    memory = Memory.open(crafted_store, settings_for(crafted_store))
    listed = memory.conversations()
    assert [c.conversation_id for c in listed] == sorted(CRAFTED_IDS)
    assert all(c.speakers == ("Ann", "Bob") and c.turns == 24 for c in listed)


# ---- channels, embedding, presets -------------------------------------------------------------


def test_hybrid_search_embeds_the_query_once_and_reports_channels(two_convs: tuple[Path, HashEmbedder]) -> None:
    store, _ = two_convs
    query_embedder = HashEmbedder()
    memory = Memory.open(store, settings_for(store), embedder=query_embedder)
    result = memory.search("hiking trail boots", conversation_id="conv-a", trace=True)
    assert result.mode == "hybrid" and query_embedder.calls == 1
    assert result.scenes[0].title.startswith("Hiking trail")
    assert "lexical" in result.scenes[0].channels and "dense" in result.scenes[0].channels
    assert result.trace is not None
    assert [s.stage for s in result.trace.stages] == [
        "topic_prefilter", "scene_cue", "scene_selection", "trig_recall", "item_selection",
    ]


def test_lexical_search_never_touches_the_embedder(two_convs: tuple[Path, HashEmbedder]) -> None:
    store, _ = two_convs
    query_embedder = HashEmbedder()
    memory = Memory.open(store, settings_for(store), embedder=query_embedder)
    result = memory.search("hiking trail boots", conversation_id="conv-a", embed=False)
    assert result.mode == "lexical" and query_embedder.calls == 0
    assert all(ch == ("lexical",) for ch in [s.channels for s in result.scenes])
    assert result.scenes[0].title.startswith("Hiking trail")


def test_a_given_query_vector_is_used_without_embedding(two_convs: tuple[Path, HashEmbedder]) -> None:
    store, _ = two_convs
    query_embedder = HashEmbedder()
    memory = Memory.open(store, settings_for(store), embedder=query_embedder)
    vector = HashEmbedder().embed(["garden tomatoes"])[0]
    result = memory.search("zzz", conversation_id="conv-a", query_vector=vector)
    assert result.mode == "hybrid" and query_embedder.calls == 0
    garden = [s for s in result.scenes if s.title.startswith("Garden tomatoes")]
    assert garden and "dense" in garden[0].channels  # reached by the vector alone: "zzz" matches no word
    with pytest.raises(QueryVectorError):
        memory.search("zzz", conversation_id="conv-a", query_vector=np.ones(5))


def test_presets_and_speaker(two_convs: tuple[Path, HashEmbedder]) -> None:
    store, _ = two_convs
    memory = Memory.open(store, settings_for(store), embedder=HashEmbedder())
    no_items = memory.search("pottery", conversation_id="conv-a", preset="paper+no-item-channel")
    assert no_items.items == () and no_items.scenes
    assert memory.search("pottery", conversation_id="conv-a", preset="no-persona").personas == ()
    bob = memory.search("pottery", conversation_id="conv-a", speaker="bob")
    assert [p.speaker for p in bob.personas] == ["Bob"]
    with pytest.raises(UnknownPresetError):
        memory.search("pottery", conversation_id="conv-a", preset="fastest")


def test_context_respects_the_budget(two_convs: tuple[Path, HashEmbedder]) -> None:
    store, _ = two_convs
    memory = Memory.open(store, settings_for(store), embedder=HashEmbedder())
    full = memory.context("pottery bowl", conversation_id="conv-a")
    assert full.context.report.budget == 6000 and full.context.report.scenes_dropped == 0
    assert full.snapshot_id == memory.snapshot_id
    tight = memory.context("pottery bowl", conversation_id="conv-a", budget_tokens=120)
    assert tight.context.report.tokens_used <= 120
    assert tight.context.report.scenes_dropped + tight.context.report.items_dropped > 0


# ---- snapshots ------------------------------------------------------------------------------


def test_a_store_without_snapshot_opens_and_waits(tmp_path: Path) -> None:
    store = tmp_path / "store"
    store.mkdir()
    memory = Memory.open(store, settings_for(store), embedder=HashEmbedder(), refresh_ms=0)
    assert memory.snapshot_id is None
    with pytest.raises(NoSnapshotError):
        memory.search("pottery", conversation_id="conv-a")
    build_store(store, [make_conv("conv-a", mark="alpha")], HashEmbedder())
    assert memory.search("pottery", conversation_id="conv-a").scenes


def test_a_missing_store_directory_is_an_error(tmp_path: Path) -> None:
    with pytest.raises(StoreError):
        Memory.open(tmp_path / "nope")


def test_a_newer_snapshot_is_picked_up_and_a_pinned_one_stays(two_convs: tuple[Path, HashEmbedder]) -> None:
    store, embedder = two_convs
    now = [0.0]
    memory = Memory(store, settings_for(store), embedder=HashEmbedder(), refresh_ms=1000, clock=lambda: now[0])
    first = memory.snapshot()
    old = memory.search("pottery", conversation_id="conv-a")
    assert all("alpha" in s.title.split() for s in old.scenes)

    second_info = publish(store, [make_conv("conv-a", mark="alpha", tag="v2")], embedder, now=LATER)
    # Within the refresh interval the pointer is not re-read.
    now[0] = 0.5
    assert memory.snapshot_id == first.snapshot_id
    now[0] = 1.5
    assert memory.snapshot_id == second_info.snapshot_id
    new = memory.search("pottery", conversation_id="conv-a")
    assert all("alphav2" in s.title.split() for s in new.scenes)
    assert all(s.scene_id.startswith("scnv2_") for s in new.scenes)
    # A snapshot pinned before the switch keeps answering from its own data (its file reopens).
    again = first.search("pottery", conversation_id="conv-a")
    assert [s.scene_id for s in again.scenes] == [s.scene_id for s in old.scenes]
    # conv-b was not rebuilt: it is still served, from the new snapshot.
    assert memory.search("hiking", conversation_id="conv-b").scenes
    assert memory.cache_stats().size <= 2


def test_a_broken_pointer_keeps_the_last_good_snapshot(two_convs: tuple[Path, HashEmbedder]) -> None:
    store, _ = two_convs
    memory = Memory.open(store, settings_for(store), embedder=HashEmbedder(), refresh_ms=0)
    good = memory.snapshot_id
    (store / "CURRENT").write_text("20990101T000000000000Z-deadbeef")
    assert memory.refresh() is False
    assert memory.snapshot_id == good
    assert memory.search("pottery", conversation_id="conv-a").scenes


# ---- the cache ------------------------------------------------------------------------------


def test_the_cache_is_bounded_and_shares_concurrent_loads(crafted_store: Path) -> None:
    memory = Memory.open(crafted_store, settings_for(crafted_store, query_cache_size=3), embedder=HashEmbedder())
    barrier = threading.Barrier(8)
    errors: list[BaseException] = []

    def first_query() -> None:
        barrier.wait()
        try:
            memory.search("pottery", conversation_id="conv-a")
        except BaseException as exc:  # surfaced by the assertion below
            errors.append(exc)
            raise

    threads = [threading.Thread(target=first_query) for _ in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors
    stats = memory.cache_stats()
    assert stats.misses == 1 and stats.hits + stats.shared == 7
    for cid in CRAFTED_IDS[:6]:
        memory.search("pottery", conversation_id=cid)
    assert memory.cache_stats().size == 3
    # A lexical query reuses a cached full index instead of loading a second one.
    before = memory.cache_stats().misses
    memory.search("pottery", conversation_id=CRAFTED_IDS[5], embed=False)
    assert memory.cache_stats().misses == before


def test_failed_loads_are_not_cached(crafted_store: Path) -> None:
    cache = IndexCache(2)
    memory = Memory.open(crafted_store, settings_for(crafted_store))
    reader = memory.snapshot().reader
    with pytest.raises(ScopeError):
        cache.get(reader, "nobody")
    assert cache.stats().size == 0
    assert cache.get(reader, "conv-a", vectors=False).n_scenes == 6


def test_locomo_sized_cold_load_and_warm_query(tmp_path: Path) -> None:
    """~40 scenes, ~300 items, 384-d vectors: the cold load is reported, warm queries are numpy only."""
    store = tmp_path / "store"
    conv = make_conv("conv-26", mark="locomo", scenes=40, turns_per_scene=15, items_per_scene=8)
    info = build_store(store, [conv], HashEmbedder(384))
    reader = SnapshotReader(info, store)
    loads = [load_index(reader, "conv-26")[1] for _ in range(3)]
    index = load_index(reader, "conv-26")[0]
    assert (index.n_scenes, index.n_items, index.dim) == (40, 320, 384)
    cold = statistics.median(t.total_s for t in loads)

    memory = Memory.open(store, settings_for(store), embedder=HashEmbedder(384))
    vector = HashEmbedder(384).embed(["pottery bowl glaze"])[0]
    memory.search("warm up", conversation_id="conv-26", query_vector=vector)
    timings = []
    for _ in range(100):
        started = time.perf_counter()
        memory.search("what did Ann say about the pottery bowl", conversation_id="conv-26", query_vector=vector)
        timings.append(time.perf_counter() - started)
    warm = statistics.median(timings)
    print(f"\nLoCoMo-sized conversation: cold load {cold * 1000:.1f} ms "
          f"(memory {loads[-1].read_memory_s * 1000:.1f}, vectors {loads[-1].read_vectors_s * 1000:.1f}, "
          f"index {loads[-1].build_index_s * 1000:.1f}; {loads[-1].vector_rows} vector rows); "
          f"warm hybrid search p50 {warm * 1000:.2f} ms")
    assert cold < 2.0
    assert warm < 0.02


# ---- answers --------------------------------------------------------------------------------


def test_answer_uses_the_answer_role_model_with_the_recalled_context(
    two_convs: tuple[Path, HashEmbedder], scripted_llm_factory: Callable[..., ScriptedLLM]
) -> None:
    store, _ = two_convs
    server = scripted_llm_factory(responders={"answer": scripted_answer})
    settings = settings_for(
        store, llm_base_url="http://127.0.0.1:9/v1", llm_answer_base_url=server.url, llm_answer_model="answerer",
        llm_max_retries=0,
    )
    memory = Memory.open(store, settings, embedder=HashEmbedder())
    asked = datetime(2023, 6, 1, 10, 0, tzinfo=UTC)
    answer = memory.answer("What pottery bowl fact?", conversation_id="conv-a", speaker="Ann", question_date=asked)
    assert answer.model == "answerer" and answer.snapshot_id == memory.snapshot_id
    assert answer.items, "the answer must come with the recalled items"
    assert answer.answer == " ".join(answer.items[0].content.split()[:6])
    assert all(item.channels for item in answer.items) and all(scene.channels for scene in answer.scenes)
    assert answer.context.report.tokens_used > 0
    request = server.requests[-1]
    assert request.operation == "answer" and request.body["model"] == "answerer"
    sent = request_input(request.body)
    assert sent["question"] == "What pottery bowl fact?" and sent["question_date"].startswith("2023-06-01")
    # the context travels as readable text beside the input block, not as a JSON-escaped string
    assert parse_context(input_message(request.body)) == answer.context.text
    assert "context" not in sent and "conversation_id" not in sent


def test_answer_prompt_shape() -> None:
    prompt = answer_prompt.build(
        answer_prompt.AnswerInput(conversation_id="c", question="When did Ann hike?", context="## Facts\n- x")
    )
    assert prompt.operation == answer_prompt.OPERATION == "answer"
    data = parse_input(prompt.messages[-1].content)
    assert data == {"question": "When did Ann hike?"}
    assert parse_context(prompt.messages[-1].content) == "## Facts\n- x"
    assert "<context>\n## Facts\n- x\n</context>" in prompt.messages[-1].content  # readable, not escaped
    reasoned = answer_prompt.build(
        answer_prompt.AnswerInput(conversation_id="c", question="When did Ann hike?", context="x"), reasoning=True
    )
    assert list(reasoned.response_model.model_fields) == ["reasoning", "answer"] and reasoned.version != prompt.version
    description = answer_prompt.AnswerResponse.model_fields["answer"].description
    assert description and description in prompt.messages[0].content
    with pytest.raises(ValueError):
        answer_prompt.AnswerResponse.model_validate({"answer": ""})

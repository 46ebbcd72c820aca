"""A scene's dialogue view in chunks that fit the encoder (MiniLM reads 256 word pieces)."""

from __future__ import annotations

from datetime import UTC, datetime

import numpy as np

from tmem.build.embed_views import embed_memory_views
from tmem.domain import ConversationMemory, Scene, Turn
from tmem.providers.sentence_transformer import SentenceTransformerEmbedder
from tmem.retrieval.cascade import search
from tmem.retrieval.config import RetrievalConfig
from tmem.retrieval.index import VectorBundle, build_index
from tmem.views.texts import dialogue_chunks, memory_views, word_budget

T0 = datetime(2023, 5, 8, tzinfo=UTC)


def turns(texts: list[str]) -> dict[str, Turn]:
    return {f"D1:{n}": Turn(conversation_id="c", session_id="s1", turn_id=f"D1:{n}", seq=n, speaker="Ann", text=t,
                            event_time=T0) for n, t in enumerate(texts, start=1)}


def test_chunks_keep_whole_turns_within_the_word_budget():
    by_id = turns(["one two three", "four five six seven", "eight", "nine ten"])
    chunks = dialogue_chunks(tuple(by_id), by_id, max_words=9)  # "Ann:" counts as a word
    assert chunks == ["Ann: one two three\nAnn: four five six seven", "Ann: eight\nAnn: nine ten"]
    assert all(len(c.split()) <= 9 for c in chunks)


def test_a_turn_longer_than_the_budget_is_cut_on_its_own():
    long = " ".join(f"w{i}" for i in range(20))
    by_id = turns(["hi", long, "bye"])
    chunks = dialogue_chunks(tuple(by_id), by_id, max_words=8)
    assert chunks[0] == "Ann: hi"
    assert [len(c.split()) for c in chunks[1:-1]] == [8, 8, 5] and chunks[-1] == "Ann: bye"
    assert " ".join(" ".join(chunks[1:-1]).split()[1:]) == long  # every word of the long turn kept, in order


def test_no_budget_keeps_one_chunk():
    by_id = turns(["a b", "c d"])
    assert dialogue_chunks(tuple(by_id), by_id, None) == ["Ann: a b\nAnn: c d"]


def test_word_budget_of_minilm():
    assert word_budget(256) == 158  # (256 - 2) / 1.6 = 158.75
    assert word_budget(None) is None
    assert SentenceTransformerEmbedder().max_input_tokens == 256  # read from the shipped model's files


class _Limited:
    """An embedder reading at most 12 tokens, whose vector is e0 when a text says 'kayak'."""

    model_name = "limited"
    dim = 4
    max_input_tokens = 12

    def embed(self, texts: list[str]) -> np.ndarray:
        out = np.zeros((len(texts), 4), dtype=np.float32)
        for row, text in enumerate(texts):
            out[row, 0 if "kayak" in text else 1] = 1.0
        return out


def test_a_match_late_in_a_long_scene_reaches_the_dialogue_channel():
    texts = [f"filler words number {n} here" for n in range(12)] + ["we bought a kayak"]
    by_id = turns(texts)
    scene = Scene(conversation_id="c", scene_id="s0", seq=0, title="t", summary="s", narrative="n",
                  turn_ids=tuple(by_id), start_time=T0, end_time=T0)
    other = scene.model_copy(update={"scene_id": "s1", "seq": 1, "turn_ids": ("D1:1",)})
    memory = ConversationMemory(conversation_id="c", scenes=(scene, other), topics=(), items=(), item_triggers=(),
                    scene_triggers=(), personas=())
    rows = embed_memory_views(memory, by_id, _Limited())
    dlg = [r for r in rows if r.view == "dlg" and r.owner_id == "s0"]
    assert len(dlg) == 13 and [r.ordinal for r in dlg] == [16 * n for n in range(13)]  # a window names its first turn
    assert len(memory_views(memory, by_id)) < len(rows)  # without a budget: one dlg row per scene
    bundle = VectorBundle.from_columns([r.owner_kind for r in rows], [r.owner_id for r in rows],
                                       [r.view for r in rows], [r.ordinal for r in rows], [r.vector for r in rows])
    index = build_index("c", [scene, other], [], [], [], [], [], list(by_id.values()), bundle)
    q = np.array([1, 0, 0, 0], dtype=np.float32)
    config = RetrievalConfig(k_topics=1, k_scenes=1, k_items=0, k_cue=1, dialogue_pool="max")
    result = search(index, "kayak", q, config, trace=True)
    cue = result.trace.stage("scene_cue")
    assert cue.selected == ("s0",)
    assert cue.candidates[0].scores["dialogue"] == 1.0  # the best chunk, not the scene's opening


def test_a_scene_about_the_query_outranks_a_long_one_that_touches_it_once():
    # s0: twelve filler turns, then one about kayaks; s1: a short exchange all about kayaks. The best
    # window of each matches alike; by default a scene's dialogue score also counts how much of it matches.
    texts = [f"filler words number {n} here" for n in range(12)] + ["we bought a kayak", "a kayak trip", "kayak again"]
    by_id = turns(texts)
    ids = tuple(by_id)
    long = Scene(conversation_id="c", scene_id="s0", seq=0, title="t", summary="s", narrative="n",
                 turn_ids=ids[:13], start_time=T0, end_time=T0)
    short = long.model_copy(update={"scene_id": "s1", "seq": 1, "turn_ids": ids[13:]})
    memory = ConversationMemory(conversation_id="c", scenes=(long, short), topics=(), items=(), item_triggers=(),
                    scene_triggers=(), personas=())
    rows = embed_memory_views(memory, by_id, _Limited())
    bundle = VectorBundle.from_columns([r.owner_kind for r in rows], [r.owner_id for r in rows],
                                       [r.view for r in rows], [r.ordinal for r in rows], [r.vector for r in rows])
    index = build_index("c", [long, short], [], [], [], [], [], list(by_id.values()), bundle)
    q = np.array([1, 0, 0, 0], dtype=np.float32)

    def dialogue(pool: str | None) -> dict[str, float]:
        config = RetrievalConfig(k_topics=1, k_scenes=2, k_items=0, k_cue=2)
        config = config if pool is None else config.with_(dialogue_pool=pool)
        cue = search(index, "kayak", q, config, trace=True).trace.stage("scene_cue")
        return {c.id: c.scores["dialogue"] for c in cue.candidates}

    by_best = dialogue("max")
    assert by_best["s0"] == by_best["s1"] == 1.0
    default = dialogue(None)
    assert RetrievalConfig().dialogue_pool == "max_mean"
    assert default["s1"] == 1.0 and default["s0"] < 0.6  # (1 + mean of 13 windows, one matching) / 2

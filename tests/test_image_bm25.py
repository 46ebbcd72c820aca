"""The BM25 index prebuilt at publish and stored in each conversation image (tmem/retrieval/lexical.py).

Deserialised, it scores every term exactly as the index built from the memory at load; an index of
another recipe is ignored (built again), and a damaged section is a StoreError.
"""

from __future__ import annotations

import json
import struct
from pathlib import Path

import numpy as np
import pytest

from tests.query_store import HashEmbedder, build_store, make_conv
from tmem.errors import StoreError
from tmem.query.loader import _vector_bundle
from tmem.retrieval import lexical
from tmem.retrieval.index import build_index
from tmem.retrieval.lexical import RECIPE, decode_bm25, encode_bm25, prebuild
from tmem.retrieval.scoring import bm25_scores, tokenize
from tmem.store.snapshot.published import SnapshotInfo
from tmem.store.snapshot.reader import SnapshotReader

CIDS = ["conv-a", "x' OR '1'='1", "conv-b"]


@pytest.fixture(scope="module")
def published(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, SnapshotInfo]:
    store = tmp_path_factory.mktemp("image-bm25") / "store"
    convs = [make_conv(cid, mark=f"mk{n}z", scenes=5 + n, items_per_scene=2) for n, cid in enumerate(CIDS)]
    return store, build_store(store, convs, HashEmbedder())


@pytest.mark.parametrize("cid", CIDS)
def test_the_stored_bm25_scores_every_term_like_the_one_built_at_load(
    published: tuple[Path, SnapshotInfo], cid: str
) -> None:
    store, info = published
    cold = SnapshotReader(info, store).read_cold(cid)
    assert cold.bm25 is not None and cold.bm25.retriever is not None
    m = cold.memory
    built = build_index(cid, m.scenes, m.topics, m.items, m.item_triggers, m.scene_triggers, m.personas, cold.turns,
                        _vector_bundle(cold.vectors))
    loaded = build_index(cid, m.scenes, m.topics, m.items, m.item_triggers, m.scene_triggers, m.personas, cold.turns,
                         _vector_bundle(cold.vectors), bm25=cold.bm25)
    assert loaded.bm25 is cold.bm25.retriever and built.bm25 is not None
    vocabulary = sorted(t for t in built.bm25.vocab_dict if t)
    assert len(vocabulary) > 20
    queries = [[t] for t in vocabulary] + [vocabulary[i : i + 4] for i in range(0, len(vocabulary), 3)]
    queries += [tokenize("pottery clay and the unknownword"), ["neverseen"]]
    for q in queries:
        want = bm25_scores(built.bm25, built.n_docs, q)
        got = bm25_scores(loaded.bm25, loaded.n_docs, q)
        assert np.array_equal(got, want), q
    assert any(bm25_scores(loaded.bm25, loaded.n_docs, q).max() > 0 for q in queries)


def test_an_index_of_another_recipe_is_built_again(published: tuple[Path, SnapshotInfo],
                                                   monkeypatch: pytest.MonkeyPatch) -> None:
    store, info = published
    monkeypatch.setattr(lexical, "RECIPE", "other-recipe")  # e.g. field weights changed since the publish
    cold = SnapshotReader(info, store).read_cold(CIDS[0])
    assert cold.bm25 is None and cold.memory.items


def test_damaged_or_mismatched_sections_are_store_errors(published: tuple[Path, SnapshotInfo]) -> None:
    store, info = published
    m = SnapshotReader(info, store).read_cold(CIDS[1]).memory
    n_docs = len(m.topics) + len(m.scenes) + len(m.items)
    data = encode_bm25(prebuild(m.scenes, m.topics, m.items), n_docs)
    assert decode_bm25(data, n_docs, source="t") is not None
    with pytest.raises(StoreError, match="covers"):
        decode_bm25(data, n_docs + 1, source="t")
    with pytest.raises(StoreError, match="bytes for"):
        decode_bm25(data[:-8], n_docs, source="t")
    with pytest.raises(StoreError, match="corrupt"):
        decode_bm25(data[:4] + b"\xff" * 8 + data[12:], n_docs, source="t")
    with pytest.raises(StoreError, match="cut short"):
        decode_bm25(data[:3], n_docs, source="t")
    (size,) = struct.unpack_from("<I", data)
    header = json.loads(data[4 : 4 + size])
    body = bytearray(data[4 + size :])
    body[header["nnz"] * 4 : header["nnz"] * 4 + 4] = struct.pack("<i", n_docs + 5)  # a document id out of range
    with pytest.raises(StoreError, match="out of range"):
        decode_bm25(data[: 4 + size] + bytes(body), n_docs, source="t")


def test_a_memory_without_tokens_stores_an_empty_index() -> None:
    data = encode_bm25(None, 3)
    empty = decode_bm25(data, 3, source="t")
    assert empty is not None and empty.retriever is None
    assert json.loads(data[4:])["recipe"] == RECIPE

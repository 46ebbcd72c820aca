"""The shared BM25 corpus of a conversation's index, and its prebuilt form stored in an image.

:func:`order_for_index` fixes the row order of topics, scenes and items (the index's positions),
:func:`corpus_tokens` the weighted field concatenation of each document (DESIGN §3). A publish
builds the BM25 matrices once per conversation (:func:`prebuild`) and stores them in the
conversation's image (:func:`encode_bm25`); a cold load then deserialises them instead of
tokenising and indexing the corpus again (bench/query.py --part scale).

A stored index names its :data:`RECIPE` (bm25s version, k1, b, field weights, tokenizer); a reader
whose recipe differs ignores it and builds the index from the memory, so a change of any of these
never serves stale scores. Deserialisation restores exactly the attributes ``bm25s.BM25.load``
restores from its own files (parameters, vocabulary, the sparse score matrix).
"""

from __future__ import annotations

import hashlib
import json
import struct
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import bm25s
import numpy as np

from tmem.domain import ConversationMemory, Item, Scene, Topic
from tmem.errors import StoreError
from tmem.retrieval.scoring import BM25_B, BM25_K1, build_bm25, tokenize

# Per-type weighted field concatenation for the shared BM25 corpus (DESIGN §3): a field of weight
# w is repeated w times, which multiplies its term frequencies (and the document length) by w.
TOPIC_TITLE_WEIGHT = 2  # the paper's topic summary: title ×2 ‖ keywords
TOPIC_KEYWORDS_WEIGHT = 1
SCENE_TITLE_WEIGHT = 3
SCENE_SUMMARY_WEIGHT = 2
SCENE_NARRATIVE_WEIGHT = 1
ITEM_CONTENT_WEIGHT = 2
ITEM_KEYWORDS_WEIGHT = 1

_PROBE = "The Quick brown foxes' parties: don't stop 42 times"  # tokenizer changes change the recipe
RECIPE = hashlib.sha256(json.dumps([
    bm25s.__version__, BM25_K1, BM25_B, "lucene",
    [TOPIC_TITLE_WEIGHT, TOPIC_KEYWORDS_WEIGHT, SCENE_TITLE_WEIGHT, SCENE_SUMMARY_WEIGHT, SCENE_NARRATIVE_WEIGHT,
     ITEM_CONTENT_WEIGHT, ITEM_KEYWORDS_WEIGHT],
    tokenize(_PROBE),
]).encode()).hexdigest()[:16]

_LEN = struct.Struct("<I")


@dataclass(frozen=True)
class PrebuiltBM25:
    """A BM25 index built at publish; ``retriever`` is ``None`` when the corpus has no tokens."""

    retriever: bm25s.BM25 | None


def order_for_index(
    scenes: Sequence[Scene], topics: Sequence[Topic], items: Sequence[Item]
) -> tuple[list[Scene], list[Topic], list[Item]]:
    """Topics and scenes by ``seq`` then id, items by their first source scene then id."""
    ordered_scenes = sorted(scenes, key=lambda s: (s.seq, s.scene_id))
    ordered_topics = sorted(topics, key=lambda t: (t.seq, t.topic_id))
    pos = {s.scene_id: i for i, s in enumerate(ordered_scenes)}
    n = len(ordered_scenes)
    ordered_items = sorted(
        items, key=lambda it: (min((pos.get(s, n) for s in it.source_scene_ids), default=n), it.item_id)
    )
    return ordered_scenes, ordered_topics, ordered_items


def _weighted(*fields: tuple[str, int]) -> list[str]:
    tokens: list[str] = []
    for text, weight in fields:
        tokens.extend(tokenize(text) * weight)
    return tokens


def corpus_tokens(topics: Sequence[Topic], scenes: Sequence[Scene], items: Sequence[Item]) -> list[list[str]]:
    """Documents ``[0, nT)`` topics, ``[nT, nT+nS)`` scenes, then items, in the given order."""
    corpus = [_weighted((t.title, TOPIC_TITLE_WEIGHT), (" ".join(t.keywords), TOPIC_KEYWORDS_WEIGHT)) for t in topics]
    corpus += [
        _weighted((s.title, SCENE_TITLE_WEIGHT), (s.summary, SCENE_SUMMARY_WEIGHT), (s.narrative, SCENE_NARRATIVE_WEIGHT))
        for s in scenes
    ]
    corpus += [_weighted((it.content, ITEM_CONTENT_WEIGHT), (" ".join(it.keywords), ITEM_KEYWORDS_WEIGHT)) for it in items]
    return corpus


def prebuild(scenes: Sequence[Scene], topics: Sequence[Topic], items: Sequence[Item]) -> bm25s.BM25 | None:
    """The BM25 index :func:`~tmem.retrieval.index.build_index` would build for this memory."""
    ordered_scenes, ordered_topics, ordered_items = order_for_index(scenes, topics, items)
    return build_bm25(corpus_tokens(ordered_topics, ordered_scenes, ordered_items))


def encode_bm25(retriever: bm25s.BM25 | None, n_docs: int) -> bytes:
    """``<u32 header length><header JSON><data f32><indices i32><indptr i64>``."""
    if retriever is None:
        header: dict[str, Any] = {"recipe": RECIPE, "n_docs": n_docs, "empty": True}
        return _LEN.pack(len(raw := json.dumps(header).encode())) + raw
    scores = retriever.scores
    vocab = [""] * len(retriever.vocab_dict)
    for token, i in retriever.vocab_dict.items():
        vocab[i] = token
    data = np.ascontiguousarray(scores["data"], dtype="<f4")
    indices = np.ascontiguousarray(scores["indices"], dtype="<i4")
    indptr = np.ascontiguousarray(scores["indptr"], dtype="<i8")
    header = {"recipe": RECIPE, "n_docs": int(scores["num_docs"]), "empty": False, "vocab": vocab,
              "nnz": int(data.size), "n_indptr": int(indptr.size)}
    raw = json.dumps(header, separators=(",", ":")).encode("utf-8")
    return _LEN.pack(len(raw)) + raw + data.tobytes() + indices.tobytes() + indptr.tobytes()


def decode_bm25(data: bytes, n_docs: int, *, source: str) -> PrebuiltBM25 | None:
    """The stored index, or ``None`` when it was built by another recipe (the caller builds one).
    :class:`StoreError` for a damaged section or one of another corpus size."""
    if len(data) < _LEN.size:
        raise StoreError(f"{source}: BM25 section is cut short ({len(data)} bytes)")
    (size,) = _LEN.unpack_from(data)
    view = memoryview(data)
    try:
        header = json.loads(bytes(view[_LEN.size : _LEN.size + size]).decode("utf-8"))
        if header["recipe"] != RECIPE:
            return None
        if header["n_docs"] != n_docs:
            raise StoreError(f"{source}: BM25 section covers {header['n_docs']} documents, the memory has {n_docs}")
        if header["empty"]:
            return PrebuiltBM25(None)
        nnz, n_indptr, vocab = int(header["nnz"]), int(header["n_indptr"]), list(header["vocab"])
    except (UnicodeDecodeError, ValueError, KeyError, TypeError) as exc:
        raise StoreError(f"{source}: BM25 section is corrupt ({exc!r})") from exc
    body = view[_LEN.size + size :]
    if len(body) != nnz * 8 + n_indptr * 8 or n_indptr < 1:
        raise StoreError(f"{source}: BM25 section has {len(body)} bytes for {nnz} scores and {n_indptr} pointers")
    values = np.frombuffer(body, dtype="<f4", count=nnz)
    indices = np.frombuffer(body, dtype="<i4", count=nnz, offset=nnz * 4)
    indptr = np.frombuffer(body, dtype="<i8", count=n_indptr, offset=nnz * 8)
    if int(indptr[-1]) != nnz or (nnz and (int(indices.max()) >= n_docs or int(indices.min()) < 0)):
        raise StoreError(f"{source}: BM25 section is corrupt (pointers or document ids out of range)")
    retriever = bm25s.BM25(k1=BM25_K1, b=BM25_B, method="lucene")
    retriever.vocab_dict = {token: i for i, token in enumerate(vocab)}
    retriever.unique_token_ids_set = set(range(len(vocab)))
    retriever.scores = {"data": values, "indices": indices, "indptr": indptr, "num_docs": n_docs}
    retriever.nonoccurrence_array = None
    return PrebuiltBM25(retriever)


class BM25Section:
    """The image section a publish writes after the vectors (``write_conversation_images(lexical=...)``)."""

    recipe = RECIPE

    def encode(self, memory: ConversationMemory) -> bytes:
        n_docs = len(memory.topics) + len(memory.scenes) + len(memory.items)
        return encode_bm25(prebuild(memory.scenes, memory.topics, memory.items), n_docs)

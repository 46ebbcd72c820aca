"""A synthetic store at production scale for the query benchmark (no LLM involved).

Every conversation gets ``turns`` turns in ``scenes`` scenes (one session per scene), ``topics``
topics (each scene in one or two of them), ``items`` items (a fifth of them connected, citing two
or three scenes) with entity and bridge triggers, scene triggers with five horizon sentences, and
two personas. Texts are random phrases over a Zipf-distributed pseudo-word vocabulary, at lengths
like LoCoMo's; every embeddable view (``tmem.views.texts.memory_views``) gets a random 384-d unit
vector. Conversations are generated in a random order of their ids, as a store that grew over time
would hold them, and written in large batches with the store's own writers:

* turns through ``ingest_transaction`` / ``IngestPlan`` (the ingest writer),
* memory rows through ``memory_frames`` (the row mapping of ``replace_memories``; a fresh store has
  nothing to delete, so the rows are inserted directly) and ``record_memory_build``'s row (one
  INSERT per batch),
* vectors as Arrow batches of the store's ``vector_schema`` (row ids from ``make_row_id``) appended
  to the table ``VectorStore`` creates (one Lance version per batch), then the store's
  ``ensure_scope_index``. ``replace_conversations`` is not used: its merge-insert joins every
  write against the whole growing table, and a fresh store has nothing to replace.

then ``publish_snapshot`` makes it the store's current snapshot.

    python bench/scale_store.py STORE [--conversations 10000] [--batch 500] [--seed 11]
"""

from __future__ import annotations

import argparse
import json
import random
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import Any

import numpy as np
import polars as pl
import pyarrow as pa

from tmem import domain
from tmem.domain import (
    HORIZON_CHANNELS,
    BridgeTrigger,
    Item,
    ItemTriggers,
    Persona,
    PersonaFact,
    Scene,
    SceneTriggers,
    Topic,
    Turn,
)
from tmem.store.duck import connect
from tmem.store.ingest_writer import IngestPlan, ingest_transaction
from tmem.store.lance import VectorStore, make_row_id, vector_schema
from tmem.store.memory_rows import memory_frames
from tmem.store.migrations import MEMORY_TABLES
from tmem.store.snapshot.published import SnapshotInfo, publish_snapshot
from tmem.views.texts import memory_views

VECTOR_TABLE = "vectors"
FACTS = "synthetic.json"  # what was generated (seed, shape, counts), beside the store's own files
SPEAKERS = ("Avery", "Jordan")
T0 = datetime(2023, 1, 2, 9, 0, tzinfo=UTC)
NOW = datetime(2026, 1, 5, 9, 0, tzinfo=UTC)
UTC_TIME = pl.Datetime("us", "UTC")


@dataclass(frozen=True)
class Shape:
    """Per-conversation sizes of the synthetic memory."""

    scenes: int = 15
    topics: int = 5
    items: int = 100
    turns: int = 150
    entities: int = 3
    bridges: int = 2
    dim: int = 384


class Texts:
    """Random texts over a Zipf-distributed vocabulary of pronounceable pseudo-words.

    Words are drawn once into a long random stream of 4-word phrases; a text of n words is the
    next n//4 phrases of the stream plus one shorter phrase. Drawing per text (numpy or
    ``random.choices``) costs more than everything else the generator does.
    """

    def __init__(self, seed: int, vocabulary: int = 4000, phrases: int = 400_000) -> None:
        self.rng = random.Random(seed)
        nprng = np.random.default_rng(seed)
        syllables = [c + v for c in "bdfghklmnprstvz" for v in "aeiou"] + ["an", "el", "in", "or", "us"]
        words: set[str] = set()
        while len(words) < vocabulary:
            n = int(nprng.integers(1, 4))
            words.add("".join(syllables[int(i)] for i in nprng.integers(0, len(syllables), size=n)))
        self.words = sorted(words)
        nprng.shuffle(self.words)
        p = 1.0 / np.arange(1, vocabulary + 1) ** 1.05
        self.p = p / p.sum()
        idx = nprng.choice(vocabulary, size=(phrases, 4), p=self.p).tolist()
        self.stream = [" ".join(self.words[i] for i in row) for row in idx]
        self.short = [[" ".join(self.words[i] for i in row[:n]) for row in idx[:4096]] for n in range(1, 4)]
        self.cursor = 0

    def text(self, lo: int, hi: int) -> str:
        n = self.rng.randint(lo, hi)
        k = n // 4
        if self.cursor + k > len(self.stream):
            self.cursor = self.rng.randrange(1024)
        parts = self.stream[self.cursor : self.cursor + k]
        self.cursor += k
        if n % 4:
            parts.append(self.short[n % 4 - 1][self.cursor & 4095])
        return " ".join(parts)

    def query(self, n: int = 8) -> str:
        return " ".join(self.rng.choices(self.words, weights=self.p.tolist(), k=n))


def conversation_id(n: int) -> str:
    return f"conv-{n:06d}"


def make_conversation(cid: str, texts: Texts, shape: Shape) -> tuple[domain.ConversationMemory, tuple[Turn, ...]]:
    """One synthetic conversation: its memory and its turns.

    Objects are made with ``model_construct`` (no validation): they are well-formed by
    construction, and validating 5 million of them would dominate the generation time.
    """
    rng = texts.rng
    per_scene = shape.turns // shape.scenes
    turns: list[Turn] = []
    scenes: list[Scene] = []
    start = T0 + timedelta(days=rng.randrange(400))
    for s in range(shape.scenes):
        day = start + timedelta(days=3 * s, hours=rng.randrange(12))
        ids = []
        for k in range(per_scene):
            tid = f"D{s + 1}:{k + 1}"
            ids.append(tid)
            turns.append(Turn.model_construct(
                conversation_id=cid, session_id=f"session_{s + 1}", turn_id=tid, seq=s * per_scene + k,
                speaker=SPEAKERS[k % 2], text=texts.text(8, 35), event_time=day + timedelta(minutes=k), metadata={}))
        scenes.append(Scene.model_construct(
            conversation_id=cid, scene_id=f"{cid}-s{s}", seq=s, title=texts.text(4, 8), summary=texts.text(25, 45),
            narrative=texts.text(60, 110), turn_ids=tuple(ids), start_time=day,
            end_time=day + timedelta(minutes=per_scene - 1)))
    topic_scenes: list[list[int]] = [[] for _ in range(shape.topics)]
    for s in range(shape.scenes):
        homes = {s % shape.topics} | ({rng.randrange(shape.topics)} if rng.random() < 0.3 else set())
        for t in sorted(homes):
            topic_scenes[t].append(s)
    topics = [Topic.model_construct(
        conversation_id=cid, topic_id=f"{cid}-t{t}", seq=t, title=texts.text(2, 4),
        keywords=tuple(texts.text(10, 12).split()), scene_ids=tuple(scenes[s].scene_id for s in topic_scenes[t]))
        for t in range(shape.topics)]
    items: list[Item] = []
    triggers: list[ItemTriggers] = []
    for i in range(shape.items):
        t = rng.randrange(shape.topics)
        pool = topic_scenes[t]
        n_src = min(len(pool), rng.randint(2, 3)) if rng.random() < 0.2 else 1
        sources = sorted(rng.sample(pool, n_src))
        iid = f"{cid}-i{i}"
        items.append(Item.model_construct(
            conversation_id=cid, item_id=iid, topic_id=topics[t].topic_id,
            kind="connected" if n_src > 1 else "atomic", content=texts.text(10, 22),
            source_scene_ids=tuple(scenes[s].scene_id for s in sources),
            event_time=scenes[sources[0]].start_time if rng.random() < 0.8 else None,
            keywords=tuple(texts.text(3, 5).split())))
        triggers.append(ItemTriggers.model_construct(
            conversation_id=cid, item_id=iid, entities=tuple(texts.text(1, 3) for _ in range(shape.entities)),
            bridges=tuple(BridgeTrigger.model_construct(situation=texts.text(6, 12), rationale=texts.text(6, 10))
                          for _ in range(shape.bridges))))
    scene_triggers = [SceneTriggers.model_construct(
        conversation_id=cid, scene_id=sc.scene_id, situation=texts.text(5, 9), object=texts.text(2, 4),
        event=texts.text(5, 9), emotion=texts.text(1, 3), horizons={ch: texts.text(8, 16) for ch in HORIZON_CHANNELS})
        for sc in scenes]
    personas = [Persona(conversation_id=cid, speaker=sp, identity=(texts.text(4, 8),),
                        preferences=tuple(texts.text(3, 6) for _ in range(3)), traits=(texts.text(1, 2),),
                        relations=(texts.text(3, 6),), timeline=(PersonaFact(fact=texts.text(5, 9), since="2023-05"),))
                for sp in SPEAKERS]
    memory = domain.ConversationMemory.model_construct(
        conversation_id=cid, scenes=tuple(scenes), topics=tuple(topics), items=tuple(items),
        item_triggers=tuple(triggers), scene_triggers=tuple(scene_triggers), personas=tuple(personas))
    return memory, tuple(turns)


def vector_table(convs: list[tuple[domain.ConversationMemory, tuple[Turn, ...]]], rng: np.random.Generator, dim: int) -> pa.Table:
    """The Lance rows (``vector_schema``) of every view the indexer would embed, with random unit vectors."""
    columns: dict[str, list[Any]] = {name: [] for name in ("row_id", "conversation_id", "owner_kind", "owner_id",
                                                           "view", "ordinal", "text")}
    for memory, turns in convs:
        cid = memory.conversation_id
        for v in memory_views(memory, {t.turn_id: t for t in turns}):
            columns["row_id"].append(make_row_id(cid, v.owner_kind, v.owner_id, v.view, v.ordinal))
            columns["conversation_id"].append(cid)
            columns["owner_kind"].append(v.owner_kind)
            columns["owner_id"].append(v.owner_id)
            columns["view"].append(v.view)
            columns["ordinal"].append(v.ordinal)
            columns["text"].append(v.text)
    n = len(columns["row_id"])
    matrix = rng.standard_normal((n, dim), dtype=np.float32)
    matrix /= np.linalg.norm(matrix, axis=1, keepdims=True)
    schema = vector_schema(dim)
    arrays = [pa.array(columns[f.name], type=f.type) for f in schema if f.name != "vector"]
    arrays.append(pa.FixedSizeListArray.from_arrays(pa.array(matrix.reshape(-1), type=pa.float32()), dim))
    return pa.Table.from_arrays(arrays, schema=schema)


def ingest_plan(convs: list[tuple[domain.ConversationMemory, tuple[Turn, ...]]]) -> IngestPlan:
    """The ingest writer's rows for these conversations (each session = one scene)."""
    conv_rows: list[dict[str, Any]] = []
    session_rows: list[dict[str, Any]] = []
    turn_rows: list[dict[str, Any]] = []
    for memory, turns in convs:
        cid = memory.conversation_id
        last = turns[-1]
        conv_rows.append({"conversation_id": cid, "source_format": "synthetic", "source_path": "bench/scale_store.py",
                          "speakers": list(SPEAKERS), "watermark_session_index": len(memory.scenes),
                          "watermark_turn_seq": last.seq, "watermark_time": last.event_time, "ingested_at": NOW,
                          "updated_at": NOW})
        seen: set[str] = set()
        for t in turns:
            if t.session_id not in seen:
                seen.add(t.session_id)
                session_rows.append({"conversation_id": cid, "session_id": t.session_id, "session_index": len(seen),
                                     "started_at": t.event_time, "ingested_at": NOW})
            turn_rows.append({"conversation_id": cid, "session_id": t.session_id, "turn_id": t.turn_id, "seq": t.seq,
                              "speaker": t.speaker, "text": t.text, "event_time": t.event_time, "metadata": None,
                              "ingested_at": NOW})
    return IngestPlan(
        conversations=pl.DataFrame(conv_rows, schema={
            "conversation_id": pl.String, "source_format": pl.String, "source_path": pl.String,
            "speakers": pl.List(pl.String), "watermark_session_index": pl.Int64, "watermark_turn_seq": pl.Int64,
            "watermark_time": UTC_TIME, "ingested_at": UTC_TIME, "updated_at": UTC_TIME}),
        sessions=pl.DataFrame(session_rows, schema={
            "conversation_id": pl.String, "session_id": pl.String, "session_index": pl.Int64,
            "started_at": UTC_TIME, "ingested_at": UTC_TIME}),
        turns=pl.DataFrame(turn_rows, schema={
            "conversation_id": pl.String, "session_id": pl.String, "turn_id": pl.String, "seq": pl.Int64,
            "speaker": pl.String, "text": pl.String, "event_time": UTC_TIME, "metadata": pl.String,
            "ingested_at": UTC_TIME}),
        qa=pl.DataFrame(),
    )


def insert_memories(store: Path, memories: list[domain.ConversationMemory]) -> None:
    """Insert fresh memories (``memory_frames`` rows, one INSERT per table) and their build records."""
    frames: dict[str, list[pl.DataFrame]] = {name: [] for name in MEMORY_TABLES}
    for memory in memories:
        for name, frame in memory_frames(memory).items():
            if frame.height:
                frames[name].append(frame)
    con = connect(store)
    try:
        con.execute("BEGIN TRANSACTION")
        for name in MEMORY_TABLES:
            if frames[name]:
                con.register("_frame", pl.concat(frames[name]))
                con.execute(f"INSERT INTO {name} SELECT * FROM _frame")  # noqa: S608 -- fixed names
                con.unregister("_frame")
        # record_memory_build's row, for the whole batch in one statement
        builds = pl.DataFrame(
            {"conversation_id": [m.conversation_id for m in memories],
             "build_id": [f"synthetic-{m.conversation_id}" for m in memories],
             "run_id": ["bench-scale"] * len(memories),
             "watermark_turn_seq": [len(m.scenes) * 10 - 1 for m in memories],
             "built_at": [NOW] * len(memories)},
            schema={"conversation_id": pl.String, "build_id": pl.String, "run_id": pl.String,
                    "watermark_turn_seq": pl.Int32, "built_at": UTC_TIME})
        con.register("_builds", builds)
        con.execute("INSERT INTO memory_builds SELECT * FROM _builds")
        con.unregister("_builds")
        con.execute("COMMIT")
    finally:
        con.close()


def _batches(order: list[int], size: int) -> Iterator[list[int]]:
    for start in range(0, len(order), size):
        yield order[start : start + size]


def build_scale_store(
    store: Path,
    *,
    conversations: int = 10_000,
    batch: int = 500,
    seed: int = 11,
    shape: Shape = Shape(),
    log: Callable[[str], None] = print,
) -> dict[str, Any]:
    """Generate, write and publish the synthetic store; returns counts and phase timings."""
    if (store / "CURRENT").exists():
        raise SystemExit(f"{store}: already holds a published store")
    store.mkdir(parents=True, exist_ok=True)
    rng = np.random.default_rng(seed)
    texts = Texts(seed)
    vectors = VectorStore(str(store / "lance"), shape.dim)
    table = vectors._table(VECTOR_TABLE, create=True)  # the store's table handle: bulk append, see the module doc
    order = rng.permutation(conversations).tolist()  # arrival order != id order, as in a store grown over time
    timings = {"generate_s": 0.0, "ingest_s": 0.0, "memory_s": 0.0, "vectors_s": 0.0}
    counts = {"conversations": 0, "turns": 0, "scenes": 0, "topics": 0, "items": 0, "vector_rows": 0}
    started = time.perf_counter()
    for n, ids in enumerate(_batches(order, batch)):
        t = time.perf_counter()
        convs = [make_conversation(conversation_id(i), texts, shape) for i in ids]
        rows = vector_table(convs, rng, shape.dim)
        timings["generate_s"] += time.perf_counter() - t
        t = time.perf_counter()
        with ingest_transaction(store) as tx:
            tx.write(ingest_plan(convs))
        timings["ingest_s"] += time.perf_counter() - t
        t = time.perf_counter()
        insert_memories(store, [m for m, _ in convs])
        timings["memory_s"] += time.perf_counter() - t
        t = time.perf_counter()
        table.add(rows)
        timings["vectors_s"] += time.perf_counter() - t
        counts["conversations"] += len(convs)
        counts["turns"] += sum(len(turns) for _, turns in convs)
        counts["scenes"] += sum(len(m.scenes) for m, _ in convs)
        counts["topics"] += sum(len(m.topics) for m, _ in convs)
        counts["items"] += sum(len(m.items) for m, _ in convs)
        counts["vector_rows"] += rows.num_rows
        log(f"batch {n + 1}: {counts['conversations']} conversations, {counts['items']} items, "
            f"{counts['vector_rows']} vectors, {time.perf_counter() - started:.0f} s "
            f"({', '.join(f'{k} {v:.0f}' for k, v in timings.items())})")
    unindexed_version = int(table.version)  # kept to measure a scoped read without the index
    t = time.perf_counter()
    vectors.ensure_scope_index(VECTOR_TABLE)  # the store's conversation_id BTREE index
    version = int(table.version)
    timings["scope_index_s"] = time.perf_counter() - t
    t = time.perf_counter()
    con = connect(store)
    try:
        info: SnapshotInfo = publish_snapshot(con, store, lance_uri=str(store / "lance"),
                                              lance_versions={VECTOR_TABLE: version}, now=NOW)
    finally:
        con.close()
    timings["publish_s"] = time.perf_counter() - t
    timings["total_s"] = time.perf_counter() - started
    facts = {"store": str(store), "snapshot_id": info.snapshot_id, "lance_version": version, "unindexed_version": unindexed_version,
            "counts": counts, "timings_s": {k: round(v, 1) for k, v in timings.items()},
            "shape": shape.__dict__, "seed": seed, "batch": batch}
    (store / FACTS).write_text(json.dumps(facts, indent=1))
    return facts


def republish(store: Path, now: datetime) -> dict[str, Any]:
    """Publish the store's working database again as a new snapshot (same memory, same pinned Lance
    version), e.g. to give a store generated before a snapshot-format change the current format.
    The previous snapshots stay (``--compare-snapshot`` A/Bs them)."""
    facts_path = store / FACTS
    facts: dict[str, Any] = json.loads(facts_path.read_text())
    started = time.perf_counter()
    con = connect(store)
    try:
        info = publish_snapshot(con, store, lance_uri=str(store / "lance"),
                                lance_versions={VECTOR_TABLE: int(facts["lance_version"])}, now=now)
    finally:
        con.close()
    facts.setdefault("earlier_snapshot_ids", []).append(facts["snapshot_id"])
    facts["snapshot_id"] = info.snapshot_id
    facts["timings_s"]["republish_s"] = round(time.perf_counter() - started, 1)
    facts_path.write_text(json.dumps(facts, indent=1))
    return facts


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("store", type=Path)
    parser.add_argument("--republish", metavar="ISO_TIME", type=datetime.fromisoformat,
                        help="publish the existing store's working database again as of this time (no generation)")
    parser.add_argument("--conversations", type=int, default=10_000)
    parser.add_argument("--batch", type=int, default=500)
    parser.add_argument("--seed", type=int, default=11)
    args = parser.parse_args()
    if args.republish is not None:
        print(json.dumps(republish(args.store, args.republish), indent=1))
        return
    facts = build_scale_store(args.store, conversations=args.conversations, batch=args.batch, seed=args.seed)
    print(json.dumps(facts, indent=1))


if __name__ == "__main__":
    main()

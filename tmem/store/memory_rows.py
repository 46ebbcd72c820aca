"""Writing and reading a conversation's built memory in the working database.

A conversation's memory is replaced whole, in one transaction, and only after its build
succeeded: a failed build never touches the rows of the last good one.
"""

from __future__ import annotations

import json
from collections.abc import Iterable, Sequence
from datetime import datetime
from typing import Any

import duckdb
import polars as pl
import pyarrow as pa

from tmem.domain import (
    SCENE_ATTRIBUTES,
    BridgeTrigger,
    ConversationMemory,
    FamilyTriggers,
    Item,
    ItemTriggers,
    Persona,
    Scene,
    SceneTriggers,
    Topic,
)
from tmem.store.duck import insert_arrow
from tmem.store.migrations import MEMORY_TABLES

_TS = pl.Datetime("us", "UTC")

_SCHEMAS: dict[str, dict[str, Any]] = {
    "scenes": {
        "conversation_id": pl.String, "scene_id": pl.String, "seq": pl.Int32, "title": pl.String,
        "summary": pl.String, "narrative": pl.String, "turn_ids": pl.List(pl.String),
        "start_time": _TS, "end_time": _TS,
    },
    "topics": {
        "conversation_id": pl.String, "topic_id": pl.String, "seq": pl.Int32, "title": pl.String,
        "keywords": pl.List(pl.String),
    },
    "topic_scene": {"conversation_id": pl.String, "topic_id": pl.String, "scene_id": pl.String},
    "items": {
        "conversation_id": pl.String, "item_id": pl.String, "topic_id": pl.String, "kind": pl.String,
        "content": pl.String, "event_time": _TS, "keywords": pl.List(pl.String), "event_end": _TS,
        "time_granularity": pl.String, "time_phrase": pl.String, "time_source": pl.String,
    },
    "item_scene": {"conversation_id": pl.String, "item_id": pl.String, "scene_id": pl.String},
    "item_triggers": {
        "conversation_id": pl.String, "item_id": pl.String, "family": pl.String, "ordinal": pl.Int32,
        "text": pl.String, "rationale": pl.String,
    },
    "scene_triggers": {
        "conversation_id": pl.String, "scene_id": pl.String, "family": pl.String, "channel": pl.String,
        "text": pl.String,
    },
    "personas": {"conversation_id": pl.String, "speaker": pl.String, "persona": pl.String},
}


def memory_frames(memory: ConversationMemory) -> dict[str, pl.DataFrame]:
    """The memory as one polars frame per table (columns in table order)."""
    return memories_frames([memory])


def memories_frames(memories: Iterable[ConversationMemory]) -> dict[str, pl.DataFrame]:
    """Several memories as one polars frame per table (columns in table order), in the given order:
    one frame of every memory's rows, not a frame per memory concatenated (~0.7 s of a 1,000-conversation
    publish's ~1.4 s of statements)."""
    rows: dict[str, list[dict[str, Any]]] = {name: [] for name in MEMORY_TABLES}
    for memory in memories:
        _add_rows(memory, rows)
    return {name: pl.DataFrame(rows[name], schema=_SCHEMAS[name]) for name in MEMORY_TABLES}


def _add_rows(memory: ConversationMemory, rows: dict[str, list[dict[str, Any]]]) -> None:
    cid = memory.conversation_id
    for s in memory.scenes:
        rows["scenes"].append({
            "conversation_id": cid, "scene_id": s.scene_id, "seq": s.seq, "title": s.title,
            "summary": s.summary, "narrative": s.narrative, "turn_ids": list(s.turn_ids),
            "start_time": s.start_time, "end_time": s.end_time,
        })
    for t in memory.topics:
        rows["topics"].append({
            "conversation_id": cid, "topic_id": t.topic_id, "seq": t.seq, "title": t.title,
            "keywords": list(t.keywords),
        })
        rows["topic_scene"].extend(
            {"conversation_id": cid, "topic_id": t.topic_id, "scene_id": sid} for sid in t.scene_ids
        )
    for i in memory.items:
        rows["items"].append({
            "conversation_id": cid, "item_id": i.item_id, "topic_id": i.topic_id, "kind": i.kind,
            "content": i.content, "event_time": i.event_time, "keywords": list(i.keywords), "event_end": i.event_end,
            "time_granularity": i.time_granularity, "time_phrase": i.time_phrase, "time_source": i.time_source,
        })
        rows["item_scene"].extend(
            {"conversation_id": cid, "item_id": i.item_id, "scene_id": sid} for sid in i.source_scene_ids
        )
    for it in memory.item_triggers:
        for n, ent in enumerate(it.entities):
            rows["item_triggers"].append({
                "conversation_id": cid, "item_id": it.item_id, "family": "entity", "ordinal": n,
                "text": ent, "rationale": None,
            })
        for n, br in enumerate(it.bridges):
            rows["item_triggers"].append({
                "conversation_id": cid, "item_id": it.item_id, "family": "bridge", "ordinal": n,
                "text": br.situation, "rationale": br.rationale,
            })
    for ft in memory.family_triggers:  # a declared family beyond the built-in four (tmem.construct.families)
        rows["item_triggers"].extend(
            {"conversation_id": cid, "item_id": ft.item_id, "family": ft.family, "ordinal": n, "text": text,
             "rationale": None}
            for n, text in enumerate(ft.texts)
        )
    for st in memory.scene_triggers:
        for attr in SCENE_ATTRIBUTES:
            rows["scene_triggers"].append({
                "conversation_id": cid, "scene_id": st.scene_id, "family": "scene", "channel": attr,
                "text": getattr(st, attr),
            })
        for channel, text in st.horizons.items():
            rows["scene_triggers"].append({
                "conversation_id": cid, "scene_id": st.scene_id, "family": "horizon", "channel": channel,
                "text": text,
            })
    for p in memory.personas:
        rows["personas"].append({
            "conversation_id": cid, "speaker": p.speaker,
            "persona": json.dumps(p.model_dump(mode="json", exclude={"conversation_id", "speaker"}), sort_keys=True),
        })


def replace_memories(con: duckdb.DuckDBPyConnection, memories: Iterable[ConversationMemory]) -> None:
    """Replace the stored memory of each given conversation, all in one transaction, per table with one
    DELETE and one INSERT however many conversations (a statement per conversation and table cost ~25 ms
    each). Only what differs is written: the DELETE removes the conversations' rows that no new row
    equals in every column, the INSERT adds the new rows but those stored (as a multiset), so the tables end as if
    every row had been replaced. A nightly that adds a session to each of 1,000 conversations leaves
    most of their rows as they were; rewriting all of them made the commit ~10 x longer (2.0 against
    0.2 s here), every row deleted and inserted again going through the write-ahead log and checkpoint."""
    memories = list(memories)
    if not memories:
        return
    ids = [m.conversation_id for m in memories]
    if len(set(ids)) != len(ids):
        raise ValueError(f"replace_memories: a conversation is given twice: {sorted({i for i in ids if ids.count(i) > 1})}")
    frames = memories_frames(memories)
    cur = con.cursor()  # its own handle: the staged frames and the transaction are this write's alone
    try:
        for name in MEMORY_TABLES:
            cur.register(f"_new_{name}", frames[name])
        cur.execute("BEGIN TRANSACTION")
        try:
            for name in MEMORY_TABLES:
                # Every table's key is part of its columns, so a stored row equal to a new one in every
                # column is that row (NULLs equal NULLs: IS NOT DISTINCT FROM).
                same = " AND ".join(f"f.{column} IS NOT DISTINCT FROM t.{column}" for column in _SCHEMAS[name])
                cur.execute(f"DELETE FROM {name} AS t WHERE list_contains(?, t.conversation_id) "  # noqa: S608 -- fixed names
                            f"AND NOT EXISTS (SELECT 1 FROM _new_{name} AS f WHERE {same})", [ids])
                # EXCEPT ALL, not NOT EXISTS: a row given twice is still inserted twice and refused by the key
                cur.execute(f"INSERT INTO {name} (SELECT * FROM _new_{name} EXCEPT ALL SELECT * FROM {name} "  # noqa: S608
                            "WHERE list_contains(?, conversation_id))", [ids])
        except duckdb.Error:
            cur.execute("ROLLBACK")
            raise
        cur.execute("COMMIT")
    finally:
        cur.close()


def record_memory_build(
    con: duckdb.DuckDBPyConnection, conversation_id: str, build_id: str, run_id: str, watermark_turn_seq: int, at: datetime
) -> None:
    record_memory_builds(con, [(conversation_id, build_id, watermark_turn_seq)], run_id, at)


def record_memory_builds(
    con: duckdb.DuckDBPyConnection, builds: Sequence[tuple[str, str, int]], run_id: str, at: datetime
) -> None:
    """Record (conversation id, build id, watermark turn seq) of each published build, in one statement
    (a statement per row took ~10 ms each: ~10 s of a 1,000-conversation publish, everything else waiting)."""
    if builds:
        table = pa.table({
            "conversation_id": pa.array([b[0] for b in builds], pa.string()),
            "build_id": pa.array([b[1] for b in builds], pa.string()),
            "run_id": pa.array([run_id] * len(builds), pa.string()),
            "watermark_turn_seq": pa.array([b[2] for b in builds], pa.int32()),
            "built_at": pa.array([at] * len(builds), pa.timestamp("us", tz="UTC")),
        })
        insert_arrow(con, "INSERT OR REPLACE INTO memory_builds "
                          "(conversation_id, build_id, run_id, watermark_turn_seq, built_at) SELECT * FROM {staged}", table)


def recorded_builds(con: duckdb.DuckDBPyConnection) -> dict[str, str]:
    """Conversation id -> the build id last recorded for it."""
    return {str(c): str(b) for c, b in con.execute("SELECT conversation_id, build_id FROM memory_builds").fetchall()}


def _list(value: Any) -> tuple[str, ...]:
    return tuple(value or ())


# The queries that read one conversation's memory, in the row order ``memory_from_rows`` expects.
# Each selects exactly the columns it needs; ``tmem.store.snapshot.image`` builds the same rows
# for every conversation at once (its SQL must keep these orders).
MEMORY_ROW_QUERIES: dict[str, str] = {
    "scenes": "SELECT scene_id, seq, title, summary, narrative, turn_ids, start_time, end_time "
              "FROM scenes WHERE conversation_id = ? ORDER BY seq, scene_id",
    "topic_scene": "SELECT ts.topic_id, ts.scene_id FROM topic_scene ts JOIN scenes s USING (conversation_id, scene_id) "
                   "WHERE ts.conversation_id = ? ORDER BY s.seq, ts.topic_id, ts.scene_id",
    "topics": "SELECT topic_id, seq, title, keywords FROM topics WHERE conversation_id = ? ORDER BY seq, topic_id",
    "item_scene": "SELECT i.item_id, i.scene_id FROM item_scene i JOIN scenes s USING (conversation_id, scene_id) "
                  "WHERE i.conversation_id = ? ORDER BY s.seq, i.item_id, i.scene_id",
    "items": "SELECT item_id, topic_id, kind, content, event_time, keywords, event_end, time_granularity, time_phrase, "
             "time_source FROM items WHERE conversation_id = ? ORDER BY item_id",
    "item_triggers": "SELECT item_id, family, text, rationale FROM item_triggers WHERE conversation_id = ? "
                     "ORDER BY item_id, family, ordinal",
    "scene_triggers": "SELECT scene_id, family, channel, text FROM scene_triggers WHERE conversation_id = ? "
                      "ORDER BY scene_id, family, channel",
    "personas": "SELECT speaker, persona FROM personas WHERE conversation_id = ? ORDER BY speaker",
}

Rows = dict[str, list[tuple[Any, ...]] | list[list[Any]]]


# Items of a snapshot published before m007 (no time columns): read as stated days.
_ITEMS_BEFORE_M007 = ("SELECT item_id, topic_id, kind, content, event_time, keywords FROM items "
                      "WHERE conversation_id = ? ORDER BY item_id")


def read_memory(con: duckdb.DuckDBPyConnection, conversation_id: str) -> ConversationMemory:
    """The stored memory of one conversation (empty tuples if never built)."""
    rows: Rows = {}
    for name, sql in MEMORY_ROW_QUERIES.items():
        try:
            rows[name] = con.execute(sql, [conversation_id]).fetchall()
        except duckdb.BinderException:
            if name != "items":
                raise
            rows[name] = con.execute(_ITEMS_BEFORE_M007, [conversation_id]).fetchall()
    return memory_from_rows(conversation_id, rows)


def _item_time(row: tuple[Any, ...] | list[Any]) -> dict[str, Any]:
    """The time fields of an item row (columns 6-9; NULL in rows written before m007)."""
    end, granularity, phrase, source = row[6:10]
    return {"event_end": end, "time_granularity": granularity or "day", "time_phrase": phrase or "",
            "time_source": source or "stated"}


def memory_from_rows(conversation_id: str, rows: Rows) -> ConversationMemory:
    """Assemble a :class:`ConversationMemory` from the rows of :data:`MEMORY_ROW_QUERIES` (same columns and
    order; timestamps as aware datetimes, persona bodies as JSON text)."""
    scenes = tuple(
        Scene(conversation_id=conversation_id, scene_id=r[0], seq=r[1], title=r[2], summary=r[3], narrative=r[4],
              turn_ids=_list(r[5]), start_time=r[6], end_time=r[7])
        for r in rows["scenes"]
    )
    members: dict[str, list[str]] = {}
    for topic_id, scene_id in rows["topic_scene"]:
        members.setdefault(topic_id, []).append(scene_id)
    topics = tuple(
        Topic(conversation_id=conversation_id, topic_id=r[0], seq=r[1], title=r[2], keywords=_list(r[3]),
              scene_ids=tuple(members.get(r[0], ())))
        for r in rows["topics"]
    )
    sources: dict[str, list[str]] = {}
    for item_id, scene_id in rows["item_scene"]:
        sources.setdefault(item_id, []).append(scene_id)
    items = tuple(
        Item(conversation_id=conversation_id, item_id=r[0], topic_id=r[1], kind=r[2], content=r[3], event_time=r[4],
             keywords=_list(r[5]), source_scene_ids=tuple(sources.get(r[0], ())), **_item_time(r))
        for r in rows["items"]
    )
    ents: dict[str, list[str]] = {}
    brgs: dict[str, list[BridgeTrigger]] = {}
    added: dict[tuple[str, str], list[str]] = {}  # (family, item id) -> texts of a declared family
    for item_id, family, text, rationale in rows["item_triggers"]:
        if family == "entity":
            ents.setdefault(item_id, []).append(text)
        elif family == "bridge":
            brgs.setdefault(item_id, []).append(BridgeTrigger(situation=text, rationale=rationale or ""))
        else:
            added.setdefault((family, item_id), []).append(text)
    item_triggers = tuple(
        ItemTriggers(conversation_id=conversation_id, item_id=iid, entities=tuple(ents.get(iid, ())),
                     bridges=tuple(brgs.get(iid, ())))
        for iid in sorted(set(ents) | set(brgs))
    )
    attrs: dict[str, dict[str, str]] = {}
    hors: dict[str, dict[str, str]] = {}
    for scene_id, family, channel, text in rows["scene_triggers"]:
        (attrs if family == "scene" else hors).setdefault(scene_id, {})[channel] = text
    scene_triggers = tuple(
        SceneTriggers(conversation_id=conversation_id, scene_id=sid,
                      situation=attrs.get(sid, {}).get("situation", ""), object=attrs.get(sid, {}).get("object", ""),
                      event=attrs.get(sid, {}).get("event", ""), emotion=attrs.get(sid, {}).get("emotion", ""),
                      horizons=hors.get(sid, {}))
        for sid in sorted(set(attrs) | set(hors))
    )
    personas = tuple(
        Persona(conversation_id=conversation_id, speaker=speaker, **json.loads(body))
        for speaker, body in rows["personas"]
    )
    family_triggers = tuple(
        FamilyTriggers(conversation_id=conversation_id, family=family, item_id=item_id, texts=tuple(texts))
        for (family, item_id), texts in sorted(added.items())
    )
    return ConversationMemory(conversation_id=conversation_id, scenes=scenes, topics=topics, items=items,
                              item_triggers=item_triggers, scene_triggers=scene_triggers, personas=personas,
                              family_triggers=family_triggers)

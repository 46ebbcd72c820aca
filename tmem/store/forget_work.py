"""Forgetting a conversation in the builder's working database (``work.duckdb``).

:func:`delete_from_work` removes, in one transaction, every row that names the conversation —
every base table with a ``conversation_id`` column (turns, sessions, the conversation row, QA,
the memory tables, ``memory_builds``, quarantine, its usage-ledger rows, its embedding
ownerships, its batch-journal requests) — plus the cached LLM answers and embeddings that only
it used, batches left without requests, and its traces in ``build_runs`` (its id in the inputs
list, its failures; a run label that contains the id is replaced). Which cache rows are its is
told by the ledger (``llm_usage.cache_key`` with ``conversation_id``, m010) and by
``embedding_owners``: a row another conversation also used stays (it is that conversation's too).
Rows written before m010 have no owner; the caller decides what happens to them
(``unowned``: delete or keep).

DuckDB marks deleted rows and reuses their blocks later; it does not overwrite them. So the
forget ends with :func:`rewrite_work_db`: the whole database is copied into a new file and the
new file replaces the old one, leaving no block of the old one behind.
"""

from __future__ import annotations

import json
import os
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Literal

import duckdb

from tmem.errors import StoreError
from tmem.store.duck import WORK_DB, work_db_path

Unowned = Literal["refuse", "delete", "keep"]
NOT_CONVERSATION_ROWS = frozenset({"forget_jobs"})  # has no conversation_id column; listed for clarity
LABEL_REDACTED = "(redacted by tmem forget)"

# The conversation's cached LLM answers no other conversation used: keys its ledger rows name,
# minus keys a ledger row of another conversation names.
_OWN_LLM = """
    SELECT DISTINCT u.cache_key FROM llm_usage u
    WHERE u.conversation_id = $cid AND u.cache_key IS NOT NULL
      AND NOT EXISTS (SELECT 1 FROM llm_usage o WHERE o.cache_key = u.cache_key AND o.conversation_id <> $cid)
"""
_SHARED_LLM = """
    SELECT count(DISTINCT u.cache_key) FROM llm_usage u
    WHERE u.conversation_id = $cid AND u.cache_key IS NOT NULL
      AND EXISTS (SELECT 1 FROM llm_usage o WHERE o.cache_key = u.cache_key AND o.conversation_id <> $cid)
      AND EXISTS (SELECT 1 FROM llm_cache c WHERE c.cache_key = u.cache_key)
"""
_UNOWNED_LLM = """
    SELECT c.cache_key FROM llm_cache c WHERE NOT EXISTS
        (SELECT 1 FROM llm_usage u WHERE u.cache_key = c.cache_key AND u.conversation_id IS NOT NULL)
"""
_OWN_EMBEDDINGS = """
    SELECT DISTINCT e.model, e.text_hash FROM embedding_owners e WHERE e.conversation_id = $cid AND NOT EXISTS
        (SELECT 1 FROM embedding_owners o WHERE o.model = e.model AND o.text_hash = e.text_hash AND o.conversation_id <> $cid)
"""
_SHARED_EMBEDDINGS = """
    SELECT count(*) FROM embedding_owners e WHERE e.conversation_id = $cid
      AND EXISTS (SELECT 1 FROM embedding_owners o WHERE o.model = e.model AND o.text_hash = e.text_hash
                  AND o.conversation_id <> $cid)
      AND EXISTS (SELECT 1 FROM embedding_cache c WHERE c.model = e.model AND c.text_hash = e.text_hash)
"""
_UNOWNED_EMBEDDINGS = """
    SELECT c.model, c.text_hash FROM embedding_cache c WHERE NOT EXISTS
        (SELECT 1 FROM embedding_owners o WHERE o.model = c.model AND o.text_hash = c.text_hash)
"""
_EMPTIED_BATCHES = """
    SELECT DISTINCT r.batch_id FROM llm_batch_requests r WHERE r.conversation_id = $cid AND NOT EXISTS
        (SELECT 1 FROM llm_batch_requests o WHERE o.batch_id = r.batch_id AND o.conversation_id IS DISTINCT FROM $cid)
"""
_IN_FLIGHT = """
    SELECT DISTINCT b.batch_id FROM llm_batch_requests r JOIN llm_batches b USING (batch_id)
    WHERE r.conversation_id = $cid AND b.status = 'submitted' ORDER BY 1
"""


@dataclass(frozen=True)
class WorkPlan:
    """What the working database holds of one conversation (and what forgetting it removes)."""

    rows: dict[str, int]  # table -> rows naming the conversation
    llm_cache: int  # cached answers only it used
    llm_cache_shared: int  # cached answers it used that another conversation used too (kept)
    embedding_cache: int
    embedding_cache_shared: int
    unowned_llm_cache: int  # rows without any owner (written before m010): see ``unowned``
    unowned_embedding_cache: int
    build_runs: int  # runs whose inputs or failures name it (scrubbed)
    emptied_batches: int  # journalled batches all of whose requests were its (removed)
    in_flight_batches: tuple[str, ...] = field(default=())  # submitted, not collected: the provider holds their input

    @property
    def total_rows(self) -> int:
        return sum(self.rows.values())

    def as_dict(self) -> dict[str, object]:
        return {"rows": dict(self.rows), "llm_cache": self.llm_cache, "llm_cache_shared_kept": self.llm_cache_shared,
                "embedding_cache": self.embedding_cache, "embedding_cache_shared_kept": self.embedding_cache_shared,
                "unowned_llm_cache": self.unowned_llm_cache, "unowned_embedding_cache": self.unowned_embedding_cache,
                "build_runs_scrubbed": self.build_runs, "batches_removed": self.emptied_batches,
                "in_flight_batches": list(self.in_flight_batches)}


def conversation_tables(con: duckdb.DuckDBPyConnection) -> list[str]:
    """Every base table of the main schema with a ``conversation_id`` column, by name."""
    rows = con.execute(
        "SELECT c.table_name FROM information_schema.columns c JOIN information_schema.tables t "
        "USING (table_catalog, table_schema, table_name) WHERE c.column_name = 'conversation_id' "
        "AND t.table_type = 'BASE TABLE' AND t.table_schema = 'main' AND t.table_catalog = current_database() "
        "ORDER BY 1"
    ).fetchall()
    return [str(r[0]) for r in rows if str(r[0]) not in NOT_CONVERSATION_ROWS]


def _count(con: duckdb.DuckDBPyConnection, sql: str, params: Mapping[str, object] | None = None) -> int:
    row = con.execute(sql, dict(params or {})).fetchone()
    return int(row[0]) if row else 0


def scrubbed_run(inputs_json: str | None, failures_json: str | None, conversation_id: str) -> tuple[str, str | None] | None:
    """A ``build_runs`` row's inputs and failures (JSON) without the conversation, or None when they do
    not name it."""
    inputs = json.loads(inputs_json or "{}")
    failures = json.loads(failures_json) if failures_json else None
    changed = False
    ids = inputs.get("conversation_ids")
    if isinstance(ids, list) and conversation_id in ids:
        inputs["conversation_ids"] = [i for i in ids if i != conversation_id]
        changed = True
    label = inputs.get("label")
    if isinstance(label, str) and conversation_id in label:  # a label may join ids: any containing it goes
        inputs["label"] = LABEL_REDACTED
        changed = True
    if isinstance(failures, list):
        kept = [f for f in failures if not (isinstance(f, dict) and f.get("conversation_id") == conversation_id)]
        if len(kept) != len(failures):
            failures, changed = kept, True
    if not changed:
        return None
    return (json.dumps(inputs, sort_keys=True, default=str),
            None if failures is None else json.dumps(failures, sort_keys=True, default=str))


def _runs_naming(
    con: duckdb.DuckDBPyConnection, conversation_id: str, table: str = "build_runs"
) -> list[tuple[str, str, str | None]]:
    """(run id, scrubbed inputs JSON, scrubbed failures JSON) of every run that names the conversation."""
    out: list[tuple[str, str, str | None]] = []
    for run_id, inputs_json, failures_json in con.execute(f"SELECT run_id, inputs, failures FROM {table}").fetchall():  # noqa: S608 -- fixed names
        scrubbed = scrubbed_run(inputs_json, failures_json, conversation_id)
        if scrubbed is not None:
            out.append((str(run_id), *scrubbed))
    return out


def scrub_build_runs(con: duckdb.DuckDBPyConnection, conversation_id: str, table: str = "build_runs") -> int:
    """Remove the conversation from the run records of ``table`` (the working database's, or a
    snapshot's copy of them); returns the runs changed."""
    scrubbed = _runs_naming(con, conversation_id, table)
    for run_id, inputs, failures in scrubbed:
        con.execute(f"UPDATE {table} SET inputs = ?, failures = ? WHERE run_id = ?", [inputs, failures, run_id])  # noqa: S608 -- fixed names
    return len(scrubbed)


def plan_work(con: duckdb.DuckDBPyConnection, conversation_id: str) -> WorkPlan:
    """What :func:`delete_from_work` would remove (nothing is changed)."""
    p = {"cid": conversation_id}
    rows = {t: _count(con, f'SELECT count(*) FROM "{t}" WHERE conversation_id = $cid', p)  # noqa: S608 -- names from information_schema
            for t in conversation_tables(con)}
    return WorkPlan(
        rows={t: n for t, n in rows.items() if n},
        llm_cache=_count(con, f"SELECT count(*) FROM llm_cache WHERE cache_key IN ({_OWN_LLM})", p),  # noqa: S608 -- constant SQL
        llm_cache_shared=_count(con, _SHARED_LLM, p),
        embedding_cache=_count(con, f"SELECT count(*) FROM embedding_cache WHERE (model, text_hash) IN ({_OWN_EMBEDDINGS})", p),  # noqa: S608
        embedding_cache_shared=_count(con, _SHARED_EMBEDDINGS, p),
        unowned_llm_cache=_count(con, f"SELECT count(*) FROM ({_UNOWNED_LLM})"),  # noqa: S608 -- constant SQL
        unowned_embedding_cache=_count(con, f"SELECT count(*) FROM ({_UNOWNED_EMBEDDINGS})"),  # noqa: S608
        build_runs=len(_runs_naming(con, conversation_id)),
        emptied_batches=_count(con, f"SELECT count(*) FROM ({_EMPTIED_BATCHES})", p),  # noqa: S608 -- constant SQL
        in_flight_batches=tuple(str(r[0]) for r in con.execute(_IN_FLIGHT, p).fetchall()),
    )


def delete_from_work(
    con: duckdb.DuckDBPyConnection, conversation_id: str, *, unowned: Unowned,
    then: Callable[[WorkPlan], None] | None = None,
) -> WorkPlan:
    """Remove the conversation from the working database in one transaction (see the module doc);
    ``unowned="delete"`` also deletes every cache row without an owner. ``then(plan)`` runs inside
    the transaction last (the forget records its progress there). Returns what was removed."""
    plan = plan_work(con, conversation_id)
    p = {"cid": conversation_id}
    con.execute("BEGIN TRANSACTION")
    try:
        con.execute(f"DELETE FROM llm_cache WHERE cache_key IN ({_OWN_LLM})", p)  # noqa: S608 -- constant SQL
        con.execute(f"DELETE FROM embedding_cache WHERE (model, text_hash) IN ({_OWN_EMBEDDINGS})", p)  # noqa: S608
        if unowned == "delete":
            con.execute(f"DELETE FROM llm_cache WHERE cache_key IN ({_UNOWNED_LLM})")  # noqa: S608 -- constant SQL
            con.execute(f"DELETE FROM embedding_cache WHERE (model, text_hash) IN ({_UNOWNED_EMBEDDINGS})")  # noqa: S608
        emptied = [str(r[0]) for r in con.execute(_EMPTIED_BATCHES, p).fetchall()]
        scrub_build_runs(con, conversation_id)
        for table in conversation_tables(con):
            con.execute(f'DELETE FROM "{table}" WHERE conversation_id = $cid', p)  # noqa: S608 -- names from information_schema
        if emptied:
            con.execute("DELETE FROM llm_batches WHERE batch_id IN (SELECT unnest(?::VARCHAR[]))", [emptied])
        if then is not None:
            then(plan)
    except BaseException:
        con.execute("ROLLBACK")
        raise
    con.execute("COMMIT")
    return plan


def holds_conversation(con: duckdb.DuckDBPyConnection, conversation_id: str) -> bool:
    """Whether any row of the working database names the conversation (exact match on the id)."""
    p = {"cid": conversation_id}
    return any(_count(con, f'SELECT count(*) FROM (SELECT 1 FROM "{t}" WHERE conversation_id = $cid LIMIT 1)', p)  # noqa: S608
               for t in conversation_tables(con))


FRESH_SUFFIX = ".forget-new"


def rewrite_work_db(con: duckdb.DuckDBPyConnection, store: Path, finish: Callable[[str], None]) -> tuple[int, int]:
    """Copy the whole working database into a new file and put it in place of the old one, so no
    block of deleted rows survives. ``finish(schema)`` runs last against the copy (attached as
    ``schema``): the forget marks itself done there, so the old file still says "rewrite pending"
    until the new one replaces it. ``con`` keeps the old file (and the store's write lock) until
    the caller closes it, which it must do next and without writing. Returns (bytes before, after).

    Safe when killed at any point: the copy is written under a temporary name and replaces the
    database by rename; a leftover copy is deleted by the next attempt."""
    path = work_db_path(store)
    fresh = path.with_name(WORK_DB + FRESH_SUFFIX)
    for leftover in (fresh, fresh.with_name(fresh.name + ".wal")):
        leftover.unlink(missing_ok=True)
    row = con.execute("SELECT current_database()").fetchone()
    if row is None:
        raise StoreError(f"{path}: cannot name the working database")
    database = str(row[0])
    try:
        con.execute("CHECKPOINT")
        before = path.stat().st_size
        con.execute("ATTACH ? AS tmem_fresh", [str(fresh)])
        try:
            con.execute(f'COPY FROM DATABASE "{database}" TO tmem_fresh')
            finish("tmem_fresh")
        finally:
            con.execute("DETACH tmem_fresh")
    except duckdb.Error as exc:
        fresh.unlink(missing_ok=True)
        raise StoreError(f"{path}: rewriting the working database failed; it is unchanged ({exc})") from exc
    with open(fresh, "rb") as fh:
        os.fsync(fh.fileno())
    after = fresh.stat().st_size
    os.replace(fresh, path)
    fd = os.open(path.parent, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)
    return before, after

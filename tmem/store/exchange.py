"""The exchange between the single publisher and build workers that must not write DuckDB.

``work.duckdb`` has one writer (the flow process) and, while it is open, no other process may
open it at all. So before a distributed build the publisher exports what workers read — the
turns of the conversations to build and the LLM and embedding cache rows of the build's
models — to ``STORE/exchange/<run_id>.duckdb``, which workers open read-only (any number of
processes may). What workers would have written comes back as journal batches
(:mod:`tmem.llm.journal`) and :func:`write_journal` stores them in one transaction.
"""

from __future__ import annotations

import os
import re
from dataclasses import dataclass
from pathlib import Path

import duckdb
import numpy as np
import pyarrow as pa

from tmem.errors import ConfigError, StoreError
from tmem.ports import JournalBatch, ServiceAddress
from tmem.settings import Settings
from tmem.store.duck import open_read_only
from tmem.store.llm_cache import write_cache_rows, write_usage_rows

EXCHANGE_DIR = "exchange"
_SAFE = re.compile(r"[^A-Za-z0-9._-]")
_STAGED = "tmem_journal_embeddings"


@dataclass(frozen=True)
class ExchangeInfo:
    path: Path
    turns: int
    llm_cache_rows: int
    embedding_rows: int


def exchange_path(store: Path, run_id: str) -> Path:
    return Path(store) / EXCHANGE_DIR / f"{_SAFE.sub('_', run_id)}.duckdb"


def build_settings_view(settings: Settings) -> dict[str, str]:
    """The settings that shape a build's output; a worker must see the same values as the publisher."""
    return {
        "TMEM_LLM_BUILD_MODEL": settings.endpoint("build").model,
        "TMEM_EMBEDDING_MODEL": settings.embedding_model,
        "TMEM_SEGMENT_WINDOW": str(settings.segment_window),
        "TMEM_TOPIC_BATCH": str(settings.topic_batch),
        "TMEM_TOPIC_SHORTLIST": str(settings.topic_shortlist),
        "TMEM_TRIGGER_BATCH": str(settings.trigger_batch),
        "TMEM_SCENE_TRIGGER_BATCH": str(settings.scene_trigger_batch),
        # Completion budgets decide where a stage splits an input whose answer does not fit.
        "TMEM_LLM_MAX_TOKENS": str(settings.llm_max_tokens or ""),
        "TMEM_LLM_OUTPUT_BUDGETS": ",".join(f"{k}={v}" for k, v in sorted(settings.output_budgets.items())),
    }


def check_worker_settings(con: duckdb.DuckDBPyConnection, path: Path, settings: Settings) -> None:
    """Raise :class:`ConfigError` naming every build setting this worker sees differently."""
    expected = dict(cur_rows(con, "SELECT key, value FROM exchange_settings"))
    mine = build_settings_view(settings)
    wrong = [f"{k}={mine.get(k)!r} (publisher: {v!r})" for k, v in sorted(expected.items()) if mine.get(k) != v]
    if wrong:
        raise ConfigError(f"{path}: this worker's settings differ from the build's: {', '.join(wrong)}")


def export_exchange(
    con: duckdb.DuckDBPyConnection, path: Path, conversation_ids: list[str], settings: Settings, *,
    encoder: ServiceAddress | None = None, embeddings: bool = True,
) -> ExchangeInfo:
    """Write the exchange file (replacing any earlier one at ``path``); atomic by rename.

    ``encoder``: the publisher's encoder service, which workers on its machine embed through
    (:mod:`tmem.llm.embed_service`). ``embeddings=False`` leaves the embedding cache out (its table
    is there, empty): every worker embeds through the service, whose queue looks texts up in the
    working database itself — at 1,000 conversations the cache holds ~200,000 vectors."""
    view = build_settings_view(settings)
    llm_model, embedding_model = view["TMEM_LLM_BUILD_MODEL"], view["TMEM_EMBEDDING_MODEL"]
    path.parent.mkdir(parents=True, exist_ok=True)
    partial = path.with_name(path.name + ".partial")
    partial.unlink(missing_ok=True)
    cur = con.cursor()
    try:
        cur.execute(f"ATTACH '{_quoted(partial)}' AS tmem_exchange")
        try:
            cur.execute(
                "CREATE TABLE tmem_exchange.turns AS SELECT * FROM turns "
                "WHERE conversation_id IN (SELECT unnest(?::VARCHAR[]))",
                [conversation_ids],
            )
            cur.execute("CREATE TABLE tmem_exchange.llm_cache AS SELECT * FROM llm_cache WHERE model = ?", [llm_model])
            cur.execute("CREATE UNIQUE INDEX llm_cache_key ON tmem_exchange.llm_cache (cache_key)")
            cur.execute(
                "CREATE TABLE tmem_exchange.embedding_cache AS SELECT * FROM embedding_cache WHERE model = ? AND ?",
                [embedding_model, embeddings],
            )
            cur.execute("CREATE TABLE tmem_exchange.exchange_encoder (host VARCHAR, address VARCHAR, authkey VARCHAR)")
            if encoder is not None:
                cur.execute("INSERT INTO tmem_exchange.exchange_encoder VALUES (?, ?, ?)",
                            [encoder.host, encoder.address, encoder.authkey])
            cur.execute("CREATE TABLE tmem_exchange.exchange_settings (key VARCHAR PRIMARY KEY, value VARCHAR)")
            cur.executemany("INSERT INTO tmem_exchange.exchange_settings VALUES (?, ?)", sorted(view.items()))
            counts = [
                _count(cur, f"tmem_exchange.{t}") for t in ("turns", "llm_cache", "embedding_cache")
            ]
        finally:
            cur.execute("DETACH tmem_exchange")
    except duckdb.Error as exc:
        partial.unlink(missing_ok=True)
        raise StoreError(f"{path}: cannot export the build exchange ({exc})") from exc
    finally:
        cur.close()
    os.replace(partial, path)
    return ExchangeInfo(path, *counts)


def served_encoder(con: duckdb.DuckDBPyConnection) -> ServiceAddress | None:
    """The publisher's encoder service named by the exchange, if it serves one."""
    cur = con.cursor()
    try:
        row = cur.execute("SELECT host, address, authkey FROM exchange_encoder").fetchone()
    finally:
        cur.close()
    return ServiceAddress(str(row[0]), str(row[1]), str(row[2])) if row else None


def open_exchange(path: Path) -> duckdb.DuckDBPyConnection:
    """The exchange file, read-only (never the working database)."""
    if not path.is_file():
        raise StoreError(f"{path}: no build exchange here; the publisher exports it before submitting work")
    return open_read_only(path, "cannot open the build exchange read-only")


def write_journal(con: duckdb.DuckDBPyConnection, batch: JournalBatch) -> None:
    """Store a journal batch — cache entries, ledger rows, embeddings — in one transaction."""
    if batch.empty:
        return
    cur = con.cursor()
    try:
        cur.execute("BEGIN TRANSACTION")
        try:
            # As the in-process cache and ledger write them: one row per key (the last answer wins, a
            # stored key replaced), the rows as one Arrow table. ``executemany`` ran a statement per row:
            # ~20 s of the publisher's CPU for the ~8,600 rows of a 200-conversation Dask nightly.
            if batch.cache_entries:
                write_cache_rows(cur, list(batch.cache_entries))
            if batch.usage:
                write_usage_rows(cur, list(batch.usage))
            if batch.embeddings:
                staged = pa.table({
                    "model": pa.array([e.model for e in batch.embeddings], type=pa.string()),
                    "text_hash": pa.array([e.text_hash for e in batch.embeddings], type=pa.string()),
                    "vector": pa.array([np.asarray(e.vector, dtype=np.float32) for e in batch.embeddings],
                                       type=pa.list_(pa.float32())),
                })
                cur.register(_STAGED, staged)
                cur.execute(
                    f"INSERT INTO embedding_cache SELECT DISTINCT ON (model, text_hash) model, text_hash, vector "  # noqa: S608 -- constant name
                    f"FROM {_STAGED} ON CONFLICT DO NOTHING"
                )
                cur.unregister(_STAGED)
            cur.execute("COMMIT")
        except (duckdb.Error, pa.ArrowException) as exc:  # Arrow: a row whose values do not fit their column
            cur.execute("ROLLBACK")
            raise StoreError(
                f"work.duckdb: storing {len(batch.cache_entries)} cache entries, {len(batch.usage)} ledger rows and "
                f"{len(batch.embeddings)} embeddings from build workers failed; nothing was written ({exc})"
            ) from exc
    finally:
        cur.close()


def cur_rows(con: duckdb.DuckDBPyConnection, sql: str) -> list[tuple[str, str]]:
    cur = con.cursor()
    try:
        return [(str(k), str(v)) for k, v in cur.execute(sql).fetchall()]
    finally:
        cur.close()


def _count(cur: duckdb.DuckDBPyConnection, table: str) -> int:
    row = cur.execute(f"SELECT count(*) FROM {table}").fetchone()  # noqa: S608 -- constant names
    return int(row[0]) if row else 0


def _quoted(path: Path) -> str:
    return str(path).replace("'", "''")

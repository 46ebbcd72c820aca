"""Ordered, named DuckDB migrations of the builder's working database.

Each migration runs once, inside a transaction, and is recorded in ``schema_migrations``.
Never edit a landed migration: append a new one.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import NamedTuple


class Migration(NamedTuple):
    name: str
    sql: str


M001_INGEST = Migration(
    "m001_ingest",
    """
    CREATE TABLE conversations (
        conversation_id VARCHAR PRIMARY KEY,
        source_format   VARCHAR NOT NULL,
        source_path     VARCHAR NOT NULL,
        speakers        VARCHAR[] NOT NULL,
        watermark_session_index INTEGER NOT NULL,
        watermark_turn_seq      INTEGER NOT NULL,
        watermark_time  TIMESTAMPTZ NOT NULL,
        ingested_at     TIMESTAMPTZ NOT NULL,
        updated_at      TIMESTAMPTZ NOT NULL
    );
    CREATE TABLE sessions (
        conversation_id VARCHAR NOT NULL,
        session_id      VARCHAR NOT NULL,
        session_index   INTEGER NOT NULL,
        started_at      TIMESTAMPTZ NOT NULL,
        ingested_at     TIMESTAMPTZ NOT NULL,
        PRIMARY KEY (conversation_id, session_id)
    );
    CREATE TABLE turns (
        conversation_id VARCHAR NOT NULL,
        session_id      VARCHAR NOT NULL,
        turn_id         VARCHAR NOT NULL,
        seq             INTEGER NOT NULL,
        speaker         VARCHAR NOT NULL,
        text            VARCHAR NOT NULL,
        event_time      TIMESTAMPTZ NOT NULL,
        metadata        JSON,
        ingested_at     TIMESTAMPTZ NOT NULL,
        PRIMARY KEY (conversation_id, turn_id)
    );
    CREATE TABLE qa (
        conversation_id VARCHAR NOT NULL,
        qa_index        INTEGER NOT NULL,
        question        VARCHAR NOT NULL,
        answer          VARCHAR,
        adversarial_answer VARCHAR,
        evidence        VARCHAR[] NOT NULL,
        category        INTEGER NOT NULL,
        PRIMARY KEY (conversation_id, qa_index)
    );
    """,
)

M002_MEMORY = Migration(
    "m002_memory",
    """
    CREATE TABLE scenes (
        conversation_id VARCHAR NOT NULL,
        scene_id        VARCHAR NOT NULL,
        seq             INTEGER NOT NULL,
        title           VARCHAR NOT NULL,
        summary         VARCHAR NOT NULL,
        narrative       VARCHAR NOT NULL,
        turn_ids        VARCHAR[] NOT NULL,
        start_time      TIMESTAMPTZ NOT NULL,
        end_time        TIMESTAMPTZ NOT NULL,
        PRIMARY KEY (conversation_id, scene_id)
    );
    CREATE TABLE topics (
        conversation_id VARCHAR NOT NULL,
        topic_id        VARCHAR NOT NULL,
        seq             INTEGER NOT NULL,
        title           VARCHAR NOT NULL,
        keywords        VARCHAR[] NOT NULL,
        PRIMARY KEY (conversation_id, topic_id)
    );
    CREATE TABLE topic_scene (
        conversation_id VARCHAR NOT NULL,
        topic_id        VARCHAR NOT NULL,
        scene_id        VARCHAR NOT NULL,
        PRIMARY KEY (conversation_id, topic_id, scene_id)
    );
    CREATE TABLE items (
        conversation_id VARCHAR NOT NULL,
        item_id         VARCHAR NOT NULL,
        topic_id        VARCHAR NOT NULL,
        kind            VARCHAR NOT NULL CHECK (kind IN ('atomic', 'connected')),
        content         VARCHAR NOT NULL,
        event_time      TIMESTAMPTZ,
        keywords        VARCHAR[] NOT NULL,
        PRIMARY KEY (conversation_id, item_id)
    );
    CREATE TABLE item_scene (
        conversation_id VARCHAR NOT NULL,
        item_id         VARCHAR NOT NULL,
        scene_id        VARCHAR NOT NULL,
        PRIMARY KEY (conversation_id, item_id, scene_id)
    );
    CREATE TABLE item_triggers (
        conversation_id VARCHAR NOT NULL,
        item_id         VARCHAR NOT NULL,
        family          VARCHAR NOT NULL CHECK (family IN ('entity', 'bridge')),
        ordinal         INTEGER NOT NULL,
        text            VARCHAR NOT NULL,
        rationale       VARCHAR,
        PRIMARY KEY (conversation_id, item_id, family, ordinal)
    );
    CREATE TABLE scene_triggers (
        conversation_id VARCHAR NOT NULL,
        scene_id        VARCHAR NOT NULL,
        family          VARCHAR NOT NULL CHECK (family IN ('scene', 'horizon')),
        channel         VARCHAR NOT NULL,
        text            VARCHAR NOT NULL,
        PRIMARY KEY (conversation_id, scene_id, family, channel)
    );
    CREATE TABLE personas (
        conversation_id VARCHAR NOT NULL,
        speaker         VARCHAR NOT NULL,
        persona         JSON NOT NULL,
        PRIMARY KEY (conversation_id, speaker)
    );
    CREATE TABLE memory_builds (
        conversation_id VARCHAR PRIMARY KEY,
        build_id        VARCHAR NOT NULL,
        run_id          VARCHAR NOT NULL,
        watermark_turn_seq INTEGER NOT NULL,
        built_at        TIMESTAMPTZ NOT NULL
    );
    """,
)

M003_LLM = Migration(
    "m003_llm",
    """
    CREATE TABLE llm_cache (
        cache_key       VARCHAR PRIMARY KEY,
        operation       VARCHAR NOT NULL,
        model           VARCHAR NOT NULL,
        prompt_version  VARCHAR NOT NULL,
        response        JSON NOT NULL,
        prompt_tokens   INTEGER,
        completion_tokens INTEGER,
        created_at      TIMESTAMPTZ NOT NULL
    );
    CREATE TABLE llm_usage (
        run_id          VARCHAR NOT NULL,
        operation       VARCHAR NOT NULL,
        model           VARCHAR NOT NULL,
        prompt_tokens   INTEGER NOT NULL,
        completion_tokens INTEGER NOT NULL,
        latency_ms      DOUBLE NOT NULL,
        cache_hit       BOOLEAN NOT NULL,
        attempts        INTEGER NOT NULL,
        recorded_at     TIMESTAMPTZ NOT NULL
    );
    CREATE TABLE build_runs (
        run_id          VARCHAR PRIMARY KEY,
        started_at      TIMESTAMPTZ NOT NULL,
        finished_at     TIMESTAMPTZ,
        status          VARCHAR NOT NULL,
        inputs          JSON NOT NULL,
        counts          JSON,
        llm_calls       INTEGER,
        llm_cache_hits  INTEGER,
        prompt_tokens   BIGINT,
        completion_tokens BIGINT,
        failures        JSON,
        snapshot_id     VARCHAR
    );
    CREATE TABLE embedding_cache (
        model           VARCHAR NOT NULL,
        text_hash       VARCHAR NOT NULL,
        vector          FLOAT[] NOT NULL,
        PRIMARY KEY (model, text_hash)
    );
    """,
)

M004_USAGE_ESTIMATED = Migration(
    "m004_usage_estimated",
    """
    ALTER TABLE llm_usage ADD COLUMN usage_estimated BOOLEAN DEFAULT FALSE;
    """,
)

M005_LLM_BATCHES = Migration(
    "m005_llm_batches",
    """
    ALTER TABLE llm_usage ADD COLUMN batch BOOLEAN DEFAULT FALSE;
    ALTER TABLE llm_usage ADD COLUMN batch_prompt_tokens INTEGER DEFAULT 0;
    ALTER TABLE llm_usage ADD COLUMN batch_completion_tokens INTEGER DEFAULT 0;
    CREATE TABLE llm_batches (
        batch_id        VARCHAR PRIMARY KEY,
        input_file_id   VARCHAR NOT NULL,
        model           VARCHAR NOT NULL,
        requests        INTEGER NOT NULL,
        status          VARCHAR NOT NULL,   -- submitted | collected | failed
        submitted_at    TIMESTAMPTZ NOT NULL,
        finished_at     TIMESTAMPTZ
    );
    CREATE TABLE llm_batch_requests (
        digest          VARCHAR NOT NULL,   -- content hash of the request body
        batch_id        VARCHAR NOT NULL,
        custom_id       VARCHAR NOT NULL,
        operation       VARCHAR NOT NULL,
        PRIMARY KEY (digest, batch_id)
    );
    """,
)

# A conversation whose LLM answers stayed invalid after the bounded repair (tmem.store.quarantine).
# state: active (the conversation's latest build failed this way), superseded (a later build was
# quarantined again), cleared (a later build of the conversation succeeded: cleared_by_run).
M006_QUARANTINE = Migration(
    "m006_quarantine",
    """
    CREATE TABLE quarantine (
        conversation_id VARCHAR NOT NULL,
        run_id          VARCHAR NOT NULL,
        error_type      VARCHAR NOT NULL,
        operation       VARCHAR NOT NULL,
        input_ref       VARCHAR NOT NULL,
        input_digest    VARCHAR,
        input_excerpt   VARCHAR,
        raw_output      VARCHAR,
        reason          VARCHAR NOT NULL,
        quarantined_at  TIMESTAMPTZ NOT NULL,
        state           VARCHAR NOT NULL CHECK (state IN ('active', 'superseded', 'cleared')),
        cleared_at      TIMESTAMPTZ,
        cleared_by_run  VARCHAR,
        PRIMARY KEY (conversation_id, run_id)
    );
    """,
)

# An item's time as precisely as the dialogue gave it (tmem.domain.Item): the end of a span, the
# granularity (day | month | year | span), the dialogue's words, and where the time came from
# (stated | said | scene). Rows built before have NULLs, read as a stated day.
M007_ITEM_TIME = Migration(
    "m007_item_time",
    """
    ALTER TABLE items ADD COLUMN event_end TIMESTAMPTZ;
    ALTER TABLE items ADD COLUMN time_granularity VARCHAR;
    ALTER TABLE items ADD COLUMN time_phrase VARCHAR;
    ALTER TABLE items ADD COLUMN time_source VARCHAR;
    """,
)

# Construction health per call (tmem.ports.UsageRecord): the adapter's repair re-asks,
# whether the call was a construction check's re-ask, whether its answer was cut at the completion
# budget, whether it ended in invalid output; and the stages' notes per run (tmem.construct.outcome):
# clipped lists, reclassified items, dropped refs, splits, quarantined units.
M008_CONSTRUCTION_HEALTH = Migration(
    "m008_construction_health",
    """
    ALTER TABLE llm_usage ADD COLUMN repairs INTEGER DEFAULT 0;
    ALTER TABLE llm_usage ADD COLUMN checked_reask BOOLEAN DEFAULT FALSE;
    ALTER TABLE llm_usage ADD COLUMN truncated BOOLEAN DEFAULT FALSE;
    ALTER TABLE llm_usage ADD COLUMN output_error BOOLEAN DEFAULT FALSE;
    CREATE TABLE build_notes (
        run_id          VARCHAR NOT NULL,
        conversation_id VARCHAR NOT NULL,
        operation       VARCHAR NOT NULL,
        kind            VARCHAR NOT NULL CHECK (kind IN ('clipped', 'reclassified', 'dropped_ref', 'split',
                                                         'quarantined')),
        input_ref       VARCHAR NOT NULL,
        detail          VARCHAR NOT NULL,
        recorded_at     TIMESTAMPTZ NOT NULL
    );
    """,
)

# Quarantine of a unit smaller than a conversation (one topic chunk's items, one item's or scene's
# triggers, one speaker's persona): the conversation publishes without it. A conversation-level
# record is unit_kind 'conversation', unit_id = its conversation id, ordinal 0. DuckDB cannot change
# a primary key in place, so the table is rebuilt with its rows.
M009_QUARANTINE_UNITS = Migration(
    "m009_quarantine_units",
    """
    CREATE TABLE quarantine_units (
        conversation_id VARCHAR NOT NULL,
        run_id          VARCHAR NOT NULL,
        unit_kind       VARCHAR NOT NULL DEFAULT 'conversation',
        unit_id         VARCHAR NOT NULL,
        ordinal         INTEGER NOT NULL DEFAULT 0,
        error_type      VARCHAR NOT NULL,
        operation       VARCHAR NOT NULL,
        input_ref       VARCHAR NOT NULL,
        input_digest    VARCHAR,
        input_excerpt   VARCHAR,
        raw_output      VARCHAR,
        reason          VARCHAR NOT NULL,
        quarantined_at  TIMESTAMPTZ NOT NULL,
        state           VARCHAR NOT NULL CHECK (state IN ('active', 'superseded', 'cleared')),
        cleared_at      TIMESTAMPTZ,
        cleared_by_run  VARCHAR,
        PRIMARY KEY (conversation_id, run_id, unit_kind, unit_id, ordinal)
    );
    INSERT INTO quarantine_units (conversation_id, run_id, unit_kind, unit_id, ordinal, error_type, operation,
        input_ref, input_digest, input_excerpt, raw_output, reason, quarantined_at, state, cleared_at, cleared_by_run)
    SELECT conversation_id, run_id, 'conversation', conversation_id, 0, error_type, operation, input_ref,
        input_digest, input_excerpt, raw_output, reason, quarantined_at, state, cleared_at, cleared_by_run
    FROM quarantine;
    DROP TABLE quarantine;
    ALTER TABLE quarantine_units RENAME TO quarantine;
    """,
)

# Forgetting a conversation (tmem.store.forget). The ledger and the batch journal name the
# conversation each call was made for (tmem.ports) and the ledger the cache key it used,
# so a conversation's cached answers can be found; a publish records which conversations own each
# cached embedding. Rows written before this migration have NULL there ("unowned").
# forget_tombstones: digests of forgotten ids (ingest refuses them unless readmitted explicitly);
# forget_jobs: a forget in progress (a killed one is resumed by the next `tmem forget`).
M010_FORGET = Migration(
    "m010_forget",
    """
    ALTER TABLE llm_usage ADD COLUMN conversation_id VARCHAR;
    ALTER TABLE llm_usage ADD COLUMN cache_key VARCHAR;
    ALTER TABLE llm_batch_requests ADD COLUMN conversation_id VARCHAR;
    CREATE TABLE embedding_owners (
        model           VARCHAR NOT NULL,
        text_hash       VARCHAR NOT NULL,
        conversation_id VARCHAR NOT NULL,
        PRIMARY KEY (model, text_hash, conversation_id)
    );
    CREATE TABLE forget_tombstones (
        id_digest       VARCHAR PRIMARY KEY,   -- tmem.store.tombstones.id_digest of the forgotten id
        forgotten_at    TIMESTAMPTZ NOT NULL,  -- when the forget started
        finished_at     TIMESTAMPTZ,           -- when it finished (NULL: still in progress)
        readmitted_at   TIMESTAMPTZ            -- set by an ingest with allow_forgotten
    );
    CREATE TABLE forget_jobs (
        id_digest       VARCHAR PRIMARY KEY,
        subject         VARCHAR,               -- the id itself, cleared before the final rewrite
        step            VARCHAR NOT NULL,
        started_at      TIMESTAMPTZ NOT NULL,
        options         JSON NOT NULL
    );
    """,
)

# Trigger families declared beyond the paper's four (tmem.construct.families) store their texts as
# item_triggers rows of their own name: the table loses its CHECK on the family (DuckDB drops a
# constraint only with its table, so the rows move to a new one of the same columns and key).
M011_TRIGGER_FAMILIES = Migration(
    "m011_trigger_families",
    """
    CREATE TABLE item_triggers_m011 (
        conversation_id VARCHAR NOT NULL,
        item_id         VARCHAR NOT NULL,
        family          VARCHAR NOT NULL,
        ordinal         INTEGER NOT NULL,
        text            VARCHAR NOT NULL,
        rationale       VARCHAR,
        PRIMARY KEY (conversation_id, item_id, family, ordinal)
    );
    INSERT INTO item_triggers_m011 SELECT conversation_id, item_id, family, ordinal, text, rationale FROM item_triggers;
    DROP TABLE item_triggers;
    ALTER TABLE item_triggers_m011 RENAME TO item_triggers;
    """,
)

MIGRATIONS: Sequence[Migration] = (
    M001_INGEST, M002_MEMORY, M003_LLM, M004_USAGE_ESTIMATED, M005_LLM_BATCHES, M006_QUARANTINE, M007_ITEM_TIME,
    M008_CONSTRUCTION_HEALTH, M009_QUARANTINE_UNITS, M010_FORGET, M011_TRIGGER_FAMILIES,
)

# Tables that make up a conversation's built memory (copied whole into a snapshot).
MEMORY_TABLES: tuple[str, ...] = (
    "scenes",
    "topics",
    "topic_scene",
    "items",
    "item_scene",
    "item_triggers",
    "scene_triggers",
    "personas",
)

"""The single publisher: write built memories and vectors, then flip the snapshot pointer."""

from __future__ import annotations

from datetime import UTC, datetime
from typing import TYPE_CHECKING

from prefect import task

from tasks.runtime import bundle
from tmem.bundle import VECTOR_TABLE, lance_uri, pinned_lance_uri
from tmem.ids import content_hash
from tmem.store.embed_cache import record_embedding_owners
from tmem.store.memory_rows import record_memory_build, replace_memories
from tmem.store.quarantine import clear_quarantine
from tmem.store.snapshot import publish_snapshot

if TYPE_CHECKING:
    from flows.build_memory import ConversationBuild


@task(name="publish", task_run_name="publish/{run_id}")
def publish_builds(store: str, run_id: str, builds: dict[str, ConversationBuild]) -> str:
    """Vectors first (new Lance versions are invisible until a manifest pins them), then the
    memory rows in one transaction, then each build's record (clearing any quarantine of the
    conversation), then the snapshot and its pointer. Returns the snapshot id."""
    b = bundle(store, run_id)
    vectors = b.vectors()
    # One Lance version for the whole publish; readers only see it once the manifest pins it.
    version = vectors.replace_conversations(VECTOR_TABLE, {cid: builds[cid].vectors for cid in sorted(builds)})
    replace_memories(b.con, [builds[cid].memory for cid in sorted(builds)])
    record_embedding_owners(b.con, b.embedder.model_name, {cid: [r.text for r in builds[cid].vectors] for cid in builds})
    now = datetime.now(UTC)
    for cid in sorted(builds):
        build = builds[cid]
        build_id = content_hash(build.memory.model_dump(mode="json"))[:16]
        record_memory_build(b.con, cid, build_id, run_id, build.watermark_turn_seq, now)
        clear_quarantine(b.con, cid, run_id, now)  # built: whatever quarantined it is resolved
    info = publish_snapshot(b.con, b.settings.store, lance_uri=pinned_lance_uri(lance_uri(b.settings)),
                            lance_versions={VECTOR_TABLE: version}, now=now,
                            image_vectors=b.settings.snapshot_image_vectors)
    return info.snapshot_id

"""The single publisher: write built memories and vectors, then flip the snapshot pointer."""

from __future__ import annotations

from collections.abc import Mapping
from datetime import UTC, datetime

from tmem.build.conversation import ConversationBuild
from tmem.build.runtime import BuildRuntime
from tmem.bundle import VECTOR_TABLE, lance_uri, pinned_lance_uri
from tmem.ids import content_hash
from tmem.store.embed_cache import record_embedding_owners
from tmem.store.memory_rows import record_memory_build, replace_memories
from tmem.store.quarantine import clear_quarantine
from tmem.store.snapshot import publish_snapshot


def publish_builds(rt: BuildRuntime, builds: Mapping[str, ConversationBuild]) -> str:
    """Vectors first (new Lance versions are invisible until a manifest pins them), then the
    memory rows in one transaction, then each build's record (clearing any quarantine of the
    conversation), then the snapshot and its pointer. Returns the snapshot id."""
    order = sorted(builds)
    # One Lance version for the whole publish; readers only see it once the manifest pins it.
    version = rt.vectors().replace_conversations(VECTOR_TABLE, {cid: builds[cid].vectors for cid in order})
    replace_memories(rt.con, [builds[cid].memory for cid in order])
    record_embedding_owners(rt.con, rt.embedder.model_name, {cid: [r.text for r in builds[cid].vectors] for cid in order})
    now = datetime.now(UTC)
    for cid in order:
        build = builds[cid]
        build_id = content_hash(build.memory.model_dump(mode="json"))[:16]
        record_memory_build(rt.con, cid, build_id, rt.run_id, build.watermark_turn_seq, now)
        clear_quarantine(rt.con, cid, rt.run_id, now)  # built: whatever quarantined it is resolved
    info = publish_snapshot(rt.con, rt.settings.store, lance_uri=pinned_lance_uri(lance_uri(rt.settings)),
                            lance_versions={VECTOR_TABLE: version}, now=now,
                            image_vectors=rt.settings.snapshot_image_vectors)
    return info.snapshot_id

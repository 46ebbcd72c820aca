"""The single publisher: write built memories and vectors, then flip the snapshot pointer.

A conversation's **build id** is a digest of what readers get of it: its memory and the embedding
model and view rules its vectors come from. A built conversation whose build id is the one already
recorded for it, and which the current snapshot publishes, is unchanged: its rows, vectors and
embedding ownerships are already in the store, so the publish does not write them again (a warm
rebuild or a nightly that touched few conversations costs what changed, not the archive). Its
build record and quarantine state are updated like any other's.
"""

from __future__ import annotations

from collections.abc import Mapping
from concurrent.futures import ThreadPoolExecutor
from dataclasses import replace
from datetime import UTC, datetime

from tmem.build.conversation import ConversationBuild
from tmem.build.runtime import BuildRuntime
from tmem.errors import StoreError
from tmem.ids import content_hash
from tmem.store.embed_cache import record_embedding_owners
from tmem.store.lance_location import VECTOR_TABLE, lance_uri, pinned_lance_uri
from tmem.store.memory_rows import record_memory_builds, recorded_builds, replace_memories
from tmem.store.quarantine import clear_quarantines
from tmem.store.snapshot.published import current_snapshot, publish_snapshot
from tmem.views.texts import VIEWS_VERSION


def build_id_of(build: ConversationBuild, embedding_model: str) -> str:
    return content_hash(build.memory.model_dump(mode="json"), embedding_model, VIEWS_VERSION)[:16]


def ready_to_publish(rt: BuildRuntime, build: ConversationBuild) -> ConversationBuild:
    """``build`` with what the publish derives from it made now, as it arrives in the flow: its build id
    and its vector rows as the Arrow table the Lance write sends. Made one conversation at a time while the
    others are still building, that Python work (~190,000 rows and 1,000 memory digests in a nightly of
    1,000 conversations) no longer stands between the last conversation and the snapshot.

    The table replaces the rows (``vectors`` emptied): both kept, a nightly's publisher held every vector
    twice until the end. Rows that fail the store's checks stay as they are, without a table: the publish
    converts them again and raises that error, naming the row, and publishes nothing, as without this step."""
    from tmem.store.lance import vector_rows_table  # the publisher's process only: workers never import LanceDB

    build_id = build_id_of(build, rt.embedder.model_name)
    try:
        table = vector_rows_table(VECTOR_TABLE, build.vectors, rt.embedder.dim)
    except StoreError:  # not lost: the publish meets the same rows and raises it (above)
        return replace(build, build_id=build_id)
    return replace(build, vectors=[], build_id=build_id, vector_table=table)


def _texts(build: ConversationBuild) -> list[str]:
    """The build's embedded texts, in row order."""
    if build.vector_table is not None:
        return [str(t) for t in build.vector_table.column("text").to_pylist()]
    return [r.text for r in build.vectors]


def publish_builds(rt: BuildRuntime, builds: Mapping[str, ConversationBuild]) -> str:
    """Vectors first (new Lance versions are invisible until a manifest pins them), then the
    memory rows in one transaction, then each build's record (clearing any quarantine of the
    conversation), then the snapshot and its pointer. Returns the snapshot id."""
    order = sorted(builds)
    model = rt.embedder.model_name
    ids = {cid: builds[cid].build_id or build_id_of(builds[cid], model) for cid in order}
    current = current_snapshot(rt.store)
    published = current.conversations if current is not None else {}
    recorded = recorded_builds(rt.con)
    changed = [cid for cid in order if not (recorded.get(cid) == published.get(cid) == ids[cid])]
    vectors = rt.vectors()

    def write_vectors() -> int:
        # One Lance version for the whole publish; readers only see it once the manifest pins it. Nothing
        # changed: the table's latest version, which holds every published row.
        converted = {cid: table for cid in changed if (table := builds[cid].vector_table) is not None}
        return (vectors.replace_conversations(VECTOR_TABLE, {cid: builds[cid].vectors for cid in changed}, converted)
                if changed or not vectors.has_table(VECTOR_TABLE) else vectors.version(VECTOR_TABLE))

    # The Lance write (Rust, off the GIL) beside the working database's rows (DuckDB, its own threads):
    # a nightly of 1,000 conversations spent ~6 s in each, one after the other, with the encoder idle.
    # Neither is visible before the snapshot below; if either fails, no build is recorded and nothing
    # is published (rows already replaced in the working database are rewritten by the next publish:
    # their conversations' recorded builds still differ from the published ones).
    with ThreadPoolExecutor(max_workers=1, thread_name_prefix="tmem-publish-vectors") as lance:
        written = lance.submit(write_vectors)
        replace_memories(rt.con, [builds[cid].memory for cid in changed])
        record_embedding_owners(rt.con, rt.embedder.model_name,
                                {cid: _texts(builds[cid]) for cid in changed})
        version = written.result()
    now = datetime.now(UTC)
    record_memory_builds(rt.con, [(cid, ids[cid], builds[cid].watermark_turn_seq) for cid in order], rt.run_id, now)
    clear_quarantines(rt.con, order, rt.run_id, now)  # built: whatever quarantined them is resolved
    info = publish_snapshot(rt.con, rt.settings.store, lance_uri=pinned_lance_uri(lance_uri(rt.settings)),
                            lance_versions={VECTOR_TABLE: version}, now=now,
                            image_vectors=rt.settings.snapshot_image_vectors)
    return info.snapshot_id

"""What "the same memory" means, as a value that can be compared: a conversation's published image.

Two published snapshots hold the same memory of a conversation when their images are equal:

* **rows**: for every memory table (``MEMORY_TABLES``: scenes, topics, topic_scene, items,
  item_scene, item_triggers, scene_triggers, personas), the conversation's rows are the same
  set of tuples, every column included (ids, seq numbers, texts, keyword lists, event times,
  persona JSON). Row order in storage does not matter; the content does.
* **vectors**: for every Lance table the snapshot pins, the conversation's rows have the same
  ``(row_id, owner_kind, owner_id, view, ordinal, text)`` tuples, and each row's vector is
  equal within ``atol`` (the embedder may batch the same text differently).

Not part of the image: record times and run ids (``memory_builds``, ``build_runs``, the ledger),
snapshot ids, Lance version numbers, and anything of other conversations.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import duckdb
import lancedb
import numpy as np
import numpy.typing as npt

from tmem.store.lance import VectorStore
from tmem.store.migrations import MEMORY_TABLES
from tmem.store.snapshot.published import SnapshotInfo

VectorKey = tuple[str, str, str, str, int, str]


@dataclass(frozen=True)
class MemoryImage:
    conversation_id: str
    rows: dict[str, tuple[tuple[Any, ...], ...]]  # table -> sorted row tuples
    vector_keys: dict[str, tuple[VectorKey, ...]]  # Lance table -> sorted row keys
    vectors: dict[str, npt.NDArray[np.float32]]  # Lance table -> vectors in vector_keys order


def _frozen(value: Any) -> Any:
    return tuple(_frozen(v) for v in value) if isinstance(value, list) else value


def memory_image(info: SnapshotInfo, conversation_id: str) -> MemoryImage:
    """The image of ``conversation_id`` in the published snapshot ``info``."""
    con = duckdb.connect(str(info.memory_db), read_only=True)
    try:
        con.execute("SET TimeZone = 'UTC'")
        rows = {
            name: tuple(sorted(
                (tuple(_frozen(v) for v in r) for r in con.execute(
                    f"SELECT * FROM {name} WHERE conversation_id = ?", [conversation_id]  # noqa: S608 -- fixed names
                ).fetchall()),
                key=repr,
            ))
            for name in MEMORY_TABLES
        }
    finally:
        con.close()
    keys: dict[str, tuple[VectorKey, ...]] = {}
    vectors: dict[str, npt.NDArray[np.float32]] = {}
    for table, version in sorted(info.lance_versions.items()):
        dim = lancedb.connect(info.lance_uri).open_table(table).schema.field("vector").type.list_size
        loaded = VectorStore(info.lance_uri, dim=dim).load_conversation(table, conversation_id, version=version)
        meta = loaded.meta.to_pylist()
        order = sorted(range(len(meta)), key=lambda i: meta[i]["row_id"])
        keys[table] = tuple(
            (m["row_id"], m["owner_kind"], m["owner_id"], m["view"], int(m["ordinal"]), m["text"])
            for m in (meta[i] for i in order)
        )
        vectors[table] = loaded.vectors[order] if order else loaded.vectors
    return MemoryImage(conversation_id, rows, keys, vectors)


def diff_images(a: MemoryImage, b: MemoryImage, atol: float = 1e-5) -> list[str]:
    """Human-readable differences between two images (empty: the same memory)."""
    out: list[str] = []
    for name in sorted(set(a.rows) | set(b.rows)):
        left, right = set(a.rows.get(name, ())), set(b.rows.get(name, ()))
        if left != right:
            out.append(f"{name}: {len(left - right)} rows only in the first, {len(right - left)} only in the second"
                       f" (e.g. {sorted(left ^ right, key=repr)[:1]})")
    for table in sorted(set(a.vector_keys) | set(b.vector_keys)):
        left_keys, right_keys = a.vector_keys.get(table, ()), b.vector_keys.get(table, ())
        if left_keys != right_keys:
            only = set(left_keys) ^ set(right_keys)
            out.append(f"vectors {table}: {len(only)} row keys differ (e.g. {sorted(only)[:1]})")
        elif left_keys and not np.allclose(a.vectors[table], b.vectors[table], atol=atol):
            worst = float(np.abs(a.vectors[table] - b.vectors[table]).max())
            out.append(f"vectors {table}: vectors differ by up to {worst:.2e}")
    return out

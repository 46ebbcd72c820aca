"""Content-derived identifiers: the same inputs always give the same id."""

from __future__ import annotations

import hashlib
import json
from typing import Any


def content_hash(*parts: Any) -> str:
    """A stable hex digest of JSON-serialisable parts (sha256, full length)."""
    payload = json.dumps(parts, sort_keys=True, ensure_ascii=False, separators=(",", ":"), default=str)
    return hashlib.sha256(payload.encode("utf-8")).hexdigest()


def content_id(kind: str, *parts: Any, length: int = 16) -> str:
    """An id like ``scn_3f2a...``: ``kind`` prefix plus a truncated content hash."""
    return f"{kind}_{content_hash(kind, *parts)[:length]}"


def conversation_partition(conversation_id: str) -> str:
    """The directory name under which files derived from one conversation are kept (Prefect task
    results, ``tasks/runtime.py``), so ``tmem forget`` removes them without reading other files.
    A digest, not the id: ids may hold any character, a path component may not."""
    return "c-" + content_hash("conversation-partition", conversation_id)[:32]

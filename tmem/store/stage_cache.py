"""The results of a build's stage units, kept by content key (what Prefect's task cache kept before).

A stage unit — one conversation's segmentation or topic admission, one topic's item extraction,
one trigger batch, one speaker's persona — is a pure function of its inputs and the build
fingerprint given the model's answers. The LLM response cache answers every call whose answer
validated; what it cannot replay is a call that failed and was worked around (an answer cut at its
budget and asked again in halves, an answer invalid after the repairs and re-asked with the
reason): asking it again would cost a call and may split differently. So a unit's finished
outcome is kept here under a key of its stage and content inputs, and a later build (a warm
rebuild, a resumed one, a grown conversation whose earlier units did not change) takes it instead
of running the unit. An outcome that quarantined a unit is never kept: the next build runs that
unit again, which is how a quarantined unit gets its next chance.

Files, one per unit result, JSON, written whole (temporary name, then rename), under
``STORE/prefect/results/<conversation partition>/`` — the directory the build's per-conversation
task results have always lived in (:func:`tmem.ids.conversation_partition`), so ``tmem forget``
deletes a conversation's results with its directory and never reads another's. Any process that
builds writes its own (a Dask worker on the shared store filesystem as well): nothing here goes
through the working database's single writer.
"""

from __future__ import annotations

import json
import logging
import os
import threading
from collections.abc import Callable
from pathlib import Path
from typing import Any

from tmem.ids import content_hash, conversation_partition

log = logging.getLogger(__name__)

STAGE_RESULTS = ("prefect", "results")  # under the store
KEY_VERSION = 1  # bump when the key's encoding changes (old files then simply miss)


class StageCache:
    """Outcomes by key, as JSON documents, per conversation directory under ``root``."""

    def __init__(self, root: Path) -> None:
        self.root = Path(root)
        self._made: set[Path] = set()
        self._lock = threading.Lock()

    @classmethod
    def of_store(cls, store: Path) -> StageCache:
        return cls(Path(store).joinpath(*STAGE_RESULTS))

    def path(self, conversation_id: str, key: str) -> Path:
        return self.root / conversation_partition(conversation_id) / f"stage-{key}.json"

    def get(self, conversation_id: str, key: str, decode: Callable[[Any], Any]) -> Any | None:
        """The decoded outcome stored under ``key``, or None (missing; damaged: logged, then None)."""
        path = self.path(conversation_id, key)
        try:
            raw = path.read_bytes()
        except FileNotFoundError:
            return None
        try:
            return decode(json.loads(raw)["outcome"])
        except (ValueError, KeyError, TypeError) as exc:  # pydantic's ValidationError is a ValueError
            log.warning("stage result %s no longer decodes, running the unit again: %s", path, exc)
            return None

    def put(self, conversation_id: str, key: str, stage: str, outcome: Any) -> None:
        """Store ``outcome`` (JSON-ready) under ``key``; atomic, last writer wins."""
        self.put_json(conversation_id, key, stage, json.dumps(outcome, ensure_ascii=False, separators=(",", ":"))
                      .encode("utf-8"))

    def put_json(self, conversation_id: str, key: str, stage: str, outcome: bytes) -> None:
        """Store ``outcome``, given as JSON (UTF-8), under ``key``; atomic, last writer wins."""
        path = self.path(conversation_id, key)
        directory = path.parent
        with self._lock:
            made = directory in self._made
        if not made:
            directory.mkdir(parents=True, exist_ok=True)
            with self._lock:
                self._made.add(directory)
        partial = path.with_name(f".{path.name}.{os.getpid()}.{threading.get_ident()}.partial")
        head = json.dumps({"stage": stage, "key_version": KEY_VERSION}, ensure_ascii=False, separators=(",", ":"))
        partial.write_bytes(head[:-1].encode("utf-8") + b',"outcome":' + outcome + b"}")
        os.replace(partial, path)


def plain(value: Any) -> Any:
    """The JSON form of a unit input: pydantic models by ``model_dump(mode="json")``, containers
    element by element. Anything else is a :class:`TypeError` (a key must never depend on ``repr``)."""
    from pydantic import BaseModel

    if value is None or isinstance(value, str | int | float | bool):
        return value
    if isinstance(value, BaseModel):
        return value.model_dump(mode="json")
    if isinstance(value, list | tuple):
        return [plain(v) for v in value]
    if isinstance(value, dict):
        return {str(k): plain(v) for k, v in value.items()}
    raise TypeError(f"cannot key a stage input of type {type(value).__name__}")


def stage_key(stage: str, inputs: dict[str, Any]) -> str:
    """The key of a unit: its stage's name and its content inputs, sha256 over their JSON form.
    Two stages called with equal inputs never share a key."""
    return content_hash("tmem-stage", KEY_VERSION, stage, {k: plain(v) for k, v in sorted(inputs.items())})

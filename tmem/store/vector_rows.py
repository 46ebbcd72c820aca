"""One embedded text as the build hands it to the vector store (:mod:`tmem.store.lance`).

Kept apart from the store so that a process which only makes rows — a Dask worker building
conversations — does not import LanceDB (~1.5 s of a worker's start-up, ``python -X importtime``).
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np
import numpy.typing as npt

from tmem.ids import content_id
from tmem.views.catalog import OwnerKind


def make_row_id(conversation_id: str, owner_kind: str, owner_id: str, view: str, ordinal: int) -> str:
    """Deterministic row id: unique per (conversation, owner, view, ordinal)."""
    return content_id("vec", conversation_id, owner_kind, owner_id, view, ordinal)


@dataclass(frozen=True)
class VectorRow:
    """One embedded text: a view (``ordinal``-th vector) of a topic, scene or item."""

    conversation_id: str
    owner_kind: OwnerKind
    owner_id: str
    view: str
    ordinal: int
    text: str
    vector: npt.NDArray[np.float32] = field(repr=False)

    @property
    def row_id(self) -> str:
        return make_row_id(self.conversation_id, self.owner_kind, self.owner_id, self.view, self.ordinal)

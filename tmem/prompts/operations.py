"""Every LLM operation, once: which role calls it, its completion budget, and whether a build may
send it through the Batch API.

Each operation's prompt module (``tmem/prompts/<operation>.py``) holds its messages, response model
and version; this table is what the rest reads: the build's fingerprint and caches
(:data:`BUILD_OPERATIONS`), ``TMEM_LLM_BATCH_STAGES`` (:data:`BATCHABLE_OPERATIONS`) and the request
budgets (:data:`tmem.prompts.budgets.DEFAULT_BUDGETS`, whose module says why each is what it is).
``tests/test_output_budgets.py`` holds the table to the prompt modules.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from types import MappingProxyType
from typing import Literal


@dataclass(frozen=True)
class Operation:
    name: str
    role: Literal["build", "answer", "judge"]  # the chat model that answers it (TMEM_LLM_<ROLE>_*)
    budget: int  # completion tokens a request is sent with
    # Off the serial path of construction (segmentation and topic admission wait on each answer),
    # so a build may wait for a batch.
    batchable: bool = False


OPERATIONS: tuple[Operation, ...] = (
    Operation("scene_boundaries", "build", 3072),
    Operation("scene_pack", "build", 2048),
    Operation("topic_match", "build", 1024),
    Operation("topic_create", "build", 1024),
    Operation("item_extract", "build", 4096, batchable=True),
    Operation("item_triggers", "build", 3072, batchable=True),
    Operation("scene_triggers", "build", 3072, batchable=True),
    Operation("persona", "build", 3072, batchable=True),
    Operation("answer", "answer", 1024),
    Operation("memory_reply", "answer", 1024),
    Operation("judge_locomo", "judge", 1024),
    Operation("judge_memory_awareness", "judge", 1024),
)

BY_NAME: Mapping[str, Operation] = MappingProxyType({op.name: op for op in OPERATIONS})
# The operations a build calls; query/eval prompts (answer, judges) must not invalidate build caches.
BUILD_OPERATIONS = frozenset(op.name for op in OPERATIONS if op.role == "build")
BATCHABLE_OPERATIONS = tuple(op.name for op in OPERATIONS if op.batchable)

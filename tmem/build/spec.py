"""The build specification: the one value a build's flow, tasks and workers receive.

A :class:`BuildSpec` is the store location plus every setting resolved at the edge (the CLI, a
deployment's flow run): a plain, JSON-serialisable value that Prefect shows as the flow's
parameter and that travels to Dask workers as a task input. It never holds a secret: API keys are
read from the environment of the process that opens the runtime (:meth:`BuildSpec.load_settings`),
so they stay out of Prefect's database, its UI and the exchange between processes.

:func:`build_fingerprint` is what makes a stage's output differ for the same input: the build
model, the build prompts' versions and the stage knobs (not the query side's).
"""

from __future__ import annotations

import types
import typing
from pathlib import Path
from typing import Any

from pydantic import BaseModel, ConfigDict, Field, SecretStr

from tmem.ids import content_hash
from tmem.prompts.base import prompt_versions
from tmem.prompts.operations import BUILD_OPERATIONS
from tmem.settings import Settings, load_settings
from tmem.views.texts import VIEWS_VERSION


def _is_secret(annotation: Any) -> bool:
    if annotation is SecretStr:
        return True
    if isinstance(annotation, types.UnionType) or typing.get_origin(annotation) is typing.Union:
        return any(_is_secret(a) for a in typing.get_args(annotation))
    return False


SECRET_FIELDS = frozenset(name for name, field in Settings.model_fields.items() if _is_secret(field.annotation))


class BuildSpec(BaseModel):
    """Where the store is and how to build it: every setting but the secrets, resolved."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    store: str = Field(description="Absolute path of the store directory.")
    settings: dict[str, Any] = Field(default_factory=dict, description="Settings (JSON values), secrets excluded.")

    @classmethod
    def resolve(cls, store: str | Path | None = None, settings: Settings | None = None) -> BuildSpec:
        """The spec of ``settings`` (default: read from the environment now) for ``store``."""
        resolved = settings if settings is not None else load_settings()
        location = Path(store) if store is not None else Path(resolved.store)
        values = resolved.model_dump(mode="json", exclude=set(SECRET_FIELDS) | {"store"})
        return cls(store=str(location.resolve()), settings=values)

    @property
    def store_path(self) -> Path:
        return Path(self.store)

    def load_settings(self) -> Settings:
        """The settings of this spec; the secrets come from this process's environment."""
        return load_settings(**self.settings, store=self.store_path)


def build_fingerprint(settings: Settings, model_name: str) -> str:
    """What makes a stage's output differ for the same input: model, prompt versions, knobs."""
    return content_hash(
        model_name, {op: v for op, v in prompt_versions().items() if op in BUILD_OPERATIONS}, settings.embedding_model,
        settings.segment_window, settings.topic_batch, settings.trigger_batch, settings.scene_trigger_batch,
        VIEWS_VERSION,
        # absent when 0 (the paper's batches), so a store built before the setting keeps its fingerprint
        *([("topic_shortlist", settings.topic_shortlist)] if settings.topic_shortlist else []),
    )

"""Where the vectors live: the LanceDB location of a store, and the one table every view's rows go to."""

from __future__ import annotations

import re
from pathlib import Path

from tmem.settings import Settings

LANCE_DIR = "lance"
VECTOR_TABLE = "vectors"

_URI_SCHEME = re.compile(r"^[A-Za-z][A-Za-z0-9+.-]*://")


def is_object_uri(location: str) -> bool:
    """True for a URI such as ``s3://bucket/lance`` (LanceDB opens it itself), False for a local path."""
    return bool(_URI_SCHEME.match(location))


def lance_uri(settings: Settings) -> str:
    """Where the vectors live: ``TMEM_LANCE_URI`` (a URI is used verbatim), else ``STORE/lance``."""
    if settings.lance_uri:
        return settings.lance_uri
    return str(Path(settings.store) / LANCE_DIR)


def pinned_lance_uri(location: str) -> str:
    """The location a snapshot manifest records: a URI unchanged, a local path made absolute."""
    return location if is_object_uri(location) else str(Path(location).resolve())

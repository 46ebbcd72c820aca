"""The snapshot format: the one written and read now, and what happens to each older one.

A snapshot's manifest names the format of its per-conversation images (:data:`MANIFEST_KEY`).
Publishing writes :data:`IMAGE_FORMAT`; readers read that format only. An older snapshot is
refused by :func:`require_current` with a message naming its manifest, its format and the command
that rewrites it (:data:`UPGRADE_COMMAND`, :mod:`tmem.store.snapshot.upgrade`); every publish
(``tmem build``) writes the current format too.

| format | written by | a reader | ``tmem snapshot upgrade`` |
|---|---|---|---|
| 3 (current) | this version | memory and turns from the image, item times, the vector and BM25 sections (a section may be absent: ``TMEM_SNAPSHOT_IMAGE_VECTORS=false`` leaves the vectors in LanceDB, which the reader then reads at the pinned version) | nothing to do |
| 2 | before item times (m007) | refuses | adds the item time columns (m007), rewrites the images |
| 1 | before the sections | refuses | rewrites the images with their sections |
| none | before images | refuses | writes the images |
| newer | a newer tmem | refuses (upgrade tmem) | refuses |
"""

from __future__ import annotations

from pathlib import Path

from tmem.errors import StoreError

IMAGE_FORMAT = 3
MANIFEST_KEY = "conversation_image_format"
UPGRADE_COMMAND = "tmem snapshot upgrade"


def format_name(image_format: int | None) -> str:
    """How a format is named in messages."""
    return "none (published before images)" if image_format is None else str(image_format)


def require_current(manifest: Path, image_format: int | None, *, store: Path | None = None) -> None:
    """Refuse a snapshot whose images are not of :data:`IMAGE_FORMAT` (:class:`StoreError` naming the
    manifest, the format and what to run)."""
    if image_format == IMAGE_FORMAT:
        return
    where = f"{manifest}: snapshot of image format {format_name(image_format)}; this tmem reads format {IMAGE_FORMAT} only"
    if image_format is not None and image_format > IMAGE_FORMAT:
        raise StoreError(f"{where} (published by a newer tmem: upgrade tmem to read it)")
    store_option = f" --store {store}" if store is not None else ""
    raise StoreError(f"{where}; run `{UPGRADE_COMMAND}{store_option}` to rewrite the current snapshot in format "
                     f"{IMAGE_FORMAT} (or publish a new one with `tmem build`)")

"""The snapshot formats: the one written now, and what a reader does with each older one.

A snapshot's manifest names the format of its per-conversation images (:data:`MANIFEST_KEY`).
Publishing writes :data:`IMAGE_FORMAT` only. Reading is one path per format, decided here and
nowhere else:

| format | written by | a reader |
|---|---|---|
| 3 (current) | this version | reads the image: memory and turns, item times, the vector and BM25 sections when present |
| 2 | before item times (m007) | reads the image and its sections; items carry no time columns (read as stated days) |
| 1 | before the sections | reads the image; vectors from LanceDB, BM25 built at load |
| none | before images | reads the memory tables and turns; vectors from LanceDB |
| anything else | a newer tmem | refused by the image decoder (a :class:`~tmem.errors.StoreError` naming the formats it knows); the tables still serve |
"""

from __future__ import annotations

IMAGE_FORMAT = 3
READABLE_FORMATS = frozenset({1, 2, 3})
MANIFEST_KEY = "conversation_image_format"


def reads_images(image_format: int | None) -> bool:
    """Whether a snapshot of ``image_format`` is read from its images (else from its tables)."""
    return image_format in READABLE_FORMATS


def has_sections(image_format: int | None) -> bool:
    """Whether its images may carry the vector and BM25 sections (format 2 on)."""
    return reads_images(image_format) and (image_format or 0) >= 2

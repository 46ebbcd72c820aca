"""Where shared datasets live: ``../shared`` beside the repository (CI lays it out the same way)."""

from __future__ import annotations

from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
SHARED = REPO.parent / "shared"
DATASETS = SHARED / "datasets"
LOCOMO10 = DATASETS / "locomo" / "locomo10.json"
LOCOMO_PLUS = DATASETS / "locomo_plus" / "locomo_plus.json"

"""Process defaults (tmem.settings.apply_process_defaults): what an entry point sets before
Prefect and torch are imported, never over a value of the user's."""

from __future__ import annotations

import pytest

from tmem.settings import PREFECT_DEFAULTS, apply_process_defaults


def test_openmp_threads_sleep_at_barriers_unless_the_user_says_otherwise(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("OMP_WAIT_POLICY", raising=False)
    apply_process_defaults()
    import os

    assert os.environ["OMP_WAIT_POLICY"] == PREFECT_DEFAULTS["OMP_WAIT_POLICY"] == "PASSIVE"
    monkeypatch.setenv("OMP_WAIT_POLICY", "ACTIVE")
    apply_process_defaults()
    assert os.environ["OMP_WAIT_POLICY"] == "ACTIVE"


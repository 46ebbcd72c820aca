"""The Prefect cache key of build tasks (tasks/runtime.py ContentInputs)."""

from __future__ import annotations

from datetime import UTC, datetime
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest
from prefect import flow, task

from tasks.runtime import ContentInputs, content_cache, result_storage
from tmem.domain import Turn


def _turn(n: int, text: str = "hello") -> Turn:
    return Turn(conversation_id="c1", session_id="s1", turn_id=f"D1:{n}", seq=n, speaker="Ann", text=text,
                event_time=datetime(2024, 1, n, tzinfo=UTC))


def _key(task_name: str, **inputs: Any) -> str | None:
    return ContentInputs().compute_key(SimpleNamespace(task=SimpleNamespace(name=task_name)), inputs, {})  # type: ignore[arg-type]


def test_the_key_names_the_task_and_ignores_store_and_run() -> None:
    turns = [_turn(1), _turn(2)]
    base = _key("segment-scenes", store="/a", run_id="r1", conversation_id="c1", turns=turns, fingerprint="f")
    assert base == _key("segment-scenes", store="/b", run_id="r2", conversation_id="c1", turns=turns, fingerprint="f")
    assert base == _key("segment-scenes", store="/a", run_id="r1", conversation_id="c1",
                        turns=tuple(_turn(n) for n in (1, 2)), fingerprint="f")  # equal models, new objects
    assert base != _key("persona", store="/a", run_id="r1", conversation_id="c1", turns=turns, fingerprint="f")
    assert base != _key("segment-scenes", store="/a", run_id="r1", conversation_id="c1",
                        turns=[_turn(1), _turn(2, "hello!")], fingerprint="f")  # one character of content
    assert base != _key("segment-scenes", store="/a", run_id="r1", conversation_id="c1", turns=turns, fingerprint="g")
    assert _key("segment-scenes", store="/a", run_id="r1") is not None  # only excluded inputs: still a key
    assert _key("segment-scenes") is None


def test_an_input_without_a_json_form_is_refused() -> None:
    with pytest.raises(TypeError, match="cannot key a task input of type object"):
        _key("persona", conversation_id="c1", speaker=object())


@pytest.mark.usefixtures("prefect_harness")
def test_two_tasks_with_equal_arguments_do_not_share_a_cache_entry(tmp_path: Path) -> None:
    """Prefect's INPUTS policy keys by arguments alone; ours adds the task's name."""
    store = str(tmp_path / "store")
    calls: list[str] = []

    def configured(t: Any) -> Any:
        return t.with_options(cache_policy=content_cache(store), result_storage=result_storage(store), persist_result=True)

    @task(name="upper")
    def upper(store: str, run_id: str, text: str) -> str:
        calls.append("upper")
        return text.upper()

    @task(name="reverse")
    def reverse(store: str, run_id: str, text: str) -> str:
        calls.append("reverse")
        return text[::-1]

    @flow
    def both(run_id: str) -> tuple[str, str]:
        return configured(upper)(store, run_id, "abc"), configured(reverse)(store, run_id, "abc")

    assert both("run-1") == ("ABC", "cba")
    assert calls == ["upper", "reverse"]
    assert both("run-2") == ("ABC", "cba")  # another run: both answered from the cache
    assert calls == ["upper", "reverse"]

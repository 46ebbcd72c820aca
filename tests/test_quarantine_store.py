"""The quarantine table (migration m006): record, supersede, clear, list; errors carry their input."""

from __future__ import annotations

import pickle
from datetime import UTC, datetime, timedelta
from pathlib import Path

import pytest

from tmem.errors import LLMOutputError, LLMTransportError, ValidationFailure
from tmem.prompts.base import Message, Prompt, render_input
from tmem.prompts.topic_create import TopicDraft
from tmem.store.duck import connect
from tmem.store.quarantine import (
    RAW_OUTPUT_LIMIT,
    clear_quarantine,
    list_quarantine,
    quarantines,
    record_quarantine,
)

T0 = datetime(2026, 1, 2, 3, 4, 5, tzinfo=UTC)


def _error(reason: str, raw: str = '{"title": 3}') -> LLMOutputError:
    return LLMOutputError("topic_create", "conv-x scene 2", reason, raw_output=raw, input_digest="d" * 64,
                          input_excerpt='<input>\n{"scene": "..."}')


def test_a_quarantine_is_recorded_superseded_by_a_later_one_and_cleared_by_a_build(tmp_path: Path) -> None:
    con = connect(tmp_path / "store")
    try:
        record_quarantine(con, "run-1", "conv-x", _error("first"), T0)
        record_quarantine(con, "run-1", "conv-y", ValidationFailure("item_extract", "conv-y topic t", "S9"), T0)
        record_quarantine(con, "run-2", "conv-x", _error("second", raw="x" * (RAW_OUTPUT_LIMIT + 5)),
                          T0 + timedelta(hours=1))

        active = list_quarantine(con)
        assert [(r.conversation_id, r.run_id, r.reason) for r in active] == [
            ("conv-x", "run-2", "second"), ("conv-y", "run-1", "S9")]
        latest = active[0]
        assert (latest.operation, latest.input_ref, latest.error_type) == ("topic_create", "conv-x scene 2",
                                                                          "LLMOutputError")
        assert latest.input_digest == "d" * 64 and latest.input_excerpt is not None
        assert latest.raw_output is not None and latest.raw_output.startswith("x" * RAW_OUTPUT_LIMIT)
        assert latest.raw_output.endswith(f"[cut: {RAW_OUTPUT_LIMIT + 5} characters]")
        assert active[1].error_type == "ValidationFailure" and active[1].raw_output is None

        assert clear_quarantine(con, "conv-x", "run-3", T0 + timedelta(hours=2)) == 1
        assert clear_quarantine(con, "conv-x", "run-4", T0 + timedelta(hours=3)) == 0  # nothing active left
        assert [r.conversation_id for r in list_quarantine(con)] == ["conv-y"]
        history = {(r.run_id, r.state, r.cleared_by_run) for r in list_quarantine(con, include_inactive=True,
                                                                                   conversation_id="conv-x")}
        assert history == {("run-1", "superseded", None), ("run-2", "cleared", "run-3")}
    finally:
        con.close()


def test_only_invalid_output_quarantines_a_conversation() -> None:
    assert quarantines(_error("bad"))
    assert quarantines(ValidationFailure("persona", "conv-x Ann", "empty"))
    assert not quarantines(LLMTransportError("persona", "conv-x Ann", "HTTP 500"))
    assert not quarantines(RuntimeError("boom"))


@pytest.mark.parametrize("cls", [LLMOutputError, ValidationFailure])
def test_llm_errors_keep_their_input_across_pickling(cls: type[LLMOutputError]) -> None:
    exc = cls("op", "ref", "why", raw_output="raw", input_digest="abc", input_excerpt="<input>x")
    back = pickle.loads(pickle.dumps(exc))
    assert type(back) is cls
    assert (back.operation, back.input_ref, back.reason, back.raw_output, back.input_digest, back.input_excerpt) == (
        "op", "ref", "why", "raw", "abc", "<input>x")


def test_a_prompt_names_its_input_by_digest_and_excerpt() -> None:
    def prompt(text: str) -> Prompt[TopicDraft]:
        messages = (Message("system", "sys"), Message("user", "Data:\n" + render_input({"text": text})))
        return Prompt("topic_create", "1", messages, TopicDraft, "ref")

    a, b = prompt("hello"), prompt("hello!")
    assert a.input_digest() == prompt("hello").input_digest() != b.input_digest()
    assert a.input_excerpt().startswith("<input>") and '"hello"' in a.input_excerpt()
    long = prompt("y" * 5000).input_excerpt(limit=100)
    assert len(long) == 103 and long.endswith("...")

"""Unit quarantine in the store (migration m009), the build report's naming of it, and the exit codes."""

from __future__ import annotations

import json
from datetime import UTC, datetime, timedelta
from pathlib import Path

import duckdb
import pytest

from tests.fakes import FakeChatModel, replies
from tests.test_construct_robust import items
from tmem.build_report import BuildSummary, MissingUnit, render_markdown
from tmem.cli.build_cmd import exit_status
from tmem.construct import item_triggers_outcome
from tmem.construct.outcome import BuildNote, QuarantinedUnit
from tmem.errors import LLMOutputError, LLMTransportError, ValidationFailure
from tmem.ports import OperationUsage
from tmem.store.build_notes import construction_health, list_build_notes, record_build_notes
from tmem.store.duck import apply_migrations, connect
from tmem.store.migrations import MIGRATIONS
from tmem.store.quarantine import (
    active_units,
    clear_quarantine,
    list_quarantine,
    record_quarantine,
    record_unit_quarantines,
)

T0 = datetime(2026, 2, 3, 4, 5, 6, tzinfo=UTC)


def unit(kind: str, unit_id: str, reason: str = "cut", operation: str = "item_triggers") -> QuarantinedUnit:
    return QuarantinedUnit.of(kind, unit_id, LLMOutputError(operation, f"conv-x {unit_id}", reason,  # type: ignore[arg-type]
                                                            raw_output="{", input_digest=f"d-{unit_id}"))


def test_unit_records_are_superseded_by_the_same_unit_and_cleared_by_the_publishing_build(tmp_path: Path) -> None:
    con = connect(tmp_path / "store")
    try:
        record_unit_quarantines(con, "run-1", "conv-x", [unit("item", "itm_a"), unit("item", "itm_b"),
                                                          unit("topic_chunk", "tpc_1", operation="item_extract"),
                                                          unit("topic_chunk", "tpc_1", operation="item_extract")],
                                T0)
        assert active_units(con, ["conv-x", "conv-y"]) == {"conv-x": [
            ("item_extract", "topic_chunk", "tpc_1"), ("item_triggers", "item", "itm_a"),
            ("item_triggers", "item", "itm_b")]}
        # Run 2 publishes conv-x and quarantines itm_a again: that record supersedes run 1's, the rest is cleared.
        record_unit_quarantines(con, "run-2", "conv-x", [unit("item", "itm_a", reason="still cut")], T0 + timedelta(1))
        assert clear_quarantine(con, "conv-x", "run-2", T0 + timedelta(2)) == 3
        states = {(r.run_id, r.unit_kind, r.unit_id, r.ordinal, r.state, r.cleared_by_run)
                  for r in list_quarantine(con, include_inactive=True)}
        assert states == {
            ("run-1", "item", "itm_a", 0, "superseded", None), ("run-1", "item", "itm_b", 0, "cleared", "run-2"),
            ("run-1", "topic_chunk", "tpc_1", 0, "cleared", "run-2"),
            ("run-1", "topic_chunk", "tpc_1", 1, "cleared", "run-2"),
            ("run-2", "item", "itm_a", 0, "active", None),
        }
        [active] = list_quarantine(con)
        assert (active.reason, active.input_digest, active.whole_conversation) == ("still cut", "d-itm_a", False)
        # A conversation-level quarantine supersedes only conversation-level records; units stay as they were.
        record_quarantine(con, "run-3", "conv-x", ValidationFailure("scene_boundaries", "conv-x turns", "bad"), T0)
        assert {(r.unit_kind, r.state) for r in list_quarantine(con)} == {("item", "active"), ("conversation", "active")}
    finally:
        con.close()


def test_m009_keeps_the_conversation_records_of_an_older_store(tmp_path: Path) -> None:
    con = duckdb.connect(str(tmp_path / "old.duckdb"))
    try:
        apply_migrations(con, MIGRATIONS[:6])  # up to m006_quarantine
        con.execute("INSERT INTO quarantine (conversation_id, run_id, error_type, operation, input_ref, reason, "
                    "quarantined_at, state) VALUES ('conv-x', 'run-1', 'LLMOutputError', 'topic_create', "
                    "'conv-x scene 2', 'why', ?, 'active')", [T0])
        assert apply_migrations(con, MIGRATIONS) == ["m007_item_time", "m008_construction_health", "m009_quarantine_units",
                                                     "m010_forget", "m011_trigger_families"]
        [record] = list_quarantine(con)
        assert (record.conversation_id, record.unit_kind, record.unit_id, record.reason, record.state) == (
            "conv-x", "conversation", "conv-x", "why", "active")
    finally:
        con.close()


def test_notes_are_stored_per_run_and_joined_with_the_ledger_as_construction_health(tmp_path: Path) -> None:
    con = connect(tmp_path / "store")
    try:
        notes = [BuildNote("item_extract", "conv-x topic t", "split", "4 scenes asked again as 2 + 2"),
                 BuildNote("item_extract", "conv-x topic t", "reclassified", "atomic item made connected"),
                 BuildNote("persona", "conv-x speaker 'Ana'", "clipped", "traits: 20 entries, kept the first 12")]
        record_build_notes(con, "run-1", "conv-x", notes, T0)
        record_build_notes(con, "run-2", "conv-x", notes[:1], T0)
        assert [n for _cid, n in list_build_notes(con, "run-1")] == notes
        health = construction_health(con, "run-1")
        assert (health["item_extract"].splits, health["item_extract"].reclassified, health["persona"].clipped) == (1, 1, 1)
        assert health["persona"].calls == 0  # no ledger rows in this run
    finally:
        con.close()


def _summary(status: str, failures: list[dict[str, object]], units: list[MissingUnit]) -> BuildSummary:
    return BuildSummary(run_id="r1", status=status, conversations_requested=["a", "b"], conversations_built=["a"],
                        failures=[], counts={"items": 3}, usage={"item_triggers": OperationUsage(
                            "item_triggers", calls=5, cache_hits=1, requests=7, repairs=1, checked_reasks=1,
                            truncations=2, output_errors=2)}, snapshot_id="s1", seconds=1.0,
                        quarantined_units=units, notes={"item_triggers": {"split": 1, "quarantined": 1}})


def test_the_report_names_missing_units_and_health_and_the_exit_status_tells_them_apart() -> None:
    missing = MissingUnit("a", "item_triggers", "item", "itm_a", "a items I4", "LLMTruncatedError",
                          "answer cut at the completion budget of 3072 tokens", "d" * 64, '{"items": [')
    summary = _summary("completed", [], [missing])
    report = render_markdown(summary)
    assert "## Quarantined units" in report and "## Construction health" in report
    assert "| a | item_triggers | item `itm_a` | a items I4 | `dddddddddddddddd` |" in report
    assert "| item_triggers | 4 | 1 | 1 | 2 | 1 | 0 | 0 | 0 | 1 |" in report
    out = json.loads(json.dumps(summary.to_json()))
    assert out["quarantined_units"][0]["unit_id"] == "itm_a"
    assert out["construction_health"]["item_triggers"]["truncations"] == 2
    assert exit_status(out) == 4  # published, some units quarantined
    assert exit_status(_summary("completed", [], []).to_json()) == 0
    assert exit_status({"status": "partial", "failures": [{"quarantined": True}], "quarantined_units": [1]}) == 3
    assert exit_status({"status": "partial", "failures": [{"quarantined": False}]}) == 1


def test_transport_errors_are_never_quarantined_or_split() -> None:
    def down(operation: str, request_json: dict[str, object]) -> str:
        raise LLMTransportError(operation, "conv-t items", "endpoint failed 6 time(s)")

    chat = FakeChatModel({"item_triggers": down})
    with pytest.raises(LLMTransportError):
        item_triggers_outcome("conv-t", items(4), chat, batch=4)
    assert chat.calls == []  # one attempt, not bisected
    # ...whereas invalid output of the same batch is bisected to single items and quarantined.
    bad = FakeChatModel({"item_triggers": replies({"items": []})})
    done = item_triggers_outcome("conv-t", items(2), bad, batch=2)
    assert [u.unit_id for u in done.quarantined] == ["itm_0", "itm_1"] and done.value == []


def test_a_truncation_error_keeps_its_budget_and_spend_across_pickling() -> None:
    import pickle

    from tmem.errors import CallSpend, LLMTruncatedError

    exc = LLMTruncatedError("item_extract", "conv-x topic t (1 scenes)", "cut", raw_output="{", input_digest="d",
                            input_excerpt="<input>", max_tokens=4096)
    exc.spend = CallSpend(1, 0, 900, 4096)
    back = pickle.loads(pickle.dumps(exc))
    assert type(back) is LLMTruncatedError and isinstance(back, LLMOutputError)
    assert (back.operation, back.input_ref, back.reason, back.raw_output, back.max_tokens, back.spend) == (
        "item_extract", "conv-x topic t (1 scenes)", "cut", "{", 4096, CallSpend(1, 0, 900, 4096))
    assert str(back) == str(exc)

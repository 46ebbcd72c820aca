"""A topic whose items can never fit its output budget, through the build flow (issue 13, point 3).

The scripted server cuts every answer at the request's ``max_tokens`` (``enforce_max_tokens``,
as a hosted model and the model bridge do). Its item extraction pads the answer of one scene —
the conversation's first, which founds the first topic — far past any budget. The stage splits
that topic's chunk in halves down to the one scene, whose answer is still cut: that topic chunk
is quarantined *as a unit* and the conversation publishes with the rest of its memory; the build
report, ``tmem build --json`` (exit 4), ``tmem quarantine`` and the store's construction health
name it. On the old code the cut answer was "repaired", failed again, and the whole conversation
was quarantined and not published. Once the model behaves, the next build re-runs only that
topic's stage task (its cached result carried the quarantine) and clears the record.
"""

from __future__ import annotations

import io
import json
from pathlib import Path
from typing import Any

import pytest

import tmem.devtools.synth as synth
from tests.flow_helpers import (
    ingest_slice,
    ledger_rows,
    published,
    report_artifact,
    set_llm_env,
    snapshot_memory,
)
from tmem.cli import run as cli_run
from tmem.cli.base import CliContext
from tmem.devtools.responders import request_input
from tmem.devtools.scripted_llm import ScriptedLLM
from tmem.store.build_notes import construction_health
from tmem.store.duck import connect

pytestmark = [pytest.mark.prefect, pytest.mark.slow, pytest.mark.timeout(1200)]

CID = "conv-26"
FIRST_TURN = "D1:1"


ITEM_BUDGET = 1000  # tokens (4,000 characters): one scene's answer fits, two scenes' do not


def padded_items(first_scene_items: int) -> Any:
    """synth's answer plus 10 padded items (~2,500 characters) per scene; the scene holding the
    conversation's first turn gets ``first_scene_items`` (200: ~50,000 characters, which no split fits)."""

    def respond(operation: str, request_json: dict[str, Any]) -> str:
        answer = json.loads(synth.item_extract(operation, request_json))
        for s in request_input(request_json)["scenes"]:
            first = any(t["id"] == FIRST_TURN for block in s["dialogue"] for t in block["turns"])
            answer["items"] += [{"kind": "atomic", "content": f"They mentioned detail {n} of {s['title']}. " + "p" * 160,
                                 "sources": [s["ref"]], "date": None, "keywords": ["detail"]}
                                for n in range(first_scene_items if first else 10)]
        return json.dumps(answer)

    return respond


def _cli(argv: list[str]) -> tuple[int, dict[str, Any] | list[Any]]:
    out, err = io.StringIO(), io.StringIO()
    code = cli_run(argv, CliContext(stdout=out, stderr=err))
    return code, json.loads(out.getvalue())


def test_a_topic_whose_items_never_fit_is_quarantined_as_a_unit_and_the_conversation_publishes(
    prefect_harness: None, scripted_llm_factory: Any, monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    server: ScriptedLLM = scripted_llm_factory(enforce_max_tokens=True)
    server.set_responder("item_extract", padded_items(200))
    store = tmp_path / "store"
    set_llm_env(monkeypatch, server, TMEM_LLM_OUTPUT_BUDGETS=f"item_extract={ITEM_BUDGET}")
    ingest_slice(store, tmp_path / "s13.json", {CID: 3})

    code, summary = _cli(["build", "--store", str(store), "--json"])

    assert isinstance(summary, dict)
    assert code == 4, summary  # published, some units quarantined
    assert (summary["status"], summary["conversations_built"], summary["failures"]) == ("completed", [CID], [])
    [unit] = summary["quarantined_units"]
    memory = snapshot_memory(published(store), CID)
    first_scene = next(s for s in memory.scenes if FIRST_TURN in s.turn_ids)
    [first_topic] = [t for t in memory.topics if first_scene.scene_id in t.scene_ids]
    assert (unit["conversation_id"], unit["operation"], unit["unit_kind"], unit["unit_id"], unit["error_type"]) == (
        CID, "item_extract", "topic_chunk", first_topic.topic_id, "LLMTruncatedError")
    assert "(1 scenes)" in unit["input_ref"] and f"{ITEM_BUDGET} tokens" in unit["reason"]

    # Published with the rest of its memory: every other scene's items, triggers, personas.
    assert not [i for i in memory.items if first_scene.scene_id in i.source_scene_ids]
    assert {sid for i in memory.items for sid in i.source_scene_ids} == {s.scene_id for s in memory.scenes} - {
        first_scene.scene_id}
    assert memory.item_triggers and len(memory.personas) == 2 and len(memory.scene_triggers) == len(memory.scenes)

    # Every cut answer was cut at the budget the request carried; none was "repaired" by re-asking it.
    extracts = server.requests_for("item_extract")
    cut = [r for r in extracts if r.content and len(r.content) == ITEM_BUDGET * 4]
    assert cut and all(r.body["max_tokens"] == ITEM_BUDGET for r in extracts)
    assert not [r for r in extracts if r.body["messages"][-1]["role"] == "user"
                and "Your previous reply was not valid" in r.body["messages"][-1]["content"]]

    # Construction health, in the summary and queryable in the store per run and operation.
    health = summary["construction_health"]["item_extract"]
    # Every cut answer was split in halves, but the one-scene answer that failed the unit.
    assert health["truncations"] == len(cut) == health["splits"] + 1 and health["splits"] >= 1
    assert (health["quarantined_units"], health["output_errors"]) == (1, len(cut))
    con = connect(store, read_only=True)
    try:
        stored = construction_health(con, summary["run_id"])["item_extract"]
        notes = con.execute("SELECT kind, count(*) FROM build_notes WHERE run_id = ? AND operation = 'item_extract' "
                            "GROUP BY kind ORDER BY kind", [summary["run_id"]]).fetchall()
    finally:
        con.close()
    assert (stored.truncations, stored.splits, stored.quarantined_units) == (len(cut), len(cut) - 1, 1)
    print(f"\nfirst topic: {len(first_topic.scene_ids)} scenes; {len(cut)} answers cut; notes {dict(notes)}")
    assert dict(notes) == ({"quarantined": 1, "split": len(cut) - 1} if len(cut) > 1 else {"quarantined": 1})

    # Named in the report artifact and listed by `tmem quarantine`.
    report = report_artifact(summary["run_id"])
    assert "## Quarantined units" in report and "## Construction health" in report
    row = next(line for line in report.splitlines() if line.startswith(f"| {CID} | item_extract | topic_chunk"))
    assert first_topic.topic_id in row and unit["input_digest"][:16] in row
    code, records = _cli(["quarantine", "--store", str(store), "--json"])
    [record] = records
    assert (record["unit_kind"], record["unit_id"], record["state"], record["run_id"]) == (
        "topic_chunk", first_topic.topic_id, "active", summary["run_id"])
    assert len(record["raw_output"]) == ITEM_BUDGET * 4

    # The model behaves again: the next build re-runs that topic's items task only and clears the record.
    server.set_responder("item_extract", padded_items(10))
    code, again = _cli(["build", "--store", str(store), "--json"])
    assert isinstance(again, dict)
    assert code == 0, again
    assert (again["status"], again["quarantined_units"]) == ("completed", [])
    rebuilt = snapshot_memory(published(store), CID)
    assert [i for i in rebuilt.items if first_scene.scene_id in i.source_scene_ids]
    asked = [op for op, hit in ledger_rows(store, again["run_id"]) if not hit]
    assert set(asked) <= {"item_extract", "item_triggers"}, asked  # every other stage came from Prefect's cache
    assert asked.count("item_extract") == 1  # only the chunk that failed is asked again
    assert _cli(["quarantine", "--store", str(store), "--json"])[1] == []
    [history] = _cli(["quarantine", "--store", str(store), "--all", "--json"])[1]
    assert (history["state"], history["cleared_by_run"]) == ("cleared", again["run_id"])

"""Prompt injection through the build flow (issue 8, point 3): conversation text tells the memory
LLM to cite scenes and turns that do not exist, to use its own ids and another conversation's id;
a scripted model obeys (tmem/devtools/injection.py). The stored structure must stay valid: the bad
answers are rejected and re-asked, items cite only scenes of their own conversation, every id is
the one tmem/ids.py derives, and the other conversation's memory is exactly what a clean build of
it gives."""

from __future__ import annotations

import json
import os
import re
from pathlib import Path

import pytest

from tests.flow_helpers import (
    INGEST_NOW,
    build,
    ingest_slice,
    published,
    set_llm_env,
    snapshot_memory,
    work_memory,
    write_locomo_slice,
)
from tmem.construct.items import item_id
from tmem.construct.segment import scene_id
from tmem.construct.topics import topic_id
from tmem.devtools import synth
from tmem.devtools.injection import CLAIMED_IDS, INJECTION, INJECTION_MARKER, ObeyLog, obedient
from tmem.devtools.scripted_llm import ScriptedLLM
from tmem.domain import ConversationMemory
from tmem.ingest import ingest_archives
from tmem.prompts.common import FEEDBACK_NOTE

pytestmark = [pytest.mark.prefect, pytest.mark.slow]  # two small builds: ~60 s idle, ~160 s on a loaded machine

A, B = "conv-26", "conv-30"  # A carries the injections; B is the conversation the model is told to write into
MODEL = "gpt-4o-mini"  # the default model: part of every derived id
OUR_ID = re.compile(r"^(scn|tpc|itm)_[0-9a-f]{16}$")


def injected_archive(path: Path) -> Path:
    """Session 1 of A and B; every fourth turn of A ends with the injection."""
    write_locomo_slice(path, {A: 1, B: 1})
    samples = json.loads(path.read_text(encoding="utf-8"))
    for sample in samples:
        if sample["sample_id"] == A:
            for k, turn in enumerate(sample["conversation"]["session_1"]):
                if k % 4 == 1:
                    turn["text"] = f"{turn['text']} {INJECTION.format(other=B)}"
    path.write_text(json.dumps(samples, ensure_ascii=False), encoding="utf-8")
    return path


def check_structure(memory: ConversationMemory, turn_ids: set[str]) -> None:
    """Every reference stays inside the conversation, and every id is the derived one."""
    cid = memory.conversation_id
    scenes = {s.scene_id: s for s in memory.scenes}
    assert scenes, f"{cid}: no scenes"
    for scene in memory.scenes:
        assert scene.conversation_id == cid and set(scene.turn_ids) <= turn_ids
        assert scene.scene_id == scene_id(cid, scene.turn_ids, MODEL)
    for topic in memory.topics:
        assert topic.conversation_id == cid and topic.scene_ids and set(topic.scene_ids) <= set(scenes)
        assert topic.topic_id == topic_id(cid, topic.scene_ids[0])
    topics = {t.topic_id for t in memory.topics}
    for item in memory.items:
        assert item.conversation_id == cid and item.topic_id in topics
        assert item.source_scene_ids and set(item.source_scene_ids) <= set(scenes)
        assert item.item_id == item_id(cid, item.content, item.source_scene_ids, MODEL)
    items = {i.item_id for i in memory.items}
    assert all(t.conversation_id == cid and t.item_id in items for t in memory.item_triggers)
    assert all(t.conversation_id == cid and t.scene_id in scenes for t in memory.scene_triggers)
    assert all(p.conversation_id == cid for p in memory.personas)
    for object_id in [*scenes, *topics, *items]:
        assert OUR_ID.match(object_id) and object_id not in CLAIMED_IDS.values()


def turn_ids_of(store: Path, cid: str) -> set[str]:
    from tests.ingest_helpers import query

    return {row[0] for row in query(store, "SELECT turn_id FROM turns WHERE conversation_id = ?", [cid])}


def test_an_obedient_model_cannot_change_the_structure_of_what_is_stored(
    prefect_harness: None, monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    for name in [n for n in os.environ if n.startswith(("TMEM_", "OPENAI_"))]:
        monkeypatch.delenv(name)
    log = ObeyLog()
    responders = {op: obedient(op, B, log) for op in synth.RESPONDERS if op != "answer"}
    with ScriptedLLM(responders=responders) as hostile, ScriptedLLM() as clean:
        store = tmp_path / "store"
        ingest_archives([injected_archive(tmp_path / "injected.json")], store, now=INGEST_NOW)
        set_llm_env(monkeypatch, hostile)
        summary = build(store)

        reference = tmp_path / "reference"  # B alone, built by the plain deterministic model
        ingest_slice(reference, tmp_path / "clean.json", {B: 1})
        set_llm_env(monkeypatch, clean)
        assert build(reference)["status"] == "completed"

    print(f"\nobeyed injections: broken references {dict(log.broken)}; claimed ids {dict(log.claimed)}")
    # The model did obey: first answers cited nothing real, every answer claimed ids and conversation B.
    assert {"scene_boundaries", "item_extract"} <= set(log.broken), log.broken
    assert sum(log.claimed.values()) >= sum(log.broken.values())
    # ... and each broken answer was rejected with its reason and asked again.
    feedback = FEEDBACK_NOTE.split("{", 1)[0]
    injected = [r for r in hostile.requests if INJECTION_MARKER in json.dumps(r.body, ensure_ascii=False)]
    for operation, broken in log.broken.items():
        reasks = [r for r in injected if r.operation == operation and feedback in json.dumps(r.body)]
        assert len(reasks) >= broken, (operation, broken, len(reasks))

    assert summary["status"] == "completed", summary["failures"]
    info = published(store)
    assert set(info.conversations) == {A, B}
    a_memory = snapshot_memory(info, A)
    check_structure(a_memory, turn_ids_of(store, A))
    assert a_memory.items and a_memory == work_memory(store, A)
    # Nothing of B was touched: its memory is exactly that of a clean build of B alone.
    b_memory = snapshot_memory(info, B)
    check_structure(b_memory, turn_ids_of(store, B))
    assert b_memory == snapshot_memory(published(reference), B)

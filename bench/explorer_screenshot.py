"""Screenshots of the memory explorer for the README (docs/explorer*.png), on real-model memory.

The memory is the fixture a capable model built for LoCoMo conv-26 sessions 1-6 with eight
LoCoMo-Plus cues stitched in (``../shared/fixtures/real-model/conv26-s1-6-cues``: its archive
and published memory tables). This script ingests the archive into a temporary store, embeds
the memory's views with the shipped MiniLM, publishes a snapshot, serves it with the real query
side (``create_app``, MiniLM query embedding) on 127.0.0.1 and drives headless Chromium
(Debian's ``chromium`` + ``chromium-driver``) through it.

    python bench/explorer_screenshot.py [--fixture DIR] [--out docs]
"""

from __future__ import annotations

import argparse
import json
import socket
import tempfile
import threading
import time
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import uvicorn

from tests.query_store import Conv, publish
from tmem import domain
from tmem.bundle import embedder_for
from tmem.domain import BridgeTrigger, Item, ItemTriggers, Persona, PersonaFact, Scene, SceneTriggers, Topic
from tmem.ingest.load import ingest_archives
from tmem.query.memory import Memory as QueryMemory
from tmem.query.service import create_app
from tmem.settings import Settings
from tmem.store.conversations import load_turns
from tmem.store.duck import connect

REPO = Path(__file__).resolve().parents[1]
FIXTURE = REPO.parent / "shared" / "fixtures" / "real-model" / "conv26-s1-6-cues"
CONVERSATION = "conv-26"
# A LoCoMo-Plus trigger query: it shares no words with its cue (Caroline on the toll of hospice
# work, session 10), so only the associative channels can reach it.
QUERY = ("I just finished helping my uncle through his last few weeks, and it made me realize how emotionally "
         "draining this kind of work could be day after day.")
FOLLOW = "hospice"  # the title of the cue's scene
FLAGS = ("--headless", "--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run",
         "--disable-background-networking", "--disable-component-update", "--disable-sync", "--hide-scrollbars")


def _group(rows: list[dict[str, Any]], key: str) -> dict[str, list[dict[str, Any]]]:
    out: dict[str, list[dict[str, Any]]] = {}
    for row in rows:
        out.setdefault(row[key], []).append(row)
    return out


def _when(value: str | None) -> datetime | None:
    return datetime.fromisoformat(value) if value else None


def fixture_memory(rows: dict[str, list[dict[str, Any]]]) -> domain.ConversationMemory:
    """The fixture's memory tables as domain objects."""
    topic_scenes, item_scenes = _group(rows["topic_scene"], "topic_id"), _group(rows["item_scene"], "item_id")
    item_trigs, scene_trigs = _group(rows["item_triggers"], "item_id"), _group(rows["scene_triggers"], "scene_id")
    scenes = tuple(Scene(**{**r, "turn_ids": tuple(r["turn_ids"]), "start_time": _when(r["start_time"]),
                            "end_time": _when(r["end_time"])}) for r in rows["scenes"])
    topics = tuple(Topic(conversation_id=r["conversation_id"], topic_id=r["topic_id"], seq=r["seq"], title=r["title"],
                         keywords=tuple(r["keywords"]),
                         scene_ids=tuple(x["scene_id"] for x in topic_scenes.get(r["topic_id"], [])))
                   for r in rows["topics"])
    items = tuple(Item(conversation_id=r["conversation_id"], item_id=r["item_id"], topic_id=r["topic_id"], kind=r["kind"],
                       content=r["content"], event_time=_when(r["event_time"]), keywords=tuple(r["keywords"]),
                       source_scene_ids=tuple(x["scene_id"] for x in item_scenes.get(r["item_id"], [])))
                  for r in rows["items"])
    item_triggers = []
    for iid, trig in item_trigs.items():
        trig = sorted(trig, key=lambda t: (t["family"], t["ordinal"]))
        item_triggers.append(ItemTriggers(
            conversation_id=CONVERSATION, item_id=iid, entities=tuple(t["text"] for t in trig if t["family"] == "entity"),
            bridges=tuple(BridgeTrigger(situation=t["text"], rationale=t["rationale"] or "")
                          for t in trig if t["family"] == "bridge")))
    scene_triggers = []
    for sid, trig in scene_trigs.items():
        attrs = {t["channel"]: t["text"] for t in trig if t["family"] == "scene"}
        scene_triggers.append(SceneTriggers(
            conversation_id=CONVERSATION, scene_id=sid, **{a: attrs.get(a, "") for a in ("situation", "object", "event", "emotion")},
            horizons={t["channel"]: t["text"] for t in trig if t["family"] == "horizon"}))
    personas = []
    for r in rows["personas"]:
        p = json.loads(r["persona"])
        personas.append(Persona(
            conversation_id=CONVERSATION, speaker=r["speaker"], identity=tuple(p["identity"]),
            preferences=tuple(p["preferences"]), traits=tuple(p["traits"]), relations=tuple(p["relations"]),
            timeline=tuple(PersonaFact(**f) for f in p["timeline"])))
    return domain.ConversationMemory(conversation_id=CONVERSATION, scenes=scenes, topics=topics, items=items,
                  item_triggers=tuple(item_triggers), scene_triggers=tuple(scene_triggers), personas=tuple(personas))


def build(store: Path, fixture: Path, settings: Settings) -> None:
    ingest_archives([fixture / "archive.json"], store, now=datetime(2026, 12, 1, 9, 0, tzinfo=UTC))
    con = connect(store, read_only=True)
    try:
        turns = load_turns(con, CONVERSATION)
    finally:
        con.close()
    memory = fixture_memory(json.loads((fixture / "memory.json").read_text(encoding="utf-8")))
    publish(store, [Conv(memory, turns)], embedder_for(settings, None), now=datetime.now(UTC))


def serve(app: Any) -> tuple[uvicorn.Server, str]:
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM, socket.IPPROTO_TCP)
    sock.bind(("127.0.0.1", 0))
    server = uvicorn.Server(uvicorn.Config(app, log_level="warning", access_log=False, lifespan="off"))
    threading.Thread(target=server.run, kwargs={"sockets": [sock]}, daemon=True).start()
    while not server.started:
        time.sleep(0.05)
    return server, f"http://127.0.0.1:{sock.getsockname()[1]}"


def shoot(url: str, out: Path) -> list[Path]:
    from selenium import webdriver
    from selenium.webdriver.chrome.service import Service
    from selenium.webdriver.support.ui import WebDriverWait

    options = webdriver.ChromeOptions()
    options.binary_location = "/usr/bin/chromium"
    for flag in (*FLAGS, f"--user-data-dir={tempfile.mkdtemp(prefix='tmem-shot-')}", "--window-size=1480,1960"):
        options.add_argument(flag)
    driver = webdriver.Chrome(options=options, service=Service("/usr/bin/chromedriver"))
    wait = WebDriverWait(driver, 60)
    shots = []
    try:
        driver.get(f"{url}/explorer/#/c/{CONVERSATION}/query")
        box = wait.until(lambda d: d.find_element("css selector", "input[name=query]"))
        box.send_keys(QUERY)
        driver.find_element("css selector", "form.query-form button[type=submit]").click()
        wait.until(lambda d: d.find_elements("css selector", "[data-stage=item_selection]"))
        # Follow the cue's scene: why the associative channels recalled it.
        driver.execute_script(
            "const s = document.querySelector('.follow-bar select');"
            "const o = [...s.options].find(o => o.text.includes(arguments[0]));"
            "s.value = o.value; s.dispatchEvent(new Event('change'));"
            "document.querySelector('main').scrollTo(0, 0);", FOLLOW)
        wait.until(lambda d: d.find_elements("css selector", ".follow .path"))
        shots.append(out / "explorer.png")
        driver.save_screenshot(str(shots[-1]))
        driver.execute_script("document.querySelector('[data-stage=scene_cue]').scrollIntoView()")
        driver.execute_script("document.querySelector('main').scrollBy(0, -8)")
        time.sleep(0.3)
        shots.append(out / "explorer-trace.png")
        driver.save_screenshot(str(shots[-1]))
        driver.get(f"{url}/explorer/#/c/{CONVERSATION}/timeline")
        first = wait.until(lambda d: d.find_element("css selector", ".tl-scene"))
        first.find_element("css selector", "details").click()
        first.find_element("css selector", ".turn-actions button").click()
        wait.until(lambda d: d.find_elements("css selector", ".turns li"))
        driver.set_window_size(1480, 1300)
        driver.execute_script("document.querySelector('main').scrollTo(0, 0)")
        shots.append(out / "explorer-timeline.png")
        driver.save_screenshot(str(shots[-1]))
    finally:
        driver.quit()
    return shots


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--fixture", type=Path, default=FIXTURE)
    parser.add_argument("--out", type=Path, default=REPO / "docs")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory(prefix="tmem-explorer-shot-") as tmp:
        store = Path(tmp) / "store"
        settings = Settings(store=store)
        build(store, args.fixture, settings)
        server, url = serve(create_app(store, settings, memory=QueryMemory.open(store, settings)))
        try:
            for path in shoot(url, args.out):
                print(path)
        finally:
            server.should_exit = True


if __name__ == "__main__":
    main()

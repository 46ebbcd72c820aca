"""The memory explorer in a real headless Chromium (Debian's ``chromium`` + ``chromium-driver``,
driven by Selenium), against a small published store served by uvicorn on 127.0.0.1 with
``TMEM_API_KEY`` set: enter the key, open a conversation, run a query and read its trace, open
turns on demand, follow hostile ids, read builds and quarantine.

CI installs the browser (``.ci/run``); ``playwright install`` cannot work here (it downloads).
"""

from __future__ import annotations

import re
import shutil
import tempfile
from collections.abc import Iterator
from pathlib import Path
from typing import Any
from urllib.parse import quote

import pytest

from tests.explorer_store import HOSTILE, RAW_OUTPUT, ExplorerStore, build_explorer_store
from tests.query_store import HashEmbedder
from tests.test_explorer import BRIDGE_QUERY, CHANNELS
from tests.test_query_service import LiveServer
from tmem.query.memory import Memory
from tmem.query.service import create_app
from tmem.settings import load_settings

pytestmark = [pytest.mark.slow, pytest.mark.timeout(300)]

CHROMIUM, CHROMEDRIVER = "/usr/bin/chromium", "/usr/bin/chromedriver"
# Without the background-networking switches Chromium dials out at start and this closed network refuses it.
FLAGS = ("--headless", "--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run",
         "--disable-background-networking", "--disable-component-update", "--disable-sync",
         "--disable-dev-shm-usage", "--window-size=1500,1000")
API_KEY = "browser-key-8c2f19a4e7"
WAIT_S = 20


@pytest.fixture(scope="module")
def es(tmp_path_factory: pytest.TempPathFactory) -> ExplorerStore:
    return build_explorer_store(tmp_path_factory.mktemp("browser") / "store")


@pytest.fixture(scope="module")
def live(es: ExplorerStore) -> Iterator[LiveServer]:
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("TMEM_API_KEY", API_KEY)  # as `tmem serve` reads it
        settings = load_settings(store=es.path)
    memory = Memory.open(es.path, settings, embedder=HashEmbedder())
    server = LiveServer(create_app(es.path, settings, memory=memory)).start()
    yield server
    server.stop()


@pytest.fixture(scope="module")
def browser() -> Iterator[Any]:
    if not (Path(CHROMIUM).exists() and Path(CHROMEDRIVER).exists()):
        pytest.fail("the browser tests need Debian's chromium and chromium-driver: apt-get install -y chromium "
                    "chromium-driver (.ci/run installs them)")
    from selenium import webdriver
    from selenium.webdriver.chrome.service import Service

    profile = tempfile.mkdtemp(prefix="tmem-chromium-")
    options = webdriver.ChromeOptions()
    options.binary_location = CHROMIUM
    for flag in (*FLAGS, f"--user-data-dir={profile}"):
        options.add_argument(flag)
    options.set_capability("goog:loggingPrefs", {"browser": "ALL"})
    driver = webdriver.Chrome(options=options, service=Service(CHROMEDRIVER))  # a given driver: no Selenium Manager
    driver.implicitly_wait(0)
    yield driver
    driver.quit()
    shutil.rmtree(profile, ignore_errors=True)


def wait_for(driver: Any, css: str, text: str | None = None) -> Any:
    from selenium.webdriver.common.by import By
    from selenium.webdriver.support import expected_conditions as ec
    from selenium.webdriver.support.ui import WebDriverWait

    wait = WebDriverWait(driver, WAIT_S)
    if text is not None:
        wait.until(ec.text_to_be_present_in_element((By.CSS_SELECTOR, css), text))
    return wait.until(ec.visibility_of_element_located((By.CSS_SELECTOR, css)))


def texts(driver: Any, css: str) -> list[str]:
    from selenium.webdriver.common.by import By

    return [str(e.text) for e in driver.find_elements(By.CSS_SELECTOR, css)]


def enter_key(driver: Any, key: str) -> None:
    dialog = wait_for(driver, "#key-dialog")
    field = dialog.find_element("css selector", "#key-input")
    field.send_keys(key)
    dialog.find_element("css selector", "button[value=ok]").click()


def open_listed(driver: Any, shown_id: str) -> None:
    """Click the conversation whose id the list shows exactly as ``shown_id``."""
    [link] = [a for a in driver.find_elements("css selector", "#conv-list li a")
              if a.find_element("css selector", ".conv-id").text == shown_id]
    link.click()
    wait_for(driver, ".conv-head h2")
    assert driver.find_element("css selector", ".conv-head h2").text == shown_id


def console_errors(driver: Any) -> list[str]:
    return [e["message"] for e in driver.get_log("browser") if e["level"] == "SEVERE"]


def test_the_explorer_in_a_real_browser(browser: Any, live: LiveServer, es: ExplorerStore, tmp_path: Path) -> None:
    driver = browser
    driver.get(live.url + "/")
    assert driver.current_url == live.url + "/explorer/"

    # The key: asked for on the first 401, refused when wrong, kept in sessionStorage, never in a URL.
    enter_key(driver, "not-the-key")
    wait_for(driver, "#key-message", "refused")
    enter_key(driver, API_KEY)
    wait_for(driver, "#conv-count", f"{len(es.convs)} conversations")
    assert driver.execute_script("return sessionStorage.getItem('tmem.explorer.apiKey')") == API_KEY
    listed = "\n".join(texts(driver, "#conv-list li"))
    assert "it's <script>window.__pwned = 1</script>" in listed and "nul\u2039NUL\u203abyte\u2039U+202E\u203a" in listed
    assert "2 turns waiting for the next build" in listed  # conv-b's turns ingested after its build

    # Open a conversation from the list, run the cascade, read the trace.
    open_listed(driver, "conv-a")
    query = wait_for(driver, "input[name=query]")
    query.send_keys(BRIDGE_QUERY)
    driver.find_element("css selector", "form.query-form button[type=submit]").click()
    wait_for(driver, "[data-stage=item_selection]")
    titles = texts(driver, ".stage header h3")
    assert titles == ["Topic prefilter", "SceneCue", "Scene selection", "TrigRecall", "Item selection"]
    assert set(texts(driver, ".explain .chan")) >= CHANNELS  # every channel named in the trace
    assert set(texts(driver, ".recalled .chan")) >= {"dense", "dialogue", "scene_trigger", "horizon", "entity_bridge"}
    gate = texts(driver, ".gate-line")[0]
    # the default gate is standardised: τ is the cosine this query's own distribution required
    assert re.match(r"2 of the 12 nearest items reached τ = 0\.\d{3} \(robust z ≥ 3(\.0)? over this query's", gate), gate
    assert texts(driver, "[data-stage=trig_recall] tr.kept .label") == [
        i.content for i in es.convs["conv-a"].memory.items if i.item_id.startswith("itm_1_")]
    assert "in context" in texts(driver, ".recalled")[0] and "tokens for scenes and items" in texts(driver, ".context")[0]
    # Follow a scene through the stages.
    driver.execute_script("const s = document.querySelector('.follow-bar select');"
                          "s.value = s.options[1].value; s.dispatchEvent(new Event('change'));")
    path = wait_for(driver, ".follow .path").text
    assert "Topic prefilter" in path and "SceneCue" in path and "Scene selection" in path and "returned at #1" in path
    assert driver.find_elements("css selector", "tr.followed")
    driver.save_screenshot(str(tmp_path / "trace.png"))

    # The timeline; turns on demand.
    driver.find_element("link text", "Timeline").click()
    first = wait_for(driver, ".tl-scene")
    assert not first.find_elements("css selector", ".turns li")
    first.find_element("css selector", ".turn-actions button").click()
    wait_for(driver, ".tl-scene .turns", "D1:1")
    assert len(first.find_elements("css selector", ".turns li")) == len(es.convs["conv-a"].memory.scenes[0].turn_ids)

    # A hostile id, opened by a deep link: its own memory, shown as text; nothing it carries runs.
    hostile = HOSTILE[0]
    driver.get(f"{live.url}/explorer/#/c/{quote(hostile, safe='')}/items")
    wait_for(driver, ".conv-head h2", "<script>")
    assert driver.find_element("css selector", ".conv-head h2").text == hostile
    items = "\n".join(texts(driver, ".item .content"))
    assert items and es.mark(hostile) in items and "alpha" not in items
    assert driver.execute_script("return window.__pwned") is None
    assert driver.execute_script("return document.querySelectorAll('script').length") == 1  # the page's own module
    assert driver.execute_script("return document.querySelectorAll('main img, aside img').length") == 0
    for cid in HOSTILE[1:3]:  # attribute-breaking ids, opened from the list
        driver.get(f"{live.url}/explorer/#/")
        wait_for(driver, "#conv-count", "conversations")
        open_listed(driver, cid)
        driver.find_element("css selector", "input[name=query]").send_keys("hiking trail")
        driver.find_element("css selector", "form.query-form button[type=submit]").click()
        wait_for(driver, "[data-stage=scene_selection]")
        assert es.mark(cid) in "\n".join(texts(driver, ".recalled .hit-title"))
        assert driver.execute_script("return window.__pwned") is None

    # Builds and quarantine, from the snapshot.
    driver.find_element("css selector", "#nav a[data-view=builds]").click()
    builds = wait_for(driver, "main table.grid", "run-old").text
    assert "serving" in builds and "partial" in builds and "failed" in builds
    driver.find_element("css selector", "#nav a[data-view=quarantine]").click()
    wait_for(driver, "main table.grid", "conv-q")
    assert "active" in texts(driver, "main table.grid")[0] and "Quarantine (1)" in texts(driver, "#nav")[0]
    driver.find_element("link text", "conv-q").click()
    wait_for(driver, "main", "not a list of scenes")
    assert RAW_OUTPUT in texts(driver, "main .pre") and not driver.find_elements("css selector", "main .pre b")

    # Same origin only, the key in no URL, no script error.
    resources = driver.execute_script("return performance.getEntriesByType('resource').map(e => e.name)")
    assert resources and all(str(r).startswith(live.url + "/") for r in resources)
    assert all(API_KEY not in str(r) for r in [*resources, driver.current_url])
    assert console_errors(driver) == [] or all("401" in e for e in console_errors(driver))


def test_without_the_key_the_page_shows_no_memory(browser: Any, live: LiveServer) -> None:
    driver = browser
    driver.get(live.url + "/explorer/")
    driver.execute_script("sessionStorage.clear()")
    driver.get(live.url + "/explorer/#/builds")
    dialog = wait_for(driver, "#key-dialog")
    dialog.find_element("css selector", "#key-cancel").click()
    wait_for(driver, "main", "API key needed")
    assert "run-old" not in driver.page_source and "alpha" not in driver.page_source

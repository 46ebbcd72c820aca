"""Prefect as its users expect it, against a real ``prefect server start`` (issue 16, point 5).

* **Alerting.** ``deployments/alerts.py`` creates the automation on Failed/Crashed runs of the
  nightly deployment with a webhook notification block; a failing run of the nightly deployment
  makes the server itself post the alert to a receiver here (naming the run and its state), and
  a failing run of another deployment does not.
* **Progress.** A build of three conversations of different lengths keeps its
  ``tmem-build-progress`` artifact current: polled while it runs, it shows values between 0 and
  100 before its final 100 % and "3 of 3 conversations done".

The server runs in a subprocess with its own ``PREFECT_HOME`` (SQLite), its services included
(the trigger evaluation and the actions that send notifications).
"""

from __future__ import annotations

import contextvars
import json
import os
import subprocess
import sys
import threading
import time
import urllib.request
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any

import pytest

from tests.flow_helpers import build, ingest_slice, set_llm_env, wait_for
from tests.paths import REPO
from tmem.devtools.scripted_llm import ScriptedLLM

pytestmark = [pytest.mark.prefect, pytest.mark.slow, pytest.mark.timeout(900)]


@dataclass
class Receiver:
    """An HTTP endpoint on 127.0.0.1 that records the JSON bodies posted to it."""

    bodies: list[dict[str, Any]] = field(default_factory=list)

    def start(self) -> str:
        received = self.bodies

        class Handler(BaseHTTPRequestHandler):
            def do_POST(self) -> None:
                length = int(self.headers.get("content-length", 0))
                received.append(json.loads(self.rfile.read(length) or b"{}"))
                self.send_response(200)
                self.end_headers()

            def log_message(self, *args: Any) -> None:
                return

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        threading.Thread(target=self.server.serve_forever, daemon=True).start()
        return f"http://127.0.0.1:{self.server.server_address[1]}/alert"

    def stop(self) -> None:
        self.server.shutdown()


@pytest.fixture(scope="module")
def real_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    """``prefect server start`` on a free port; the API URL, set as this process's Prefect API."""
    import socket

    from prefect.settings import PREFECT_API_URL, temporary_settings

    home = tmp_path_factory.mktemp("real-prefect-home")
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    env = {k: v for k, v in os.environ.items() if not k.startswith("PREFECT_")} | {
        "PREFECT_HOME": str(home), "PREFECT_SERVER_ANALYTICS_ENABLED": "false", "DO_NOT_TRACK": "1",
        "PREFECT_UI_URL": f"http://127.0.0.1:{port}"}  # as docs/operations.md starts it: alerts link to the run
    log = (home / "server.log").open("w")
    proc = subprocess.Popen([sys.executable, "-m", "prefect", "server", "start", "--host", "127.0.0.1", "--port",
                             str(port)], env=env, stdout=log, stderr=subprocess.STDOUT, cwd=REPO)
    api = f"http://127.0.0.1:{port}/api"
    try:
        deadline = time.monotonic() + 180
        while True:
            try:
                with urllib.request.urlopen(f"{api}/health", timeout=5):
                    break
            except OSError:
                assert proc.poll() is None and time.monotonic() < deadline, (home / "server.log").read_text()[-3000:]
                time.sleep(0.5)
        with temporary_settings(updates={PREFECT_API_URL: api}):
            yield api
            # flush what this module's runs queued for this server while it still answers: a worker left
            # holding events or logs for a stopped server makes the session's last drain wait forever
            from prefect.events.worker import EventsWorker
            from prefect.logging.handlers import APILogWorker

            APILogWorker.drain_all(timeout=60, at_exit=False)
            EventsWorker.drain_all(timeout=60, at_exit=False)
    finally:
        proc.terminate()
        proc.wait(timeout=60)
        log.close()


def test_a_failed_nightly_run_alerts_through_the_automation_and_another_deployments_failure_does_not(
    real_server: str, tmp_path: Path
) -> None:
    from prefect.automations import Automation
    from prefect.client.orchestration import get_client
    from prefect.flow_engine import run_flow

    from deployments.alerts import AUTOMATION, FAILED_EVENTS, create_nightly_alert
    from tmem.flows.backfill import backfill
    from tmem.flows.nightly_rebuild import nightly_rebuild

    nightly = nightly_rebuild.to_deployment(name="nightly-rebuild", parameters={"store": str(tmp_path / "store")})
    other = backfill.to_deployment(name="backfill", parameters={"store": str(tmp_path / "store")})
    nightly_id, other_id = nightly.apply(), other.apply()  # type: ignore[union-attr]
    receiver = Receiver()
    url = receiver.start()
    try:
        automation = create_nightly_alert("nightly-rebuild/nightly-rebuild", webhook_url=url)
        again = create_nightly_alert("nightly-rebuild/nightly-rebuild", webhook_url=url)  # replaced, not doubled
        with get_client(sync_client=True) as client:
            assert [a.id for a in client.read_automations_by_name(name=AUTOMATION)] == [again.id] != [automation.id]
        stored = Automation.read(name=AUTOMATION)
        assert stored.trigger.expect == set(FAILED_EVENTS)  # type: ignore[union-attr]
        related: Any = stored.trigger.match_related  # type: ignore[union-attr]
        assert related.model_dump() == {"prefect.resource.id": f"prefect.deployment.{nightly_id}"}  # a ResourceSpecification

        with get_client(sync_client=True) as client:
            failing_other = client.create_flow_run_from_deployment(other_id, parameters={"paths": [str(tmp_path / "no.json")]})
            failing = client.create_flow_run_from_deployment(nightly_id, parameters={"keep_snapshots": 0})
        assert run_flow(backfill, flow_run=failing_other, parameters={"store": str(tmp_path / "store"),
                        "paths": [str(tmp_path / "no.json")]}, return_type="state").is_failed()
        state = run_flow(nightly_rebuild, flow_run=failing, parameters={"store": str(tmp_path / "store"),
                                                                        "keep_snapshots": 0}, return_type="state")
        assert state.is_failed()

        body = wait_for(lambda: next((b for b in receiver.bodies if failing.name in b.get("text", "")), None),
                        timeout_s=120, what="the alert of the failed nightly run")
        assert "Failed" in body["text"] and "keep_snapshots must be >= 1" in body["text"]
        assert real_server.removesuffix("/api") + f"/runs/flow-run/{failing.id}" in body["text"]  # the server's UI
        time.sleep(5)  # the other deployment's failure had as long to alert as the nightly's
        assert [b for b in receiver.bodies if failing_other.name in b.get("text", "")] == []
        assert len([b for b in receiver.bodies if failing.name in b.get("text", "")]) == 1
    finally:
        receiver.stop()


def test_a_long_build_keeps_its_progress_artifact_current(
    real_server: str, scripted_llm_factory: Any, monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    from prefect.client.orchestration import get_client
    from prefect.client.schemas.filters import ArtifactFilter, ArtifactFilterKey

    server: ScriptedLLM = scripted_llm_factory(latency_ms=40)
    set_llm_env(monkeypatch, server)
    store = tmp_path / "store"
    ingest_slice(store, tmp_path / "three.json", {"conv-30": 1, "conv-26": 2, "conv-41": 4})
    seen: list[tuple[float, str]] = []
    seen_between = threading.Event()
    # The three conversations may finish within milliseconds of each other (CI saw a poller that
    # never caught 33 % or 67 %): after the build's first update between 0 and 100 % it waits
    # (at most 60 s) until the poller has read an intermediate value from the server, so what is
    # asserted is that the server shows progress while the build runs, not the poller's luck.
    from tmem.tasks.runtime import BuildProgress

    done = BuildProgress.conversation_done

    def done_then_wait(self: BuildProgress, conversation_id: str, ok: bool) -> None:
        done(self, conversation_id, ok)
        if 0 < self.done < self.total:
            seen_between.wait(60)

    monkeypatch.setattr(BuildProgress, "conversation_done", done_then_wait)

    def progress() -> list[Any]:
        with get_client(sync_client=True) as client:
            return client.read_artifacts(artifact_filter=ArtifactFilter(key=ArtifactFilterKey(any_=["tmem-build-progress"])))

    with ThreadPoolExecutor(1) as pool:
        # The build runs in a thread: it gets this context, so it reports to the real server too.
        running = pool.submit(contextvars.copy_context().run, build, store)
        while not running.done():
            seen += [(float(a.data), str(a.description)) for a in progress()]
            if any(0 < v < 100 for v, _ in seen):
                seen_between.set()
            time.sleep(0.1)
        summary = running.result()
    assert summary["status"] == "completed", summary["failures"]
    [final] = progress()
    assert (final.type, float(final.data)) == ("progress", 100.0)
    assert final.description == "tmem build all: 3 of 3 conversations done"
    assert str(final.flow_run_id) == summary["run_id"]
    values = sorted({v for v, _ in seen})
    assert [v for v in values if 0 < v < 100], f"no intermediate progress seen: {values}"
    # polled every 0.1 s, a state may pass unseen when two conversations finish together: every state seen
    # is one of the build's, in order, and the artifact moved at least once before the end
    valid = [f"tmem build all: {n} of 3 conversations done" for n in range(4)]
    order = [valid.index(d) for _, d in seen]  # ValueError on a description the build never writes
    assert order == sorted(order) and any(0 < n < 3 for n in order), seen


def test_the_alert_body_names_the_run_when_the_server_does_not_know_its_ui_address(monkeypatch: pytest.MonkeyPatch) -> None:
    """Rendered as the server renders it (its template filters): never a bare "None" for the link."""
    import uuid

    from prefect.server.events.jinja_filters import all_filters
    from prefect.server.schemas.core import FlowRun
    from prefect.server.utilities.user_templates import register_user_template_filters, render_user_template_sync
    from prefect.settings import PREFECT_API_URL, PREFECT_UI_URL, temporary_settings

    from deployments.alerts import BODY

    register_user_template_filters(all_filters)
    run = FlowRun(id=uuid.uuid4(), flow_id=uuid.uuid4(), name="nightly-rebuild/nightly")
    with temporary_settings(restore_defaults={PREFECT_UI_URL, PREFECT_API_URL}):
        bare = render_user_template_sync(BODY, {"flow_run": run})
    with temporary_settings(updates={PREFECT_UI_URL: "http://prefect.internal:4200"}):
        linked = render_user_template_sync(BODY, {"flow_run": run})
    assert bare.splitlines()[-1] == f"flow run id {run.id}"
    assert linked.splitlines()[-1] == f"http://prefect.internal:4200/runs/flow-run/{run.id}"

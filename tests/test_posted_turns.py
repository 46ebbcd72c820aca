"""Turns posted by a live assistant (issue 16, point 3): ``POST /conversations/{id}/turns``.

A post is validated exactly like file ingest (the same reasons, record by record), idempotent by
turn id, answered at once without the builder's lock, spooled whole (one file per post, never
interleaved by concurrent writers) and ingested by the next drain; a refused post writes nothing.
Over real HTTP: uvicorn on a loopback port, httpx as the client.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys
import time
from collections.abc import Iterator
from concurrent.futures import ProcessPoolExecutor, ThreadPoolExecutor
from datetime import UTC, datetime, timedelta
from multiprocessing import get_context
from pathlib import Path
from typing import Any
from urllib.parse import quote

import httpx
import pytest

from tests.flow_helpers import cli_json
from tests.query_store import SPEAKERS
from tests.test_isolation import FRAGMENTS
from tests.test_query_service import REPO, LiveServer, app_for, two_conversation_store
from tmem.errors import IngestError
from tmem.ingest import ingest_archives, parse_jsonl_text, read_archive
from tmem.ingest.posted import parse_posted, parse_posted_text
from tmem.ingest.spool import Spool, conversation_key, drain_spool
from tmem.settings import Settings, load_settings
from tmem.store.duck import connect
from tmem.store.ingest_writer import StoredState

T0 = datetime(2027, 1, 1, 10, 0, tzinfo=UTC)
NOW = datetime(2027, 2, 1, tzinfo=UTC)
API_KEY = "tmem-post-key-51c0de9a77b4e3f2"


def turn(tid: str, second: int, speaker: str = "Ann", text: str | None = None, session: str = "live-1",
         **extra: Any) -> dict[str, Any]:
    return {"session_id": session, "turn_id": tid, "speaker": speaker, "text": text or f"{speaker} says {tid}",
            "timestamp": (T0 + timedelta(seconds=second)).isoformat(), **extra}


def batch(prefix: str, n: int, start: int = 0, session: str = "live-1") -> list[dict[str, Any]]:
    return [turn(f"{prefix}{k}", start + k, SPEAKERS[k % 2], session=session) for k in range(n)]


def turns_url(conversation_id: str) -> str:
    """Every character percent-encoded (dots too: a client must not fold '..' segments)."""
    return f"/conversations/{quote(conversation_id, safe='').replace('.', '%2E')}/turns"


def spooled(store: Path) -> list[Path]:
    root = store / "spool"
    return sorted(p for p in root.rglob("*") if p.is_file() and p.parent.name != "locks") if root.exists() else []


def stored_turns(store: Path, conversation_id: str) -> list[tuple[str, str, str]]:
    con = connect(store, read_only=True)
    try:
        rows = con.execute("SELECT turn_id, speaker, text FROM turns WHERE conversation_id = ? ORDER BY seq",
                           [conversation_id]).fetchall()
    finally:
        con.close()
    return [(str(a), str(b), str(c)) for a, b, c in rows]


@pytest.fixture
def store(tmp_path: Path) -> Path:
    return two_conversation_store(tmp_path / "store")


@pytest.fixture
def live(store: Path) -> Iterator[LiveServer]:
    server = LiveServer(app_for(store)).start()
    yield server
    server.stop()


# ---- the same errors as file ingest ------------------------------------------------------------

BAD_TURNS: dict[str, tuple[list[Any], list[str] | None]] = {
    "missing field": ([turn("a", 0), {k: v for k, v in turn("b", 1).items() if k != "text"}], None),
    "wrong type": ([turn("a", 0, text=7)], None),  # type: ignore[arg-type]
    "empty string": ([turn("a", 0, text="   ")], None),
    "empty speaker": ([turn("a", 0, speaker="")], None),
    "naive timestamp": ([{**turn("a", 0), "timestamp": "2027-01-01T10:00:00"}], None),
    "bad timestamp": ([{**turn("a", 0), "timestamp": "yesterday"}], None),
    "out of range in UTC": ([{**turn("a", 0), "timestamp": "9999-12-31T23:30:00-05:00"}], None),
    "backwards": ([turn("a", 5), turn("b", 1)], None),
    "unknown speaker": ([turn("a", 0), turn("b", 1, speaker="Eve")], ["Ann", "Bob"]),
    "speaker declared twice": ([turn("a", 0)], ["Ann", "Ann"]),
    "duplicate turn id": ([turn("a", 0), turn("a", 1)], None),
    "session resumes": ([turn("a", 0), turn("b", 1, session="s2"), turn("c", 2)], None),
    "unknown field": ([{**turn("a", 0), "speeker": "Ann"}], None),
    "lone surrogate": ([turn("a", 0, text="bad \ud800 text")], None),
    "metadata not strings": ([turn("a", 0, metadata={"n": 1})], None),
    "record not an object": ([turn("a", 0), ["not", "a", "record"]], None),
    "unknown kind": ([{**turn("a", 0), "kind": "utterance"}], None),
}


def file_error(conversation_id: str, turns: list[Any], speakers: list[str] | None) -> IngestError:
    """The error file ingest gives for the same records as a JSON Lines archive."""
    lines = [] if speakers is None else [{"kind": "conversation", "conversation_id": conversation_id, "speakers": speakers}]
    lines += [{"conversation_id": conversation_id, **t} if isinstance(t, dict) else t for t in turns]
    text = "\n".join(json.dumps(line, ensure_ascii=False) for line in lines)
    with pytest.raises(IngestError) as caught:
        parse_jsonl_text(text, "archive.jsonl")
    return caught.value


def as_posted(reason: str, speakers: list[str] | None) -> str:
    """A file error's reason with its line numbers named as a post names its records."""
    offset = 1 if speakers is not None else 0

    def name(match: re.Match[str]) -> str:
        n = int(match.group(1)) - 1 - offset
        return "speakers" if n < 0 else f"turns[{n}]"

    return re.sub(r"line (\d+)", name, reason)


@pytest.mark.parametrize("case", sorted(BAD_TURNS))
def test_a_post_is_refused_with_the_error_file_ingest_gives(case: str) -> None:
    turns, speakers = BAD_TURNS[case]
    expected = file_error("c1", turns, speakers)
    body: dict[str, Any] = {"turns": turns} if speakers is None else {"turns": turns, "speakers": speakers}
    with pytest.raises(IngestError) as caught:
        parse_posted("c1", body)
    assert caught.value.path == "request"
    assert caught.value.record == as_posted(expected.record, speakers)
    assert caught.value.reason == as_posted(expected.reason, speakers)


def test_strict_json_rules_of_files_apply_to_raw_bodies() -> None:
    for raw, reason in [
        ('{"turns": [{"text": "a", "text": "b"}]}', "duplicate key 'text' in one JSON object"),
        ('{"turns": [NaN]}', "not valid JSON: NaN is not a JSON value"),
        ('{"turns": [' + "1" * 150 + "]}", "not valid JSON: an integer with 150 digits is too long (at most 100)"),
        ('{"turns": ' + "[" * 5000 + "]" * 5000 + "}", "not valid JSON: nested too deeply (past 100 levels here)"),
        ('{"turns": [1,]}', "not valid JSON: Expecting value"),
    ]:
        with pytest.raises(IngestError) as caught:
            parse_posted_text("c1", raw)
        assert caught.value.reason.startswith(reason), (raw[:40], caught.value.reason)
    for body, reason in [
        ([], "the request body must be a JSON object, got array"),
        ({}, "missing required field 'turns'"),
        ({"turns": []}, "field 'turns' is empty: post at least one turn"),
        ({"turns": {"a": 1}}, "field 'turns' must be a list of turn records, got object"),
        ({"turns": [turn("a", 0)], "speaker": ["Ann"]}, "unknown field 'speaker'; allowed: speakers, turns"),
        ({"turns": [{**turn("a", 0), "conversation_id": "c2"}]},
         "field 'conversation_id' is 'c2', but the turns were posted to conversation 'c1'"),
        ({"turns": [{"kind": "conversation", "conversation_id": "c1", "speakers": ["Ann"]}]},
         "only turn records belong in 'turns'; declare speakers with 'speakers'"),
    ]:
        with pytest.raises(IngestError) as caught:
            parse_posted("c1", body)
        assert caught.value.reason == reason
    with pytest.raises(IngestError, match="conversation id: field 'conversation_id' must not be empty"):
        parse_posted(" ", {"turns": [turn("a", 0)]})


def test_conflicts_with_the_store_are_the_errors_file_ingest_gives(store: Path) -> None:
    """Against what is stored (the published turns of conv-a: D1:1 … D6:4 in sessions S1 … S6)."""
    settings = Settings(store=store)
    from tests.query_store import HashEmbedder
    from tmem.query.memory import Memory
    from tmem.query.turns_api import post_turns

    memory = Memory.open(store, settings, embedder=HashEmbedder())
    stored = stored_turns(store, "conv-a")
    last = datetime(2023, 5, 13, 13, 0, 3, tzinfo=UTC)  # conv-a's last turn (S6, D6:4)
    cases = {
        "changed text": [{"session_id": "S1", "turn_id": "D1:1", "speaker": "Ann", "text": "rewritten",
                          "timestamp": datetime(2023, 5, 8, 13, 0, tzinfo=UTC).isoformat()}],
        "before the watermark": [turn("new", 0, session="S7") | {"timestamp": (last - timedelta(days=1)).isoformat()}],
        "closed session": [turn("new", 0, session="S2") | {"timestamp": (last + timedelta(days=1)).isoformat()}],
    }
    for name, turns in cases.items():
        archive = parse_posted("conv-a", {"turns": turns})
        with pytest.raises(IngestError) as posted:
            post_turns(memory, Spool(store), archive, NOW)
        path = store.parent / f"{name}.jsonl"
        path.write_text("\n".join(json.dumps({"conversation_id": "conv-a", **t}) for t in turns), encoding="utf-8")
        with pytest.raises(IngestError) as filed:
            ingest_archives([path], store, now=NOW)
        assert posted.value.reason == filed.value.reason, name
        assert posted.value.record == "turns[0]" and filed.value.record == "line 1"
    assert spooled(store) == [] and stored_turns(store, "conv-a") == stored


# ---- over HTTP ---------------------------------------------------------------------------------


def test_posts_are_spooled_at_once_idempotent_and_counted(store: Path, live: LiveServer) -> None:
    body = {"speakers": ["Ann", "Bob"], "turns": [*batch("L", 4), turn("L4", 9, metadata={"via": "app"})]}
    with httpx.Client(base_url=live.url, timeout=10) as client:
        first = client.post(turns_url("conv-a"), json=body)
        assert first.status_code == 202, first.text
        assert first.json() == {"conversation_id": "conv-a", "posted_turns": 5, "new_turns": 5, "pending_turns": 5}
        files = spooled(store)
        again = client.post(turns_url("conv-a"), json=body)  # a retry: nothing new, nothing written
        assert again.status_code == 202 and again.json()["new_turns"] == 0 and again.json()["pending_turns"] == 5
        grown = client.post(turns_url("conv-a"), json={"turns": body["turns"][3:] + batch("M", 2, start=20)})
        assert grown.json() == {"conversation_id": "conv-a", "posted_turns": 4, "new_turns": 2, "pending_turns": 7}
        assert len(spooled(store)) == len(files) + 1
        health = client.get("/health").json()
        listing = {c["conversation_id"]: c for c in client.get("/conversations").json()}
    assert health["pending_turns"] == 7
    assert listing["conv-a"]["pending_turns"] == 7 and listing["conv-a"]["turns"] == 24
    assert listing["conv-b"]["pending_turns"] == 0
    with httpx.Client(base_url=live.url, timeout=10) as client:  # the explorer's badge counts the same spool
        explored = {c["conversation_id"]: c for c in client.get("/explorer/api/overview").json()["conversations"]}
    assert explored["conv-a"]["pending_turns"] == 7 and explored["conv-b"]["pending_turns"] == 0
    # Each spool file is a tmem JSON Lines archive holding exactly that post's new turns.
    first_file, second_file = spooled(store)
    assert first_file.parent.name == second_file.parent.name == conversation_key("conv-a")
    archives = [read_archive(f) for f in (first_file, second_file)]
    assert [t.turn_id for t in archives[0].conversations[0].turns] == ["L0", "L1", "L2", "L3", "L4"]
    assert archives[0].conversations[0].speakers == ("Ann", "Bob")
    assert archives[0].conversations[0].turns[4].metadata == {"via": "app"}
    assert [t.turn_id for t in archives[1].conversations[0].turns] == ["M0", "M1"]


def test_a_refused_post_writes_nothing(store: Path, live: LiveServer) -> None:
    with httpx.Client(base_url=live.url, timeout=10) as client:
        client.post(turns_url("conv-b"), json={"turns": batch("K", 2)})
        before = {p: p.read_bytes() for p in spooled(store)}
        for case in sorted(BAD_TURNS):
            turns, speakers = BAD_TURNS[case]
            body: dict[str, Any] = {"turns": turns} if speakers is None else {"turns": turns, "speakers": speakers}
            raw = json.dumps(body, ensure_ascii=False).encode("utf-8", "surrogatepass")
            response = client.post(turns_url("conv-b"), content=raw, headers={"content-type": "application/json"})
            assert response.status_code == 422, (case, response.text)
            detail = response.json()["detail"]
            assert detail["error"] == f"request: {detail['record']}: {detail['reason']}"
            assert detail["record"] in {"speakers", "body"} or detail["record"].startswith("turns["), case
        for raw in (b"\xff\xfe not utf-8", b'{"turns": [NaN]}', b"", b'{"turns": [' + b"[" * 3000 + b"]" * 3000 + b"]}"):
            response = client.post(turns_url("conv-b"), content=raw)
            assert response.status_code == 422 and response.json()["detail"]["record"] == "body", raw[:20]
        conflict = client.post(turns_url("conv-b"), json={"turns": [turn("K0", 0, text="rewritten")]})
        assert conflict.status_code == 422 and "conflicting change" in conflict.json()["detail"]["reason"]
        too_big = client.post(turns_url("conv-b"), json={"turns": [turn("H", 0, text="x" * (1024 * 1024))]})
        assert too_big.status_code == 413
        long_id = client.post(turns_url("c" * 1025), json={"turns": batch("Z", 1)})
        assert long_id.status_code == 422
        assert client.post("/conversations//turns", json={"turns": batch("Z", 1)}).status_code == 422
    assert {p: p.read_bytes() for p in spooled(store)} == before


def test_the_api_key_guards_posts_and_the_listing(store: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("TMEM_API_KEY", API_KEY)
    live = LiveServer(app_for(store, load_settings(store=store))).start()
    try:
        with httpx.Client(base_url=live.url, timeout=10) as client:
            for headers in ({}, {"Authorization": "Bearer wrong"}, {"Authorization": f"Basic {API_KEY}"}):
                response = client.post(turns_url("conv-a"), json={"turns": batch("A", 1)}, headers=headers)
                assert response.status_code == 401 and API_KEY not in response.text
                assert client.get("/conversations", headers=headers).status_code == 401
            assert spooled(store) == []
            ok = client.post(turns_url("conv-a"), json={"turns": batch("A", 1)},
                             headers={"Authorization": f"Bearer {API_KEY}"})
            assert ok.status_code == 202 and API_KEY not in ok.text
    finally:
        live.stop()
    assert API_KEY not in "".join(p.read_text(encoding="utf-8") for p in spooled(store))


def hostile_ids() -> list[str]:
    """The isolation test's fragments as ids, with near-miss variants of each other."""
    base = [f for f in FRAGMENTS if f.strip()] + ["conv-a/turns", "conv-a", "CONV-A", "conv-a ", "%2e%2e"]
    return list(dict.fromkeys(base))


def test_hostile_ids_each_reach_their_own_spool_and_nothing_else(store: Path, live: LiveServer) -> None:
    ids = hostile_ids()
    with httpx.Client(base_url=live.url, timeout=10) as client:
        for n, cid in enumerate(ids):
            response = client.post(turns_url(cid), json={"turns": [turn(f"h{n}", n, text=f"marker{n}")]})
            assert response.status_code == 202, (cid, response.text)
            assert response.json()["conversation_id"] == cid and response.json()["new_turns"] == 1
        listing = {c["conversation_id"]: c["pending_turns"] for c in client.get("/conversations").json()}
    assert {cid: listing[cid] for cid in ids} == dict.fromkeys(ids, 1)
    root = (store / "spool").resolve()
    for path in spooled(store):
        assert path.resolve().is_relative_to(root) and re.fullmatch(r"[0-9a-f]{32}", path.parent.name)
    by_id = {read_archive(p).conversations[0].conversation_id: read_archive(p) for p in spooled(store)}
    for n, cid in enumerate(ids):
        assert [t.text for t in by_id[cid].conversations[0].turns] == [f"marker{n}"]


# ---- concurrent writers ------------------------------------------------------------------------


def test_concurrent_posters_over_http_never_interleave_or_duplicate(store: Path, live: LiveServer) -> None:
    shared = [batch(f"S{b}-", 5, start=10 * b, session=f"s{b}") for b in range(4)]

    def poster(worker: int) -> list[int]:
        new: list[int] = []
        with httpx.Client(base_url=live.url, timeout=30) as client:
            own = client.post(turns_url(f"own-{worker}"), json={"turns": batch(f"W{worker}-", 3)})
            assert own.status_code == 202, own.text
            for turns in shared:  # every worker posts the same sessions, in order
                response = client.post(turns_url("shared"), json={"turns": turns})
                assert response.status_code == 202, response.text
                new.append(response.json()["new_turns"])
        return new

    with ThreadPoolExecutor(8) as pool:
        results = list(pool.map(poster, range(8)))
    assert [sum(r[b] for r in results) for b in range(4)] == [5, 5, 5, 5]  # each session accepted exactly once
    assert Spool(store).pending_turns() == {"shared": 20} | {f"own-{w}": 3 for w in range(8)}
    shared_files = sorted((store / "spool" / "pending" / conversation_key("shared")).iterdir())
    assert [[t.turn_id for t in read_archive(f).conversations[0].turns] for f in shared_files] == [
        [t["turn_id"] for t in turns] for turns in shared
    ]
    assert list((store / "spool" / "tmp").iterdir()) == []


class _NothingPublished:
    def published_id(self) -> str | None:
        return None

    def published_state(self, conversation_id: str) -> StoredState:
        return StoredState.empty()


def post_from_another_process(store: str, worker: int) -> list[int]:
    """One process's posts: its own conversation, then the shared sessions in order."""
    spool = Spool(Path(store))
    published = _NothingPublished()
    spool.post(parse_posted(f"proc-{worker}", {"turns": batch(f"P{worker}-", 2)}), published=published, now=NOW)
    return [
        spool.post(parse_posted("shared", {"turns": batch(f"S{b}-", 4, start=10 * b, session=f"s{b}")}),
                   published=published, now=NOW).new_turns
        for b in range(3)
    ]


def test_concurrent_posting_processes_share_the_spool_safely(tmp_path: Path) -> None:
    store = tmp_path / "store"
    store.mkdir()
    with ProcessPoolExecutor(3, mp_context=get_context("spawn")) as pool:
        results = list(pool.map(post_from_another_process, [str(store)] * 3, range(3)))
    assert [sum(r[b] for r in results) for b in range(3)] == [4, 4, 4]
    assert Spool(store).pending_turns() == {"shared": 12, "proc-0": 2, "proc-1": 2, "proc-2": 2}
    report = drain_spool(store, now=NOW)
    assert report.files == 6 and report.new_turns == 18 and report.rejected == ()
    assert [t[0] for t in stored_turns(store, "shared")] == [f"S{b}-{k}" for b in range(3) for k in range(4)]
    assert spooled(store) == []


# ---- draining ----------------------------------------------------------------------------------


def test_tmem_ingest_drains_the_spool_and_a_crash_before_removal_is_harmless(store: Path, live: LiveServer) -> None:
    with httpx.Client(base_url=live.url, timeout=10) as client:
        client.post(turns_url("conv-a"), json={"turns": batch("L", 3, session="S6")})  # continues the last session
        client.post(turns_url("brand new"), json={"speakers": ["Cy", "Di"], "turns": [
            turn("n0", 0, "Cy"), turn("n1", 1, "Di")]})
    (kept,) = [p for p in spooled(store) if p.parent.name == conversation_key("conv-a")]
    copy = store.parent / "kept.jsonl"
    shutil.copy(kept, copy)
    before = stored_turns(store, "conv-a")
    out = cli_json(["ingest", "--store", str(store), "--json"])
    assert out["spool"] == {"files": 2, "new_turns": 5, "conversations": ["brand new", "conv-a"], "rejected": []}
    assert stored_turns(store, "conv-a") == [*before, ("L0", "Ann", "Ann says L0"), ("L1", "Bob", "Bob says L1"),
                                             ("L2", "Ann", "Ann says L2")]
    assert [t[0] for t in stored_turns(store, "brand new")] == ["n0", "n1"]
    assert spooled(store) == [] and Spool(store).pending_turns() == {}
    # A drain that died after its commit, before removing the file: the file is drained again, adding nothing.
    kept.parent.mkdir(parents=True, exist_ok=True)
    shutil.copy(copy, kept)
    again = drain_spool(store, now=NOW)
    assert again.files == 1 and again.new_turns == 0 and spooled(store) == []
    assert len(stored_turns(store, "conv-a")) == len(before) + 3


def test_a_post_the_store_refuses_by_drain_time_is_moved_aside_and_the_rest_ingested(
    store: Path, live: LiveServer, tmp_path: Path
) -> None:
    with httpx.Client(base_url=live.url, timeout=10) as client:
        assert client.post(turns_url("late"), json={"turns": batch("x", 2)}).status_code == 202
        assert client.post(turns_url("fine"), json={"turns": batch("y", 2)}).status_code == 202
    # Between the post and the drain an archive file changed the same turn.
    archive = tmp_path / "late.jsonl"
    archive.write_text(json.dumps({"conversation_id": "late", **turn("x0", 0, text="other words")}) + "\n",
                       encoding="utf-8")
    ingest_archives([archive], store, now=NOW)
    report = drain_spool(store, now=NOW)
    assert report.files == 2 and report.new_turns == 2 and report.conversations == ("fine",)
    (refused,) = report.rejected
    assert "conflicting change: turn 'x0' of conversation 'late'" in refused["error"]
    moved = Path(refused["file"])
    assert moved.is_file() and moved.parent.parent.name == "rejected"
    assert "conflicting change" in moved.with_name(f"{moved.stem}.error.txt").read_text(encoding="utf-8")
    assert stored_turns(store, "late") == [("x0", "Ann", "other words")]
    assert [t[0] for t in stored_turns(store, "fine")] == ["y0", "y1"]
    assert Spool(store).pending_turns() == {}


HOLD_THE_STORE = """
import sys, time
from pathlib import Path
from tmem.store.duck import connect
con = connect(Path(sys.argv[1]))
print("holding", flush=True)
sys.stdin.readline()
con.close()
"""


def test_posts_succeed_at_once_while_the_builder_holds_the_working_database(store: Path, live: LiveServer) -> None:
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    holder = subprocess.Popen([sys.executable, "-c", HOLD_THE_STORE, str(store)], env=env, text=True,
                              stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    try:
        assert holder.stdout is not None and holder.stdout.readline().strip() == "holding"
        with httpx.Client(base_url=live.url, timeout=10) as client:
            started = time.perf_counter()
            response = client.post(turns_url("conv-a"), json={"turns": batch("B", 3, session="S6")})
            took = time.perf_counter() - started
        assert response.status_code == 202 and response.json()["new_turns"] == 3
        assert took < 5.0, f"a post waited {took:.1f} s"
        # The lock is real: an ingest from another process cannot open the store now; the post waits.
        blocked = subprocess.run([sys.executable, "-m", "tmem", "ingest", "--store", str(store)], env=env,
                                 capture_output=True, text=True, timeout=120)
        assert blocked.returncode == 2 and "cannot open for writing" in blocked.stderr
        assert Spool(store).pending_turns() == {"conv-a": 3}
    finally:
        if holder.stdin is not None:
            holder.stdin.write("\n")
            holder.stdin.flush()
        holder.wait(timeout=30)
    assert drain_spool(store, now=NOW).new_turns == 3
    assert [t[0] for t in stored_turns(store, "conv-a")][-3:] == ["B0", "B1", "B2"]


def test_a_damaged_spool_file_neither_blocks_posts_nor_reaches_the_store(store: Path, live: LiveServer) -> None:
    folder = store / "spool" / "pending" / conversation_key("conv-b")
    folder.mkdir(parents=True)
    damaged = folder / f"{1:020d}-deadbeef.jsonl"
    damaged.write_text('{"conversation_id": "conv-b", "session_id": "S6", "turn_id": "cut', encoding="utf-8")
    with httpx.Client(base_url=live.url, timeout=10) as client:
        posted = client.post(turns_url("conv-b"), json={"turns": batch("G", 2, session="S6")})
        assert posted.status_code == 202 and posted.json()["new_turns"] == 2, posted.text
        assert str(store) not in posted.text
        assert client.get("/health").json()["pending_turns"] == 2
    report = drain_spool(store, now=NOW)
    assert report.new_turns == 2 and [Path(r["file"]).name for r in report.rejected] == [damaged.name]
    assert "not valid JSON" in report.rejected[0]["error"]
    assert [t[0] for t in stored_turns(store, "conv-b")][-2:] == ["G0", "G1"]

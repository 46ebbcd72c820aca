"""Group commit (tmem/store/group_commit.py) and the working database's LLM tables on it: rows from
many threads share a transaction, every write returns only once its row is committed, a row that
fails fails only its own caller, and the response cache and ledger keep what each call stored."""

from __future__ import annotations

import threading
import time
from concurrent.futures import ThreadPoolExecutor
from datetime import UTC, datetime
from pathlib import Path

import duckdb
import pytest

from tmem.ports import CacheEntry, UsageRecord
from tmem.store.duck import connect
from tmem.store.group_commit import GroupCommit
from tmem.store.llm_cache import DuckResponseCache, DuckUsageLedger, write_cache_rows


def _table(tmp_path: Path) -> duckdb.DuckDBPyConnection:
    con = duckdb.connect(str(tmp_path / "rows.duckdb"))
    con.execute("CREATE TABLE rows (v INTEGER NOT NULL CHECK (v >= 0))")
    return con


class HeldWriter:
    """Writes rows one statement per round; the first round waits until released."""

    def __init__(self) -> None:
        self.release = threading.Event()
        self.rounds: list[list[int]] = []

    def __call__(self, cur: duckdb.DuckDBPyConnection, rows: list[int]) -> None:
        if not self.rounds:
            self.release.wait(10)
        self.rounds.append(list(rows))
        cur.execute("INSERT INTO rows SELECT unnest(?::INTEGER[])", [rows])


def test_rows_queued_behind_a_commit_share_the_next_transaction_and_return_committed(tmp_path: Path) -> None:
    con = _table(tmp_path)
    writer = HeldWriter()
    group = GroupCommit(con, writer, cursor_lock=threading.Lock(), name="test")
    first = threading.Thread(target=group.write, args=(0,))
    first.start()
    time.sleep(0.2)  # the writer thread is inside the first round, held
    seen: list[int] = []

    def write_then_read(v: int) -> None:
        group.write(v)
        reader = con.cursor()  # another connection: sees only committed rows
        try:
            row = reader.execute("SELECT count(*) FROM rows WHERE v = ?", [v]).fetchone()
            seen.append(int(row[0]) if row else -1)
        finally:
            reader.close()

    with ThreadPoolExecutor(20) as pool:
        futures = [pool.submit(write_then_read, v) for v in range(1, 21)]
        time.sleep(0.3)
        writer.release.set()
        [f.result(timeout=30) for f in futures]
    first.join(10)
    assert writer.rounds[0] == [0] and sorted(writer.rounds[1]) == list(range(1, 21)) and len(writer.rounds) == 2
    assert seen == [1] * 20 and group.rounds == 2
    assert con.execute("SELECT count(*) FROM rows").fetchone() == (21,)


def test_a_row_that_fails_fails_only_its_caller(tmp_path: Path) -> None:
    con = _table(tmp_path)
    writer = HeldWriter()
    group = GroupCommit(con, writer, cursor_lock=threading.Lock(), name="test")
    first = threading.Thread(target=group.write, args=(100,))
    first.start()
    time.sleep(0.2)
    with ThreadPoolExecutor(6) as pool:
        futures = {v: pool.submit(group.write, v) for v in (1, 2, -3, 4, 5)}  # -3 breaks the CHECK
        time.sleep(0.3)
        writer.release.set()
        for v, future in futures.items():
            if v < 0:
                with pytest.raises(duckdb.ConstraintException):
                    future.result(timeout=30)
            else:
                future.result(timeout=30)
    first.join(10)
    stored = sorted(int(r[0]) for r in con.execute("SELECT v FROM rows").fetchall())
    assert stored == [1, 2, 4, 5, 100]  # the failed round rolled back whole, then each row alone


def test_the_writer_thread_ends_when_idle_and_starts_again(tmp_path: Path) -> None:
    con = _table(tmp_path)
    group = GroupCommit(con, HeldWriter(), cursor_lock=threading.Lock(), name="idle-test", idle_s=0.05)
    group._write_rows.release.set()  # type: ignore[attr-defined]
    group.write(1)
    time.sleep(0.3)
    assert not [t for t in threading.enumerate() if t.name == "tmem-idle-test-writer"]
    group.write(2)
    assert con.execute("SELECT count(*) FROM rows").fetchone() == (2,)


def _entry(key: str, response: str) -> CacheEntry:
    return CacheEntry(cache_key=key, operation="segment", model="m", prompt_version="v1", response_json=response,
                      prompt_tokens=10, completion_tokens=5, created_at=datetime(2026, 12, 1, tzinfo=UTC))


def _usage(n: int) -> UsageRecord:
    return UsageRecord(run_id="run-1", operation="segment" if n % 2 else "topics", model="m", prompt_tokens=n,
                       completion_tokens=1, latency_ms=2.5, cache_hit=False, attempts=1,
                       recorded_at=datetime(2026, 12, 1, tzinfo=UTC), repairs=n % 3, conversation_id=f"c{n}",
                       cache_key=f"k{n}")


def test_the_response_cache_and_ledger_keep_every_concurrent_call(tmp_path: Path) -> None:
    con = connect(tmp_path / "store")
    cache, ledger = DuckResponseCache(con), DuckUsageLedger(con)
    def call(n: int) -> None:
        cache.put(_entry(f"k{n}", f'{{"n": {n}}}'))
        ledger.record(_usage(n))

    with ThreadPoolExecutor(32) as pool:
        list(pool.map(call, range(200)))
    assert cache.count() == 200 and all(cache.get(f"k{n}") == f'{{"n": {n}}}' for n in range(200))
    summary = ledger.summary("run-1")
    assert summary["segment"].calls == 100 and summary["topics"].calls == 100
    assert summary["segment"].prompt_tokens + summary["topics"].prompt_tokens == sum(range(200))
    assert summary["segment"].repairs + summary["topics"].repairs == sum(n % 3 for n in range(200))
    row = con.execute("SELECT conversation_id, cache_key, recorded_at, usage_estimated, batch FROM llm_usage "
                      "WHERE prompt_tokens = 7").fetchone()
    assert row == ("c7", "k7", datetime(2026, 12, 1, tzinfo=UTC), False, False)
    assert cache.writes.rounds + ledger.writes.rounds < 400  # some calls shared a transaction


def test_one_key_stored_twice_at_once_keeps_one_row(tmp_path: Path) -> None:
    con = connect(tmp_path / "store")
    cache = DuckResponseCache(con)
    with ThreadPoolExecutor(16) as pool:
        list(pool.map(lambda n: cache.put(_entry("same", f'{{"n": {n}}}')), range(16)))
    assert cache.count() == 1 and cache.get("same") is not None
    cache.put(_entry("same", '{"n": "last"}'))
    assert cache.get("same") == '{"n": "last"}'


def test_deferred_rows_return_at_once_and_share_one_transaction_within_the_linger(tmp_path: Path) -> None:
    con = _table(tmp_path)
    rounds: list[list[int]] = []

    def write(cur: duckdb.DuckDBPyConnection, rows: list[int]) -> None:
        rounds.append(list(rows))
        cur.execute("INSERT INTO rows SELECT unnest(?::INTEGER[])", [rows])

    group = GroupCommit(con, write, cursor_lock=threading.Lock(), name="later", linger_s=5.0)
    started = time.monotonic()
    for v in range(50):
        group.write_later(v)
    assert time.monotonic() - started < 1.0  # nobody waited for a commit
    assert con.execute("SELECT count(*) FROM rows").fetchone() == (0,)  # lingering, not yet committed
    group.flush()  # a waiting caller ends the linger: everything queued before it commits now
    assert time.monotonic() - started < 4.0
    assert con.execute("SELECT count(*) FROM rows").fetchone() == (50,)
    assert rounds == [list(range(50))] and group.rounds == 1
    group.write(50)  # a synchronous row after them: its own round, committed on return
    assert con.execute("SELECT count(*) FROM rows").fetchone() == (51,)


def test_deferred_rows_are_committed_after_the_linger_without_a_flush(tmp_path: Path) -> None:
    con = _table(tmp_path)
    group = GroupCommit(con, HeldWriter(), cursor_lock=threading.Lock(), name="later", linger_s=0.2)
    group._write_rows.release.set()  # type: ignore[attr-defined]
    group.write_later(1)
    group.write_later(2)
    deadline = time.monotonic() + 10
    while con.execute("SELECT count(*) FROM rows").fetchone() != (2,) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert con.execute("SELECT count(*) FROM rows").fetchone() == (2,)


def test_a_deferred_row_that_fails_is_raised_at_the_next_flush_and_the_others_are_kept(tmp_path: Path) -> None:
    con = _table(tmp_path)
    group = GroupCommit(con, HeldWriter(), cursor_lock=threading.Lock(), name="later", linger_s=0.1)
    group._write_rows.release.set()  # type: ignore[attr-defined]
    for v in (1, -2, 3):  # -2 breaks the CHECK
        group.write_later(v)
    with pytest.raises(duckdb.ConstraintException):
        group.flush()
    group.flush()  # raised once: the next flush has nothing to report
    assert sorted(int(r[0]) for r in con.execute("SELECT v FROM rows").fetchall()) == [1, 3]


def test_a_deferred_ledger_commits_at_flush_and_its_summary_sees_every_row(tmp_path: Path) -> None:
    con = connect(tmp_path / "store")
    ledger = DuckUsageLedger(con, deferred=True, linger_s=30.0)
    with ThreadPoolExecutor(8) as pool:
        list(pool.map(lambda n: ledger.record(_usage(n)), range(40)))
    reader = con.cursor()
    try:
        assert reader.execute("SELECT count(*) FROM llm_usage").fetchone() == (0,)  # recorded, not yet committed
    finally:
        reader.close()
    summary = ledger.summary("run-1")  # flushes first
    assert summary["segment"].calls + summary["topics"].calls == 40 and ledger.writes.rounds == 1
    assert not DuckUsageLedger(con).deferred  # other users keep a row committed on return


@pytest.mark.parametrize("size", [3, 40])  # one INSERT ... VALUES, and one Arrow table
def test_a_round_inserts_new_answers_and_replaces_a_stored_one(tmp_path: Path, size: int) -> None:
    con = connect(tmp_path / "store")
    cache = DuckResponseCache(con)
    cache.put(_entry("k0", '{"n": "first"}'))
    cur = con.cursor()
    try:
        cur.begin()
        write_cache_rows(cur, [_entry(f"k{n}", f'{{"n": {n}}}') for n in range(size)] + [_entry("k1", '{"n": "again"}')])
        cur.commit()
    finally:
        cur.close()
    assert cache.count() == size
    assert cache.get("k0") == '{"n": 0}' and cache.get("k1") == '{"n": "again"}'  # replaced; the last of a round wins
    assert cache.get(f"k{size - 1}") == f'{{"n": {size - 1}}}'


def test_a_cache_that_knows_its_keys_answers_an_unknown_key_without_the_table(tmp_path: Path) -> None:
    con = connect(tmp_path / "store")
    DuckResponseCache(con).put(_entry("before", '{"n": 1}'))
    known = DuckResponseCache(con, known_keys=True)
    assert known.get("before") == '{"n": 1}'  # stored when it was opened: read from the table
    known.put(_entry("mine", '{"n": 2}'))
    assert known.get("mine") == '{"n": 2}'
    # a row written behind its back is not looked up: the single writer's cache only
    DuckResponseCache(con).put(_entry("behind", '{"n": 3}'))
    assert known.get("behind") is None and DuckResponseCache(con).get("behind") == '{"n": 3}'
    assert known.get("never") is None

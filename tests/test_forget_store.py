"""``tmem forget`` on hand-built stores (no LLM build, no Prefect): exact-string scope among ids
crafted to collide, cache ownership, the unowned-rows rule, tombstones at ingest, dry runs and
refusals. The flow-built end-to-end proof is tests/test_forget_flow.py."""

from __future__ import annotations

import base64
import io
import json
import pickle
import subprocess
import sys
from datetime import UTC, datetime
from pathlib import Path

import duckdb
import numpy as np
import pytest
from pydantic import BaseModel

from tests.forget_helpers import find_strings, image_bytes, owned_cache, tree_bytes, work_rows
from tests.query_store import SPEAKERS, Conv, HashEmbedder, build_store, make_conv
from tmem.cli import run as cli_run
from tmem.cli.base import CliContext
from tmem.errors import ForgetError, IngestError, ScopeError
from tmem.ids import conversation_partition
from tmem.ingest.load import ingest_archives
from tmem.llm.cached_embedder import embedding_key
from tmem.llm.response_cache import CachedChatModel, InMemoryResponseCache
from tmem.llm.usage import InMemoryUsageLedger
from tmem.ports import CacheEntry, Completion, JournalBatch, TokenUsage, UsageRecord, conversation_scope
from tmem.prompts.base import Message, Prompt
from tmem.query.memory import Memory
from tmem.settings import Settings
from tmem.store.duck import connect, work_db_path
from tmem.store.embed_cache import DuckEmbeddingCache, record_embedding_owners
from tmem.store.exchange import write_journal
from tmem.store.forget import forget_conversation
from tmem.store.forget_files import pickle_names
from tmem.store.lance import VectorStore
from tmem.store.llm_cache import DuckResponseCache, DuckUsageLedger
from tmem.store.memory_image import diff_images, memory_image
from tmem.store.snapshot.published import current_snapshot, list_snapshots
from tmem.store.tombstones import id_digest

NOW = datetime(2026, 2, 1, 12, 0, tzinfo=UTC)
FAMILIES = (
    ("x' OR '1'='1", "x' OR '1'='1 ", "X' OR '1'='1", "x' OR '1'='1%"),
    ("conv/../a", "conv/..", "../conv/../a"),
    ("会话\x00", "会话", "会话\x00\x00"),
    ("%", "_", "%%", "' OR 1=1 --%"),
)
DIM = 64


def mark(n: int) -> str:
    return f"qzx{n}mark"


def _entry(key: str, text: str) -> CacheEntry:
    return CacheEntry(key, "scene_pack", "m", "v1", json.dumps({"summary": text}), 10, 5, NOW)


def _use(ledger: DuckUsageLedger, key: str, cid: str | None) -> None:
    ledger.record(UsageRecord("run-1", "scene_pack", "m", 10, 5, 1.0, False, 1, NOW, conversation_id=cid, cache_key=key))


def _pickled(payload: object) -> bytes:
    return base64.b64encode(pickle.dumps(payload, protocol=5))


def family_store(root: Path, ids: tuple[str, ...]) -> tuple[Path, list[Conv]]:
    """A published store of ``ids`` with, per conversation: its own LLM answers and embeddings (owned),
    a task-result partition, and one answer shared by conversations 0 and 1; plus a flat (older
    layout) task result of conversations 0 and 1 each, and an exchange leftover."""
    store = root / "store"
    convs = [make_conv(cid, mark=mark(n), scenes=3, turns_per_scene=2, items_per_scene=2, tag=f"T{n}")
             for n, cid in enumerate(ids)]
    build_store(store, convs, HashEmbedder(DIM))
    con = connect(store)
    try:
        cache, ledger, vectors = DuckResponseCache(con), DuckUsageLedger(con), DuckEmbeddingCache(con)
        for n, conv in enumerate(convs):
            cid = conv.conversation_id
            cache.put(_entry(f"own-{n}", f"answer about {mark(n)}"))
            _use(ledger, f"own-{n}", cid)
            text = f"view text of {mark(n)}"
            vectors.put_many("hash-64", {embedding_key("hash-64", text): np.full(DIM, n, dtype=np.float32)})
            record_embedding_owners(con, "hash-64", {cid: [text]})
            part = store / "prefect" / "results" / conversation_partition(cid)
            part.mkdir(parents=True)
            (part / "k1").write_bytes(_pickled({"conversation_id": cid, "text": f"segment of {mark(n)}"}))
        cache.put(_entry("shared", "an answer two conversations asked for"))
        _use(ledger, "shared", convs[0].conversation_id)
        _use(ledger, "shared", convs[1].conversation_id)
    finally:
        con.close()
    flat = store / "prefect" / "results"
    (flat / "legacy-0").write_bytes(_pickled({"conversation_id": convs[0].conversation_id, "t": mark(0)}))
    (flat / "legacy-1").write_bytes(_pickled({"conversation_id": convs[1].conversation_id, "t": "kept"}))
    (store / "exchange").mkdir()
    (store / "exchange" / "dead-run.duckdb").write_bytes(b"leftover of a killed Dask build " + mark(0).encode())
    return store, convs


def forget(store: Path, cid: str, **kwargs: object) -> dict[str, object]:
    return forget_conversation(store, cid, now=NOW, lance_uri=str(store / "lance"), **kwargs)  # type: ignore[arg-type]


def state_of_others(store: Path, convs: list[Conv], skip: int) -> dict[str, object]:
    info = current_snapshot(store)
    assert info is not None
    return {
        c.conversation_id: {
            "work": work_rows(store, c.conversation_id),
            "cache": owned_cache(store, c.conversation_id),
            "image": image_bytes(info.path, c.conversation_id),
            "results": tree_bytes(store / "prefect" / "results" / conversation_partition(c.conversation_id)),
        }
        for n, c in enumerate(convs) if n != skip
    }


@pytest.mark.parametrize("ids", FAMILIES, ids=["quotes", "paths", "nul", "wildcards"])
def test_forget_removes_exactly_the_id_and_leaves_near_miss_ids_byte_identical(tmp_path: Path, ids: tuple[str, ...]) -> None:
    store, convs = family_store(tmp_path, ids)
    before = current_snapshot(store)
    assert before is not None
    others = state_of_others(store, convs, skip=0)
    images_before = {c.conversation_id: memory_image(before, c.conversation_id) for c in convs[1:]}
    assert find_strings([store], [mark(0)]), "the scan must see the conversation before it is forgotten"

    report = forget(store, ids[0])

    steps = report["steps"]
    assert isinstance(steps, dict)
    assert steps["work"]["rows"]["turns"] == len(convs[0].turns)
    assert steps["work"]["llm_cache"] == 1 and steps["work"]["llm_cache_shared_kept"] == 1
    assert steps["work"]["embedding_cache"] == 1
    assert steps["files"]["prefect_partition_files"] == 1 and steps["files"]["prefect_legacy_results"] == 1
    assert find_strings([store], [mark(0)]) == {}
    after = current_snapshot(store)
    assert after is not None and after.snapshot_id != before.snapshot_id
    assert list_snapshots(store) == [after.snapshot_id]
    assert sorted(after.conversations) == sorted(ids[1:])
    assert state_of_others(store, convs, skip=0) == others  # rows, cache rows, image bytes, task results
    for cid, image in images_before.items():
        assert diff_images(image, memory_image(after, cid)) == []
    assert (store / "prefect" / "results" / "legacy-1").is_file()  # another id's task result: not the same string
    vectors = VectorStore(str(store / "lance"), DIM)
    assert len(vectors.load_conversation("vectors", ids[0])) == 0
    assert vectors.list_versions("vectors") == [after.lance_versions["vectors"]]
    memory = Memory.open(store, Settings(store=store), embedder=HashEmbedder(DIM))
    with pytest.raises(ScopeError):
        memory.search("pottery", conversation_id=ids[0])
    for cid in ids[1:]:
        assert memory.search("pottery", conversation_id=cid).items
    con = connect(store, read_only=True)
    try:
        assert con.execute("SELECT count(*) FROM forget_jobs").fetchone() == (0,)
        stone = con.execute("SELECT finished_at FROM forget_tombstones WHERE id_digest = ?", [id_digest(ids[0])]).fetchone()
        assert stone is not None and stone[0] is not None
        assert con.execute("SELECT cache_key FROM llm_cache WHERE cache_key = 'shared'").fetchall() == [("shared",)]
    finally:
        con.close()


def test_deleted_rows_survive_in_the_duckdb_file_unless_it_is_rewritten(tmp_path: Path) -> None:
    """Why the forget ends by rewriting work.duckdb: a DELETE of rows sharing row groups with other
    conversations' rows leaves their bytes in the file, checkpoint or not."""
    store, _ = family_store(tmp_path, ("alpha", "beta"))
    rng = np.random.default_rng(7)
    secrets = ["Z" + rng.bytes(24).hex() for _ in range(20)]  # incompressible, unique
    con = connect(store)
    con.executemany("INSERT INTO qa VALUES ('alpha', ?, ?, 'a', NULL, [], 1)", [[i, q] for i, q in enumerate(secrets)])
    con.executemany("INSERT INTO qa VALUES ('beta', ?, ?, 'b', NULL, [], 1)", [[i, f"other {i}"] for i in range(3000)])
    con.execute("CHECKPOINT")
    con.close()
    control = tmp_path / "control.duckdb"
    control.write_bytes(work_db_path(store).read_bytes())
    plain = duckdb.connect(str(control))
    plain.execute("DELETE FROM qa WHERE conversation_id = 'alpha'")
    plain.execute("CHECKPOINT")
    plain.close()
    assert any(q.encode() in control.read_bytes() for q in secrets)  # deleted, yet still in the file
    forget(store, "alpha")
    data = work_db_path(store).read_bytes().lower()
    assert not [q for q in secrets if q.lower().encode() in data]
    assert find_strings([store], secrets) == {}


def test_unowned_cache_rows_refuse_the_forget_until_told_what_to_do(tmp_path: Path) -> None:
    store, _ = family_store(tmp_path, ("alpha", "beta"))
    con = connect(store)
    DuckResponseCache(con).put(_entry("legacy", "written before owners were recorded"))
    con.close()
    files = tree_bytes(store)
    with pytest.raises(ForgetError, match=r"'alpha'.*1 cached LLM answers .*no recorded owner.*nothing was removed"):
        forget(store, "alpha")
    assert tree_bytes(store) == files
    kept = forget(store, "alpha", unowned="keep")
    assert kept["unowned"] == "keep"
    con = connect(store, read_only=True)
    assert con.execute("SELECT count(*) FROM llm_cache WHERE cache_key = 'legacy'").fetchone() == (1,)
    con.close()
    forget(store, "beta", unowned="delete")
    con = connect(store, read_only=True)
    assert con.execute("SELECT count(*) FROM llm_cache").fetchone() == (0,)
    con.close()


def test_an_unknown_or_empty_id_is_refused_naming_it_and_nothing_changes(tmp_path: Path) -> None:
    store, _ = family_store(tmp_path, ("alpha", "alpha "))
    files = tree_bytes(store)
    for bad, pattern in (("alph", r"'alph': not in store"), ("", "needs a conversation id"), ("ALPHA", "'ALPHA'")):
        with pytest.raises(ForgetError, match=pattern):
            forget(store, bad)
    out, err = io.StringIO(), io.StringIO()
    code = cli_run(["forget", "--store", str(store), "--conversation=nope"], CliContext(stdout=out, stderr=err))
    assert code == 2 and "'nope': not in store" in err.getvalue() and "nothing was removed" in err.getvalue()
    assert tree_bytes(store) == files


def test_a_dry_run_lists_what_would_go_and_changes_nothing(tmp_path: Path) -> None:
    store, convs = family_store(tmp_path, ("alpha", "beta"))
    forget(store, "beta", dry_run=True)  # migrations applied, the first time only
    files = tree_bytes(store)
    report = forget(store, "alpha", dry_run=True)
    held = report["would_remove"]
    assert isinstance(held, dict)
    assert held["work"]["rows"]["turns"] == len(convs[0].turns) and held["vector_rows"]["vectors"] > 0
    assert held["snapshots_holding"] == list_snapshots(store)
    assert held["files"]["prefect_partition_files"] == 1 and held["files"]["exchange_files"] == 1
    assert tree_bytes(store) == files
    assert find_strings([store], [mark(0)])


def test_ingest_refuses_a_forgotten_conversation_unless_readmitted(tmp_path: Path) -> None:
    store, _ = family_store(tmp_path, ("alpha", "beta"))
    archive = tmp_path / "again.jsonl"
    lines = [{"kind": "conversation", "conversation_id": "alpha", "speakers": list(SPEAKERS)},
             {"conversation_id": "alpha", "session_id": "S1", "turn_id": "t1", "speaker": SPEAKERS[0],
              "text": "back again", "timestamp": "2024-01-01T00:00:00+00:00"}]
    archive.write_text("".join(json.dumps(r) + "\n" for r in lines))
    forget(store, "alpha")
    with pytest.raises(IngestError, match=r"again.jsonl: line 1: conversation 'alpha' was forgotten at .*--allow-forgotten"):
        ingest_archives([archive], store, now=NOW)
    assert work_rows(store, "alpha")["turns"] == []
    report = ingest_archives([archive], store, now=NOW, allow_forgotten=True)
    assert report.new_turns == 1
    ingest_archives([archive], store, now=NOW)  # readmitted: later ingests need no flag
    forget(store, "alpha")  # forgotten again: refused again
    with pytest.raises(IngestError, match="was forgotten"):
        ingest_archives([archive], store, now=NOW)


def test_forget_refuses_while_another_process_holds_the_store(tmp_path: Path) -> None:
    store, _ = family_store(tmp_path, ("alpha", "beta"))
    holder = subprocess.Popen(
        [sys.executable, "-c", "import duckdb, sys, time; c = duckdb.connect(sys.argv[1]); print('held', flush=True); "
         "time.sleep(60)", str(work_db_path(store))], stdout=subprocess.PIPE, text=True)
    try:
        assert holder.stdout is not None and holder.stdout.readline().strip() == "held"
        out, err = io.StringIO(), io.StringIO()
        code = cli_run(["forget", "--store", str(store), "--conversation=alpha"], CliContext(stdout=out, stderr=err))
        assert code == 2 and "cannot open for writing; is another tmem process building?" in err.getvalue()
    finally:
        holder.kill()
        holder.wait()
    assert work_rows(store, "alpha")["turns"]


def test_pickle_scan_matches_the_exact_id_and_runs_no_code() -> None:
    data = pickle.dumps({"conversation_id": "conv-1", "other": ["conv-10", "xconv-1"]}, protocol=5)
    assert pickle_names(data, "conv-1") is True
    assert pickle_names(data, "conv-") is False and pickle_names(data, "conv-100") is False
    assert pickle_names(pickle.dumps("a" * 300 + "\x00"), "a" * 300 + "\x00") is True  # long ids: BINUNICODE
    assert pickle_names(b"not a pickle at all", "conv-1") is None
    hostile = b"cos\nsystem\n(S'touch /tmp/tmem-pwned'\ntR."  # would run a shell command if unpickled
    assert pickle_names(hostile, "conv-1") is False and not Path("/tmp/tmem-pwned").exists()


class CacheAnswer(BaseModel):
    text: str


class _Metered:
    model_name = "m"

    def complete_metered(self, prompt: Prompt[CacheAnswer]) -> Completion[CacheAnswer]:
        return Completion(CacheAnswer(text="ok"), TokenUsage(3, 1), 1)


def test_calls_record_their_conversation_and_cache_key_in_the_ledger() -> None:
    ledger, cache = InMemoryUsageLedger(), InMemoryResponseCache()
    chat = CachedChatModel(_Metered(), cache=cache, ledger=ledger, run_id="r")
    prompt = Prompt("scene_pack", "v1", (Message("user", "hello"),), CacheAnswer, "test")
    with conversation_scope("conv ' 1"):
        chat.complete(prompt)  # a miss
    with conversation_scope("conv ' 2"):
        chat.complete(prompt)  # a hit on the same row: conversation 2 uses it too
    chat.complete(prompt)  # outside any scope
    key = prompt.cache_key("m")
    assert [(r.conversation_id, r.cache_key, r.cache_hit) for r in ledger.records] == [
        ("conv ' 1", key, False), ("conv ' 2", key, True), (None, key, True)]


def test_ledger_rows_from_build_workers_keep_their_owner(tmp_path: Path) -> None:
    """A Dask worker's ledger rows travel back in its journal; the publisher stores their owner too."""
    con = connect(tmp_path / "store")
    try:
        record = UsageRecord("run-1", "scene_pack", "m", 10, 5, 1.0, True, 0, NOW, conversation_id="c ' 1", cache_key="k1")
        write_journal(con, JournalBatch(usage=(record,)))
        assert con.execute("SELECT conversation_id, cache_key FROM llm_usage").fetchall() == [("c ' 1", "k1")]
    finally:
        con.close()

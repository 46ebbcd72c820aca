"""Tenant isolation (issue 8, point 4): every read path requires a scope, and no result of one
conversation ever appears in another's — for crafted ids, across the Python API, the CLI and HTTP.

Each Hypothesis example builds a store of 2-4 conversations whose ids are crafted to collide
(quotes, ``' OR 1=1 --``, ``%``, ``_``, path separators, ``..``, unicode, NUL, long ids, ids that
are prefixes or case variants of each other). Conversation n's texts carry the word
``qzx<n>mark`` and its object ids the tag ``T<n>``; every ordered pair (x, y) queries x with
y's own words, and nothing marked or tagged for y may come back.
"""

from __future__ import annotations

import inspect
import io
import json
import re
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
from fastapi.testclient import TestClient
from hypothesis import HealthCheck, assume, given, settings
from hypothesis import strategies as st

from tests.fakes import FakeChatModel
from tests.query_store import Conv, HashEmbedder, build_store, make_conv
from tmem.cli import COMMANDS, build_parser, run
from tmem.cli.base import CliContext
from tmem.errors import ScopeError
from tmem.query.memory import Memory, MemorySnapshot
from tmem.query.service import MAX_CONVERSATION_ID_CHARS, AnswerRequest, SearchRequest, create_app
from tmem.settings import Settings

MARKS = re.compile(r"qzx\d+mark")
TAGS = re.compile(r"\b(?:scn|top|itm)T(\d+)_")
ISOLATION = settings(
    deadline=None, derandomize=True, database=None,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.function_scoped_fixture, HealthCheck.filter_too_much],
)

FRAGMENTS = (
    "' OR 1=1 --", "x' OR '1'='1", "%", "_", "*", '"', "'", "''", "..", "../", "/", "\\", "..\\", "会话", "🙂",
    "\u202e", "\u200b", "\x00", "\t", "\n", " ", ";", "--", "/*", "$1", "{}", "[0]", "conv", "x" * 300,
)
CRAFTED = (
    st.lists(st.one_of(st.sampled_from(FRAGMENTS), st.text(st.characters(exclude_categories=["Cs"]), min_size=1, max_size=4)),
             min_size=1, max_size=4)
    .map("".join)
    .filter(lambda s: bool(s.strip()))
)


@st.composite
def id_family(draw: st.DrawFn, base_ids: st.SearchStrategy[str] = CRAFTED, http: bool = False) -> list[str]:
    """2-4 distinct ids: a crafted id, near-miss variants of it (prefix, suffix, case, wildcard) and another."""
    base = draw(base_ids)
    variants = [base + "_", base[:-1], base.upper(), base * 2, "." + base, base + "-"]
    variants += [base + "%", base + " ", "' OR 1=1 --" + base, base + "/..", "../" + base, base + "\x00", base + "*"]
    chosen = draw(st.lists(st.sampled_from(variants), min_size=1, max_size=2))
    ids = list(dict.fromkeys([base, *chosen, draw(base_ids)]))
    ids = list(dict.fromkeys(i[:MAX_CONVERSATION_ID_CHARS] if http else i for i in ids if i.strip()))
    assume(len(ids) >= 2)
    return ids[:4]


@dataclass(frozen=True)
class Family:
    store: Path
    convs: list[Conv]

    def mark(self, n: int) -> str:
        return f"qzx{n}mark"

    def query_from(self, n: int) -> str:
        """Words of conversation n's own memory: its first item, first scene title and its mark."""
        memory = self.convs[n].memory
        return f"{memory.items[0].content} {memory.scenes[0].title}"


class Stores:
    """A fresh store directory per example (Hypothesis reuses the function's tmp_path)."""

    def __init__(self, root: Path) -> None:
        self.root, self.n = root, 0

    def build(self, ids: Sequence[str]) -> Family:
        self.n += 1
        store = self.root / f"family{self.n}" / "store"
        convs = [make_conv(cid, mark=f"qzx{n}mark", scenes=3, turns_per_scene=2, items_per_scene=2, tag=f"T{n}")
                 for n, cid in enumerate(ids)]
        build_store(store, convs, HashEmbedder())
        return Family(store, convs)


def owners(text: str) -> set[int]:
    """The conversations (by index) whose marks or tagged ids occur in ``text``."""
    return {int(m[3:-4]) for m in MARKS.findall(text)} | {int(t) for t in TAGS.findall(text)}


def assert_only(n: int, text: str, what: str) -> None:
    found = owners(text)
    assert found == {n}, f"{what}: expected only conversation {n}'s memory, found {sorted(found)}"


def without(payload: dict[str, Any], *keys: str) -> str:
    """The response as text, minus the echoed question (which carries the other conversation's words)."""
    return json.dumps({k: v for k, v in payload.items() if k not in keys}, ensure_ascii=False)


def check_api(family: Family, x: int, y: int) -> None:
    cid = family.convs[x].conversation_id
    question = family.query_from(y)
    chat = FakeChatModel()
    memory = Memory.open(family.store, Settings(store=family.store), embedder=HashEmbedder(), chat=chat)
    for embed in (True, False):
        result = memory.search(question, conversation_id=cid, embed=embed, trace=True)
        assert result.conversation_id == cid and result.scenes and result.items
        for item in result.items:
            assert_only(x, f"{item.item_id} {item.content} {' '.join(item.source_scene_ids)}", "item")
            assert set(item.source_scene_ids) <= {s.scene_id for s in family.convs[x].memory.scenes}
        for scene in result.scenes:
            assert_only(x, f"{scene.scene_id} {scene.title}", "scene")
            assert {t.conversation_id for t in scene.turns} == {cid}
            assert all(family.mark(x) in t.text for t in scene.turns)
        assert result.personas and {p.conversation_id for p in result.personas} == {cid}
        assert result.trace is not None
        assert_only(x, " ".join(c.id for stage in result.trace.stages for c in stage.candidates), "trace")
        context = memory.context(question, conversation_id=cid, embed=embed)
        assert_only(x, context.context.text, "context")
    answer = memory.answer(question, conversation_id=cid, embed=False)
    assert_only(x, answer.context.text, "answer context")
    assert owners(answer.answer) <= {x}
    sent = chat.calls[-1].context
    assert_only(x, sent, "context sent to the answer model")


def check_cli(family: Family, x: int, y: int) -> None:
    cid = family.convs[x].conversation_id
    out, err = io.StringIO(), io.StringIO()
    # "--conversation=ID": an id such as "--../" would otherwise be read as an option
    argv = ["query", f"--conversation={cid}", "--store", str(family.store), "--no-embed", "--json", "--context", "--trace",
            "--", family.query_from(y)]
    code = run(argv, CliContext(stdout=out, stderr=err, settings_loader=lambda: Settings(store=family.store)))
    assert code == 0, err.getvalue()
    payload = json.loads(out.getvalue())
    assert payload["conversation_id"] == cid and payload["scenes"] and payload["items"]
    assert owners(" ".join(payload["trace"].pop("query_tokens"))) <= {y}  # the question's own words, echoed
    assert_only(x, without(payload, "query", "conversation_id"), "tmem query --json")


@pytest.mark.slow  # 12 builds of a small store: ~25 s idle, several times that on a loaded machine
def test_no_conversation_ever_sees_another_through_the_api_and_cli(tmp_path: Path) -> None:
    stores = Stores(tmp_path)
    pairs = 0

    @settings(ISOLATION, max_examples=12)
    @given(ids=id_family())
    def check(ids: list[str]) -> None:
        nonlocal pairs
        family = stores.build(ids)
        for x in range(len(ids)):
            for y in range(len(ids)):
                if x != y:
                    check_api(family, x, y)
                    pairs += 1
        check_cli(family, 0, 1)  # the CLI on a smaller sample: one ordered pair per family
        check_cli(family, 1, 0)

    check()
    print(f"\nisolation (API + CLI): {stores.n} crafted families, {pairs} ordered pairs queried")
    assert stores.n >= 12


def http_client(family: Family) -> TestClient:
    settings_ = Settings(store=family.store)
    memory = Memory.open(family.store, settings_, embedder=HashEmbedder(), chat=FakeChatModel())
    return TestClient(create_app(family.store, settings_, memory=memory), raise_server_exceptions=False)


def test_no_conversation_ever_sees_another_over_http(tmp_path: Path) -> None:
    stores = Stores(tmp_path)

    @settings(ISOLATION, max_examples=6)
    @given(ids=id_family(http=True))
    def check(ids: list[str]) -> None:
        family = stores.build(ids)
        with http_client(family) as client:
            for x, conv in enumerate(family.convs):
                y = (x + 1) % len(family.convs)
                found = client.post("/search", json={"query": family.query_from(y), "conversation_id": conv.conversation_id,
                                                     "trace": True})
                assert found.status_code == 200, found.text
                body = found.json()
                assert body["scenes"] and body["items"] and body["trace"]["stages"]
                assert owners(" ".join(body["trace"].pop("query_tokens"))) <= {y}  # the question's own words, echoed
                assert_only(x, without(body, "query", "conversation_id"), "POST /search")
                answered = client.post("/answer", json={"question": family.query_from(y), "include_context": True,
                                                        "conversation_id": conv.conversation_id, "embed": False})
                assert answered.status_code == 200, answered.text
                assert_only(x, without(answered.json(), "question", "conversation_id"), "POST /answer")
                for near_miss in (conv.conversation_id + "%", conv.conversation_id + "' OR 1=1 --", "../" + conv.conversation_id,
                                  conv.conversation_id + "\x00", conv.conversation_id.upper() + " "):
                    if near_miss in {c.conversation_id for c in family.convs}:
                        continue
                    refused = client.post("/search", json={"query": "x", "conversation_id": near_miss})
                    assert refused.status_code == 404 and owners(refused.text) == set()
                    assert near_miss not in refused.text
            too_long = client.post("/search", json={"query": "x", "conversation_id": "a" * (MAX_CONVERSATION_ID_CHARS + 1)})
            assert too_long.status_code == 422

    check()
    assert stores.n >= 6


# ---- every read path requires a scope ------------------------------------------------------


READS = ("search", "context", "answer")


@pytest.mark.parametrize("owner", [Memory, MemorySnapshot])
@pytest.mark.parametrize("method", READS)
def test_python_reads_take_a_required_keyword_only_scope(owner: type, method: str) -> None:
    parameter = inspect.signature(getattr(owner, method)).parameters["conversation_id"]
    assert parameter.kind is inspect.Parameter.KEYWORD_ONLY
    assert parameter.default is inspect.Parameter.empty  # no default, hence no "all conversations"


def test_python_reads_refuse_every_non_scope(tmp_path: Path) -> None:
    family = Stores(tmp_path).build(["conv-a", "conv-b"])
    memory = Memory.open(family.store, Settings(store=family.store), embedder=HashEmbedder(), chat=FakeChatModel())
    for cid in (None, "", "*", "%", "all", "conv-%", ["conv-a", "conv-b"], ("conv-a",), {"$ne": ""}):
        for method in READS:
            call: Callable[..., Any] = getattr(memory, method)
            with pytest.raises(ScopeError):
                call("pottery", conversation_id=cid, embed=False)


@pytest.mark.parametrize("command", ["query", "answer"])
def test_cli_reads_require_conversation(command: str, capsys: pytest.CaptureFixture[str]) -> None:
    parser = build_parser(COMMANDS)
    sub = next(a for a in parser._actions if a.dest == "command_name")
    action = next(a for a in sub.choices[command]._actions if "--conversation" in a.option_strings)  # type: ignore[union-attr]
    assert action.required and action.default is None
    assert run([command, "pottery"], CliContext(stdout=io.StringIO(), stderr=io.StringIO())) == 2
    assert "the following arguments are required: --conversation" in capsys.readouterr().err  # argparse's usage error


@pytest.mark.parametrize("model", [SearchRequest, AnswerRequest])
def test_http_reads_require_conversation_id(model: type[SearchRequest] | type[AnswerRequest]) -> None:
    field = model.model_fields["conversation_id"]
    assert field.is_required()
    assert model.model_config.get("extra") == "forbid"  # no side channel such as "tenant" or "all"


# ---- the service never echoes internal errors ------------------------------------------------

SECRET = "sk-live-9f8e7d6c5b4a password=hunter2"
GENERIC = {"internal error", "memory store unavailable", "the answer model failed", "conversation not found"}


def assert_generic(response: Any, *secrets: str) -> None:
    assert response.status_code >= 500
    assert response.json()["detail"] in GENERIC
    for secret in secrets:
        assert secret not in response.text and all(secret not in v for v in response.headers.values())


def test_an_internal_exception_in_a_handler_is_a_generic_500(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    import tmem.query.loader as loader

    family = Stores(tmp_path).build(["conv-a", "conv-b"])

    def exploding_load(*args: Any, **kwargs: Any) -> Any:
        raise RuntimeError(f"{SECRET} while reading {family.store}/snapshots")

    monkeypatch.setattr(loader, "load_index", exploding_load)
    with http_client(family) as client:
        for path, key in (("/search", "query"), ("/answer", "question")):
            response = client.post(path, json={key: "pottery", "conversation_id": "conv-a"})
            assert response.status_code == 500 and response.json() == {"detail": "internal error"}
            assert_generic(response, "hunter2", "sk-live", str(family.store), "RuntimeError", "Traceback")


def test_a_corrupted_snapshot_file_is_not_echoed(tmp_path: Path) -> None:
    family = Stores(tmp_path).build(["conv-a", "conv-b"])
    with http_client(family) as client:
        memory_db = client.app.state.memory.snapshot().info.memory_db  # type: ignore[attr-defined]
        memory_db.write_bytes(f"{SECRET} not a database ".encode() * 200)
        response = client.post("/search", json={"query": "pottery", "conversation_id": "conv-a"})
        assert_generic(response, "hunter2", "sk-live", str(family.store), "duckdb", "Traceback")
        assert client.get("/health").status_code == 200  # the service itself stays up

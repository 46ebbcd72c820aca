"""``tmem query`` and ``tmem answer`` through the CLI entry point, on published test stores."""

from __future__ import annotations

import io
import json
import os
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path

import pytest

from tests.query_store import HashEmbedder, build_store, make_conv
from tests.test_query_memory import scripted_answer
from tmem.cli import run
from tmem.cli.base import CliContext
from tmem.devtools.scripted_llm import ScriptedLLM
from tmem.settings import Settings

REPO = Path(__file__).resolve().parents[1]


@pytest.fixture(scope="module")
def store(tmp_path_factory: pytest.TempPathFactory) -> Path:
    path = tmp_path_factory.mktemp("cli") / "store"
    build_store(path, [make_conv("conv-a", mark="alpha"), make_conv("conv-b", mark="beta")], HashEmbedder())
    return path


def cli(argv: list[str], settings: Settings) -> tuple[int, str, str]:
    out, err = io.StringIO(), io.StringIO()
    code = run(argv, CliContext(stdout=out, stderr=err, settings_loader=lambda: settings))
    return code, out.getvalue(), err.getvalue()


def test_query_prints_scenes_and_items_with_their_channels(store: Path) -> None:
    code, out, err = cli(["query", "hiking trail boots", "--conversation", "conv-a", "--store", str(store), "--no-embed"],
                         Settings())
    assert code == 0, err
    lines = out.splitlines()
    assert lines[0].startswith("conversation conv-a · snapshot ") and "lexical" in lines[0]
    assert "Scenes (" in out and "Items (" in out
    first_scene = next(line for line in lines if line.startswith("  1. "))
    assert "Hiking trail alpha 1" in first_scene and "via lexical" in first_scene
    assert "beta" not in out
    assert "Personas: Ann, Bob" in out
    assert any(line.startswith("context ") and "tokens" in line for line in lines)


def test_query_json_and_trace(store: Path) -> None:
    code, out, err = cli(
        ["query", "pottery bowl", "--conversation", "conv-b", "--store", str(store), "--no-embed", "--json", "--trace",
         "--speaker", "Bob", "--preset", "paper"],
        Settings(),
    )
    assert code == 0, err
    body = json.loads(out)
    assert body["conversation_id"] == "conv-b" and body["preset"] == "paper" and body["snapshot_id"]
    assert body["mode"] == "lexical" and body["scenes"] and body["items"]
    assert all("beta" in s["title"].split() for s in body["scenes"])
    assert all(set(i["channels"]) == {"lexical"} for i in body["items"])
    assert [p["speaker"] for p in body["personas"]] == ["Bob"]
    assert body["trace"]["config"] == "paper"
    assert [s["stage"] for s in body["trace"]["stages"]] == ["topic_prefilter", "scene_selection", "item_selection"]
    assert body["context_report"]["budget"] == 6000


def test_query_trace_text(store: Path) -> None:
    code, out, _ = cli(["query", "pottery bowl", "--conversation", "conv-a", "--store", str(store), "--no-embed",
                        "--trace"], Settings())
    assert code == 0
    assert "Trace · preset default · lexical" in out
    assert "  topic_prefilter: fusion rrf" in out and "  scene_selection: fusion best_rank" in out
    assert "    * scn_0  fused" in out


@pytest.mark.parametrize("cid", ["conv-c", "' OR 1=1 --", "conv-a%", "../conv-a", ""])
def test_unknown_conversation_exits_2(store: Path, cid: str) -> None:
    code, out, err = cli(["query", "pottery", "--conversation", cid, "--store", str(store), "--no-embed"], Settings())
    assert code == 2 and out == ""
    assert "error:" in err and ("unknown conversation" in err or "conversation id" in err)


def test_bad_input_exits_2(store: Path, tmp_path: Path) -> None:
    assert cli(["query", "pottery", "--store", str(store)], Settings())[0] == 2  # no --conversation
    code, _, err = cli(["query", "pottery", "--conversation", "conv-a", "--store", str(store), "--preset", "fast"],
                       Settings())
    assert code == 2 and "'fast'" in err and "known presets: paper, default" in err
    empty = tmp_path / "empty"
    empty.mkdir()
    code, _, err = cli(["query", "pottery", "--conversation", "conv-a", "--store", str(empty)], Settings())
    assert code == 2 and "nothing published yet" in err
    code, _, err = cli(["query", "pottery", "--conversation", "conv-a", "--store", str(tmp_path / "nope")], Settings())
    assert code == 2 and "no tmem store" in err


def test_answer_command(store: Path, scripted_llm_factory: Callable[..., ScriptedLLM]) -> None:
    llm = scripted_llm_factory(responders={"answer": scripted_answer})
    settings = Settings(llm_base_url=llm.url, llm_max_retries=0, llm_timeout_s=5)
    code, out, err = cli(["answer", "Which garden fact?", "--conversation", "conv-a", "--store", str(store),
                          "--no-embed", "--json", "--date", "2023-06-01"], settings)
    assert code == 0, err
    body = json.loads(out)
    assert body["answer"] == " ".join(body["items"][0]["content"].split()[:6]) and body["conversation_id"] == "conv-a"
    code, out, err = cli(["answer", "Which garden fact?", "--conversation", "conv-a", "--store", str(store),
                          "--no-embed"], settings)
    assert code == 0, err
    assert out.splitlines()[0] == body["answer"]
    assert "model gpt-4o-mini" in out and "Items (" in out

    llm.fail_next("server_error", n=3, operation="answer")
    code, _, err = cli(["answer", "Which garden fact?", "--conversation", "conv-a", "--store", str(store),
                        "--no-embed"], settings)
    assert code == 1 and "answer" in err
    assert cli(["answer", "x", "--conversation", "nobody", "--store", str(store), "--no-embed"], settings)[0] == 2


def test_lexical_query_imports_no_model_and_no_lancedb(store: Path) -> None:
    """``--no-embed`` keeps the query path light: no torch, sentence-transformers, LanceDB or openai."""
    script = (
        "import sys, json\n"
        "from tmem.cli import main\n"
        f"code = main(['query', 'pottery', '--conversation', 'conv-a', '--store', {str(store)!r}, '--no-embed', '--json'])\n"
        "heavy = [m for m in ('torch', 'sentence_transformers', 'lancedb', 'openai') if m in sys.modules]\n"
        "print(json.dumps({'code': code, 'heavy': heavy}), file=sys.stderr)\n"
    )
    env = {k: v for k, v in os.environ.items() if not k.startswith("TMEM_")}
    env.update({"HF_HUB_OFFLINE": "1", "PYTHONPATH": str(REPO)})
    done = subprocess.run([sys.executable, "-c", script], env=env, capture_output=True, text=True, timeout=120,
                          check=False)
    report = json.loads(done.stderr.strip().splitlines()[-1])
    assert report == {"code": 0, "heavy": []}
    assert json.loads(done.stdout)["scenes"]


@pytest.fixture(scope="module")
def minilm_store(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A store embedded with the real MiniLM (the configured default), for the hybrid CLI path."""
    from tmem.providers.sentence_transformer import SentenceTransformerEmbedder

    path = tmp_path_factory.mktemp("minilm") / "store"
    build_store(path, [make_conv("conv-a", mark="alpha", scenes=4, items_per_scene=1)], SentenceTransformerEmbedder())
    return path


def test_hybrid_query_with_the_real_embedder(minilm_store: Path) -> None:
    code, out, err = cli(["query", "climbing to a peak in sturdy footwear", "--conversation", "conv-a", "--store",
                          str(minilm_store), "--json"], Settings())
    assert code == 0, err
    body = json.loads(out)
    assert body["mode"] == "hybrid"
    hiking = [s for s in body["scenes"] if s["title"].startswith("Hiking trail")]
    assert hiking and "dense" in hiking[0]["channels"]


def test_answer_with_the_local_provider_goes_through_the_embedded_endpoint(
    store: Path, scripted_llm_factory: Callable[..., ScriptedLLM], monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    """``TMEM_LLM_PROVIDER=local``: the CLI starts the embedded model (here a stand-in serving the
    scripted answers under the model alias), exports its endpoint for the command and restores the
    environment afterwards; without the [local] extra it is a clear error, exit 2."""
    from contextlib import contextmanager

    from tmem.providers import llama_cpp
    from tmem.settings import load_settings

    llm = scripted_llm_factory(responders={"answer": scripted_answer})
    started: list[str] = []

    @contextmanager
    def fake_server(settings: Settings):  # type: ignore[no-untyped-def]
        started.append(str(settings.store))
        yield llama_cpp.LocalServer(base_url=llm.url, model="tiny-local", pid=0, log_path=tmp_path / "log")

    monkeypatch.setattr(llama_cpp, "local_server_for", fake_server)
    monkeypatch.setattr(llama_cpp, "llama_cpp_installed", lambda: True)
    monkeypatch.setenv("TMEM_LLM_PROVIDER", "local")
    monkeypatch.setenv("TMEM_LLM_BASE_URL", "http://127.0.0.1:9/v1")  # ignored: local was asked for
    monkeypatch.delenv("TMEM_LLM_ANSWER_MODEL", raising=False)
    out, err = io.StringIO(), io.StringIO()
    argv = ["answer", "Which garden fact?", "--conversation", "conv-a", "--store", str(store), "--no-embed", "--json"]
    code = run(argv, CliContext(stdout=out, stderr=err, settings_loader=load_settings))
    assert code == 0, err.getvalue()
    assert json.loads(out.getvalue())["model"] == "tiny-local"
    assert started == [str(store)] and "embedded model tiny-local" in err.getvalue()
    assert os.environ["TMEM_LLM_BASE_URL"] == "http://127.0.0.1:9/v1" and "TMEM_LLM_ANSWER_MODEL" not in os.environ

    monkeypatch.setattr(llama_cpp, "llama_cpp_installed", lambda: False)
    out, err = io.StringIO(), io.StringIO()
    code = run(argv, CliContext(stdout=out, stderr=err, settings_loader=load_settings))
    assert code == 2 and "embedded model is not installed" in err.getvalue() and out.getvalue() == ""

"""The QA runner: recall → answer → judge, saved as JSONL, resumed and re-scored without calls.

Unit tests run on a hand-built published store (tests/query_store.py) with typed fake chat
models; the end-to-end test builds two trimmed LoCoMo conversations with the Prefect flow against
the scripted server and runs ``tmem eval`` twice (the second run must make zero requests).
"""

from __future__ import annotations

import json
import re
from collections.abc import Iterator
from dataclasses import replace
from pathlib import Path
from typing import Any

import pytest
from pydantic import ValidationError

from tests.fakes import FakeChatModel
from tests.paths import DATASETS
from tests.query_store import HashEmbedder, build_store, make_conv
from tmem.devtools.responders import input_message, request_input
from tmem.devtools.scripted_llm import ScriptedLLM
from tmem.eval.ablations import EvalConfig, ablation_configs, sweep_configs
from tmem.eval.examples import QAExample
from tmem.eval.judge import JudgeSetup, judge_prompt, read_verdict
from tmem.eval.prompt_files import FileJudgement, PromptFileError, load_prompt_file
from tmem.eval.report import outstanding_failures
from tmem.eval.results import question_table, summary_table
from tmem.eval.run_folder import RunFolder, RunFolderError
from tmem.eval.runner import AnswerSetup, NotBuiltError, QARunner, RunOptions, answer_request, embed_questions
from tmem.prompts.common import parse_context
from tmem.query.memory import Memory
from tmem.settings import Settings

CONFIG = EvalConfig(name="default")


def qa(n: int, question: str, answer: str, category: str = "single-hop", evidence: tuple[str, ...] = ("D1:1",),
       cid: str = "conv-a") -> QAExample:
    return QAExample(qid=f"{cid}#{n}", dataset="locomo", conversation_id=cid, question=question, answer=answer,
                     category=category, category_id=None, evidence=evidence,
                     question_date="2023-06-01T10:00:00+00:00", speaker=None, extra={})


EXAMPLES = [
    qa(0, "What did Ann say about the pottery bowl?", "pottery bowl"),
    qa(1, "When did Bob talk about the hiking trail?", "the trail", "temporal", ("D2:2",)),
    qa(2, "Which marathon race shoes?", "running shoes", "multi-hop", ("D5:1", "D5:3")),
    qa(3, "What grows in the garden?", "tomatoes", "open-domain", ("D6:1",)),
]


def _words(text: str) -> set[str]:
    return set(re.findall(r"[a-z0-9]+", text.lower()))


def first_turn_answer(operation: str, request_json: dict[str, Any]) -> str:
    """Deterministic answerer: the first six words of the first dialogue line of the context;
    the garden question gets a fixed answer (its F1 is worked out by hand below)."""
    data = request_input(request_json)
    if "garden" in data["question"]:
        return json.dumps({"answer": "tomatoes and seeds"})
    for line in parse_context(input_message(request_json)).splitlines():
        if line.startswith("[") and ": " in line:
            return json.dumps({"answer": " ".join(line.split(": ", 1)[1].split()[:6])})
    return json.dumps({"answer": "Not mentioned"})


def overlap_judge(operation: str, request_json: dict[str, Any]) -> str:
    """CORRECT when the reference and the candidate share a word."""
    data = request_input(request_json)
    shared = _words(data["reference_answer"]) & _words(data["candidate_answer"])
    return json.dumps({"reasoning": f"shared {sorted(shared)}", "label": "CORRECT" if shared else "WRONG"})


@pytest.fixture(scope="module")
def store(tmp_path_factory: pytest.TempPathFactory) -> Path:
    path = tmp_path_factory.mktemp("eval-store") / "store"
    build_store(path, [make_conv("conv-a", mark="alpha", scenes=8)], HashEmbedder())
    return path


@pytest.fixture
def chats() -> tuple[FakeChatModel, FakeChatModel]:
    return (FakeChatModel({"answer": first_turn_answer}, model_name="fake-answer", use_synth=False),
            FakeChatModel({"judge_locomo": overlap_judge}, model_name="fake-judge", use_synth=False))


def make_runner(store: Path, answer: FakeChatModel, judge: FakeChatModel, **options: Any) -> QARunner:
    memory = Memory.open(store, Settings(store=store), embedder=HashEmbedder(), chat=answer)
    return QARunner(memory, answer, judge, RunOptions(**options), vectors=embed_questions(memory, EXAMPLES))


def run_once(runner: QARunner, folder: RunFolder, examples: list[QAExample] = EXAMPLES) -> Any:
    folder.open(runner.manifest("locomo", CONFIG))
    return runner.run(examples, folder, CONFIG)


def test_run_saves_answers_contexts_and_every_judge_run(store: Path, chats: Any, tmp_path: Path) -> None:
    answer, judge = chats
    folder = RunFolder(tmp_path / "run")
    tally = run_once(make_runner(store, answer, judge, judge_runs=2, workers=3), folder)
    assert (tally.answered, tally.judged, tally.failures) == (4, 8, 0)
    assert answer.count("answer") == 4 and judge.count("judge_locomo") == 8
    # The judge runs differ in their input, so a response cache cannot collapse them.
    runs = sorted((c.input["question"], c.input["judge_run"]) for c in judge.of("judge_locomo"))
    assert runs == sorted((e.question, r) for e in EXAMPLES for r in (1, 2))
    prompts = {c.prompt.cache_key("m") for c in judge.of("judge_locomo")}
    assert len(prompts) == 8
    answers = folder.answered()
    assert set(answers) == {e.qid for e in EXAMPLES}
    contexts = {r["qid"]: r for r in folder.records("contexts")}
    for example in EXAMPLES:
        sent = next(c for c in answer.of("answer") if c.input["question"] == example.question)
        assert contexts[example.qid]["text"] == sent.context  # the context saved is the one sent
        record = answers[example.qid]
        # input tokens = every message of the answer prompt at 4 characters per token, context included
        expected = sum(-(-len(m.content) // 4) for m in sent.prompt.messages)
        assert record["input_tokens"] == expected > record["context_tokens"] > 0
    assert answers["conv-a#3"]["answer"] == "tomatoes and seeds"


def test_rerun_makes_no_call_and_more_judge_runs_only_add_the_missing_ones(store: Path, chats: Any,
                                                                            tmp_path: Path) -> None:
    answer, judge = chats
    folder = RunFolder(tmp_path / "run")
    run_once(make_runner(store, answer, judge, judge_runs=1), folder)
    calls = (answer.count("answer"), judge.count("judge_locomo"))
    again = run_once(make_runner(store, answer, judge, judge_runs=1), folder)
    assert (again.answered, again.judged, again.answers_reused, again.judgements_reused) == (0, 0, 4, 4)
    assert (answer.count("answer"), judge.count("judge_locomo")) == calls
    more = run_once(make_runner(store, answer, judge, judge_runs=3), folder)
    assert (more.answered, more.judged) == (0, 8)
    assert sorted(r for _, r in folder.judged()) == [1] * 4 + [2] * 4 + [3] * 4
    assert answer.count("answer") == 4


def test_failed_calls_are_recorded_and_redone_by_the_next_run(store: Path, tmp_path: Path) -> None:
    def flaky_judge(operation: str, request_json: dict[str, Any]) -> str:
        data = request_input(request_json)
        return "not json" if "pottery" in data["question"] else overlap_judge(operation, request_json)

    answer = FakeChatModel({"answer": first_turn_answer}, model_name="fake-answer", use_synth=False)
    judge = FakeChatModel({"judge_locomo": flaky_judge}, model_name="fake-judge", use_synth=False)
    folder = RunFolder(tmp_path / "run")
    tally = run_once(make_runner(store, answer, judge), folder)
    assert tally.failures == 1
    errors = folder.records("errors")
    assert [(e["qid"], e["stage"], e["run"], e["error_type"]) for e in errors] == [
        ("conv-a#0", "judge", 1, "LLMOutputError")]
    assert outstanding_failures(folder) == 1
    judge.scripts["judge_locomo"] = overlap_judge
    retry = run_once(make_runner(store, answer, judge), folder)
    assert (retry.answered, retry.judged, retry.failures) == (0, 1, 0)
    assert ("conv-a#0", 1) in folder.judged()
    assert outstanding_failures(folder) == 0 and len(folder.records("errors")) == 1


def test_scores_come_from_saved_outputs(store: Path, chats: Any, tmp_path: Path) -> None:
    answer, judge = chats
    folder = RunFolder(tmp_path / "run")
    run_once(make_runner(store, answer, judge, judge_runs=2), folder)
    calls = len(answer.calls) + len(judge.calls)
    questions, judgements = question_table(folder)
    table, _ = summary_table([folder])
    assert len(answer.calls) + len(judge.calls) == calls  # scoring made no call
    assert judgements.height == 8
    answers = {qid: r["answer"] for qid, r in folder.answered().items()}
    # The scripted judge is deterministic: recompute its verdicts from the saved answers.
    verdict = {e.qid: float(bool(_words(e.answer) & _words(answers[e.qid]))) for e in EXAMPLES}
    overall = table.filter(table["category"] == "overall").row(0, named=True)
    assert overall["n"] == 4 and overall["missing"] == 0
    assert overall["accuracy_pct"] == pytest.approx(100 * sum(verdict.values()) / 4, abs=0.01)
    assert overall["accuracy_std_pct"] == pytest.approx(0.0)  # two identical judge runs
    garden = questions.filter(questions["qid"] == "conv-a#3").row(0, named=True)
    # "tomatoes and seeds" vs "tomatoes" (open-domain):
    # official [tomato, seed] vs [tomato]: P 1/2, R 1 -> 2/3; mem0/memos {tomatoes, and, seeds} vs {tomatoes} -> 1/2
    assert garden["f1_official"] == pytest.approx(2 / 3)
    assert garden["f1_mem0"] == pytest.approx(0.5) and garden["f1_memos"] == pytest.approx(0.5)
    assert garden["judge_score"] == 1.0
    rows = {r["category"]: r for r in table.iter_rows(named=True)}
    assert list(rows) == ["single-hop", "multi-hop", "temporal", "open-domain", "overall"]
    assert rows["open-domain"]["f1_official_pct"] == pytest.approx(66.67, abs=0.01)


def test_a_folder_holding_another_run_is_refused(store: Path, chats: Any, tmp_path: Path) -> None:
    answer, judge = chats
    folder = RunFolder(tmp_path / "run")
    run_once(make_runner(store, answer, judge), folder)
    other = FakeChatModel({"answer": first_turn_answer}, model_name="another-model", use_synth=False)
    with pytest.raises(RunFolderError, match="answer_model"):
        run_once(make_runner(store, other, judge), folder)


def test_questions_about_unbuilt_conversations_are_refused(store: Path, chats: Any, tmp_path: Path) -> None:
    answer, judge = chats
    stray = [*EXAMPLES, qa(9, "Anything?", "x", cid="conv-zzz")]
    with pytest.raises(NotBuiltError, match="conv-zzz"):
        run_once(make_runner(store, answer, judge), RunFolder(tmp_path / "run"), stray)
    assert answer.calls == []


def test_a_damaged_last_line_is_skipped_and_its_question_redone(store: Path, chats: Any, tmp_path: Path) -> None:
    answer, judge = chats
    folder = RunFolder(tmp_path / "run")
    run_once(make_runner(store, answer, judge), folder)
    path = folder.file("answers")
    lines = path.read_text(encoding="utf-8").splitlines(keepends=True)
    path.write_text("".join(lines[:-1]) + lines[-1][: len(lines[-1]) // 2], encoding="utf-8")  # a torn write
    lost = json.loads(lines[-1])["qid"]
    tally = run_once(make_runner(store, answer, judge), folder)
    assert folder.damaged_lines >= 1
    assert tally.answered == 1 and answer.count("answer") == 5
    assert lost in folder.answered() and len(folder.answered()) == 4


def test_protocol_files_are_sent_verbatim_and_judge_runs_keep_distinct_cache_keys(tmp_path: Path) -> None:
    answer_file = tmp_path / "answer.txt"
    answer_file.write_text("Memories:\n\n{{memories}}\n\nQuestion: {{question}}\nAnswer:", encoding="utf-8")
    judge_file = tmp_path / "judge.txt"
    judge_file.write_text('Q: {question}\nGold: {gold_answer}\nGot: {generated_answer}\n{{"label": "CORRECT"}}',
                          encoding="utf-8")
    example = EXAMPLES[0]
    prompt = answer_request(example, "CTX", ("Ann", "Bob"), AnswerSetup(load_prompt_file(answer_file), role="system"))
    assert [(m.role, m.content) for m in prompt.messages] == [
        ("system", f"Memories:\n\nCTX\n\nQuestion: {example.question}\nAnswer:")]
    setup = JudgeSetup(load_prompt_file(judge_file))
    first, second = (judge_prompt(example, "a bowl", run, setup, "") for run in (1, 2))
    expected = f'Q: {example.question}\nGold: pottery bowl\nGot: a bowl\n{{"label": "CORRECT"}}'
    assert first.messages == second.messages and first.messages[0].content == expected
    assert first.cache_key("m") != second.cache_key("m")
    # LoCoMo's QA prompt has no context placeholder ("based on the above context"): context goes first.
    qa_file = tmp_path / "qa.txt"
    qa_file.write_text("\nBased on the above context, answer.\n\nQuestion: {} Short answer:", encoding="utf-8")
    official = answer_request(example, "CTX", (), AnswerSetup(load_prompt_file(qa_file), positional=("question",)))
    assert official.messages[0].content == f"CTX\n\n\nBased on the above context, answer.\n\nQuestion: {example.question} Short answer:"


def test_named_configurations_cover_table4_and_figure4() -> None:
    configs = ablation_configs()
    assert [c.display for c in configs] == ["T-Mem", "w/o SL", "w/o IC", "w/o ET+BT", "w/o PS", "w/o TF", "w/o ST",
                                            "w/o HT", "w/o ST+HT"]
    settings = Settings()
    resolved = {c.name: c.retrieval(settings) for c in configs}
    assert resolved["no-horizon"].horizon_trigger is False and resolved["no-horizon"].scene_trigger is True
    assert not resolved["no-scene-horizon"].scene_trigger and not resolved["no-scene-horizon"].horizon_trigger
    assert all(getattr(resolved["default"], f) for f in ("scene_layer", "item_channel", "item_triggers", "persona",
                                                          "topic_filter", "scene_trigger", "horizon_trigger"))
    sweep = sweep_configs("ks", [1, 3])
    assert [c.name for c in sweep] == ["kS=1", "kS=3"]
    assert [c.retrieval(settings).k_scenes for c in sweep] == [1, 3]
    assert sweep_configs("R")[0].retrieval(settings).trigger_cap == 0  # the paper's values by default
    assert replace(CONFIG, preset="paper").retrieval(settings).scene_fusion == "rrf"


def test_locomo_plus_items_get_a_memory_reply_and_the_awareness_judge(store: Path, tmp_path: Path) -> None:
    item = QAExample(qid="plus-0001", dataset="locomo-plus", conversation_id="conv-a",
                     question="I finally finished the papers for the agency!", answer="", category="cognitive",
                     category_id=None, evidence=("D3:1", "D3:2"), question_date="2023-07-01T10:00:00+00:00",
                     speaker="Ann", extra={"cue_dialogue": "A: unused fallback"})

    def reply(operation: str, request_json: dict[str, Any]) -> str:
        data = request_input(request_json)
        context = parse_context(input_message(request_json))
        return json.dumps({"reply": f"{data['respondent']} remembers: " + context.split("\n")[3][:60]})

    def aware(operation: str, request_json: dict[str, Any]) -> str:
        data = request_input(request_json)
        shared = _words(data["earlier_exchange"]) & _words(data["reply"]) - {"ann", "bob", "the", "and"}
        return json.dumps({"reasoning": "", "label": "CORRECT" if shared else "WRONG"})

    answer = FakeChatModel({"memory_reply": reply}, model_name="fake-answer", use_synth=False)
    judge = FakeChatModel({"judge_memory_awareness": aware}, model_name="fake-judge", use_synth=False)
    memory = Memory.open(store, Settings(store=store), embedder=HashEmbedder(), chat=answer)
    runner = QARunner(memory, answer, judge, RunOptions())
    folder = RunFolder(tmp_path / "plus")
    folder.open(runner.manifest("locomo-plus", CONFIG))
    tally = runner.run([item], folder, CONFIG)
    assert (tally.answered, tally.judged, tally.failures) == (1, 1, 0)
    sent = answer.of("memory_reply")[0].input
    assert (sent["speaker"], sent["respondent"], sent["latest_message"]) == ("Ann", "Bob", item.question)
    assert sent["message_date"] == "2023-07-01 Sat 10:00"
    cue = judge.of("judge_memory_awareness")[0].input
    # the cue is the evidence turns' text from the snapshot (speaker names, not A/B)
    assert cue["earlier_exchange"].splitlines() == [
        "Ann: Ann talks about the adoption and the agency with alpha number 0",
        "Bob: Bob talks about the agency and the family with alpha number 1",
    ]
    assert cue["reply"].startswith("Bob remembers: ")
    questions, _ = question_table(folder)
    row = questions.row(0, named=True)
    assert row["category"] == "cognitive" and row["f1_official"] is None and row["f1_memos"] is None
    assert row["judge_score"] == float(folder.judged()[("plus-0001", 1)]["score"])


# --------------------------------------------------------------------------- protocol prompt files

PROTOCOL = DATASETS / "protocol"


def test_every_protocol_file_is_read_with_its_placeholder_style() -> None:
    styles = {}
    for path in sorted(PROTOCOL.glob("*.txt")):
        template = load_prompt_file(path, plain_ok=True)
        assert template.text == path.read_text(encoding="utf-8")  # kept byte for byte
        styles[path.name] = (template.style, template.fields)
    assert styles["memos__ANSWER_PROMPT_MEMOS.txt"] == ("format", ("context", "question"))
    assert styles["mem0__ANSWER_PROMPT_ZEP.txt"] == ("jinja", ("memories", "question"))
    assert styles["memos__judge_accuracy_prompt.fstring_source.txt"] == ("format", ("question", "gold_answer", "response"))
    assert styles["locomo_official__QA_PROMPT.txt"] == ("format", ("",))
    assert styles["memos__judge_system_prompt.txt"] == ("plain", ())


def test_escaped_braces_stay_literal_and_jinja_variables_are_filled() -> None:
    judge = load_prompt_file(PROTOCOL / "locomo_plus__judge_template__Cognitive.txt")
    text = judge.fill({"evidence": "Ann: I hurt my knee.", "pred": "How is the knee?"})
    assert '{"label": "correct"|"wrong", "reason":' in text and "Ann: I hurt my knee." in text
    assert "{evidence}" not in text and "{{" not in text
    zep = load_prompt_file(PROTOCOL / "mem0__ANSWER_PROMPT_ZEP.txt")
    filled = zep.fill({"memories": "MEMS", "question": "Q?"})
    assert "MEMS" in filled and "Question: Q?" in filled and "{{" not in filled


def test_unfillable_placeholders_fail_with_the_name_and_the_reason(tmp_path: Path) -> None:
    mem0 = load_prompt_file(PROTOCOL / "mem0__ANSWER_PROMPT.txt")
    with pytest.raises(PromptFileError, match=r"speaker_1_memories.*not split per speaker"):
        mem0.fill({"question": "q", "context": "c"})
    odd = tmp_path / "odd.txt"
    odd.write_text("Tell me {mood} about {question}", encoding="utf-8")
    with pytest.raises(PromptFileError, match=r"'mood' cannot be filled .*fillable: context, question"):
        load_prompt_file(odd).fill({"question": "q", "context": "c"})
    official = load_prompt_file(PROTOCOL / "locomo_official__QA_PROMPT.txt")
    with pytest.raises(PromptFileError, match="1 positional"):
        official.fill({"question": "q"})
    assert "Question: q Short answer:" in official.fill({"question": "q"}, ["question"])
    expr = tmp_path / "expr.txt"
    expr.write_text("{question.upper} {context}", encoding="utf-8")
    with pytest.raises(PromptFileError, match="expression"):
        load_prompt_file(expr)
    plain = tmp_path / "plain.txt"
    plain.write_text("no placeholders at all", encoding="utf-8")
    with pytest.raises(PromptFileError, match="no placeholder"):
        load_prompt_file(plain)


def test_dollar_templates_are_filled(tmp_path: Path) -> None:
    path = tmp_path / "dollar.txt"
    path.write_text("Context: ${context}\nQ: $question (cost $$5)", encoding="utf-8")
    template = load_prompt_file(path)
    assert template.style == "dollar"
    assert template.fill({"context": "C", "question": "Q"}) == "Context: C\nQ: Q (cost $5)"


def test_file_judge_labels_are_normalised_and_scored() -> None:
    assert [FileJudgement(label=x).label for x in ("CORRECT", "'wrong'", " Partial ")] == ["correct", "wrong", "partial"]
    assert read_verdict(FileJudgement(label="partial", reason="half")) == ("partial", 0.5, "half")
    with pytest.raises(ValidationError):
        FileJudgement(label="maybe")


# --------------------------------------------------------------------------- end to end (Prefect + scripted server)

LOCOMO_SESSIONS = {"conv-26": 2, "conv-30": 2}


def write_slice_with_qa(path: Path) -> int:
    """Sessions 1-2 of conv-26 and conv-30 with their category 1-4 QA whose evidence lies in them."""
    from tests.flow_helpers import write_locomo_slice
    from tests.paths import LOCOMO10

    write_locomo_slice(path, LOCOMO_SESSIONS)
    full = {s["sample_id"]: s for s in json.loads(LOCOMO10.read_text(encoding="utf-8"))}
    data = json.loads(path.read_text(encoding="utf-8"))
    total = 0
    for sample in data:
        limit = LOCOMO_SESSIONS[sample["sample_id"]]
        sample["qa"] = [
            q for q in full[sample["sample_id"]]["qa"]
            if q.get("category") in (1, 2, 3, 4) and q["evidence"]
            and all(re.fullmatch(r"D(\d+):\d+", e) and int(e[1:].split(":")[0]) <= limit for e in q["evidence"])
        ]
        total += len(sample["qa"])
    path.write_text(json.dumps(data), encoding="utf-8")
    return total


@pytest.fixture
def eval_server(scripted_llm_factory: Any, monkeypatch: pytest.MonkeyPatch) -> Iterator[ScriptedLLM]:
    from tests.flow_helpers import set_llm_env

    server: ScriptedLLM = scripted_llm_factory()
    server.set_responder("answer", first_turn_answer)
    server.set_responder("judge_locomo", overlap_judge)
    set_llm_env(monkeypatch, server)
    yield server


@pytest.mark.prefect
@pytest.mark.slow
def test_end_to_end_eval_resumes_and_rescoring_makes_zero_calls(
    prefect_harness: None, eval_server: ScriptedLLM, tmp_path: Path
) -> None:
    from prefect.client.orchestration import get_client
    from prefect.client.schemas.filters import ArtifactFilter, ArtifactFilterKey

    from tests.flow_helpers import cli_json
    from tmem.flows.evaluate import ARTIFACT_KEY, evaluate

    data, store, out = tmp_path / "slice.json", tmp_path / "store", tmp_path / "results"
    n = write_slice_with_qa(data)
    argv = ["eval", "locomo", "--data", str(data), "--store", str(store), "--out", str(out), "--build",
            "--judge-runs", "2", "--json"]
    first = cli_json(argv)
    ops = {r.operation for r in eval_server.requests}
    assert {"scene_boundaries", "answer", "judge_locomo"} <= ops  # built, answered, judged
    assert len(eval_server.requests_for("answer")) == n and len(eval_server.requests_for("judge_locomo")) == 2 * n
    assert first["questions"] == n and first["failures"] == 0
    overall = next(r for r in first["results"] if r["category"] == "overall")
    assert overall["n"] == n and overall["accuracy_pct"] is not None
    assert all(overall[f"f1_{v}_pct"] is not None for v in ("official", "mem0", "memos"))
    assert overall["mean_input_tokens"] > overall["mean_context_tokens"] > 0
    assert overall["build_tokens_per_conversation"] > 0
    run = out / "default"
    assert len(RunFolder(run).answered()) == n and len(RunFolder(run).judged()) == 2 * n
    report = (out / "report.md").read_text(encoding="utf-8")
    assert f"| T-Mem | {n} | 0 |" in report and "## Accuracy per category" in report
    charts = sorted(p.name for p in (out / "charts").glob("*.png"))
    assert charts == ["accuracy_per_category.png", "tokens_vs_accuracy.png"]

    requests = len(eval_server.requests)
    again = cli_json(argv)  # same command: the build is reused, every answer and judgement too
    assert len(eval_server.requests) == requests
    assert [t["answered"] + t["judged"] for t in again["tallies"]] == [0]
    rescored = cli_json(["eval", "report", str(out), "--json"])
    assert len(eval_server.requests) == requests
    assert next(r for r in rescored["results"] if r["category"] == "overall") == overall

    result = evaluate(data=str(data), out=str(out), store=str(store), judge_runs=2)  # the flow: zero calls
    assert len(eval_server.requests) == requests and result["questions"] == n
    with get_client(sync_client=True) as client:
        artifacts = client.read_artifacts(artifact_filter=ArtifactFilter(key=ArtifactFilterKey(any_=[ARTIFACT_KEY])))
    assert artifacts and "## Overall" in str(artifacts[0].data)


def test_the_harness_warns_when_answers_are_judged_by_their_own_model() -> None:
    from tmem.eval.session import same_model_warning
    from tmem.settings import Settings

    shared = Settings(llm_base_url="http://a/v1", llm_model="m")
    assert same_model_warning(shared) is not None and "not independent" in (same_model_warning(shared) or "")
    assert same_model_warning(Settings(llm_base_url="http://a/v1", llm_model="m", llm_judge_model="j")) is None
    other_host = Settings(llm_base_url="http://a/v1", llm_model="m", llm_judge_base_url="http://b/v1")
    assert same_model_warning(other_host) is None


def test_tmem_eval_and_the_flow_share_one_dispatch_of_the_modes() -> None:
    from tmem.eval.ablations import EvalConfigError, eval_configs

    kind, [single] = eval_configs("single", "paper+no-horizon")
    assert (kind, single.preset) == ("paper_no-horizon", "paper+no-horizon")
    kind, ablate = eval_configs("ablate", only=["no-horizon"])
    assert (kind, [c.preset for c in ablate]) == ("ablate", ["default", "no-horizon"])
    kind, sweep = eval_configs("sweep", param="ks", values="1,3")
    assert (kind, len(sweep)) == ("sweep-kS", 2)
    with pytest.raises(EvalConfigError, match="needs sweep_param"):
        eval_configs("sweep")
    with pytest.raises(ValueError, match="unknown mode 'table'"):
        eval_configs("table")


def test_the_harness_answers_with_the_reasoning_field_when_the_setting_asks(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    import argparse

    from tmem.cli.eval_cmd import _options, configure

    parser = argparse.ArgumentParser()
    configure(parser)
    argv = ["locomo", "--data", "x.json", "--store", str(tmp_path)]
    monkeypatch.setenv("TMEM_ANSWER_REASONING", "on")
    reasoned = _options(parser.parse_args(argv)).answer
    assert reasoned.reasoning and reasoned.identity()["reasoning"] is True
    prompt = answer_request(EXAMPLES[0], "CTX", ("Ann", "Bob"), reasoned)
    assert "reasoning" in prompt.response_model.model_fields  # the answer model is asked to reason first
    answer_file = tmp_path / "answer.txt"
    answer_file.write_text("{{memories}}\n{{question}}", encoding="utf-8")
    protocol = _options(parser.parse_args([*argv, "--answer-prompt", str(answer_file)])).answer
    assert not protocol.reasoning  # a protocol's own prompt file is sent as it is
    monkeypatch.setenv("TMEM_ANSWER_REASONING", "off")
    assert not _options(parser.parse_args(argv)).answer.reasoning

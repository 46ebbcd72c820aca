import json

from tmem.devtools import synth
from tmem.prompts import answer
from tmem.prompts.base import render_input


def _request(question: str, context: str) -> dict:
    prompt = answer.build(answer.AnswerInput(conversation_id="c", question=question, context=context))
    return {"messages": [{"role": m.role, "content": m.content} for m in prompt.messages]}


def test_scripted_answer_picks_the_line_sharing_most_words_with_the_question() -> None:
    context = "## Facts\n- [4 Mar 2024] Ana has a severe shellfish allergy.\n- [18 Mar 2024] Ben got promoted to team lead."
    out = json.loads(synth.answer("answer", _request("When did Ben get promoted?", context)))
    assert out["answer"].startswith("[18 Mar 2024] Ben got promoted")


def test_scripted_answer_says_not_mentioned_when_nothing_overlaps() -> None:
    out = json.loads(synth.answer("answer", _request("Who won the chess match?", "## Facts\n- Ana likes pottery.")))
    assert out == {"answer": "Not mentioned"}
    assert render_input({"x": 1}).startswith("<input>")

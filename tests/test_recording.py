"""Replaying a recording of a model's answers through the real openai adapter."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from pydantic import SecretStr

from tmem.devtools.recording import RecordingError, ReplayServer, read_recording, write_recording
from tmem.errors import LLMError
from tmem.prompts import topic_create
from tmem.providers.openai_chat import ChatConfig, OpenAIChatModel


def _prompt(title: str) -> object:
    scene = topic_create.SceneView(date="2023-05-08", title=title, summary="s", narrative="n")
    payload = topic_create.CreateInput(conversation_id="c", scene_ref="S1", scene=scene)
    return topic_create.build(payload)


def _adapter(base_url: str) -> OpenAIChatModel:
    return OpenAIChatModel(ChatConfig(base_url=base_url, api_key=SecretStr("k"), model="m", max_retries=0,
                                      repair_attempts=0))


def test_a_recorded_request_is_answered_and_another_is_refused(tmp_path: Path):
    prompt = _prompt("Ana's pottery class")
    body = _adapter("http://unused/v1").request_body(prompt)
    answer = {"title": "Pottery class", "keywords": [f"k{i}" for i in range(10)]}
    path = tmp_path / "rec.jsonl"
    assert write_recording(path, [{"operation": "topic_create", "messages": body["messages"],
                                   "response_format": body["response_format"], "response": answer}]) == 1
    with ReplayServer(read_recording(path)) as server:
        chat = _adapter(server.base_url)
        assert chat.complete(prompt).model_dump() == topic_create.TopicDraft.model_validate(answer).model_dump()
        with pytest.raises(LLMError, match="not in the recording"):
            chat.complete(_prompt("Something else"))
        assert server.served == 1 and server.missed == ["topic_create"]


def test_a_bad_recording_names_the_line(tmp_path: Path):
    path = tmp_path / "rec.jsonl"
    path.write_text(json.dumps({"messages": [], "response": {}}) + "\n{not json\n", encoding="utf-8")
    with pytest.raises(RecordingError, match=r"rec.jsonl: line 2"):
        read_recording(path)

"""The recording ``make demo`` replays: a capable model's answers to the sample's build and questions.

Two files beside the sample archive: the recording (``examples/sample_recording.jsonl``, the format
of :mod:`tmem.devtools.recording`: one answered request a line) and its manifest
(``examples/sample_recording.json``), which names what the recording is valid for — the archive's
content digest, the prompt version of every operation the demo asks, every setting that changes
the requests the demo sends (or which of them it sends), the demo's questions — and what it is: a
label, the models, the calls and the memory the recorded build made.

:func:`check_recording` compares a manifest with the current checkout and settings: the demo
replays only a recording that matches, and otherwise says in one line what changed
(``recording is stale: item_extract prompt v2 → v3``). Made by ``python -m tmem.demo
--record-through URL`` (:func:`write_manifest`); never used outside the demo and the benchmarks.
"""

from __future__ import annotations

import hashlib
import json
from collections import Counter
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from datetime import datetime
from pathlib import Path
from typing import Any

from tmem.devtools.recording import RecordedAnswer, RecordingError, read_recording
from tmem.settings import Settings

REPO = Path(__file__).resolve().parents[1]
SAMPLE_RECORDING = REPO / "examples" / "sample_recording.jsonl"
MANIFEST_FORMAT = 1
DEMO_PRESET = "default"  # the retrieval preset the demo answers with (Memory.answer's default)
DEFAULT_SOURCE = "a capable model through an OpenAI-compatible endpoint"
RECORD_COMMAND = "python -m tmem.demo --record-through URL"
MAX_REASONS = 4  # shown in the one stale line; the rest are counted


def manifest_path(recording: Path) -> Path:
    """``sample_recording.jsonl`` → ``sample_recording.json``."""
    return recording.with_suffix(".json")


def journal_path(recording: Path) -> Path:
    """Where a recording in progress keeps each answer as it arrives (removed once written)."""
    return recording.with_suffix(".partial.jsonl")


def file_digest(path: Path) -> str:
    return "sha256:" + hashlib.sha256(Path(path).read_bytes()).hexdigest()


def demo_operations() -> frozenset[str]:
    """Every LLM operation the demo can ask: the build's and the answer."""
    from tmem.prompts.operations import BUILD_OPERATIONS

    return BUILD_OPERATIONS | {"answer"}


def request_settings(settings: Settings) -> dict[str, Any]:
    """Every setting that changes the demo's requests, or which of them are sent.

    Construction: the batch sizes (what one request holds), the structured-output mode (the schema
    travels in ``response_format`` or in the prompt), the repair re-asks and the Batch API (a
    recording answers synchronous requests only). Answers: the query embedding model and the
    views it embeds, the retrieval preset with its budgets and the context budget (what goes into
    each answer's context), and answer reasoning. Completion budgets are left out: ``max_tokens``
    is no part of a request's identity, and a cut answer is recorded as cut.
    """
    from tmem.retrieval.config import config_from_settings
    from tmem.views.texts import VIEWS_VERSION

    return {
        "segment_window": settings.segment_window,
        "topic_batch": settings.topic_batch,
        "trigger_batch": settings.trigger_batch,
        "scene_trigger_batch": settings.scene_trigger_batch,
        # absent when 0 (the paper's batches): recordings made before the setting stay valid
        **({"topic_shortlist": settings.topic_shortlist} if settings.topic_shortlist else {}),
        "llm_structured_mode": settings.llm_structured_mode,
        "llm_repair_attempts": settings.llm_repair_attempts,
        "llm_batch": settings.llm_batch,
        "embedding_model": settings.embedding_model,
        "views_version": VIEWS_VERSION,
        "answer_reasoning": settings.answer_reasoning,
        "context_token_budget": settings.context_token_budget,
        "retrieval_preset": DEMO_PRESET,
        "retrieval": config_from_settings(settings, DEMO_PRESET).model_dump(mode="json"),
    }


def current_validity(archive: Path, questions: Sequence[tuple[str, str | None]], settings: Settings) -> dict[str, Any]:
    """What a recording of the demo on ``archive`` must have been made with, as a manifest states it."""
    from tmem.prompts.base import prompt_versions

    operations = demo_operations()
    return {
        "archive": {"name": archive.name, "digest": file_digest(archive)},
        "prompt_versions": {op: v for op, v in prompt_versions().items() if op in operations},
        "settings": request_settings(settings),
        "questions": [{"text": text, "speaker": speaker} for text, speaker in questions],
    }


def _flat(value: Any, prefix: str = "") -> dict[str, Any]:
    if isinstance(value, Mapping):
        out: dict[str, Any] = {}
        for key, inner in value.items():
            out.update(_flat(inner, f"{prefix}{key}."))
        return out
    return {prefix.rstrip("."): value}


def stale_reasons(manifest: Mapping[str, Any], current: Mapping[str, Any]) -> list[str]:
    """What differs between a manifest and the current checkout, worded for one line."""
    reasons: list[str] = []
    recorded_archive = manifest.get("archive") or {}
    if recorded_archive.get("digest") != current["archive"]["digest"]:
        reasons.append(f"{current['archive']['name']} changed since it was recorded")
    recorded_prompts = manifest.get("prompt_versions") or {}
    for op in sorted(set(recorded_prompts) | set(current["prompt_versions"])):
        old, new = recorded_prompts.get(op), current["prompt_versions"].get(op)
        if old != new:
            reasons.append(f"{op} prompt {_version(old)} → {_version(new)}")
    reasons.extend(settings_changes(manifest.get("settings") or {}, current["settings"]))
    if manifest.get("questions") != current["questions"]:
        reasons.append("the demo's questions changed")
    return reasons


def settings_changes(old: Mapping[str, Any], new: Mapping[str, Any]) -> list[str]:
    """``name old → new`` for every request setting (:func:`request_settings`) that differs."""
    before, after = _flat(old), _flat(new)
    return [f"{name} {before.get(name, 'unset')} → {after.get(name, 'unset')}"
            for name in sorted(set(before) | set(after)) if before.get(name, "unset") != after.get(name, "unset")]


def _version(version: object) -> str:
    return "none" if version is None else f"v{version}"


@dataclass(frozen=True)
class RecordingCheck:
    """Whether a recording can be replayed for the demo now, and the one line that says so."""

    usable: bool
    line: str
    manifest: Mapping[str, Any] | None = None
    answers: Mapping[str, RecordedAnswer] | None = None

    @property
    def label(self) -> str:
        return str((self.manifest or {}).get("label") or "")

    @property
    def models(self) -> dict[str, str]:
        """``{role: model name}`` the recorded build and answers used."""
        return {str(k): str(v) for k, v in ((self.manifest or {}).get("models") or {}).items()}


def check_recording(recording: Path, current: Mapping[str, Any]) -> RecordingCheck:
    """Read ``recording`` and its manifest and compare them with ``current`` (:func:`current_validity`)."""
    shown = _shown(recording)
    if not recording.is_file():
        return RecordingCheck(False, f"no recording of a capable model ships with this checkout ({shown})")
    manifest_file = manifest_path(recording)
    try:
        manifest = json.loads(manifest_file.read_text(encoding="utf-8"))
    except FileNotFoundError:
        return RecordingCheck(False, f"recording unusable: its manifest {_shown(manifest_file)} is missing")
    except (OSError, ValueError) as exc:
        return RecordingCheck(False, f"recording unusable: its manifest {_shown(manifest_file)} is unreadable ({exc})")
    if not isinstance(manifest, dict) or manifest.get("format") != MANIFEST_FORMAT:
        return RecordingCheck(False, f"recording unusable: {_shown(manifest_file)} is not a format-{MANIFEST_FORMAT} "
                                     "manifest")
    if manifest.get("recording_digest") != file_digest(recording):
        return RecordingCheck(False, f"recording is stale: {recording.name} is not the file its manifest describes")
    reasons = stale_reasons(manifest, current)
    if reasons:
        more = f" and {len(reasons) - MAX_REASONS} more" if len(reasons) > MAX_REASONS else ""
        return RecordingCheck(False, f"recording is stale: {', '.join(reasons[:MAX_REASONS])}{more}", manifest)
    try:
        answers = read_recording(recording)
    except RecordingError as exc:
        return RecordingCheck(False, f"recording unusable: {exc}", manifest)
    return RecordingCheck(True, str(manifest.get("label") or ""), manifest, answers)


def _shown(path: Path) -> str:
    try:
        return str(path.resolve().relative_to(REPO))
    except ValueError:
        return str(path)


def call_counts(entries: Sequence[Mapping[str, Any]]) -> dict[str, Any]:
    by_operation = Counter(str(e.get("operation") or "unknown") for e in entries)
    answers = by_operation.get("answer", 0)
    return {"build": sum(by_operation.values()) - answers, "answer": answers,
            "by_operation": dict(sorted(by_operation.items()))}


def write_manifest(
    recording: Path,
    entries: Sequence[Mapping[str, Any]],
    current: Mapping[str, Any],
    *,
    source: str,
    models: Mapping[str, str],
    build: Mapping[str, Any],
    recorded_at: datetime,
) -> dict[str, Any]:
    """Write the manifest of ``recording`` (already written, from ``entries``) and return it."""
    calls = call_counts(entries)
    manifest = {
        "format": MANIFEST_FORMAT,
        "label": f"answers recorded from {source} on {recorded_at:%Y-%m-%d}; "
                 f"{calls['build']} build calls, {calls['answer']} answers",
        "source": source,
        "recorded_at": recorded_at.isoformat(timespec="seconds"),
        "recording": recording.name,
        "recording_digest": file_digest(recording),
        **current,
        "models": dict(models),
        "calls": calls,
        "build": dict(build),
        "record_command": RECORD_COMMAND,
    }
    path = manifest_path(recording)
    tmp = path.with_suffix(".json.tmp")
    tmp.write_text(json.dumps(manifest, ensure_ascii=False, indent=1) + "\n", encoding="utf-8")
    tmp.replace(path)
    return manifest

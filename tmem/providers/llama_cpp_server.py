"""The embedded model's server process: llama.cpp's OpenAI-compatible server, plus one bridge.

``python -m tmem.providers.llama_cpp_server --model PATH --port N`` serves ``/v1/chat/completions``
and ``/v1/models`` on 127.0.0.1 with ``llama_cpp.server`` (started and stopped by
:func:`tmem.providers.llama_cpp.local_llm_server`; not meant to be run by hand).

``llama_cpp.server`` constrains generation with a grammar compiled from a JSON schema, but it
takes the schema in the older ``{"type": "json_object", "schema": ...}`` form and refuses
``{"type": "json_schema", ...}`` (HTTP 422). The bridge rewrites the second form into the first,
so tmem's adapter keeps its default ``json_schema`` path and every answer is decoded under the
grammar of its response schema.

Before that, the bridge *tightens* the schema for a tiny model (:func:`tighten_schema`): it
bounds every string and list (a 135M model otherwise repeats itself until ``max_tokens`` cuts
the JSON), and, for tmem's own operations (named by the ``X-Tmem-Operation`` header), it
restricts the reference fields to the refs that the request's ``<input>`` block offers, and the
per-host answer lists to exactly one entry per input ref, in order. A tightened schema only
ever accepts a subset of what the original accepts, so every answer still validates against
the response model; what changes is that the tiny model cannot invent a turn id or skip a host.
"""

from __future__ import annotations

import argparse
import copy
import json
import logging
import os
import re
import threading
import time
from collections.abc import Callable
from typing import Any

from tmem.prompts.base import INPUT_OPEN, parse_input
from tmem.prompts.common import EXAMPLE_HEADER

log = logging.getLogger(__name__)

OPERATION_HEADER = b"x-tmem-operation"
MAX_STRING_CHARS = 320  # longest string the grammar lets a tiny model write (a narrative fits)
MAX_LIST_ITEMS = 6  # longest list, unless the response model asks for more (raised to minItems)
ISO_DATE_PATTERN = r"^[0-9]{4}-[0-9]{2}-[0-9]{2}$"
# Shorter caps by field name (strings, or the strings of a list): a tiny model that starts
# copying a dialogue line into a title is stopped where a title should end.
FIELD_CHARS = {
    "title": 80, "keywords": 40, "new_keywords": 40, "entities": 48, "summary": 240, "content": 200,
    "situation": 160, "object": 160, "event": 160, "emotion": 160, "rationale": 160, "answer": 160,
    "identity": 80, "preferences": 80, "traits": 80, "relations": 80, "fact": 100,
}

Schema = dict[str, Any]


def inline_refs(schema: Schema) -> Schema:
    """A copy of a pydantic JSON schema with every local ``$ref`` replaced by its definition.

    Needed because a grammar converter reads only the ``$ref`` of a property that has one, so a
    constraint added beside it would be ignored. tmem's response models are not recursive.
    """
    defs: dict[str, Any] = schema.get("$defs", {})

    def visit(node: Any) -> Any:
        if isinstance(node, dict):
            ref = node.get("$ref")
            if isinstance(ref, str) and ref.startswith("#/$defs/"):
                merged = {k: v for k, v in node.items() if k != "$ref"}
                merged.update(visit(copy.deepcopy(defs[ref.removeprefix("#/$defs/")])))
                return merged
            return {k: visit(v) for k, v in node.items() if k != "$defs"}
        if isinstance(node, list):
            return [visit(v) for v in node]
        return node

    result: Schema = visit(schema)
    return result


def _bound(node: Any) -> None:
    """Cap every string's length and every list's size, in place (keeping each minimum reachable)."""
    if isinstance(node, list):
        for value in node:
            _bound(value)
        return
    if not isinstance(node, dict):
        return
    if node.get("type") == "string" and "enum" not in node and "const" not in node and "pattern" not in node:
        node["maxLength"] = min(node.get("maxLength", MAX_STRING_CHARS), MAX_STRING_CHARS)
    if node.get("type") == "array" and "prefixItems" not in node:
        cap = max(node.get("minItems", 0), MAX_LIST_ITEMS)
        node["maxItems"] = min(node.get("maxItems", cap), cap)
    for name, prop in node.get("properties", {}).items():
        if name in FIELD_CHARS and isinstance(prop, dict):
            target = prop.get("items", prop) if prop.get("type") == "array" else prop
            if target.get("type") == "string" and "enum" not in target and "const" not in target:
                target["maxLength"] = min(target.get("maxLength", FIELD_CHARS[name]), FIELD_CHARS[name])
    for value in node.values():
        _bound(value)


def _prop(schema: Schema, *path: str) -> Schema:
    """The sub-schema at ``path`` (property names; ``[]`` steps into a list's items)."""
    node = schema
    for step in path:
        node = node["items"] if step == "[]" else node["properties"][step]
    return node


def _enum(node: Schema, values: list[str]) -> None:
    node.clear()
    node.update({"type": "string", "enum": values})


def _one_per_ref(array: Schema, refs: list[str]) -> None:
    """Turn a list of ``{ref, ...}`` answers into a tuple: one entry per ref, in input order."""
    if not refs:
        return
    item = array["items"]
    entries = []
    for ref in refs:
        entry = copy.deepcopy(item)
        entry["properties"]["ref"] = {"type": "string", "const": ref}
        entries.append(entry)
    array.clear()
    array.update({"type": "array", "prefixItems": entries, "minItems": len(refs), "maxItems": len(refs)})


def _refs(data: dict[str, Any], key: str) -> list[str]:
    return [str(entry["ref"]) for entry in data.get(key, [])]


def _date(node: Schema) -> None:
    """``YYYY-MM-DD`` or null, instead of any string."""
    node.clear()
    node.update({"anyOf": [{"type": "string", "pattern": ISO_DATE_PATTERN}, {"type": "null"}]})


def _scene_boundaries(schema: Schema, data: dict[str, Any]) -> None:
    new_ids = [str(t["id"]) for block in data.get("new_turns", []) for t in block.get("turns", [])]
    if new_ids:
        _enum(_prop(schema, "closed", "[]", "last_turn"), new_ids)
    # One close per window: with short windows a scene rarely closes twice in one, and two
    # closes at the same turn (a tiny model's favourite) would be rejected.
    _prop(schema, "closed")["maxItems"] = 1


def _scene_pack(schema: Schema, data: dict[str, Any]) -> None:
    _one_per_ref(_prop(schema, "scenes"), _refs(data, "scenes"))


_WORD = re.compile(r"[A-Za-z][A-Za-z'-]{2,}")
_COMMON = frozenset(
    "the and for that this with was were are has have had not but you your they them their she her his him from "
    "what when where which who will would can could should about there here then than just also very into out over "
    "some any all our its been being did does get got like one two really said told asked".split()
)


def scene_words(scene: dict[str, Any]) -> list[str]:
    """Distinct content words of a scene view (title, summary, narrative), in order of appearance."""
    seen: dict[str, str] = {}
    for field in ("title", "summary", "narrative"):
        for word in _WORD.findall(str(scene.get(field, ""))):
            key = word.lower().strip("'-")
            if key not in _COMMON and key not in seen:
                seen[key] = word.strip("'-")
    return list(seen.values())


def _topic_create(schema: Schema, data: dict[str, Any]) -> None:
    """Keywords from the scene's own words, distinct by construction: slot i of the ten may take
    only the words at positions i, i+10, i+20... A tiny model otherwise repeats one keyword ten
    times, and a topic needs ten distinct ones."""
    keywords = _prop(schema, "keywords")
    slots = int(keywords.get("minItems", 0))
    words = scene_words(data["scene"])
    if slots < 1 or len(words) < slots:
        return
    keywords.clear()
    keywords.update({
        "type": "array",
        "prefixItems": [{"type": "string", "enum": words[i::slots]} for i in range(slots)],
        "minItems": slots,
        "maxItems": slots,
    })


def _topic_match(schema: Schema, data: dict[str, Any]) -> None:
    refs = _refs(data, "topics") + [str(t["ref"]) for t in data.get("other_topics") or []]
    admitted = _prop(schema, "admitted")
    if refs:
        _enum(_prop(schema, "admitted", "[]", "ref"), refs)
        admitted["maxItems"] = min(2, len(refs))
    if not data.get("may_open_new", False):
        schema["properties"]["new_topic"] = {"type": "null"}


def _item_extract(schema: Schema, data: dict[str, Any]) -> None:
    refs = _refs(data, "scenes")
    item = _prop(schema, "items", "[]")
    # Atomic items only: one fact, one source scene. Linking scenes is beyond a tiny model.
    item["properties"]["kind"] = {"type": "string", "const": "atomic"}
    sources = item["properties"]["sources"]
    sources.update({"minItems": 1, "maxItems": 1})
    if refs:
        sources["items"] = {"type": "string", "enum": refs}
    _date(item["properties"]["when"])  # a day or null: months, years and spans are beyond a tiny model
    turn_ids = [str(t["id"]) for scene in data.get("scenes", []) for block in scene.get("dialogue", [])
                for t in block.get("turns", [])]
    if turn_ids:
        item["properties"]["said_in"] = {"anyOf": [{"type": "string", "enum": turn_ids}, {"type": "null"}]}
    _prop(schema, "items").update({"minItems": 1, "maxItems": 4})


def _item_triggers(schema: Schema, data: dict[str, Any]) -> None:
    item = _prop(schema, "items", "[]")
    item["properties"]["entities"]["maxItems"] = 3
    item["properties"]["bridges"]["maxItems"] = 2
    _one_per_ref(_prop(schema, "items"), _refs(data, "items"))


def _scene_triggers(schema: Schema, data: dict[str, Any]) -> None:
    _one_per_ref(_prop(schema, "scenes"), _refs(data, "scenes"))


def _persona(schema: Schema, data: dict[str, Any]) -> None:
    for name in ("identity", "preferences", "traits", "relations", "timeline"):
        _prop(schema, name)["maxItems"] = 4


OPERATION_RULES: dict[str, Callable[[Schema, dict[str, Any]], None]] = {
    "scene_boundaries": _scene_boundaries,
    "scene_pack": _scene_pack,
    "topic_create": _topic_create,
    "topic_match": _topic_match,
    "item_extract": _item_extract,
    "item_triggers": _item_triggers,
    "scene_triggers": _scene_triggers,
    "persona": _persona,
}


def tighten_schema(operation: str | None, schema: Schema, data: Any) -> Schema:
    """The schema a tiny model decodes under: bounded, and bound to the input's refs when known.

    ``data`` is the request's input block (or ``None``); an unknown operation, or an input of
    an unexpected shape, gets the bounds only.
    """
    tight = inline_refs(schema)
    _bound(tight)
    rule = OPERATION_RULES.get(operation or "")
    if rule is not None and isinstance(data, dict):
        try:
            rule(tight, data)
        except (KeyError, TypeError, AttributeError) as exc:  # a schema or input of another shape: bounds only
            log.warning("schema of %s not tightened (%s: %s)", operation, type(exc).__name__, exc)
            tight = inline_refs(schema)
            _bound(tight)
    return tight


def request_data(body: dict[str, Any]) -> Any:
    """The ``<input>`` block of the request's last user message that has one, else ``None``."""
    for message in reversed(body.get("messages", [])):
        content = message.get("content")
        if message.get("role") == "user" and isinstance(content, str) and INPUT_OPEN in content:
            try:
                return parse_input(content)
            except ValueError:  # a malformed block (json.JSONDecodeError is a ValueError)
                return None
    return None


# llama-cpp-python's converter lets a JSON string hold raw control characters (a newline typed
# inside a string), which is not JSON: the strict rule of upstream llama.cpp excludes them.
LOOSE_CHAR = 'char ::= [^"\\\\] |'
STRICT_CHAR = 'char ::= [^"\\\\\\x7F\\x00-\\x1F] |'


def schema_grammar(schema: Schema) -> str:
    """The GBNF grammar of ``schema``, with JSON's rule for string characters."""
    from llama_cpp.llama_grammar import json_schema_to_gbnf

    grammar: str = json_schema_to_gbnf(json.dumps(schema))
    return grammar.replace(LOOSE_CHAR, STRICT_CHAR)


def drop_shape_example(content: str) -> str:
    """A system message without its "example of the shape" paragraph.

    Measured on SmolLM2-135M: with the example present, most answers copied its made-up content
    word for word (a persona of "a nurse in Leeds", a topic "Ana's move to Lisbon" for a chat about
    an adoption). Under a grammar the example teaches nothing the schema does not enforce.
    """
    start = content.find("\n\n" + EXAMPLE_HEADER)
    if start < 0:
        return content
    end = content.find("\n\n", start + 2)
    return content[:start] + (content[end:] if end >= 0 else "")


def rewrite_request(raw: bytes, operation: str | None) -> bytes:
    """A chat request whose ``json_schema`` response format becomes llama.cpp's ``json_object`` +
    ``schema``, tightened for the operation; any other request is returned unchanged."""
    try:
        body = json.loads(raw)
    except ValueError:
        return raw
    fmt = body.get("response_format") if isinstance(body, dict) else None
    if not isinstance(fmt, dict) or fmt.get("type") != "json_schema":
        return raw
    schema = (fmt.get("json_schema") or {}).get("schema")
    if not isinstance(schema, dict):
        body["response_format"] = {"type": "json_object"}
    else:
        tight = tighten_schema(operation, schema, request_data(body))
        try:
            body["grammar"] = schema_grammar(tight)
            del body["response_format"]
        except (ValueError, KeyError, TypeError, AssertionError, RecursionError) as exc:
            log.warning("no grammar for the schema of %s (%s: %s): llama.cpp converts it", operation,
                        type(exc).__name__, exc)
            body["response_format"] = {"type": "json_object", "schema": tight}
        for message in body.get("messages", []):
            if message.get("role") == "system" and isinstance(message.get("content"), str):
                message["content"] = drop_shape_example(message["content"])
    return json.dumps(body).encode()


class JsonSchemaBridge:
    """ASGI middleware applying :func:`rewrite_request` to ``POST .../chat/completions``."""

    def __init__(self, app: Any) -> None:
        self.app = app
        self.calls = 0

    async def __call__(self, scope: dict[str, Any], receive: Any, send: Any) -> None:
        if scope.get("type") != "http" or scope.get("method") != "POST" or not str(
            scope.get("path", "")
        ).endswith("/chat/completions"):
            await self.app(scope, receive, send)
            return
        chunks: list[bytes] = []
        more = True
        while more:
            message = await receive()
            chunks.append(message.get("body", b""))
            more = bool(message.get("more_body", False))
        headers = dict(scope.get("headers", []))
        operation = headers[OPERATION_HEADER].decode() if OPERATION_HEADER in headers else None
        body = rewrite_request(b"".join(chunks), operation)
        scope = dict(scope)
        scope["headers"] = [(k, v) for k, v in scope.get("headers", []) if k != b"content-length"] + [
            (b"content-length", str(len(body)).encode())
        ]
        replayed = False
        started = time.perf_counter()
        answer: list[bytes] = []

        async def replay() -> dict[str, Any]:
            nonlocal replayed
            if not replayed:
                replayed = True
                return {"type": "http.request", "body": body, "more_body": False}
            result: dict[str, Any] = await receive()
            return result

        async def send_and_count(message: dict[str, Any]) -> None:
            if message.get("type") == "http.response.body":
                answer.append(message.get("body", b""))
                if not message.get("more_body", False):
                    self._report(operation, time.perf_counter() - started, b"".join(answer))
            await send(message)

        await self.app(scope, replay, send_and_count)

    def _report(self, operation: str | None, seconds: float, answer: bytes) -> None:
        """One progress line per call on stdout (the server log), read by the demo."""
        self.calls += 1
        try:
            tokens = json.loads(answer).get("usage", {}).get("completion_tokens", "?")
        except (ValueError, AttributeError):
            tokens = "?"
        print(f"tmem-call {self.calls} {operation or '-'} {seconds:.1f} {tokens}", flush=True)


def create_app(model_path: str, alias: str, n_ctx: int, n_threads: int) -> Any:
    """llama.cpp's FastAPI app for one model, wrapped in the :class:`JsonSchemaBridge`."""
    from llama_cpp.server.app import create_app as llama_app
    from llama_cpp.server.settings import ModelSettings, ServerSettings

    model = ModelSettings(
        model=model_path,
        model_alias=alias,
        n_ctx=n_ctx,
        n_threads=n_threads,
        n_threads_batch=n_threads,
        n_batch=512,
        verbose=False,
    )
    server = ServerSettings(host="127.0.0.1", port=0, interrupt_requests=False)
    return JsonSchemaBridge(llama_app(server_settings=server, model_settings=[model]))


def _exit_with_parent() -> None:
    """Stop when the tmem process that started this server is gone, even if it was killed
    without running its clean-up (its ``with`` block stops the server otherwise)."""
    parent = os.getppid()

    def watch() -> None:
        while os.getppid() == parent:
            time.sleep(1.0)
        os._exit(0)

    threading.Thread(target=watch, name="exit-with-parent", daemon=True).start()


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="python -m tmem.providers.llama_cpp_server", description=__doc__.split("\n")[0])
    parser.add_argument("--model", required=True, help="path to a GGUF file")
    parser.add_argument("--alias", required=True, help="the model name the server answers to")
    parser.add_argument("--port", type=int, required=True)
    parser.add_argument("--n-ctx", type=int, default=8192)
    parser.add_argument("--n-threads", type=int, default=2)
    args = parser.parse_args(argv)
    _exit_with_parent()
    import uvicorn

    app = create_app(args.model, args.alias, args.n_ctx, args.n_threads)
    uvicorn.run(app, host="127.0.0.1", port=args.port, log_level="warning")


if __name__ == "__main__":
    main()

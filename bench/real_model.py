"""Quality on memory built by a real model: build through any OpenAI-compatible endpoint, then measure.

A measuring loop, not a test: the endpoint is whatever ``TMEM_LLM_*`` names (a hosted model, a
local server, or ``../shared/tools/model-bridge``, whose answers are written by capable models).

    # 1. an archive: a LoCoMo conversation with LoCoMo-Plus cues stitched in (one build measures both)
    python bench/real_model.py stitch --host conv-30 --cues 16 --out runs/conv30
    # 2. build it through the endpoint (or --replay a recording: zero model calls)
    python bench/real_model.py build --archive runs/conv30/archive.json --store runs/conv30/store
    # 3. measure: evidence recall, cue recall (k and equal-token budgets), channels, construction health
    python bench/real_model.py eval --store runs/conv30/store --data runs/conv30/archive.json \
        --cues runs/conv30/cue_questions.json --build-json runs/conv30/store/build.json --label conv30
    # a bridge queue as a recording (replayable while prompts are unchanged; answer sizes vs budgets)
    python bench/real_model.py record QUEUE --out runs/conv30/build_calls.jsonl

``eval`` prints the tables and writes ``bench/results/real_model_<label>.json``. Figures from a
build through the bridge are quoted as "built by a capable model through the bridge".
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import subprocess
import sys
import time
from collections import Counter
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]
DATA = REPO.parent / "shared" / "datasets"
RESULTS = REPO / "bench" / "results"
KS = (1, 3, 5, 10)
BUDGETS = (500, 1000, 2000)


def _env() -> dict[str, str]:
    env = dict(os.environ)
    env.setdefault("HF_HUB_OFFLINE", "1")
    env.setdefault("TRANSFORMERS_OFFLINE", "1")
    env.setdefault("PREFECT_SERVER_ANALYTICS_ENABLED", "false")
    env.setdefault("DO_NOT_TRACK", "1")
    return env


# --------------------------------------------------------------------------- stitch


def cmd_stitch(args: argparse.Namespace) -> int:
    from tmem.eval.cue_stitch import stitch_cues, write_cue_stitch

    stitch = stitch_cues(args.locomo, args.plus, args.host, cues=args.cues,
                         item_indices=[int(i) for i in args.items.split(",")] if args.items else None)
    archive, cues = write_cue_stitch(stitch, args.out)
    print(json.dumps({"conversation_id": stitch.conversation_id, "archive": str(archive), "cue_questions": str(cues),
                      "cues": [e.extra["plus_index"] for e in stitch.cue_examples], "defects": stitch.defects.counts}))
    return 0


# --------------------------------------------------------------------------- record


def read_queue(queue: Path) -> list[dict[str, Any]]:
    """A bridge queue (req-N.json + resp-N.json) as recorded requests, in request order."""
    entries = []
    for req in sorted(queue.glob("req-*.json")):
        n = req.stem.removeprefix("req-")
        resp = queue / f"resp-{n}.json"
        if not resp.exists():
            continue
        body = json.loads(req.read_text(encoding="utf-8"))["request"]
        text = resp.read_text(encoding="utf-8")
        fmt = body.get("response_format") or {}
        cap = body.get("max_completion_tokens") or body.get("max_tokens")
        try:
            response: Any = json.loads(text)
        except json.JSONDecodeError:
            response = text
        entries.append({
            "n": int(n), "operation": (fmt.get("json_schema") or {}).get("name") or "unknown",
            "messages": body.get("messages", []), "response_format": fmt, "response": response,
            "max_tokens": cap, "answer_tokens": len(text) // 4,
        })
    return entries


def cmd_record(args: argparse.Namespace) -> int:
    from tmem.devtools.recording import write_recording

    entries = read_queue(args.queue)
    write_recording(args.out, entries)
    ops = Counter(e["operation"] for e in entries)
    over = [(e["n"], e["operation"], e["answer_tokens"], e["max_tokens"]) for e in entries
            if e["max_tokens"] and e["answer_tokens"] > e["max_tokens"]]
    print(json.dumps({"recorded": len(entries), "by_operation": dict(sorted(ops.items())),
                      "answers_over_their_max_tokens": over}, indent=1))
    return 0


# --------------------------------------------------------------------------- build


def _forwarding_replay(recording: Path, upstream: str | None) -> Any:
    """A replay server that answers recorded requests and, with ``upstream``, sends every other one
    there (an OpenAI-compatible URL, e.g. the bridge) and records its answer: a prompt change then
    costs only the requests it changes."""
    import urllib.request

    from tmem.devtools.recording import RecordedAnswer, ReplayServer, read_recording, request_key

    class Forwarding(ReplayServer):
        def answer(self, body: Any) -> tuple[int, dict[str, Any]]:
            key = request_key(body.get("messages") or [], body.get("response_format"))
            if key in self.answers or upstream is None:
                return super().answer(body)
            request = urllib.request.Request(upstream.rstrip("/") + "/chat/completions", method="POST",
                                             data=json.dumps(body).encode(), headers={"Content-Type": "application/json"})
            with urllib.request.urlopen(request, timeout=6000) as reply:
                payload = json.loads(reply.read())
            choice = payload["choices"][0]
            with self._lock:
                self.answers[key] = RecordedAnswer("forwarded", choice["message"]["content"], choice["finish_reason"])
                self.forwarded += 1
            return 200, payload

    server = Forwarding(read_recording(recording) if recording.exists() else {})
    server.forwarded = 0
    return server


def cmd_build(args: argparse.Namespace) -> int:
    env = _env()
    env.setdefault("PREFECT_HOME", str(args.store / "prefect-home"))
    tmem = [sys.executable, "-m", "tmem"]
    subprocess.run([*tmem, "ingest", str(args.archive), "--store", str(args.store), "--json"], check=True, env=env)
    replay = None
    if args.replay is not None:
        replay = _forwarding_replay(args.replay, args.upstream).__enter__()
        env.update(TMEM_LLM_BASE_URL=replay.base_url, TMEM_LLM_API_KEY="replay", TMEM_LLM_PROVIDER="openai")
        env.setdefault("TMEM_LLM_MODEL", "capable-bridge")
    started = time.perf_counter()
    try:
        done = subprocess.run([*tmem, "build", "--store", str(args.store), "--json"], env=env, capture_output=True,
                              text=True)
    finally:
        if replay is not None:
            print(f"replay: served {replay.served}, forwarded {replay.forwarded}, not in the recording "
                  f"{len(replay.missed)} {Counter(replay.missed).most_common()}", file=sys.stderr)
            replay.__exit__(None, None, None)
    (args.store / "build.json").write_text(done.stdout, encoding="utf-8")
    sys.stderr.write(done.stderr[-3000:])
    print(f"build exit {done.returncode} in {time.perf_counter() - started:.0f} s; report: {args.store / 'build.json'}")
    return done.returncode


# --------------------------------------------------------------------------- eval


def variant_config(memory: Any, spec: str) -> Any:
    """``preset`` or ``preset@field=value;field=value`` (e.g. ``default@trigger_gate_z=2.5``)."""
    name, _, overrides = spec.partition("@")
    config = memory.config(name)
    changes: dict[str, Any] = {}
    for part in filter(None, overrides.split(";")):
        key, _, value = part.partition("=")
        field = type(config).model_fields.get(key)
        if field is None:
            raise SystemExit(f"unknown retrieval field {key!r} in {spec!r}")
        changes[key] = value if field.annotation in (str,) or not value.replace(".", "").replace("-", "").isdigit() \
            else (float(value) if "." in value else int(value))
    return config.with_(name=spec, **changes) if changes else config


class Reindexed:
    """The store's built memory with its views embedded anew by this checkout's rules (no LLM call):
    measures a change of views or index on memory built before it. ``scene_triggers``: a file of
    scene triggers (``retrigger``) replacing the stored ones, to compare one prompt on the same scenes."""

    def __init__(self, store: Path, embedder: Any, scene_triggers: Path | None = None) -> None:
        self.store, self.embedder, self.scene_triggers = store, embedder, scene_triggers
        self._indexes: dict[str, Any] = {}
        self._memories: dict[str, Any] = {}
        self._rows: dict[str, Any] = {}

    def memory(self, conversation_id: str) -> Any:
        self.index(conversation_id)
        return self._memories[conversation_id]

    def rows(self, conversation_id: str) -> Any:
        """The embedded rows as a column view (owner_kinds, owner_ids, views, ordinals, vectors)."""
        from types import SimpleNamespace

        import numpy as np

        self.index(conversation_id)
        rows = self._rows[conversation_id]
        return SimpleNamespace(owner_kinds=[r.owner_kind for r in rows], owner_ids=[r.owner_id for r in rows],
                               views=[r.view for r in rows], ordinals=[r.ordinal for r in rows],
                               vectors=np.vstack([r.vector for r in rows]))

    def index(self, conversation_id: str, **_: Any) -> Any:
        from tmem.build.embed_views import embed_memory_views
        from tmem.retrieval.index import VectorBundle, build_index
        from tmem.store.conversations import load_turns
        from tmem.store.duck import connect
        from tmem.store.memory_rows import read_memory

        if conversation_id not in self._indexes:
            con = connect(self.store, read_only=True)
            try:
                memory, turns = read_memory(con, conversation_id), load_turns(con, conversation_id)
            finally:
                con.close()
            if self.scene_triggers is not None:
                from tmem.domain import SceneTriggers

                rows = json.loads(self.scene_triggers.read_text(encoding="utf-8"))
                memory = memory.model_copy(update={"scene_triggers": tuple(SceneTriggers(**r) for r in rows)})
            rows = embed_memory_views(memory, {t.turn_id: t for t in turns}, self.embedder)
            self._memories[conversation_id] = memory
            self._rows[conversation_id] = rows
            bundle = VectorBundle.from_columns([r.owner_kind for r in rows], [r.owner_id for r in rows],
                                               [r.view for r in rows], [r.ordinal for r in rows],
                                               [r.vector for r in rows])
            self._indexes[conversation_id] = build_index(
                conversation_id, memory.scenes, memory.topics, memory.items, memory.item_triggers,
                memory.scene_triggers, memory.personas, turns, bundle)
        return self._indexes[conversation_id]


class MaskedCues:
    """One index per cue question, the other cues' scenes (and the items, triggers and topic links that
    come only from them) left out: the protocol's condition (one cue among its host's scenes) measured
    on one build. Without it every trigger also competes with the other stitched cues, short exchanges
    of one genre ("I did X after Y, and now ...") that crowd each other out; ``--cue-condition``
    reports both. Index lookups go by an alias id ``<conversation>#<qid>``."""

    def __init__(self, store: Path, embedder: Any, cue_examples: list[Any], reindex: Reindexed | None) -> None:
        from tmem.query.memory import Memory
        from tmem.settings import load_settings

        self.memory = Memory.open(store, load_settings(store=store), embedder=embedder)
        self.snapshot = self.memory.snapshot()
        self.reindex = reindex
        self.cue_turns = {e.qid: set(e.evidence) for e in cue_examples}
        self._indexes: dict[str, Any] = {}

    @staticmethod
    def alias(example: Any) -> str:
        return f"{example.conversation_id}#{example.qid}"

    def others(self, alias: str) -> set[str]:
        qid = alias.split("#", 1)[1]
        return {t for other, turns in self.cue_turns.items() if other != qid for t in turns}

    def turns(self, alias: str) -> tuple[Any, ...]:
        reader = self.snapshot.reader
        _, turns = reader.read_conversation(alias.split("#", 1)[0])
        hidden = self.others(alias)
        return tuple(t for t in turns if t.turn_id not in hidden)

    def index(self, alias: str, **_: Any) -> Any:
        from tmem.retrieval.index import VectorBundle, build_index

        if alias in self._indexes:
            return self._indexes[alias]
        cid, hidden = alias.split("#", 1)[0], self.others(alias)
        full = self.reindex.index(cid) if self.reindex is not None else self.snapshot.index(cid)
        reader = self.snapshot.reader
        memory, turns = reader.read_conversation(cid)
        if self.reindex is not None:
            memory = self.reindex.memory(cid)
        gone = {s.scene_id for s in memory.scenes if set(s.turn_ids) <= hidden}
        items = [i.model_copy(update={"source_scene_ids": tuple(x for x in i.source_scene_ids if x not in gone)})
                 for i in memory.items if set(i.source_scene_ids) - gone]
        kept_items = {i.item_id for i in items}
        topics = [t.model_copy(update={"scene_ids": tuple(s for s in t.scene_ids if s not in gone)})
                  for t in memory.topics]
        topics = [t for t in topics if t.scene_ids]
        owners = {s.scene_id for s in memory.scenes} - gone | kept_items | {t.topic_id for t in topics}
        rows = self.reindex.rows(cid) if self.reindex is not None else reader.read_vector_rows(cid)
        keep = [k for k, owner in enumerate(rows.owner_ids) if owner in owners]
        bundle = VectorBundle.from_columns([rows.owner_kinds[k] for k in keep], [rows.owner_ids[k] for k in keep],
                                           [rows.views[k] for k in keep], [rows.ordinals[k] for k in keep],
                                           rows.vectors[keep] if keep else rows.vectors[:0])
        index = build_index(
            alias, [s.model_copy(update={"conversation_id": alias}) for s in memory.scenes if s.scene_id not in gone],
            [t.model_copy(update={"conversation_id": alias}) for t in topics],
            [i.model_copy(update={"conversation_id": alias}) for i in items],
            [t.model_copy(update={"conversation_id": alias}) for t in memory.item_triggers if t.item_id in kept_items],
            [t.model_copy(update={"conversation_id": alias}) for t in memory.scene_triggers if t.scene_id not in gone],
            [p.model_copy(update={"conversation_id": alias}) for p in memory.personas],
            [t.model_copy(update={"conversation_id": alias}) for t in turns], bundle)
        del full
        self._indexes[alias] = index
        return index


def _snapshot(memory: Any, reindex: Reindexed | None) -> Any:
    return reindex if reindex is not None else memory.snapshot()


def _systems(store: Path, presets: list[str], vectors: Any, turns: dict[str, Any], budget_k: int,
             reindex: Reindexed | None = None) -> list[Any]:
    from tmem.eval.baselines import baseline
    from tmem.eval.tmem_system import TmemRetriever, TmemSearcher
    from tmem.query.memory import Memory
    from tmem.settings import load_settings

    memory = Memory.open(store, load_settings(store=store), embedder=vectors.embedder)
    systems: list[Any] = []
    for p in presets:
        searcher = TmemSearcher(memory, p, vectors, budget_k=budget_k, config=variant_config(memory, p))
        if reindex is not None:
            searcher.snapshot = reindex
        systems.append(TmemRetriever(searcher))
    return [*systems, baseline("flat", turns.__getitem__, vectors)]


def _recall_table(examples: list[Any], systems: list[Any]) -> dict[str, Any]:
    from tmem.eval.retrieval_metrics import evaluate_retrieval, rows_frame, summarise

    rows = evaluate_retrieval(examples, systems, ks=KS, budgets=BUDGETS)
    summary = summarise(rows_frame(rows))
    out: dict[str, Any] = {}
    for r in summary.to_dicts():
        if r["category"] != "all":
            continue
        key = f"{r['mode']}@{r['cut']}"
        out.setdefault(r["system"], {})[key] = {"recall": round(r["recall"], 3), "tokens": round(r["mean_tokens"])}
    return out


def _diagnose(store: Path, preset: str, vectors: Any, examples: list[Any], k: int,
              reindex: Reindexed | None = None) -> dict[str, Any]:
    from tmem.eval.diagnostics import diagnose, summarise
    from tmem.query.memory import Memory
    from tmem.retrieval.cascade import search
    from tmem.settings import load_settings

    memory = Memory.open(store, load_settings(store=store), embedder=vectors.embedder)
    snapshot = _snapshot(memory, reindex)
    config = variant_config(memory, preset).with_(k_scenes=k, k_items=k)
    found = []
    for e in examples:
        index = snapshot.index(e.conversation_id)
        result = search(index, e.question, vectors.vector(e.question), config, speaker=e.speaker, trace=True)
        found.append(diagnose(index, e, result))
    return summarise(found).as_dict()


def _crowding(store: Path, preset: str, vectors: Any, examples: list[Any], k: int,
              reindex: Reindexed | None = None) -> dict[str, Any]:
    """All cues in one memory: how often another stitched cue's scene takes a cue's place in the top k."""
    from tmem.eval.diagnostics import cue_crowding, evidence_scenes
    from tmem.query.memory import Memory
    from tmem.retrieval.cascade import search
    from tmem.settings import load_settings

    memory = Memory.open(store, load_settings(store=store), embedder=vectors.embedder)
    snapshot = _snapshot(memory, reindex)
    config = variant_config(memory, preset).with_(k_scenes=k, k_items=k)
    index = snapshot.index(examples[0].conversation_id)
    own = [{index.scenes.ids[i] for i in evidence_scenes(index, e.evidence)} for e in examples]
    returned = [[s.scene_id for s in search(index, e.question, vectors.vector(e.question), config,
                                            speaker=e.speaker).scenes] for e in examples]
    return cue_crowding(own, returned, set().union(*own), index.n_scenes).as_dict()


def _memory_shape(store: Path, vectors: Any, conversation_id: str, cue_examples: list[Any],
                  reindex: Reindexed | None = None) -> dict[str, Any]:
    from statistics import median

    from tmem.query.memory import Memory
    from tmem.settings import load_settings

    memory = Memory.open(store, load_settings(store=store), embedder=vectors.embedder)
    index = _snapshot(memory, reindex).index(conversation_id)
    sizes = [len(t) for t in index.scenes.turn_ids]
    horizons = int(index.scenes.hor_owner.size)
    cue_scenes = []
    for e in cue_examples:
        cue = set(e.evidence)
        holding = [turns for turns in index.scenes.turn_ids if cue & set(turns)]
        cue_scenes.append({"cue": e.extra.get("plus_index"), "scenes": len(holding),
                           "own_scene": len(holding) == 1 and set(holding[0]) == cue,
                           "scene_turns": [len(t) for t in holding]})
    return {
        "scenes": index.n_scenes, "topics": index.n_topics, "items": index.n_items,
        "connected_items": sum(1 for k in index.items.kinds if k == "connected"),
        "scene_turns_median": median(sizes) if sizes else 0, "scenes_of_3_turns_or_fewer": sum(s <= 3 for s in sizes),
        "horizon_sentences": horizons, "horizon_fill": round(horizons / max(1, 5 * index.n_scenes), 3),
        "cues_in_their_own_scene": sum(c["own_scene"] for c in cue_scenes), "cue_scenes": cue_scenes,
    }


def cmd_eval(args: argparse.Namespace) -> int:
    from tmem.settings import apply_process_defaults

    apply_process_defaults()
    from tmem.bundle import embedder_for
    from tmem.cli.eval_retrieval import check_evidence, store_turns
    from tmem.eval.datasets import load_locomo_qa
    from tmem.eval.retrieval_metrics import VectorMemo
    from tmem.settings import load_settings

    started = time.perf_counter()
    presets = [p for p in args.presets.split(",") if p]
    vectors = VectorMemo(embedder_for(load_settings(store=args.store), None))
    if args.window_turns is not None:  # a dialogue-window size to compare (with --reindex)
        import tmem.build.embed_views

        tmem.build.embed_views.DIALOGUE_WINDOW_TURNS = args.window_turns or None  # type: ignore[misc]
    reindex = Reindexed(args.store, vectors.embedder, args.scene_triggers) if args.reindex else None
    parts: dict[str, Any] = {}
    sets = {"evidence": load_locomo_qa(args.data)[0]}
    if args.cues is not None:
        sets["cue"] = load_locomo_qa(args.cues)[0]
    conversation_id = sets["evidence"][0].conversation_id
    turns = store_turns(args.store, [conversation_id])
    if "cue" in sets:  # the cue questions a second time, each against its host and its own cue only
        sets["cue_alone"] = sets["cue"]
    for name, examples in sets.items():
        examples, _ = check_evidence(examples, turns)
        examples = [e for e in examples if e.evidence]
        vectors.prefetch(e.question for e in examples)
        source: Any = reindex
        known = dict(turns)
        if name == "cue_alone":
            masked = MaskedCues(args.store, vectors.embedder, examples, reindex)
            examples = [dataclasses.replace(e, conversation_id=MaskedCues.alias(e)) for e in examples]
            known.update({e.conversation_id: masked.turns(e.conversation_id) for e in examples})
            source = masked
        systems = _systems(args.store, presets, vectors, known, budget_k=max(KS), reindex=source)
        parts[name] = {"questions": len(examples), "recall": _recall_table(examples, systems),
                       "channels_at_5": {p: _diagnose(args.store, p, vectors, examples, 5, source) for p in presets}}
        if name == "cue":
            parts[name]["crowding_at_5"] = {p: _crowding(args.store, p, vectors, examples, 5, reindex) for p in presets}
    shape = _memory_shape(args.store, vectors, conversation_id, sets.get("cue", []), reindex)
    health = json.loads(args.build_json.read_text(encoding="utf-8")) if args.build_json else None
    report = {
        "label": args.label, "store": str(args.store), "conversation_id": conversation_id, "presets": presets,
        "embedding_model": load_settings(store=args.store).embedding_model, "memory": shape,
        "construction": _health(health) if health else None, **parts,
        "seconds": round(time.perf_counter() - started, 1), "load_avg": os.getloadavg()[0],
        "source": args.source, "reindexed": bool(args.reindex),
    }
    out = RESULTS / f"real_model_{args.label}.json"
    out.write_text(json.dumps(report, indent=1, ensure_ascii=False), encoding="utf-8")
    for line in render(report):
        print(line)
    print(f"\nwritten {out}")
    return 0


def _health(build: dict[str, Any]) -> dict[str, Any]:
    keep = ("status", "llm_calls", "prompt_tokens", "completion_tokens", "quarantined", "failures", "usage_by_operation",
            "notes", "quarantined_units")
    return {k: build[k] for k in keep if k in build}


def render(report: dict[str, Any]) -> list[str]:
    lines = [f"# {report['label']}: {report['conversation_id']} ({report['source']})", ""]
    m = report["memory"]
    lines.append(f"memory: {m['scenes']} scenes (median {m['scene_turns_median']} turns, "
                 f"{m['scenes_of_3_turns_or_fewer']} of ≤3), {m['topics']} topics, {m['items']} items "
                 f"({m['connected_items']} connected), horizon fill {m['horizon_fill']}, "
                 f"cues in their own scene {m['cues_in_their_own_scene']}/{len(m['cue_scenes'])}")
    for part in ("evidence", "cue", "cue_alone"):
        if part not in report:
            continue
        data = report[part]
        cols = [f"k@{k}" for k in KS] + [f"budget@{b}" for b in BUDGETS]
        lines += ["", f"{part} recall, {data['questions']} questions", "system".ljust(16) + "".join(
            c.replace("k@", "R@").rjust(12) for c in cols)]
        for system, cells in data["recall"].items():
            lines.append(system.ljust(16) + "".join(
                (f"{cells[c]['recall']:.3f}" if c in cells else "-").rjust(12) for c in cols))
        for preset, diag in data["channels_at_5"].items():
            share = ", ".join(f"{c} {v:.2f}" for c, v in diag["reached_by_share"].items() if v)
            trig = diag["trig_recall"]
            lines.append(f"  {preset} @5: found {diag['found_turns']}/{diag['evidence_turns']} turns; reached by: {share}")
            lines.append(f"    trig recall fired on {trig['queries_fired']} queries, {trig['items_recalled']} items "
                         f"({trig['items_recalled_that_are_evidence']} evidence); best cosine median "
                         f"{trig['best_trigger_cosine_median']} range {trig['best_trigger_cosine_range']}")
            lines.append(f"    evidence-scene rank medians: {diag['evidence_scene_rank_median']}")
        for preset, crowd in data.get("crowding_at_5", {}).items():
            lines.append(f"  {preset} @5 scenes: cue scene returned for {crowd['returned']}/{crowd['questions']}; "
                         f"{crowd['misses_crowded']} of {crowd['misses']} misses had another cue's scene in the top 5; "
                         f"other cues' scenes per question {crowd['other_cue_scenes_per_question']} "
                         f"(by chance {round(5 * crowd['cue_scene_share'], 2)})")
    if report.get("construction"):
        c = report["construction"]
        lines += ["", f"construction: {c.get('status')} · {c.get('llm_calls')} calls · quarantined {c.get('quarantined')}"]
        for op, u in (c.get("usage_by_operation") or {}).items():
            lines.append(f"  {op:<18} " + " ".join(f"{k}={v}" for k, v in u.items()))
    return lines


def cmd_retrigger(args: argparse.Namespace) -> int:
    """Scene and horizon triggers of a built memory's scenes asked anew with this checkout's prompt,
    through the endpoint of TMEM_LLM_* (the rest of the memory is kept): a prompt A/B on the same scenes."""
    from tmem.bundle import chat_model_for
    from tmem.construct import scene_triggers
    from tmem.settings import apply_process_defaults, load_settings
    from tmem.store.conversations import load_turns
    from tmem.store.duck import connect
    from tmem.store.memory_rows import read_memory

    apply_process_defaults()
    con = connect(args.store, read_only=True)
    try:
        cid = con.execute("SELECT conversation_id FROM conversations ORDER BY 1 LIMIT 1").fetchone()[0]
        memory, turns = read_memory(con, cid), load_turns(con, cid)
    finally:
        con.close()
    chat = chat_model_for(load_settings(store=args.store), "build", None, "retrigger")
    found = scene_triggers(cid, list(memory.scenes), {t.turn_id: t for t in turns}, chat, batch=args.batch)
    args.out.write_text(json.dumps([t.model_dump(mode="json") for t in found], indent=1), encoding="utf-8")
    print(f"{len(found)} scenes' triggers written to {args.out}")
    return 0


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = parser.add_subparsers(dest="cmd", required=True)
    st = sub.add_parser("stitch")
    st.add_argument("--host", required=True)
    st.add_argument("--cues", type=int, default=16)
    st.add_argument("--items", default=None, help="explicit LoCoMo-Plus item indices, comma-separated")
    st.add_argument("--locomo", type=Path, default=DATA / "locomo" / "locomo10.json")
    st.add_argument("--plus", type=Path, default=DATA / "locomo_plus" / "locomo_plus.json")
    st.add_argument("--out", type=Path, required=True)
    st.set_defaults(run=cmd_stitch)
    rec = sub.add_parser("record")
    rec.add_argument("queue", type=Path)
    rec.add_argument("--out", type=Path, required=True)
    rec.set_defaults(run=cmd_record)
    b = sub.add_parser("build")
    b.add_argument("--archive", type=Path, required=True)
    b.add_argument("--store", type=Path, required=True)
    b.add_argument("--replay", type=Path, default=None, help="a recording to replay instead of TMEM_LLM_BASE_URL")
    b.add_argument("--upstream", default=None, help="with --replay: send requests the recording lacks here (e.g. the bridge)")
    b.set_defaults(run=cmd_build)
    rt = sub.add_parser("retrigger")
    rt.add_argument("--store", type=Path, required=True)
    rt.add_argument("--out", type=Path, required=True)
    rt.add_argument("--batch", type=int, default=4)
    rt.set_defaults(run=cmd_retrigger)
    ev = sub.add_parser("eval")
    ev.add_argument("--store", type=Path, required=True)
    ev.add_argument("--data", type=Path, required=True, help="the archive (LoCoMo JSON) whose QA is evidence recall")
    ev.add_argument("--cues", type=Path, default=None, help="the cue questions (LoCoMo JSON) for cue recall")
    ev.add_argument("--presets", default="default,paper")
    ev.add_argument("--build-json", type=Path, default=None, help="`tmem build --json` output of the build")
    ev.add_argument("--label", required=True)
    ev.add_argument("--source", default="built by a capable model through the bridge")
    ev.add_argument("--window-turns", type=int, default=None, help="with --reindex: turns per dialogue window (0: no limit)")
    ev.add_argument("--scene-triggers", type=Path, default=None, help="with --reindex: scene triggers from `retrigger`")
    ev.add_argument("--reindex", action="store_true",
                    help="embed the stored memory's views anew with this checkout's rules (no LLM call)")
    ev.set_defaults(run=cmd_eval)
    args = parser.parse_args(argv)
    code: int = args.run(args)
    return code


if __name__ == "__main__":
    raise SystemExit(main())

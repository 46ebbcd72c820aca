"""The memory explorer of ``tmem serve``: a read-only page at ``/explorer/`` and its JSON API.

The page and its assets (plain HTML/JS/CSS shipped in the package, no CDN) are public: they
hold no memory. Every data endpoint under ``/explorer/api`` answers like ``/search`` does —
the API key when ``TMEM_API_KEY`` is set (401), the conversation named by its exact id in the
JSON body (404 unknown, 422 empty or too long), 503 before anything is published — and reads
only the pinned published snapshot, never the builder's ``work.duckdb``.

Builds and quarantine come from the snapshot's copy of the builder's records, as they stood at
publish (:mod:`tmem.store.snapshot.catalog`). Turns posted by a live assistant and not built
yet are counted by the ``pending_turns`` hook (the service passes the spool of posted turns).
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from importlib.resources import files

from fastapi import APIRouter, HTTPException, Response
from fastapi.params import Depends
from fastapi.responses import RedirectResponse

from tmem import __version__
from tmem.errors import ScopeError, StoreError
from tmem.explorer import views
from tmem.explorer.schemas import (
    ConversationOut,
    ConversationQuarantineOut,
    ConversationRow,
    Defaults,
    ExplainOut,
    ExplainRequest,
    OverviewOut,
    PublishedSnapshot,
    QuarantineOut,
    RunsOut,
    ScopedRequest,
    SnapshotOut,
    TurnsOut,
    TurnsRequest,
)
from tmem.query.memory import Memory, MemorySnapshot
from tmem.query.schemas import TurnOut, item_out, persona_out, scene_out
from tmem.retrieval.config import preset_names
from tmem.store.quarantine import QuarantineRecord
from tmem.store.runs import RunRecord
from tmem.store.snapshot.catalog import ConversationCounts, conversation_counts, snapshot_quarantine, snapshot_runs
from tmem.store.snapshot.published import list_snapshots, read_snapshot

log = logging.getLogger(__name__)

PendingTurns = Callable[[], Mapping[str, int]]
PAGE_PATH = "/explorer/"
ASSET_TYPES = {".html": "text/html; charset=utf-8", ".js": "text/javascript; charset=utf-8",
               ".css": "text/css; charset=utf-8", ".svg": "image/svg+xml"}
# Scripts and styles from this origin only, no inline code, no framing, no requests elsewhere.
PAGE_HEADERS = {
    "Content-Security-Policy": "default-src 'none'; script-src 'self'; style-src 'self'; img-src 'self' data:; "
                               "connect-src 'self'; base-uri 'none'; form-action 'none'; frame-ancestors 'none'",
    "X-Content-Type-Options": "nosniff",
    "Referrer-Policy": "no-referrer",
    "Cache-Control": "no-cache",
}
SNAPSHOTS_LISTED = 20
RECORDS_NOTE = (
    "Build records as of this snapshot's publish: the run that published it is still running in that record, "
    "and runs that published nothing appear with the next publish. `tmem runs` and `tmem quarantine` read the "
    "working database directly when no build holds it."
)
NO_RECORDS_NOTE = (
    "This snapshot was published before snapshots carried build records; the next build adds them. "
    "`tmem runs` and `tmem quarantine` read the working database when no build holds it."
)


def no_pending_turns() -> Mapping[str, int]:
    """No spool of posted turns yet: nothing is waiting."""
    return {}


@dataclass(frozen=True)
class Catalog:
    """What one snapshot says about itself (immutable, so read once per snapshot)."""

    snapshot_id: str
    counts: dict[str, ConversationCounts]
    runs: list[RunRecord] | None
    quarantine: list[QuarantineRecord] | None

    def quarantined(self) -> set[str]:
        return {q.conversation_id for q in self.quarantine or () if q.state == "active"}


class CatalogCache:
    """The catalogue of the snapshot being served, recomputed when the snapshot changes."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._catalog: Catalog | None = None

    def get(self, pinned: MemorySnapshot) -> Catalog:
        with self._lock:
            cached = self._catalog
            if cached is not None and cached.snapshot_id == pinned.snapshot_id:
                return cached
            with pinned.reader.tables() as cursor:
                catalog = Catalog(
                    snapshot_id=pinned.snapshot_id,
                    counts={c.conversation_id: c for c in conversation_counts(cursor)},
                    runs=snapshot_runs(cursor),
                    quarantine=snapshot_quarantine(cursor),
                )
            self._catalog = catalog
            return catalog


def _load_assets() -> dict[str, tuple[bytes, str]]:
    """The page's files, read once from the package (a wheel carries them as package data)."""
    assets: dict[str, tuple[bytes, str]] = {}
    for entry in (files("tmem.explorer") / "static").iterdir():
        suffix = "." + entry.name.rsplit(".", 1)[-1]
        if entry.is_file() and suffix in ASSET_TYPES:
            assets[entry.name] = (entry.read_bytes(), ASSET_TYPES[suffix])
    if "index.html" not in assets:
        raise StoreError("tmem.explorer: the package lacks static/index.html (installed without its package data?)")
    return assets


def _no_store(response: Response) -> None:
    response.headers["Cache-Control"] = "no-store"  # memory behind a key: never kept by a browser or proxy
    response.headers["X-Content-Type-Options"] = "nosniff"


def explorer_router(memory: Memory, auth: Sequence[Depends], *, pending_turns: PendingTurns | None = None) -> APIRouter:
    """The page routes and ``/explorer/api`` data routes over ``memory``'s published snapshot;
    ``auth`` are the dependencies that check the API key (as on ``/search``)."""
    assets = _load_assets()
    catalogs = CatalogCache()
    pending = pending_turns or no_pending_turns
    router = APIRouter()
    api = APIRouter(prefix="/explorer/api", dependencies=[*auth, Depends(_no_store)], tags=["explorer"])

    @router.get("/", include_in_schema=False)
    def root() -> RedirectResponse:
        return RedirectResponse(PAGE_PATH, status_code=307)

    @router.get("/explorer", include_in_schema=False)
    def explorer_no_slash() -> RedirectResponse:
        return RedirectResponse(PAGE_PATH, status_code=307)

    @router.get(PAGE_PATH, include_in_schema=False)
    def page() -> Response:
        body, media = assets["index.html"]
        return Response(body, media_type=media, headers=PAGE_HEADERS)

    @router.get("/explorer/assets/{name}", include_in_schema=False)
    def asset(name: str) -> Response:
        found = assets.get(name)
        if found is None or name == "index.html":
            raise HTTPException(404, "not found")
        return Response(found[0], media_type=found[1], headers=PAGE_HEADERS)

    def rows(pinned: MemorySnapshot) -> tuple[Catalog, dict[str, ConversationRow]]:
        catalog = catalogs.get(pinned)
        waiting, quarantined = pending(), catalog.quarantined()
        return catalog, {
            cid: views.conversation_row(c, pending_turns=int(waiting.get(cid, 0)), quarantined=cid in quarantined)
            for cid, c in catalog.counts.items()
        }

    def scoped(pinned: MemorySnapshot, conversation_id: str) -> None:
        if not pinned.has_conversation(conversation_id):
            raise ScopeError(f"snapshot {pinned.snapshot_id} holds no memory for {conversation_id!r}")

    @api.get("/overview", response_model=OverviewOut)
    def overview() -> OverviewOut:
        pinned = memory.snapshot()
        catalog, by_id = rows(pinned)
        s = memory.settings
        return OverviewOut(
            snapshot=SnapshotOut(snapshot_id=pinned.snapshot_id, created_at=pinned.info.created_at,
                                 image_format=pinned.info.image_format, conversations=len(pinned.info.conversations),
                                 lance_versions=pinned.info.lance_versions),
            conversations=list(by_id.values()),
            quarantine_active=len(catalog.quarantined()),
            presets=list(preset_names()),
            defaults=Defaults(k_topics=s.k_topics, k_scenes=s.k_scenes, k_items=s.k_items, k_cue=s.k_cue,
                              trigger_cap=s.trigger_cap, trigger_gate=s.trigger_gate, trigger_gate_z=s.trigger_gate_z,
                              rrf_k0=s.rrf_k0,
                              context_token_budget=s.context_token_budget),
            version=__version__,
        )

    @api.post("/conversation", response_model=ConversationOut)
    def conversation(body: ScopedRequest) -> ConversationOut:
        pinned = memory.snapshot()
        scoped(pinned, body.conversation_id)
        mem, turns = pinned.reader.read_conversation(body.conversation_id)
        _, by_id = rows(pinned)
        scenes, topics, items = views.memory_views(mem, turns)
        return ConversationOut(
            snapshot_id=pinned.snapshot_id, conversation=by_id[body.conversation_id], scenes=scenes, topics=topics,
            items=items, personas=[persona_out(p) for p in mem.personas],
        )

    @api.post("/turns", response_model=TurnsOut)
    def scene_turns(body: TurnsRequest) -> TurnsOut:
        pinned = memory.snapshot()
        scoped(pinned, body.conversation_id)
        mem, turns = pinned.reader.read_conversation(body.conversation_id)
        scene = next((s for s in mem.scenes if s.scene_id == body.scene_id), None)
        if scene is None:
            raise HTTPException(404, "scene not found")
        by_turn = {t.turn_id: t for t in turns}
        return TurnsOut(
            snapshot_id=pinned.snapshot_id, conversation_id=body.conversation_id, scene_id=scene.scene_id,
            turns=[TurnOut(turn_id=t.turn_id, session_id=t.session_id, speaker=t.speaker, text=t.text,
                           event_time=t.event_time)
                   for t in (by_turn[i] for i in scene.turn_ids if i in by_turn)],
        )

    @api.post("/explain", response_model=ExplainOut)
    def explain(body: ExplainRequest) -> ExplainOut:
        started = time.perf_counter()
        pinned = memory.snapshot()
        scoped(pinned, body.conversation_id)
        config = memory.config(body.preset)
        recalled = pinned.context(body.query, conversation_id=body.conversation_id, speaker=body.speaker,
                                  preset=body.preset, budget_tokens=body.budget_tokens, trace=True, embed=body.embed)
        result, trace = recalled.result, recalled.result.trace
        assert trace is not None  # asked for
        labels = views.labels_of(pinned.index(body.conversation_id, vectors=body.embed))  # cached by the search
        return ExplainOut(
            snapshot_id=pinned.snapshot_id, conversation_id=result.conversation_id, query=result.query,
            mode=result.mode, preset=body.preset, config=config.model_dump(), query_tokens=list(trace.query_tokens),
            took_ms=round((time.perf_counter() - started) * 1000, 3),
            scenes=[scene_out(s) for s in result.scenes], items=[item_out(i) for i in result.items],
            personas=[persona_out(p) for p in result.personas], persona_speaker=trace.persona_speaker,
            persona_matched=trace.persona_matched,
            stages=[views.stage_view(s, config, labels) for s in trace.stages],
            gate=views.gate_view(trace.stage("trig_recall"), config), context=views.context_view(recalled),
        )

    @api.get("/runs", response_model=RunsOut)
    def runs() -> RunsOut:
        pinned = memory.snapshot()
        catalog = catalogs.get(pinned)
        publishing = {c.run_id for c in catalog.counts.values()}
        return RunsOut(
            snapshot_id=pinned.snapshot_id, recorded=catalog.runs is not None,
            note=RECORDS_NOTE if catalog.runs is not None else NO_RECORDS_NOTE,
            runs=[views.run_view(r, pinned.snapshot_id, publishing) for r in catalog.runs or ()],
            snapshots=_published(memory, pinned.snapshot_id),
        )

    @api.get("/quarantine", response_model=QuarantineOut)
    def quarantine() -> QuarantineOut:
        pinned = memory.snapshot()
        catalog = catalogs.get(pinned)
        return QuarantineOut(
            snapshot_id=pinned.snapshot_id, recorded=catalog.quarantine is not None,
            note=RECORDS_NOTE if catalog.quarantine is not None else NO_RECORDS_NOTE,
            records=[views.quarantine_view(q, pinned.has_conversation(q.conversation_id))
                     for q in catalog.quarantine or ()],
        )

    @api.post("/conversation/quarantine", response_model=ConversationQuarantineOut)
    def conversation_quarantine(body: ScopedRequest) -> ConversationQuarantineOut:
        """The full records (input excerpt, raw output) of one conversation: a quarantined
        conversation may have no published memory yet, so its records also open it."""
        pinned = memory.snapshot()
        catalog = catalogs.get(pinned)
        records = [q for q in catalog.quarantine or () if q.conversation_id == body.conversation_id]
        if not records:
            scoped(pinned, body.conversation_id)
        published = pinned.has_conversation(body.conversation_id)
        return ConversationQuarantineOut(
            snapshot_id=pinned.snapshot_id, conversation_id=body.conversation_id, recorded=catalog.quarantine is not None,
            records=[views.quarantine_detail(q, published) for q in records],
        )

    router.include_router(api)
    return router


def _published(memory: Memory, current: str) -> list[PublishedSnapshot]:
    """The newest published snapshots (their manifests), newest first."""
    out: list[PublishedSnapshot] = []
    for snapshot_id in reversed(list_snapshots(memory.store)[-SNAPSHOTS_LISTED:]):
        try:
            info = read_snapshot(memory.store, snapshot_id)
        except StoreError as exc:  # pruned or half-deleted meanwhile: list the others
            log.warning("explorer: skipping snapshot %s (%s)", snapshot_id, exc)
            continue
        out.append(PublishedSnapshot(snapshot_id=info.snapshot_id, created_at=info.created_at,
                                     conversations=len(info.conversations), current=snapshot_id == current))
    return out

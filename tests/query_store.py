"""Hand-built published stores for the query-side tests (no LLM build involved).

``build_store`` ingests a tmem JSON Lines archive of the conversations' turns, writes their
memories and vector rows, and publishes a snapshot exactly as the builder does. Memories are
themed: scene i of a conversation is about ``THEMES[i % len(THEMES)]``, and every text carries
the conversation's ``mark`` word, so a test can tell whose memory (and which build) a result
came from.
"""

from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass
from datetime import UTC, datetime, timedelta
from pathlib import Path

import numpy as np
import numpy.typing as npt

from tmem import domain
from tmem.build.embed_views import embed_memory_views
from tmem.domain import (
    HORIZON_CHANNELS,
    BridgeTrigger,
    Item,
    ItemTriggers,
    Persona,
    PersonaFact,
    Scene,
    SceneTriggers,
    Topic,
    Turn,
)
from tmem.ingest.load import ingest_archives
from tmem.ports import Embedder
from tmem.retrieval.scoring import tokenize
from tmem.store.duck import connect
from tmem.store.lance import VectorStore
from tmem.store.memory_rows import record_memory_build, replace_memories
from tmem.store.snapshot.published import SnapshotInfo, publish_snapshot

NOW = datetime(2026, 1, 5, 9, 0, tzinfo=UTC)
T0 = datetime(2023, 5, 8, 13, 0, tzinfo=UTC)
SPEAKERS = ("Ann", "Bob")
THEMES: tuple[tuple[str, ...], ...] = (
    ("pottery", "bowl", "clay", "glaze", "kiln"),
    ("hiking", "trail", "mountain", "boots", "summit"),
    ("adoption", "agency", "family", "child", "papers"),
    ("guitar", "concert", "band", "song", "stage"),
    ("marathon", "running", "race", "training", "shoes"),
    ("garden", "tomatoes", "seeds", "soil", "harvest"),
    ("painting", "canvas", "sunset", "colors", "brush"),
    ("camping", "tent", "lake", "fire", "stars"),
)


class HashEmbedder:
    """A typed fake :class:`Embedder`: bag of hashed word tokens, L2-normalised.

    Texts sharing words get a positive cosine, unrelated texts ~0: enough to exercise the dense
    channels deterministically without a model.
    """

    def __init__(self, dim: int = 64) -> None:
        self._dim = dim
        self.calls = 0
        self.texts = 0

    @property
    def model_name(self) -> str:
        return f"hash-{self._dim}"

    @property
    def dim(self) -> int:
        return self._dim

    @property
    def max_input_tokens(self) -> int | None:
        return None  # no input limit: dialogue views stay whole

    def embed(self, texts: list[str]) -> npt.NDArray[np.float32]:
        self.calls += 1
        self.texts += len(texts)
        out = np.zeros((len(texts), self._dim), dtype=np.float32)
        for row, text in enumerate(texts):
            for token in tokenize(text) or ["<empty>"]:
                digest = hashlib.blake2b(token.encode(), digest_size=8).digest()
                slot = int.from_bytes(digest[:4], "little") % self._dim
                out[row, slot] += 1.0 if digest[4] & 1 else -1.0
            norm = float(np.linalg.norm(out[row]))
            out[row] = out[row] / norm if norm > 0 else 0.0
            if norm == 0:
                out[row, 0] = 1.0
        return out


@dataclass(frozen=True)
class Conv:
    """One conversation of a test store: its memory and its turns."""

    memory: domain.ConversationMemory
    turns: tuple[Turn, ...]

    @property
    def conversation_id(self) -> str:
        return self.memory.conversation_id


def make_turns(cid: str, scenes: int, turns_per_scene: int, mark: str) -> tuple[Turn, ...]:
    turns: list[Turn] = []
    for s in range(scenes):
        theme = THEMES[s % len(THEMES)]
        for k in range(turns_per_scene):
            seq = s * turns_per_scene + k
            speaker = SPEAKERS[k % 2]
            turns.append(
                Turn(
                    conversation_id=cid, session_id=f"S{s + 1}", turn_id=f"D{s + 1}:{k + 1}", seq=seq,
                    speaker=speaker,
                    text=f"{speaker} talks about the {theme[k % 5]} and the {theme[(k + 1) % 5]} with {mark} number {k}",
                    event_time=T0 + timedelta(days=s, seconds=k),
                )
            )
    return tuple(turns)


def make_memory(
    cid: str,
    turns: tuple[Turn, ...],
    *,
    scenes: int,
    turns_per_scene: int,
    items_per_scene: int,
    mark: str,
    tag: str = "",
) -> domain.ConversationMemory:
    """A themed memory over ``turns``; ``tag`` changes every id and title (a different build)."""
    scene_objs: list[Scene] = []
    for s in range(scenes):
        theme = THEMES[s % len(THEMES)]
        own = turns[s * turns_per_scene : (s + 1) * turns_per_scene]
        scene_objs.append(
            Scene(
                conversation_id=cid, scene_id=f"scn{tag}_{s}", seq=s,
                title=f"{theme[0].title()} {theme[1]} {mark}{tag} {s}",
                summary=f"Ann and Bob discuss the {theme[1]} and {theme[2]} ({mark}).",
                narrative=f"On day {s} Ann told Bob about the {theme[0]}, the {theme[3]} and the {theme[4]}. {mark}",
                turn_ids=tuple(t.turn_id for t in own),
                start_time=own[0].event_time, end_time=own[-1].event_time,
            )
        )
    n_topics = min(len(THEMES), scenes)
    topics = tuple(
        Topic(
            conversation_id=cid, topic_id=f"top{tag}_{t}", seq=t, title=f"{THEMES[t][0].title()} {mark}",
            keywords=(*THEMES[t], mark, f"kw{t}a", f"kw{t}b", f"kw{t}c", f"kw{t}d"),
            scene_ids=tuple(sc.scene_id for i, sc in enumerate(scene_objs) if i % len(THEMES) == t),
        )
        for t in range(n_topics)
    )
    items: list[Item] = []
    item_triggers: list[ItemTriggers] = []
    for s, scene in enumerate(scene_objs):
        theme = THEMES[s % len(THEMES)]
        for j in range(items_per_scene):
            iid = f"itm{tag}_{s}_{j}"
            items.append(
                Item(
                    conversation_id=cid, item_id=iid, topic_id=topics[s % len(THEMES)].topic_id,
                    kind="atomic" if j % 3 else "connected",
                    content=f"{SPEAKERS[j % 2]} has a {theme[j % 5]} {theme[(j + 2) % 5]} fact {mark}{tag} {s}-{j}.",
                    source_scene_ids=(scene.scene_id,),
                    event_time=scene.start_time if j % 4 else None,
                    keywords=(theme[j % 5], mark),
                )
            )
            item_triggers.append(
                ItemTriggers(
                    conversation_id=cid, item_id=iid, entities=(f"{theme[0]} hobby", f"{theme[3]} interest"),
                    bridges=(BridgeTrigger(situation=f"planning a weekend of {theme[4]}", rationale=f"{mark} likes it"),),
                )
            )
    scene_triggers = tuple(
        SceneTriggers(
            conversation_id=cid, scene_id=sc.scene_id, situation=f"at the {THEMES[s % len(THEMES)][2]}",
            object=THEMES[s % len(THEMES)][3], event=f"talk {s}", emotion="joy",
            horizons={ch: f"{ch.replace('_', ' ')} of {THEMES[s % len(THEMES)][4]} {mark}" for ch in HORIZON_CHANNELS},
        )
        for s, sc in enumerate(scene_objs)
    )
    personas = tuple(
        Persona(
            conversation_id=cid, speaker=sp, identity=(f"{sp} of {mark}",), preferences=(THEMES[i][0],),
            traits=("curious",), relations=(f"friend of {SPEAKERS[1 - i]}",),
            timeline=(PersonaFact(fact=f"{sp} joined {mark}", since="2023-05"),),
        )
        for i, sp in enumerate(SPEAKERS)
    )
    return domain.ConversationMemory(
        conversation_id=cid, scenes=tuple(scene_objs), topics=topics, items=tuple(items),
        item_triggers=tuple(item_triggers), scene_triggers=scene_triggers, personas=personas,
    )


def make_conv(
    cid: str, *, mark: str, scenes: int = 6, turns_per_scene: int = 4, items_per_scene: int = 2, tag: str = ""
) -> Conv:
    turns = make_turns(cid, scenes, turns_per_scene, mark)
    memory = make_memory(
        cid, turns, scenes=scenes, turns_per_scene=turns_per_scene, items_per_scene=items_per_scene, mark=mark, tag=tag
    )
    return Conv(memory, turns)


def ingest_turns(store: Path, convs: list[Conv], now: datetime = NOW) -> None:
    """Ingest the conversations' turns through the public JSON Lines ingest."""
    records: list[dict[str, object]] = []
    for conv in convs:
        records.append({"kind": "conversation", "conversation_id": conv.conversation_id, "speakers": list(SPEAKERS)})
        records += [
            {
                "conversation_id": t.conversation_id, "session_id": t.session_id, "turn_id": t.turn_id,
                "speaker": t.speaker, "text": t.text, "timestamp": t.event_time.isoformat(),
            }
            for t in conv.turns
        ]
    store.mkdir(parents=True, exist_ok=True)
    archive = store.parent / f"{store.name}-archive-{len(list(store.parent.glob(store.name + '-archive-*')))}.jsonl"
    archive.write_text("".join(json.dumps(r, ensure_ascii=False) + "\n" for r in records), encoding="utf-8")
    ingest_archives([archive], store, now=now)


def publish(store: Path, convs: list[Conv], embedder: Embedder, now: datetime = NOW) -> SnapshotInfo:
    """Write the memories and their vectors, then publish a snapshot (the builder's publish order)."""
    lance = str(store / "lance")
    vectors = VectorStore(lance, embedder.dim)
    version = 0
    for conv in convs:
        rows = embed_memory_views(conv.memory, {t.turn_id: t for t in conv.turns}, embedder)
        version = vectors.replace_conversation("vectors", conv.conversation_id, rows)
    con = connect(store)
    try:
        replace_memories(con, [c.memory for c in convs])
        for conv in convs:
            record_memory_build(con, conv.conversation_id, f"build-{conv.memory.scenes[0].scene_id}", "run-test",
                                len(conv.turns) - 1, now)
        return publish_snapshot(con, store, lance_uri=lance, lance_versions={"vectors": version}, now=now)
    finally:
        con.close()


def build_store(store: Path, convs: list[Conv], embedder: Embedder, now: datetime = NOW) -> SnapshotInfo:
    ingest_turns(store, convs, now)
    return publish(store, convs, embedder, now)

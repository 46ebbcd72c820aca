"""The spool of posted turns: accepted at once, ingested by the next builder that holds the store.

While a build runs, the builder holds ``work.duckdb`` and no other process may open it (README,
"DuckDB locking decides the layout"), so a post cannot wait to be written there. It is
validated, planned and then written as one file::

    STORE/spool/pending/<key>/<seq>-<rand>.jsonl   one file per accepted post: a JSON Lines archive
                                                   of the post's new turns (key: hash of the id)
    STORE/spool/rejected/<key>/…                   files a drain refused, beside <name>.error.txt
    STORE/spool/tmp/                               files being written
    STORE/spool/locks/<key>.lock                   one writer per conversation at a time (flock)

A file is written under ``tmp/``, fsynced and renamed into ``pending/`` (same file system: the
rename is atomic), so readers see a whole post or none, and concurrent writers never interleave.
Posts to one conversation are planned and written under its lock, in order, each against what
the store will hold once the posts before it are ingested: the published snapshot's turns plus
the files already waiting (:class:`PublishedInput`). A post that adds nothing writes nothing.

:func:`drain_spool` ingests the waiting files into the working database, one transaction per
file in arrival order, and removes each file after its commit; a crash in between is harmless,
because ingesting it again adds nothing. A file the store now refuses (e.g. an archive ingested
after the post changed the same turns) is moved to ``rejected/`` with the error.
"""

from __future__ import annotations

import fcntl
import hashlib
import logging
import os
import threading
import time
import uuid
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import asdict, dataclass, field
from datetime import datetime
from pathlib import Path
from typing import TYPE_CHECKING, Protocol

from tmem.errors import IngestError
from tmem.ingest.archive import ParsedArchive
from tmem.ingest.frames import archive_frames, plan_ingest
from tmem.ingest.jsonl import read_jsonl
from tmem.ingest.load import ingest_parsed
from tmem.ingest.posted import apply_plan, spool_text
from tmem.store.ingest_writer import StoredState

if TYPE_CHECKING:
    import duckdb

log = logging.getLogger(__name__)

SPOOL = "spool"
STALE_TMP_S = 3600.0  # a writer takes milliseconds: a partial file this old is from a crash


class PublishedInput(Protocol):
    """What the published memory holds of the ingested input (the state a post is planned on)."""

    def published_id(self) -> str | None:
        """The published snapshot's id (None: nothing published)."""
        ...

    def published_state(self, conversation_id: str) -> StoredState:
        """The conversation's ingested rows as published (empty frames when it has none)."""
        ...


@dataclass(frozen=True)
class PostResult:
    conversation_id: str
    posted_turns: int  # turns in the post
    new_turns: int  # of them, turns the store does not hold or wait for yet (the rest: repeats)
    pending_turns: int  # this conversation's posted turns waiting for the next build, this post's included

    def as_dict(self) -> dict[str, object]:
        return asdict(self)


@dataclass(frozen=True)
class DrainReport:
    files: int = 0
    new_turns: int = 0
    conversations: tuple[str, ...] = ()
    rejected: tuple[dict[str, str], ...] = field(default_factory=tuple)  # {"file", "error"}

    def as_dict(self) -> dict[str, object]:
        return {"files": self.files, "new_turns": self.new_turns, "conversations": list(self.conversations),
                "rejected": [dict(r) for r in self.rejected]}


@dataclass(frozen=True)
class _Planned:
    snapshot_id: str | None
    files: tuple[str, ...]  # names of the pending files folded into ``state``, in order
    state: StoredState


def conversation_key(conversation_id: str) -> str:
    """The spool directory name of a conversation: ids may hold any character, names may not."""
    return hashlib.sha256(conversation_id.encode("utf-8")).hexdigest()[:32]


class Spool:
    """The spool of one store. Thread-safe; processes sharing the directory coordinate by flock."""

    def __init__(self, store: Path) -> None:
        self.root = Path(store) / SPOOL
        self.pending = self.root / "pending"
        self.rejected = self.root / "rejected"
        self._lock = threading.Lock()
        self._counts: dict[Path, tuple[str, int]] = {}  # pending file -> (conversation id, turns); files never change
        self._planned: dict[str, _Planned] = {}

    # ---- posting ----------------------------------------------------------------------------

    def post(self, archive: ParsedArchive, *, published: PublishedInput, now: datetime) -> PostResult:
        """Plan a validated post (:func:`tmem.ingest.posted.parse_posted`) and spool what it adds.
        Raises :class:`IngestError` (nothing written) when ingest would refuse it against the store."""
        (conversation,) = archive.conversations
        conversation_id = conversation.conversation_id
        key = conversation_key(conversation_id)
        folder = self.pending / key
        with self._conversation_lock(key):
            state, files = self._state_before(conversation_id, folder, published, now)
            plan, counts = plan_ingest(archive_frames([archive]), state, now)
            new_ids = set(plan.turns["turn_id"].to_list())
            if new_ids:
                declared = archive.records.conversations[conversation_id] == "speakers"
                name = self._write(folder, files, spool_text(conversation, new_ids, declared))
                with self._lock:
                    self._planned[key] = _Planned(published.published_id(), (*files, name), apply_plan(state, plan))
                    self._counts[folder / name] = (conversation_id, len(new_ids))
        return PostResult(conversation_id, len(conversation.turns), counts.new_turns,
                          self._count(_spooled(folder)).get(conversation_id, 0))

    def _state_before(
        self, conversation_id: str, folder: Path, published: PublishedInput, now: datetime
    ) -> tuple[StoredState, tuple[str, ...]]:
        """What the store will hold of the conversation once its waiting files are ingested."""
        key = folder.name
        snapshot_id = published.published_id()
        files = tuple(p.name for p in _spooled(folder))
        with self._lock:
            cached = self._planned.get(key)
        if cached is not None and cached.snapshot_id == snapshot_id and files[: len(cached.files)] == cached.files:
            state, todo = cached.state, files[len(cached.files):]
        else:
            state, todo = published.published_state(conversation_id), files
        applied = files[: len(files) - len(todo)]
        for name in todo:
            try:
                earlier = _read_spooled(folder / name)
                if earlier is None:
                    continue  # drained meanwhile: its turns are in the working database now
                plan, _ = plan_ingest(archive_frames([earlier]), state, now)
            except IngestError as exc:  # the file is not named to the poster: it is the store's
                log.warning("spooled post %s/%s no longer fits the store; the next drain rejects it: %s", key, name, exc)
            else:
                state = apply_plan(state, plan)
            applied = (*applied, name)
        with self._lock:
            self._planned[key] = _Planned(snapshot_id, applied, state)
        return state, applied

    def _write(self, folder: Path, files: tuple[str, ...], text: str) -> str:
        """Write one spool file atomically (temp + fsync + rename); returns its name."""
        last = int(files[-1].split("-", 1)[0]) if files else 0
        name = f"{max(time.time_ns(), last + 1):020d}-{uuid.uuid4().hex[:8]}.jsonl"
        tmp_dir = self.root / "tmp"
        tmp_dir.mkdir(parents=True, exist_ok=True)
        folder.mkdir(parents=True, exist_ok=True)
        tmp = tmp_dir / f".{uuid.uuid4().hex}.part"
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o644)
        try:
            try:
                data = memoryview(text.encode("utf-8"))
                while data:
                    data = data[os.write(fd, data):]
                os.fsync(fd)
            finally:
                os.close(fd)
            os.rename(tmp, folder / name)
        except OSError:
            tmp.unlink(missing_ok=True)
            raise
        _fsync_dir(folder)
        return name

    @contextmanager
    def _conversation_lock(self, key: str) -> Iterator[None]:
        locks = self.root / "locks"
        locks.mkdir(parents=True, exist_ok=True)
        fd = os.open(locks / f"{key}.lock", os.O_RDWR | os.O_CREAT, 0o644)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX)  # one open file description per call: excludes threads too
            yield
        finally:
            os.close(fd)  # releases the lock

    # ---- reading ----------------------------------------------------------------------------

    def pending_files(self) -> list[Path]:
        """Every waiting file: conversations in key order, each conversation's files in arrival order."""
        if not self.pending.is_dir():
            return []
        return [f for folder in sorted(self.pending.iterdir()) if folder.is_dir() for f in _spooled(folder)]

    def pending_turns(self) -> dict[str, int]:
        """Per conversation, how many posted turns wait for the next build (conversations with none
        are left out)."""
        files = self.pending_files()
        totals = self._count(files)
        with self._lock:  # forget drained files
            live = set(files)
            for gone in [p for p in self._counts if p not in live]:
                del self._counts[gone]
        return totals

    def _count(self, files: list[Path]) -> dict[str, int]:
        totals: dict[str, int] = {}
        for path in files:
            with self._lock:
                known = self._counts.get(path)
            if known is None:
                try:
                    archive = _read_spooled(path)
                except IngestError as exc:
                    log.warning("spooled post %s is unreadable; the next drain rejects it: %s", path, exc)
                    continue
                if archive is None:
                    continue  # drained meanwhile
                (conversation,) = archive.conversations
                known = (conversation.conversation_id, len(conversation.turns))
                with self._lock:
                    self._counts[path] = known
            totals[known[0]] = totals.get(known[0], 0) + known[1]
        return totals

    def reject(self, path: Path, error: str) -> Path:
        """Move a waiting file aside (``rejected/``) with the reason beside it."""
        target = self.rejected / path.parent.name
        target.mkdir(parents=True, exist_ok=True)
        (target / f"{path.stem}.error.txt").write_text(error + "\n", encoding="utf-8")
        os.replace(path, target / path.name)
        return target / path.name

    def remove_stale_tmp(self, now_s: float) -> None:
        tmp_dir = self.root / "tmp"
        if tmp_dir.is_dir():
            for part in tmp_dir.glob(".*.part"):
                if now_s - part.stat().st_mtime > STALE_TMP_S:
                    part.unlink(missing_ok=True)


def _read_spooled(path: Path) -> ParsedArchive | None:
    """A waiting file, read as the JSON Lines archive it is; None when a drain removed it meanwhile."""
    try:
        return read_jsonl(path)
    except IngestError:
        if not path.exists():
            return None
        raise


def _spooled(folder: Path) -> list[Path]:
    if not folder.is_dir():
        return []
    return sorted(p for p in folder.iterdir() if p.suffix == ".jsonl" and not p.name.startswith("."))


def _fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def drain_spool(store: Path, *, now: datetime, con: duckdb.DuckDBPyConnection | None = None) -> DrainReport:
    """Ingest every waiting post into the working database (through ``con``, the builder's
    connection, when given), one transaction per file in arrival order; remove each file after its
    commit. A file the store refuses is moved to ``rejected/`` and reported, the others go on."""
    spool = Spool(store)
    spool.remove_stale_tmp(time.time())
    files = spool.pending_files()
    if not files:
        return DrainReport()
    owned = con is None
    if con is None:
        from tmem.store.duck import connect

        con = connect(Path(store))
    new_turns, conversations, rejected = 0, set[str](), []
    try:
        for path in files:
            try:
                archive = read_jsonl(path)
                report = ingest_parsed([archive], Path(store), now=now, con=con)
            except IngestError as exc:
                moved = spool.reject(path, str(exc))
                log.error("spooled post refused by the store, moved to %s: %s", moved, exc)
                rejected.append({"file": str(moved), "error": str(exc)})
                continue
            path.unlink()  # after the commit: a crash before this re-ingests the file, adding nothing
            new_turns += report.new_turns
            conversations.update(c.conversation_id for c in archive.conversations)
    finally:
        if owned:
            con.close()
    return DrainReport(files=len(files), new_turns=new_turns, conversations=tuple(sorted(conversations)),
                       rejected=tuple(rejected))

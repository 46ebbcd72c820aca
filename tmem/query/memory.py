"""The Python API of the query side: ``Memory.open(store).search(query, conversation_id=...)``.

A :class:`Memory` follows the store's published snapshot. Every call pins the current snapshot
once (:meth:`Memory.snapshot`) and does all its work on it, so one query never mixes two
snapshots; a newer snapshot is picked up without restarting, by re-reading the tiny ``CURRENT``
pointer at most every ``refresh_ms`` milliseconds.

Scope is mandatory: every call names one conversation (a :class:`~tmem.query.request.Recall`
checks the id when it is made), which must be one the snapshot holds memory for (exact string
match, whatever characters the id contains); anything else raises :class:`~tmem.errors.ScopeError`. The query embedder and the answer model are created lazily,
on the first call that needs them, so a lexical query never imports torch or openai.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import numpy.typing as npt
from typing_extensions import Unpack

from tmem.errors import ScopeError, StoreError
from tmem.ports import ChatModel, Embedder
from tmem.prompts import answer as answer_prompt
from tmem.prompts.common import when
from tmem.query.loader import CacheStats, IndexCache
from tmem.query.request import Recall, RecallOptions
from tmem.retrieval.cascade import ScoredItem, ScoredScene, SearchResult, search
from tmem.retrieval.config import RetrievalConfig, config_from_settings
from tmem.retrieval.context import FormattedContext, format_context
from tmem.retrieval.index import ConversationIndex
from tmem.settings import Settings, load_settings
from tmem.store.lance_location import VECTOR_TABLE
from tmem.store.snapshot.published import CURRENT, SnapshotInfo, current_snapshot
from tmem.store.snapshot.reader import SnapshotConversation, SnapshotReader

log = logging.getLogger(__name__)

DEFAULT_REFRESH_MS = 500
ANSWER_RUN_ID = "query"


class NoSnapshotError(StoreError):
    """The store has no published snapshot yet (nothing was built)."""


@dataclass(frozen=True)
class QueryContext:
    """A search and the QA context rendered from it."""

    snapshot_id: str
    result: SearchResult
    context: FormattedContext


@dataclass(frozen=True)
class Answer:
    """The answer-role model's short answer, with everything it was given."""

    question: str
    answer: str
    conversation_id: str
    snapshot_id: str
    model: str
    context: FormattedContext  # the text sent and its token report
    result: SearchResult  # recalled scenes and items (with the channels that reached them), personas

    @property
    def scenes(self) -> tuple[ScoredScene, ...]:
        return self.result.scenes

    @property
    def items(self) -> tuple[ScoredItem, ...]:
        return self.result.items


class KeywordRecall:
    """``search``, ``context`` and ``answer`` by keywords: each call states one
    :class:`~tmem.query.request.Recall` (whose fields say what each option does) and runs it on one
    pinned snapshot."""

    def pinned(self) -> MemorySnapshot:
        raise NotImplementedError

    def search(self, query: str, *, conversation_id: str, **options: Unpack[RecallOptions]) -> SearchResult:
        """The cascade's recall of ``query`` in one conversation."""
        return self.pinned().search_for(Recall(query, conversation_id, **options))

    def context(self, query: str, *, conversation_id: str, **options: Unpack[RecallOptions]) -> QueryContext:
        """The recall and the QA context rendered from it."""
        return self.pinned().context_for(Recall(query, conversation_id, **options))

    def answer(self, question: str, *, conversation_id: str, **options: Unpack[RecallOptions]) -> Answer:
        """The answer-role model's short answer to ``question`` from one conversation's memory."""
        return self.pinned().answer_for(Recall(question, conversation_id, **options))


class MemorySnapshot(KeywordRecall):
    """One published snapshot, pinned: every method reads this snapshot and no other."""

    def __init__(self, owner: Memory, info: SnapshotInfo) -> None:
        self._owner = owner
        self.info = info
        self.reader = SnapshotReader(info, owner.store, VECTOR_TABLE)

    @property
    def snapshot_id(self) -> str:
        return self.info.snapshot_id

    def pinned(self) -> MemorySnapshot:
        return self

    def has_conversation(self, conversation_id: str) -> bool:
        return isinstance(conversation_id, str) and conversation_id in self.info.conversations

    def conversations(self) -> tuple[SnapshotConversation, ...]:
        return self.reader.list_conversations()

    def index(self, conversation_id: str, *, vectors: bool = True) -> ConversationIndex:
        """The loaded (cached) index of one conversation of this snapshot."""
        if not isinstance(conversation_id, str) or not conversation_id:
            raise ScopeError(f"a query needs a conversation id, got {conversation_id!r}")
        if conversation_id not in self.info.conversations:
            raise ScopeError(f"unknown conversation {conversation_id!r}: snapshot {self.snapshot_id} holds no memory for it")
        return self._owner.cache.get(self.reader, conversation_id, vectors=vectors)

    def search_for(self, request: Recall) -> SearchResult:
        """Run the cascade over the request's conversation. The text is embedded (lazily loading the
        embedder) unless ``request.query_vector`` is given or ``request.embed`` is False (lexical only)."""
        config = self._owner.config(request.preset)
        index = self.index(request.conversation_id, vectors=request.embed or request.query_vector is not None)
        vector = request.query_vector
        if vector is None and request.embed and index.dim > 0:
            vector = self._owner.embed_query(request.text)
        return search(index, request.text, vector, config, speaker=request.speaker, trace=request.trace)

    def context_for(self, request: Recall) -> QueryContext:
        """Search, then render the QA context under ``request.budget_tokens`` (default: settings)."""
        result = self.search_for(request)
        budget = self._owner.settings.context_token_budget if request.budget_tokens is None else request.budget_tokens
        return QueryContext(self.snapshot_id, result, format_context(result, budget))

    def answer_for(self, request: Recall) -> Answer:
        """Recall, render the context, and ask the answer-role model for a short answer."""
        recalled = self.context_for(request)
        chat = self._owner.chat_model()
        prompt = answer_prompt.build(
            answer_prompt.AnswerInput(
                conversation_id=request.conversation_id,
                question=request.text,
                question_date=when(request.question_date) if request.question_date is not None else None,
                context=recalled.context.text,
            ),
            reasoning=self._owner.settings.answer_reasoning == "on",
        )
        response = chat.complete(prompt)
        return Answer(
            question=request.text,
            answer=response.answer.strip(),
            conversation_id=request.conversation_id,
            snapshot_id=self.snapshot_id,
            model=chat.model_name,
            context=recalled.context,
            result=recalled.result,
        )


class Memory(KeywordRecall):
    """The query side of one store. Thread-safe; share one instance per process."""

    def __init__(
        self,
        store: Path,
        settings: Settings,
        *,
        embedder: Embedder | None = None,
        chat: ChatModel | None = None,
        refresh_ms: int = DEFAULT_REFRESH_MS,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.store = Path(store)
        self.settings = settings
        self.refresh_s = max(refresh_ms, 0) / 1000.0
        self.cache = IndexCache(settings.query_cache_size)
        self._clock = clock
        self._embedder = embedder
        self._chat = chat
        # One lock per lazily built dependency: loading the embedder (seconds) must not hold up a
        # lexical query's preset lookup, nor the answer model's client.
        self._config_lock = threading.Lock()
        self._embedder_lock = threading.Lock()
        self._chat_lock = threading.Lock()
        self._refresh_lock = threading.Lock()
        self._configs: dict[str, RetrievalConfig] = {}
        self._pinned: MemorySnapshot | None = None
        self._checked_at = float("-inf")
        self._pointer: str | None = None
        self.refresh(force=True)

    @classmethod
    def open(
        cls,
        store: Path | str,
        settings: Settings | None = None,
        *,
        embedder: Embedder | None = None,
        chat: ChatModel | None = None,
        refresh_ms: int = DEFAULT_REFRESH_MS,
    ) -> Memory:
        """Open the query side of ``store``. A store with nothing published yet opens (queries
        then raise :class:`NoSnapshotError` until a build publishes); a missing directory is a
        :class:`~tmem.errors.StoreError`. ``embedder``/``chat`` replace the configured ones."""
        path = Path(store)
        if not path.is_dir():
            raise StoreError(f"{path}: no tmem store here (not a directory)")
        return cls(path, settings or load_settings(store=path), embedder=embedder, chat=chat, refresh_ms=refresh_ms)

    # ---- snapshots ---------------------------------------------------------------------

    @property
    def snapshot_id(self) -> str | None:
        pinned = self.current()
        return pinned.snapshot_id if pinned is not None else None

    def pinned(self) -> MemorySnapshot:
        return self.snapshot()

    def snapshot(self) -> MemorySnapshot:
        """Pin the current snapshot (switching to a newer one when due)."""
        pinned = self.current()
        if pinned is None:
            raise NoSnapshotError(f"{self.store}: nothing published yet; build the memory first (no {CURRENT})")
        return pinned

    def current(self) -> MemorySnapshot | None:
        """The current snapshot pinned (switching to a newer one when due), or ``None`` before the
        first publish."""
        if self._clock() - self._checked_at >= self.refresh_s:
            self.refresh()
        return self._pinned

    def refresh(self, *, force: bool = False) -> bool:
        """Re-read the ``CURRENT`` pointer and switch when it names another snapshot; returns
        whether it switched. A pointer that cannot be followed keeps the last good snapshot."""
        with self._refresh_lock:
            now = self._clock()
            if not force and now - self._checked_at < self.refresh_s:
                return False
            self._checked_at = now
            try:
                pointer = (self.store / CURRENT).read_text().strip()
            except FileNotFoundError:
                return False
            if pointer == self._pointer:
                return False
            try:
                info = current_snapshot(self.store)
            except StoreError:
                log.exception("store %s: cannot follow %s=%r; keeping snapshot %s", self.store, CURRENT, pointer, self._pointer)
                return False
            if info is None or (self._pinned is not None and info.snapshot_id == self._pinned.snapshot_id):
                self._pointer = pointer
                return False
            retired = self._pinned
            self._pinned = MemorySnapshot(self, info)  # one reference swap: readers see old or new
            self._pointer = pointer
        if retired is not None:
            retired.reader.retire()
        evicted = self.cache.evict_snapshots_except(info.snapshot_id)
        log.info("store %s: now serving snapshot %s (%d cached indexes dropped)", self.store, info.snapshot_id, evicted)
        return True

    # ---- lazily built dependencies -------------------------------------------------------

    def config(self, preset: str) -> RetrievalConfig:
        """The named preset with the settings' budgets (raises UnknownPresetError)."""
        config = self._configs.get(preset)
        if config is None:
            config = config_from_settings(self.settings, preset)
            with self._config_lock:
                if len(self._configs) < 256:  # names are user input: keep the memo bounded
                    self._configs[preset] = config
        return config

    def embedder(self) -> Embedder:
        with self._embedder_lock:
            if self._embedder is None:
                from tmem.bundle import embedder_for

                # one short text per call: fewer torch threads are faster (query_embedding_threads)
                self._embedder = embedder_for(self.settings, None, threads=self.settings.query_embedding_threads)
            return self._embedder

    def embed_query(self, text: str) -> npt.NDArray[np.float32]:
        return self.embedder().embed([text])[0]

    def chat_model(self) -> ChatModel:
        with self._chat_lock:
            if self._chat is None:
                from tmem.bundle import chat_model_for

                self._chat = chat_model_for(self.settings, "answer", None, run_id=ANSWER_RUN_ID)
            return self._chat

    def cache_stats(self) -> CacheStats:
        return self.cache.stats()

    # ---- the API, on the current snapshot ------------------------------------------------

    def conversations(self) -> tuple[SnapshotConversation, ...]:
        return self.snapshot().conversations()

"""The call layer: what wraps a model adapter on its way to the core, written once.

| module | what it adds |
|---|---|
| :mod:`tmem.llm.response_cache` | answers cached by content key; one usage row per call (:class:`CachedChatModel`) |
| :mod:`tmem.llm.usage` | the usage ledger's sums per operation and run |
| :mod:`tmem.llm.batching` | chosen operations routed through a batch endpoint, resumable by journal |
| :mod:`tmem.llm.journal` | cache, ledger and embedding writes kept in memory by a read-only worker |
| :mod:`tmem.llm.bounded` | the in-flight bound of a process |
| :mod:`tmem.llm.cached_embedder` | each distinct text embedded once per model |
| :mod:`tmem.llm.embed_queue` | one embedding worker per build, calls coalesced |

It depends on :mod:`tmem.ports` only (never on :mod:`tmem.providers` or :mod:`tmem.store`).
"""

"""The build of memory as a library (DESIGN.md §2, §6): what the Prefect flows compose.

* :mod:`tmem.build.spec` — :class:`BuildSpec`, the one serialisable description of a build (store
  location and resolved settings, never a secret) and the build fingerprint;
* :mod:`tmem.build.runtime` — the runtime a process opens from a spec once (working database or a
  Dask worker's read-only exchange, chat model, embedder, stage cache);
* :mod:`tmem.build.stages` — the stage units of one conversation with their retries and their
  content-keyed results (:mod:`tmem.store.stage_cache`);
* :mod:`tmem.build.conversation` — one conversation's pipeline: segment → topics → items →
  item triggers / scene triggers / personas → embedded views;
* :mod:`tmem.build.bookkeeping` — a build run's records: which conversations, quarantine and
  notes as results arrive, the summary and the report;
* :mod:`tmem.build.publish` — the single publisher (vectors, rows, build records, snapshot).

Nothing here imports Prefect: ``tasks/`` wraps these functions, ``flows/`` composes them.
"""

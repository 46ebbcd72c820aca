"""Published snapshots: what the query side reads, written once by a publish and never changed.

| module | holds |
|---|---|
| :mod:`~tmem.store.snapshot.published` | the layout, the manifest (:class:`SnapshotInfo`), publishing, the ``CURRENT`` pointer, pruning |
| :mod:`~tmem.store.snapshot.formats` | the current format (the only one read), and what becomes of each older one |
| :mod:`~tmem.store.snapshot.upgrade` | ``tmem snapshot upgrade``: an older-format current snapshot rewritten in the current one |
| :mod:`~tmem.store.snapshot.image` | one conversation's image (memory and turns as one record) |
| :mod:`~tmem.store.snapshot.image_vectors` | the vector section of an image |
| :mod:`~tmem.store.snapshot.reader` | reading conversations back (the query side's only store access) |
| :mod:`~tmem.store.snapshot.catalog` | counts, runs and quarantine as a snapshot recorded them |
| :mod:`~tmem.store.snapshot.forget` | rewriting published snapshots without a forgotten conversation |
"""

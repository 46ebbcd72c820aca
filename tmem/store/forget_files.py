"""Forgetting a conversation in the plain files of a store: Prefect task results and cache
records, and Dask exchange files. Prefect's files are handled as files (no Prefect import).

* **Task results.** The build tasks of a conversation keep their results and cache records in a
  directory of their own (``STORE/prefect/results/<partition>/``, ``STORE/prefect/cache-keys/
  <store>/<partition>/``, :func:`tmem.ids.conversation_partition`): deleted whole. Results written
  before that layout lie flat in ``STORE/prefect/results/``, and Prefect's own local result storage
  (``PREFECT_LOCAL_STORAGE_PATH``, given as ``result_dirs``) holds results of tasks and flows
  without a storage of their own when ``PREFECT_RESULTS_PERSIST_BY_DEFAULT`` is on; those files are
  read and deleted when their pickle holds a string equal to the conversation id (every domain
  object carries its ``conversation_id``). The pickle is walked with :mod:`pickletools` and never
  loaded, so no code in it runs. A cache record whose result file is gone is deleted with it.
* **Exchange files** (``STORE/exchange/*.duckdb``) are copies a distributed build exports for its
  workers (turns and every cache row of the build's models) and deletes when it ends; any still
  there is the leftover of a build that died, and is deleted (the next build exports afresh).
"""

from __future__ import annotations

import base64
import binascii
import json
import pickletools
import shutil
import struct
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path

from tmem.ids import conversation_partition
from tmem.store.exchange import EXCHANGE_DIR

PREFECT_DIR = "prefect"
RESULTS = "results"
CACHE_KEYS = "cache-keys"
_STRING_OPS = frozenset({"SHORT_BINUNICODE", "BINUNICODE", "BINUNICODE8", "UNICODE", "STRING", "BINSTRING",
                         "SHORT_BINSTRING"})


@dataclass(frozen=True)
class FilesForget:
    """Files that held the conversation (``files``, ``bytes``), by where they were."""

    partition_files: int
    legacy_files: int
    cache_records: int
    exchange_files: int
    bytes: int
    unreadable: int  # legacy result files that are no pickle tmem can walk (kept; listed in the report)

    def as_dict(self) -> dict[str, int]:
        return {"prefect_partition_files": self.partition_files, "prefect_legacy_results": self.legacy_files,
                "prefect_cache_records": self.cache_records, "exchange_files": self.exchange_files,
                "bytes": self.bytes, "prefect_unreadable_kept": self.unreadable}


def _pickle_bytes(data: bytes) -> bytes | None:
    """The pickle inside a Prefect result file: raw base64 (a result stored by key), or a result
    record's JSON whose ``result`` is base64; None for anything else."""
    text = data.strip()
    if text[:1] == b"{":
        try:
            record = json.loads(text)
        except ValueError:
            return None
        inner = record.get("result") if isinstance(record, dict) else None
        text = inner.encode("ascii", "ignore") if isinstance(inner, str) else b""
        if not text:
            return None
    try:
        return base64.b64decode(text, validate=False)
    except (binascii.Error, ValueError):
        return None


def pickle_names(data: bytes, conversation_id: str) -> bool | None:
    """Whether the pickle ``data`` holds a string exactly equal to ``conversation_id`` (None: not a
    pickle). Walked opcode by opcode; nothing is unpickled."""
    try:
        for opcode, arg, _ in pickletools.genops(data):
            if opcode.name in _STRING_OPS:
                value = arg.decode("utf-8", "surrogatepass") if isinstance(arg, bytes) else arg
                if value == conversation_id:
                    return True
    except (ValueError, EOFError, IndexError, struct.error, UnicodeDecodeError):
        return None
    return False


def _files(root: Path, *, recursive: bool) -> Iterator[Path]:
    if not root.is_dir():
        return
    for path in sorted(root.rglob("*") if recursive else root.iterdir()):
        if path.is_file() and not path.is_symlink():
            yield path


def _size(paths: Sequence[Path]) -> int:
    return sum(p.stat().st_size for p in paths if p.exists())


def _partitions(store: Path, conversation_id: str) -> list[Path]:
    name = conversation_partition(conversation_id)
    prefect = store / PREFECT_DIR
    found = [prefect / RESULTS / name]
    keys = prefect / CACHE_KEYS
    if keys.is_dir():
        found += [d / name for d in sorted(keys.iterdir()) if d.is_dir()]
    return [d for d in found if d.is_dir()]


def _legacy_results(store: Path, result_dirs: Sequence[Path], conversation_id: str) -> tuple[list[Path], int]:
    """Result files outside the partitions whose pickle names the conversation, and the count of
    files that could not be read as one."""
    candidates = list(_files(store / PREFECT_DIR / RESULTS, recursive=False))
    for extra in result_dirs:
        candidates += list(_files(Path(extra), recursive=True))
    hits: list[Path] = []
    unreadable = 0
    for path in candidates:
        data = _pickle_bytes(path.read_bytes())
        found = pickle_names(data, conversation_id) if data is not None else None
        if found:
            hits.append(path)
        elif found is None:
            unreadable += 1
    return hits, unreadable


def _orphan_records(store: Path, removed: set[Path]) -> list[Path]:
    """Flat cache records (``cache-keys/<store>/<key>``) pointing at a result file being removed."""
    out: list[Path] = []
    keys = store / PREFECT_DIR / CACHE_KEYS
    if not keys.is_dir():
        return out
    for directory in sorted(d for d in keys.iterdir() if d.is_dir()):
        for path in _files(directory, recursive=False):
            try:
                record = json.loads(path.read_bytes())
            except ValueError:
                continue
            target = record.get("storage_key") if isinstance(record, dict) else None
            if isinstance(target, str) and Path(target).resolve() in removed:
                out.append(path)
    return out


def forget_files(store: Path, conversation_id: str, *, result_dirs: Sequence[Path] = (), dry_run: bool = False) -> FilesForget:
    """Delete (or with ``dry_run`` only count) the files above that hold the conversation."""
    store = Path(store)
    partitions = _partitions(store, conversation_id)
    partition_files = [f for d in partitions for f in _files(d, recursive=True)]
    legacy, unreadable = _legacy_results(store, result_dirs, conversation_id)
    records = _orphan_records(store, {p.resolve() for p in legacy})
    exchange = list(_files(store / EXCHANGE_DIR, recursive=False))
    report = FilesForget(len(partition_files), len(legacy), len(records), len(exchange),
                         _size(partition_files + legacy + records + exchange), unreadable)
    if dry_run:
        return report
    for path in [*legacy, *records, *exchange]:
        path.unlink(missing_ok=True)
    for directory in partitions:
        shutil.rmtree(directory, ignore_errors=False)
    return report

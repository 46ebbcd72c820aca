"""Small helpers shared by the query benchmarks: latency summaries, machine facts, RSS, tables."""

from __future__ import annotations

import os
import platform
import threading
import time
from collections.abc import Sequence
from datetime import UTC, datetime
from typing import Any

import numpy as np


def summary_ms(seconds: Sequence[float]) -> dict[str, float]:
    """p50/p95/p99/mean/min/max in milliseconds of a list of durations in seconds."""
    if not seconds:
        return {"n": 0}
    ms = np.asarray(seconds, dtype=np.float64) * 1000.0
    return {
        "n": int(ms.size),
        "p50": round(float(np.percentile(ms, 50)), 3),
        "p95": round(float(np.percentile(ms, 95)), 3),
        "p99": round(float(np.percentile(ms, 99)), 3),
        "mean": round(float(ms.mean()), 3),
        "min": round(float(ms.min()), 3),
        "max": round(float(ms.max()), 3),
    }


def rss_bytes() -> int:
    """Resident set size of this process now (Linux /proc; 0 elsewhere)."""
    try:
        with open("/proc/self/statm") as fh:
            pages = int(fh.read().split()[1])
    except (OSError, ValueError, IndexError):
        return 0
    return pages * os.sysconf("SC_PAGE_SIZE")


def loadavg() -> list[float]:
    return [round(x, 2) for x in os.getloadavg()]


def machine_info() -> dict[str, Any]:
    """What the numbers were measured on. The machine is shared: the load average matters."""
    mem_total = 0
    try:
        with open("/proc/meminfo") as fh:
            for line in fh:
                if line.startswith("MemTotal:"):
                    mem_total = int(line.split()[1]) * 1024
    except OSError:
        pass
    cpu = platform.processor()
    try:
        with open("/proc/cpuinfo") as fh:
            for line in fh:
                if line.startswith("model name"):
                    cpu = line.split(":", 1)[1].strip()
                    break
    except OSError:
        pass
    import duckdb
    import lancedb

    return {
        "cores": os.cpu_count(),
        "cpu": cpu,
        "memory_gib": round(mem_total / 2**30, 1),
        "python": platform.python_version(),
        "platform": platform.platform(),
        "numpy": np.__version__,
        "duckdb": duckdb.__version__,
        "lancedb": lancedb.__version__,
        "loadavg_start": loadavg(),
        "started_at": datetime.now(UTC).isoformat(timespec="seconds"),
        "shared_machine": "2 cores shared with other helpers working in parallel: compare with the load average",
    }


class Stopwatch:
    """``with Stopwatch() as sw: ...`` then ``sw.s``."""

    def __enter__(self) -> Stopwatch:
        self.started = time.perf_counter()
        return self

    def __exit__(self, *exc: object) -> None:
        self.s = time.perf_counter() - self.started


def table(rows: Sequence[Sequence[object]], header: Sequence[str]) -> str:
    """A plain fixed-width text table."""
    cells = [[str(c) for c in header]] + [[f"{c:.2f}" if isinstance(c, float) else str(c) for c in r] for r in rows]
    widths = [max(len(r[i]) for r in cells) for i in range(len(header))]
    lines = ["  ".join(c.rjust(w) if i else c.ljust(w) for i, (c, w) in enumerate(zip(r, widths, strict=True)))
             for r in cells]
    lines.insert(1, "  ".join("-" * w for w in widths))
    return "\n".join(lines)


def _proc_cpu_seconds(pid: int, own: bool = False) -> float:
    """utime + stime of one process and of its children it has waited for (Linux /proc); ``own``:
    of the process alone."""
    try:
        with open(f"/proc/{pid}/stat") as fh:
            fields = fh.read().rsplit(")", 1)[1].split()
    except (OSError, IndexError):
        return 0.0
    # after the command: state(0) ... utime(11) stime(12) cutime(13) cstime(14)
    return sum(int(fields[i]) for i in ((11, 12) if own else (11, 12, 13, 14))) / os.sysconf("SC_CLK_TCK")


def processes_named(name: str) -> list[int]:
    """Pids of the processes whose command name is ``name`` (e.g. ``postgres``)."""
    found = []
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                with open(f"/proc/{entry}/comm") as fh:
                    if fh.read().strip() == name:
                        found.append(int(entry))
            except OSError:
                continue
    return found


def processes_running(fragment: str) -> list[int]:
    """Pids of the processes whose command line contains ``fragment``."""
    found = []
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                with open(f"/proc/{entry}/cmdline", "rb") as fh:
                    if fragment.encode() in fh.read():
                        found.append(int(entry))
            except OSError:
                continue
    return found


def _machine_cpu_fields(stat_line: str | None = None) -> list[int]:
    """The aggregate ``cpu`` line of /proc/stat: user nice system idle iowait irq softirq steal ..."""
    if stat_line is None:
        with open("/proc/stat") as fh:
            stat_line = fh.readline()
    name, *values = stat_line.split()
    if name != "cpu" or len(values) < 8:
        raise ValueError(f"/proc/stat: expected the aggregate 'cpu' line with 8 or more fields, got {stat_line!r}")
    return [int(x) for x in values]


def machine_busy_seconds(stat_line: str | None = None) -> float:
    """Core-seconds the whole machine spent busy since boot (/proc/stat: all but idle and iowait;
    steal included: time a virtual core was runnable but the host ran someone else)."""
    fields = _machine_cpu_fields(stat_line)
    busy = sum(fields[:8]) - fields[3] - fields[4]
    return busy / os.sysconf("SC_CLK_TCK")


def machine_steal_seconds(stat_line: str | None = None) -> float:
    """Core-seconds the hypervisor took from this VM's cores since boot (/proc/stat's 8th field):
    a phase with much steal ran on a slower machine than one without, whatever the code did."""
    return _machine_cpu_fields(stat_line)[7] / os.sysconf("SC_CLK_TCK")


class CpuAccount:
    """CPU seconds spent by named groups of processes between ``start()`` and ``stop()``.

    ``groups`` maps a name to a function returning the pids to read at that moment (read at both
    ends; a pid gone at the end counts only what it had when it was last read). ``children`` is
    this process's waited-for children (``RUSAGE_CHILDREN``: a phase run with ``subprocess.run``),
    ``self`` this process, ``machine`` every core of the machine, ``steal`` the part of ``machine``
    the host gave to another tenant (a noisy neighbour: compare runs only with their steal in view)."""

    def __init__(self, groups: dict[str, Any], polled: dict[str, Any] | None = None, every_s: float = 0.5,
                 own: frozenset[str] = frozenset()) -> None:
        self.groups = groups
        self.own = own  # polled groups read without their processes' children (e.g. Dask workers' encoders)
        # groups whose processes come and go inside the phase (e.g. the build's encoder children): read
        # every ``every_s`` by a thread, each pid counted from its value at start (0 if born later) to
        # its last reading
        self.polled = polled or {}
        self.every_s = every_s
        self._start: dict[str, float] = {}
        self._first: dict[str, dict[int, float]] = {}
        self._last: dict[str, dict[int, float]] = {}
        self._stop_polling: threading.Event | None = None
        self._poller: threading.Thread | None = None

    def _poll(self, baseline: bool = False) -> None:
        for name, pids in self.polled.items():
            for pid in pids():
                value = _proc_cpu_seconds(pid, own=name in self.own)
                if value <= 0.0:
                    continue
                self._last[name][pid] = value
                if baseline:
                    self._first[name][pid] = value

    def _read(self) -> dict[str, float]:
        import resource

        me, kids = resource.getrusage(resource.RUSAGE_SELF), resource.getrusage(resource.RUSAGE_CHILDREN)
        now = {"machine": machine_busy_seconds(), "steal": machine_steal_seconds(), "self": me.ru_utime + me.ru_stime,
               "children": kids.ru_utime + kids.ru_stime}
        for name, pids in self.groups.items():
            now[name] = sum(_proc_cpu_seconds(pid) for pid in pids())
        return now

    def start(self) -> None:
        self._start = self._read()
        self._first = {name: {} for name in self.polled}
        self._last = {name: {} for name in self.polled}
        if self.polled:
            self._poll(baseline=True)
            stop = self._stop_polling = threading.Event()

            def loop() -> None:
                while not stop.wait(self.every_s):
                    self._poll()

            self._poller = threading.Thread(target=loop, name="cpu-poller", daemon=True)
            self._poller.start()

    def stop(self) -> dict[str, float]:
        end = self._read()
        spent = {name: round(end[name] - self._start.get(name, 0.0), 1) for name in end}
        if self._poller is not None and self._stop_polling is not None:
            self._stop_polling.set()
            self._poller.join()
            self._poller = None
        for name in self.polled:
            spent[name] = round(sum(v - self._first[name].get(pid, 0.0) for pid, v in self._last[name].items()), 1)
        return spent

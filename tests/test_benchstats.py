"""bench/benchstats.CpuAccount: CPU seconds of process groups over a phase, including processes
that start and end inside it (a build's encoder children)."""

from __future__ import annotations

import os
import subprocess
import sys
import time

import pytest

from bench.benchstats import CpuAccount, machine_busy_seconds, machine_steal_seconds, processes_running

BURN = "import time, sys\nend = time.process_time() + float(sys.argv[1])\nwhile time.process_time() < end: pass\ntime.sleep(float(sys.argv[2]))"


def _burner(marker: str, cpu_s: float, linger_s: float) -> subprocess.Popen[bytes]:
    return subprocess.Popen([sys.executable, "-c", BURN, str(cpu_s), str(linger_s), marker])


def test_polled_group_counts_a_process_born_and_gone_inside_the_phase() -> None:
    marker = f"cpu-account-born-{time.monotonic_ns()}"
    account = CpuAccount({}, polled={"burners": lambda: processes_running(marker)}, every_s=0.05)
    account.start()
    child = _burner(marker, 0.4, 0.3)  # reads taken while it lingers after burning
    child.wait()
    spent = account.stop()
    assert 0.3 <= spent["burners"] <= 1.0


def test_polled_group_counts_only_what_a_running_process_spent_after_start() -> None:
    marker = f"cpu-account-old-{time.monotonic_ns()}"
    child = _burner(marker, 0.6, 5.0)
    try:
        deadline = time.monotonic() + 10
        while not processes_running(marker) and time.monotonic() < deadline:
            time.sleep(0.01)
        time.sleep(0.8)  # it has burnt its CPU and now sleeps
        account = CpuAccount({}, polled={"burners": lambda: processes_running(marker)}, every_s=0.05)
        account.start()
        time.sleep(0.2)
        assert account.stop()["burners"] < 0.1
    finally:
        child.kill()
        child.wait()


PARENT = (
    "import subprocess, sys, time\n"
    "child = subprocess.Popen([sys.executable, '-c', sys.argv[1], '0.5', '0'])\n"
    "child.wait()\n"  # the child's CPU is now in this process's cutime
    "time.sleep(float(sys.argv[2]))"
)


def test_an_own_group_leaves_out_the_cpu_of_children_its_processes_waited_for() -> None:
    """As a Dask worker's encoder children are counted in their own group, not again in the worker's."""
    marker = f"cpu-account-parent-{time.monotonic_ns()}"
    account = CpuAccount({}, polled={"with": lambda: processes_running(marker), "own": lambda: processes_running(marker)},
                         every_s=0.05, own=frozenset({"own"}))
    account.start()
    parent = subprocess.Popen([sys.executable, "-c", PARENT, BURN, "0.6", marker])
    parent.wait()
    spent = account.stop()
    assert spent["with"] >= 0.45 and spent["own"] < spent["with"] - 0.35


def test_steal_is_the_eighth_field_of_the_cpu_line_and_part_of_busy_time() -> None:
    tick = os.sysconf("SC_CLK_TCK")
    line = f"cpu  {100 * tick} 0 {50 * tick} {900 * tick} {7 * tick} 0 {3 * tick} {40 * tick} 0 0"
    assert machine_steal_seconds(line) == 40.0
    assert machine_busy_seconds(line) == 193.0  # user + system + softirq + steal; idle, iowait left out


def test_a_line_that_is_not_the_aggregate_cpu_line_is_refused_by_name() -> None:
    with pytest.raises(ValueError, match="aggregate 'cpu' line"):
        machine_steal_seconds("cpu0 1 2 3 4 5 6 7 8")


def test_the_account_reports_the_machines_steal_over_the_phase() -> None:
    account = CpuAccount({})
    account.start()
    spent = account.stop()
    assert "steal" in spent and 0.0 <= spent["steal"] <= spent["machine"] + 0.1

"""CPU time of processes, from ``/proc/PID/stat`` (all threads: ZeroMQ's I/O threads too)."""

from __future__ import annotations

import os
import time
from collections.abc import Iterator
from typing import Any

_TICK = os.sysconf("SC_CLK_TCK") if hasattr(os, "sysconf") else 100


def cpu_seconds(pid: int, thread: int | None = None) -> float:
    """User + system CPU seconds of ``pid`` (of its thread ``thread``) so far (0 when it is
    gone)."""
    path = f"/proc/{pid}/stat" if thread is None else f"/proc/{pid}/task/{thread}/stat"
    try:
        with open(path) as f:
            text = f.read()
    except OSError:
        return 0.0
    # The command name (field 2) may hold spaces: fields after it are counted from its ')'.
    fields = text[text.rindex(")") + 2 :].split()
    return (int(fields[11]) + int(fields[12])) / _TICK


def cpu_of(pids: list[int]) -> list[float]:
    return [cpu_seconds(p) for p in pids]


class CpuWindow:
    """CPU seconds spent by some processes between ``start()`` and ``stop()``."""

    def __init__(self, pids: list[int]) -> None:
        self.pids = pids
        self._start: list[float] = []
        self.spent: list[float] = []

    def start(self) -> None:
        self._start = cpu_of(self.pids)

    def stop(self) -> list[float]:
        self.spent = [b - a for a, b in zip(self._start, cpu_of(self.pids), strict=True)]
        return self.spent


def machine_cpu() -> tuple[float, float]:
    """(busy, total) CPU seconds of the whole machine so far, every core, from /proc/stat
    (total includes idle; (0, 0) where there is none)."""
    try:
        with open("/proc/stat") as f:
            fields = [int(x) for x in f.readline().split()[1:]]
    except (OSError, ValueError):
        return 0.0, 0.0
    total = sum(fields[:8])  # user nice system idle iowait irq softirq steal (guest: in user)
    return (total - fields[3] - fields[4]) / _TICK, total / _TICK


def others_share(before: tuple[float, float], after: tuple[float, float], ours: float) -> float:
    """The share of the machine's CPU that processes other than ``ours`` (CPU seconds) took
    between two ``machine_cpu()`` readings: what a noisy neighbour took from a measurement."""
    total = after[1] - before[1]
    return max(0.0, (after[0] - before[0] - ours) / total) if total > 0 else 0.0


WARMUP = 3


def timed(
    batches: Iterator[int], count: int, others: list[int], warmup: int = WARMUP
) -> dict[str, Any]:
    """Images/s over ``count`` batches after ``warmup`` untimed ones, with the CPU seconds
    this process and ``others`` spent meanwhile, and the share of the machine's CPU that
    went to other processes (a noisy neighbour)."""
    for _ in range(warmup):
        next(batches)
    window = CpuWindow([os.getpid(), *others])
    window.start()
    machine = machine_cpu()
    start = time.perf_counter()
    images = sum(next(batches) for _ in range(count))
    elapsed = time.perf_counter() - start
    spent = window.stop()
    return {
        "images_per_s": images / elapsed,
        "images": images,
        "seconds": elapsed,
        "cpu_self_s": spent[0],
        "cpu_others_s": spent[1:],
        "others_cpu_share": others_share(machine, machine_cpu(), sum(spent)),
    }

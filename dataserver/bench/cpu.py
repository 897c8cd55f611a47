"""CPU time of processes, from ``/proc/PID/stat`` (all threads: ZeroMQ's I/O threads too)."""

from __future__ import annotations

import os

_TICK = os.sysconf("SC_CLK_TCK") if hasattr(os, "sysconf") else 100


def cpu_seconds(pid: int) -> float:
    """User + system CPU seconds of ``pid`` so far (0 when it is gone)."""
    try:
        with open(f"/proc/{pid}/stat") as f:
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

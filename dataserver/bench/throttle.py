"""The slow_server figure's throttle (``python -m dataserver.bench.throttle PID...``): stops
the processes ``STOP_S`` of every ``CYCLE_S`` (SIGSTOP, SIGCONT) until SIGTERM, then lets
them go on. A server throttled so looks like a node whose CPU is taken by others: right
answers, a tenth of its rate, in bursts."""

from __future__ import annotations

import os
import signal
import sys
import time

STOP_S, CYCLE_S = 0.09, 0.1  # stopped 90 ms of every 100 ms


def throttle(pids: list[int]) -> None:
    running = [True]
    signal.signal(signal.SIGTERM, lambda *_: running.__setitem__(0, False))

    def send(sig: int) -> None:
        for pid in pids:
            try:
                os.kill(pid, sig)
            except ProcessLookupError:
                pass

    try:
        while running[0]:
            send(signal.SIGSTOP)
            time.sleep(STOP_S)
            send(signal.SIGCONT)
            time.sleep(CYCLE_S - STOP_S)
    finally:
        send(signal.SIGCONT)


if __name__ == "__main__":
    throttle([int(p) for p in sys.argv[1:]])

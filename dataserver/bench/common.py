"""What every figure of ``dataserver bench`` shares: running one side in a fresh process,
a server for the figure, rounds that alternate the sides, medians."""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any

from dataserver.admin import child_pids
from dataserver.demo import start_server, stop_server

Progress = Callable[[str], None]


def run_side(side: str, args: argparse.Namespace, **opts: Any) -> dict[str, Any]:
    """Run one side of a comparison in a fresh process; return what it printed."""
    cmd = [sys.executable, "-m", "dataserver.bench.side", side]
    base = {
        "workers": args.workers,
        "batch_size": args.batch_size,
        "image_size": args.image_size,
        "batches": args.batches,
    }
    for key, value in {**base, **opts}.items():
        cmd += [f"--{key.replace('_', '-')}", str(value)]
    out = subprocess.run(cmd, capture_output=True, text=True, timeout=900, check=False)
    lines = [line for line in out.stdout.splitlines() if line.startswith("{")]
    if out.returncode != 0 or not lines:
        raise RuntimeError(f"bench side {side} failed:\n{out.stderr[-3000:]}")
    return dict(json.loads(lines[-1]))


def served(args: argparse.Namespace, address: str, pids: list[int], **opts: Any) -> dict[str, Any]:
    """The dataserver side against the server at ``address``, whose processes are ``pids``
    (their CPU time is counted with the client's)."""
    return run_side(
        "dataserver", args, address=address, server_pids=",".join(map(str, pids)), **opts
    )


@contextmanager
def server(flags: list[str], timeout: float = 60.0) -> Iterator[tuple[str, list[int]]]:
    """A ``dataserver serve`` for the figure: (address, [front pid, worker pids...])."""
    proc, address = start_server(flags, timeout=timeout)
    try:
        pids = [proc.pid, *child_pids(proc.pid)]
        yield address, pids
    finally:
        stop_server(proc)


def med(values: list[float]) -> float:
    return statistics.median(values)


def rounds(
    args: argparse.Namespace, progress: Progress, sides: dict[str, Callable[[], dict[str, Any]]]
) -> dict[str, list[dict[str, Any]]]:
    """Each side ``args.rounds`` times, alternating; progress after each run."""
    out: dict[str, list[dict[str, Any]]] = {name: [] for name in sides}
    for r in range(args.rounds):
        for name, run in sides.items():
            result = run()
            out[name].append(result)
            rate = result.get("images_per_s")
            shown = f"{rate:,.0f} images/s" if isinstance(rate, (int, float)) else ""
            progress(f"round {r + 1}/{args.rounds}: {name} {shown}")
    return out


def _per_image_ms(run: dict[str, Any]) -> float:
    return 1000 * (run["cpu_self_s"] + sum(run["cpu_others_s"])) / run["images"]

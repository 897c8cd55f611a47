"""``dataserver bench --only slow_server``: what a slow but correct server costs a job.

Two 1-worker servers serve the same data (``dataserver.data.simulated:held``: samples that
cost ``MS`` ms of sleep, no CPU, so the machine's cores are not what is measured; no store,
so a slow server stays slow); one of them is slow in one of four ways:

- ``hold_0.9s``: every sample held 0.9 s more (under the client's 1 s deadline floor);
- ``hold_3s``: every sample held 3 s (past the deadline);
- ``tail_5pct_2s``: 5% of the samples (by a hash of the index) held 2 s: a heavy tail;
- ``throttled_10pct``: a healthy server stopped 90 ms of every 100 ms (SIGSTOP/SIGCONT to
  its front and worker, by a helper process: ``python -m dataserver.bench.throttle``).

Each case runs with ``hedge=True`` (the default) and ``hedge=False`` (what the client did
before hedging), side by side, alternating, ``--rounds`` times, medians. Reported against
the healthy server alone (throughput: the target is >= 0.9, it can do the work alone),
run in the same rounds as each case (on a shared machine a reference taken minutes before
is another machine), and a healthy pair (the p99 wait in ``next()``: target within 2x),
and the extra work hedging costs with no slow server (hedges / tasks: target <= 10%).
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

from dataserver.admin import child_pids
from dataserver.bench.common import Progress, med, rounds, run_side
from dataserver.demo import start_server, stop_server

MS = 2.0  # a sample's cost on a healthy server (sleep): one worker makes ~500 a second
N = 4096
WARMUP = 3  # batches (or ``WARMUP_S``, whichever ends first) before the clock starts
WARMUP_S = 2.0
IMAGE = 64
CASES = {
    "hold_0.9s": {"hold_ms": 900.0, "share": 1.0},
    "hold_3s": {"hold_ms": 3000.0, "share": 1.0},
    "tail_5pct_2s": {"hold_ms": 2000.0, "share": 0.05},
}


def _flags(hold_ms: float = 0.0, share: float = 1.0) -> list[str]:
    dataset = {"n": N, "ms": MS, "size": 32, "hold_ms": hold_ms, "share": share}
    return [
        "--dataset",
        "dataserver.data.simulated:held",
        "--dataset-args",
        json.dumps(dataset),
        "--workers",
        "1",
        "--cache-gb",
        "0",
    ]


@contextmanager
def _server(hold_ms: float = 0.0, share: float = 1.0) -> Iterator[tuple[str, list[int]]]:
    proc, address = start_server(_flags(hold_ms, share), timeout=120)
    try:
        yield address, [proc.pid, *child_pids(proc.pid)]
    finally:
        stop_server(proc)


@contextmanager
def _throttled(pids: list[int]) -> Iterator[None]:
    """``pids`` stopped 90 ms of every 100 ms by a helper process meanwhile."""
    helper = subprocess.Popen(
        [sys.executable, "-m", "dataserver.bench.throttle", *map(str, pids)],
        stdin=subprocess.PIPE,
    )
    try:
        yield
    finally:
        helper.terminate()  # (it lets them go on before it exits)
        helper.wait(10)
        for pid in pids:  # (and should it have died first)
            try:
                os.kill(pid, signal.SIGCONT)
            except ProcessLookupError:
                pass


def slow_server_side(args: argparse.Namespace) -> dict[str, Any]:
    """The trainer's side: batches for ``--seconds`` after a warm-up; images/s, the waits
    in ``next()`` and the client's hedging counters."""
    from dataserver_client import DataServerClient, iterate_epochs

    extra = json.loads(args.client_args)
    with DataServerClient(
        args.address.split(","),
        batch_size=args.batch_size,
        image_size=(IMAGE, IMAGE),
        stitch_k=1,
        device="cpu",
        timeout=120,
        **extra,
    ) as client:
        batches = iterate_epochs(client)
        start = time.perf_counter()
        for _ in range(WARMUP):
            next(batches)
            if time.perf_counter() - start > WARMUP_S:
                break
        before = client.stats()
        waits: list[float] = []
        images = 0
        start = time.perf_counter()
        while time.perf_counter() - start < args.seconds:
            asked = time.perf_counter()
            images += len(next(batches))
            waits.append((time.perf_counter() - asked) * 1e3)
        elapsed = time.perf_counter() - start
        stats = client.stats()
    sent = sum(s["sent"] for s in stats["servers"]) - sum(s["sent"] for s in before["servers"])
    hedged = stats["hedged"] - before["hedged"]
    return {
        "images_per_s": images / elapsed,
        "waits_ms": waits,
        "hedged": hedged,
        "hedge_won": stats["hedge_won"] - before["hedge_won"],
        "tasks": sent - hedged,
        "hedging": stats["hedging"],
    }


def _p99(waits: list[float]) -> float:
    ordered = sorted(waits)
    return ordered[min(len(ordered) - 1, int(0.99 * len(ordered)))] if ordered else 0.0


def _run(args: argparse.Namespace, addresses: list[str], hedge: bool) -> dict[str, Any]:
    opts = {"client_args": json.dumps({"hedge": hedge}), "seconds": args.slow_seconds}
    return run_side("slow_server", args, address=",".join(addresses), **opts)


def _case(
    args: argparse.Namespace, progress: Progress, addresses: list[str]
) -> dict[str, list[dict[str, Any]]]:
    """Hedging on and off against ``addresses``, and the healthy server (the first) alone,
    alternating in each round."""
    return rounds(
        args,
        progress,
        {
            "hedge_on": lambda: _run(args, addresses, True),
            "hedge_off": lambda: _run(args, addresses, False),
            "alone": lambda: _run(args, addresses[:1], True),
        },
    )


def _summary(runs: dict[str, list[dict[str, Any]]], pair_p99: float) -> dict[str, Any]:
    solo = runs.pop("alone")
    alone = med([r["images_per_s"] for r in solo])
    out: dict[str, Any] = {
        "healthy_alone_images_per_s": round(alone, 1),
        # (the floor the p99 target meets: one server doing the pair's work alone)
        "healthy_alone_p99_wait_ms": round(med([_p99(r["waits_ms"]) for r in solo]), 1),
    }
    for side, each in runs.items():
        rate = med([r["images_per_s"] for r in each])
        p99 = med([_p99(r["waits_ms"]) for r in each])
        out[side] = {
            "images_per_s": round(rate, 1),
            "vs_healthy_alone": round(rate / alone, 3) if alone else None,
            "p99_wait_ms": round(p99, 1),
            "p99_vs_healthy_pair": round(p99 / pair_p99, 2) if pair_p99 else None,
            "hedged_share": round(
                sum(r["hedged"] for r in each) / max(1, sum(r["tasks"] for r in each)), 4
            ),
            "hedge_won": sum(r["hedge_won"] for r in each),
        }
    return out


def fig_slow_server(args: argparse.Namespace, spec: str, progress: Progress) -> dict[str, Any]:
    """The figure (``spec`` unused: its servers serve the ``held`` dataset)."""
    out: dict[str, Any] = {"sample_ms": MS, "seconds_per_run": args.slow_seconds}
    with _server() as (healthy, _), _server() as (other, other_pids):
        pair = _case(args, progress, [healthy, other])
        pair_p99 = med([_p99(r["waits_ms"]) for r in pair["hedge_on"]])
        out["healthy_pair"] = _summary(pair, pair_p99)
        out["healthy_alone_images_per_s"] = out["healthy_pair"]["healthy_alone_images_per_s"]
        out["extra_work_no_slow_server"] = out["healthy_pair"]["hedge_on"]["hedged_share"]
        for name, hold in CASES.items():
            with _server(hold["hold_ms"], hold["share"]) as (slow, _):
                progress(f"{name}: the slow server is up")
                out[name] = _summary(_case(args, progress, [healthy, slow]), pair_p99)
        with _throttled(other_pids):
            progress("throttled_10pct: the other server is stopped 90 ms of every 100 ms")
            out["throttled_10pct"] = _summary(_case(args, progress, [healthy, other]), pair_p99)
    return out

"""Bounded memory: a 2,000-batch soak keeps both sides flat after warm-up, and a client that
stops reading (or ignores its credit) cannot make the server buffer without bound."""

from __future__ import annotations

import json
import subprocess
import sys
import time
from typing import Any

import pytest
import zmq
from conftest import PLUGINS, server_env

from dataserver import protocol
from dataserver.protocol import MsgType
from dataserver_client import DataServerClient

MB = 1 << 20


def rss(pid: int) -> int:
    with open(f"/proc/{pid}/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) * 1024
    return 0


@pytest.mark.timeout(300)
def test_soak_2000_batches_memory_is_flat_on_both_sides(start_server: Any) -> None:
    # Workers keep up to --cache-mb of prepared sources by design: a small cap lets the
    # warm-up fill it, so what is measured after it is leaks, not the cache filling.
    server = start_server(
        "--dataset", "ds_plugins:flat", "--dataset-args", json.dumps({"n": 500}), "--cache-mb", "8"
    )
    pids = [server.pid, *server.worker_pids()]
    client = subprocess.Popen(
        [sys.executable, str(PLUGINS / "soak_client.py"), server.address, "2000", "500"],
        stdout=subprocess.PIPE,
        text=True,
        env=server_env(),
    )
    warm: dict[int, int] = {}
    deadline = time.monotonic() + 280
    while client.poll() is None and time.monotonic() < deadline:
        done = server.stats()["counters"].get("tasks_done", 0)
        if not warm and done > 500 * 8:  # past the client's warm-up
            warm = {pid: rss(pid) for pid in pids}
        time.sleep(0.2)
    end = {pid: rss(pid) for pid in pids}
    out, _ = client.communicate(timeout=30)
    assert client.returncode == 0
    result = json.loads(out.strip().splitlines()[-1])
    growth = {"client": result["end"] - result["warm"]}
    growth.update({f"server pid {pid}": end[pid] - warm[pid] for pid in pids})
    print("\nRSS after warm-up -> end:")
    print(f"  client: {result['warm'] / MB:.1f} -> {result['end'] / MB:.1f} MiB")
    for pid in pids:
        print(f"  server pid {pid}: {warm[pid] / MB:.1f} -> {end[pid] / MB:.1f} MiB")
    assert result["batches"] == 2000
    for who, grew in growth.items():
        assert grew < 8 * MB, f"{who} grew {grew / MB:.1f} MiB over 1,500 batches"


@pytest.mark.timeout(120)
def test_a_client_that_stops_reading_is_bounded(start_server: Any) -> None:
    server = start_server("--dataset", "synthetic:images=64,seed=0")
    with DataServerClient(
        server.address, batch_size=8, image_size=(256, 256), prefetch=2, device="cpu"
    ) as c:
        c.set_epoch(0)
        next(iter(c))
        time.sleep(2.0)  # the trainer stalls: nothing more is planned than prefetch allows
        done = server.stats()["counters"]["tasks_done"]
        assert done <= 8 * (1 + 2), done
        assert server.stats()["queue_depth"] == 0


@pytest.mark.timeout(120)
def test_a_client_that_ignores_credit_and_never_reads_is_capped(start_server: Any) -> None:
    server = start_server("--dataset", "synthetic:images=64,seed=0", workers=1)
    ctx = zmq.Context()
    sock = ctx.socket(zmq.DEALER)
    sock.setsockopt(zmq.LINGER, 0)
    sock.setsockopt(zmq.RCVHWM, 1)
    sock.setsockopt(zmq.RCVBUF, 4096)
    sock.connect(server.address)
    try:
        session = b"g" * 16
        sock.send_multipart(protocol.make(MsgType.HELLO, {"session": session}))
        before = rss(server.pid)
        for task_id in range(1, 3001):  # far beyond any credit, at 512 x 512 each
            header = {
                "session": session,
                "task_id": task_id,
                "plan_version": 1,
                "epoch": 0,
                "seed": 0,
                "indices": [task_id % 64],
                "grid": 1,
                "out_hw": [512, 512],
                "on_error": "raise",
                "control_seq": 0,
                "control": {},
            }
            sock.send_multipart(protocol.make(MsgType.TASK, header))
        time.sleep(8.0)
        stats = server.stats()
        grew = rss(server.pid) - before
        print(
            f"\nfront RSS grew {grew / MB:.1f} MiB; rejected {stats['rejected']}; counters {stats['counters']}"
        )
        assert stats["rejected"].get("queue_full", 0) > 2000
        assert stats["queue_depth"] <= 64
        assert grew < 150 * MB  # bounded by the queue cap and the send high-water mark
    finally:
        sock.close(linger=0)
        ctx.term()
    # ... and everyone else is still served.
    with DataServerClient(server.address, batch_size=8, image_size=(32, 32), device="cpu") as c:
        c.set_epoch(0)
        assert sum(len(b) for b in c) == 64

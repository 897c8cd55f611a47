"""Guarantees 2, 4 and 6 under real failures: workers and servers killed with SIGKILL,
servers restarted, poison samples. Every epoch still delivers each index exactly once."""

from __future__ import annotations

import json
import os
import signal
import time
from typing import Any

import pytest
import torch
from clients import make_client
from conftest import Server, free_port, wait_until

from dataserver_client import Batch, DataServerError

pytestmark = pytest.mark.timeout(150)

SLOW = ("--dataset", "ds_plugins:slow", "--dataset-args", json.dumps({"n": 96, "ms": 15}))


def indices(batches: list[Batch]) -> list[int]:
    return [i for b in batches for idx in b.indices for i in idx]


def kill(pid: int) -> None:
    os.kill(pid, signal.SIGKILL)


def test_killed_workers_are_replaced_and_the_epoch_is_exact_and_identical(
    start_server: Any,
) -> None:
    server = start_server(*SLOW, "--cache-gb", "0", workers=2)  # slow every time: killed mid-task
    kw: dict[str, Any] = {
        "batch_size": 8,
        "image_size": (48, 64),
        "seed": 2,
        "prefetch": 2,
    }
    with make_client(server.address, **kw) as c:
        c.set_epoch(0)
        reference = list(c)
    with make_client(server.address, **kw) as c:
        c.set_epoch(0)
        got = []
        for n, batch in enumerate(c):
            got.append(batch)
            if n == 2:
                kill(server.worker_pids()[0])  # one worker, mid-task
            if n == 6:
                for pid in server.worker_pids():  # every worker at once
                    kill(pid)
    assert sorted(indices(got)) == list(range(96))
    for a, b in zip(reference, got, strict=True):
        assert a.indices == b.indices and torch.equal(a.images, b.images)
    stats = server.stats()
    assert stats["counters"]["worker_deaths"] >= 3
    assert stats["counters"].get("tasks_retried", 0) >= 1
    assert wait_until(lambda: server.stats()["workers_alive"] == 2, 10)


def test_poison_sample_is_named_and_can_be_skipped(start_server: Any) -> None:
    server = start_server(
        "--dataset", "ds_plugins:poison", "--dataset-args", json.dumps({"n": 24, "index": 7})
    )
    with make_client(
        server.address, batch_size=4, image_size=(32, 32), shuffle=False, timeout=30
    ) as c:
        c.set_epoch(0)
        it = iter(c)
        assert next(it).indices == [[0], [1], [2], [3]]
        with pytest.raises(DataServerError, match="sample 7 killed 2 worker processes") as info:
            next(it)
        assert info.value.index == 7
        assert next(it).indices == [[8], [9], [10], [11]]
    with make_client(
        server.address,
        batch_size=4,
        image_size=(32, 32),
        shuffle=False,
        on_error="skip",
    ) as c:
        c.set_epoch(0)
        batches = list(c)
    assert sorted(indices(batches)) == [i for i in range(24) if i != 7]
    assert sum(b.skipped for b in batches) == 1
    assert server.stats()["counters"]["tasks_poisoned"] >= 2
    assert wait_until(lambda: server.stats()["workers_alive"] == 2, 10)


def test_a_poison_sample_in_a_stitched_image_costs_only_itself(start_server: Any) -> None:
    server = start_server(
        "--dataset", "ds_plugins:poison", "--dataset-args", json.dumps({"n": 24, "index": 7})
    )
    with make_client(
        server.address,
        batch_size=2,
        image_size=(64, 64),
        shuffle=False,
        on_error="skip",
    ) as c:
        c.set_mode("stitch")
        c.set_epoch(0)
        batches = list(c)
    assert sorted(indices(batches)) == [i for i in range(24) if i != 7]
    assert sum(b.skipped for b in batches) == 1 and [
        i for b in batches for i in b.skipped_indices
    ] == [7]
    group = next(grp for b in batches for grp in b.indices if 6 in grp)
    assert group == [4, 5, 6]  # the image still holds the poison sample's three neighbours


def test_a_killed_server_s_tasks_move_to_the_other(start_server: Any) -> None:
    a = start_server(*SLOW, workers=2)
    b = start_server(*SLOW, workers=2)
    with make_client([a.address, b.address], batch_size=8, image_size=(32, 32), timeout=20) as c:
        c.set_epoch(0)
        got = []
        start = time.monotonic()
        for n, batch in enumerate(c):
            got.append(batch)
            if n == 3:
                b.kill()
        elapsed = time.monotonic() - start
        servers = {s["address"]: s for s in c.stats()["servers"]}
    assert sorted(indices(got)) == list(range(96))
    assert elapsed < 8  # the lost server's tasks moved within seconds, not after the 20 s timeout
    assert servers[b.address]["state"] == "lost"


def test_a_server_restarted_on_the_same_port_is_picked_up_again(start_server: Any) -> None:
    port = free_port()
    first = Server(*SLOW, workers=2, bind=f"tcp://127.0.0.1:{port}")
    replacement: Server | None = None
    try:
        with make_client(first.address, batch_size=8, image_size=(32, 32), timeout=30) as c:
            c.set_epoch(0)
            got = []
            for n, batch in enumerate(c):
                got.append(batch)
                if n == 3:
                    first.kill()
                    time.sleep(0.5)
                    replacement = Server(*SLOW, workers=2, bind=f"tcp://127.0.0.1:{port}")
        assert sorted(indices(got)) == list(range(96))
        assert replacement is not None and replacement.stats()["counters"]["tasks_done"] > 0
    finally:
        first.stop()
        if replacement is not None:
            replacement.stop()


def test_the_client_raises_when_its_only_server_stays_away(start_server: Any) -> None:
    server = start_server(*SLOW, workers=1)
    with make_client(server.address, batch_size=8, image_size=(32, 32), timeout=3) as c:
        c.set_epoch(0)
        it = iter(c)
        next(it)
        server.kill()
        start = time.monotonic()
        with pytest.raises(
            DataServerError, match=f"no progress for 3 s; waiting for: {server.address}"
        ):
            for _ in it:
                pass
        assert time.monotonic() - start < 15

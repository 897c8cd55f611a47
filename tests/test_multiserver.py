"""A client over several servers: tasks spread over all of them, results identical."""

from __future__ import annotations

from typing import Any

import pytest
import torch
from clients import make_client
from conftest import wait_until

pytestmark = pytest.mark.timeout(90)


def idle(server: Any) -> bool:
    stats = server.stats()
    return bool(stats["workers_busy"] == 0 and stats["queue_depth"] == 0)


def test_client_spreads_tasks_over_two_servers(start_server: Any) -> None:
    a = start_server("--dataset", "synthetic:images=64,seed=2", workers=2)
    b = start_server("--dataset", "synthetic:images=64,seed=2", workers=2)
    # Without hedging: a hedged task's copy decodes its sources on the second server by
    # design (test_slow_servers.py); what is counted here is where keys route.
    with make_client(
        [a.address, b.address], batch_size=8, image_size=(64, 64), hedge=False
    ) as client:
        client.set_epoch(0)
        batches = list(client)
        assert wait_until(lambda: idle(a) and idle(b), 10)
        per_server = {s["address"]: s["results"] for s in client.stats()["servers"]}
    assert sorted(i for bt in batches for idx in bt.indices for i in idx) == list(range(64))
    images = [s.stats()["counters"].get("images_done", 0) for s in (a, b)]
    decoded = [s.stats()["counters"].get("sources_decoded", 0) for s in (a, b)]
    assert min(images) >= 16, images  # both servers did a real share of the work
    # Each sample belongs to one server's store (rendezvous hashing): the lookahead's
    # second composition of a batch reuses the source there instead of decoding it again.
    # (Without affinity about a third of the samples were decoded on both servers; a rare
    # race still lets one group of k go to both, hence the margin of one batch.)
    assert 64 <= sum(decoded) <= 64 + 8, decoded
    tasks = [a.stats()["counters"]["tasks_done"], b.stats()["counters"]["tasks_done"]]
    assert per_server == {a.address: tasks[0], b.address: tasks[1]}
    # Same batches as from one server alone.
    with make_client(a.address, batch_size=8, image_size=(64, 64)) as single:
        single.set_epoch(0)
        for x, y in zip(batches, single, strict=True):
            assert x.indices == y.indices and torch.equal(x.images, y.images)


def test_servers_with_different_datasets_are_refused(start_server: Any) -> None:
    a = start_server("--dataset", "synthetic:images=64,seed=2", workers=1)
    b = start_server("--dataset", "synthetic:images=64,seed=3", workers=1)
    with pytest.raises(Exception, match="servers disagree on the dataset"):
        make_client([a.address, b.address], timeout=5)


@pytest.mark.parametrize(
    ("flags", "transport"),
    [
        (["--direct-results"], "ipc://"),  # a client on the server's host: over ipc
        (["--direct-results", "--no-local-results"], "tcp://"),
        (["--no-direct-results"], None),
    ],
)
def test_results_come_straight_from_workers_or_through_the_front(
    start_server: Any, flags: list[str], transport: str | None
) -> None:
    direct = transport is not None
    server = start_server("--dataset", "synthetic:images=48,seed=2", *flags, workers=2)
    with make_client(server.address, batch_size=8, image_size=(64, 64)) as c:
        c.set_epoch(0)
        assert sorted(i for b in c for idx in b.indices for i in idx) == list(range(48))
        endpoints = c._engine.links.links[0].result_endpoints if c._engine.links else set()
        assert all(e.startswith(transport or "-") for e in endpoints) if direct else not endpoints
        # The lookahead's last tasks are answered while the client is still there to take them.
        assert wait_until(lambda: idle(server), 10)
    counters = server.stats()["counters"]
    assert counters["sources_decoded"] == 48  # each once (the lookahead composes some twice)
    direct_count = counters.get("results_direct", 0)
    assert counters.get("results_via_front", 0) + direct_count == counters["tasks_done"]
    if direct:  # all but those sent before the client had connected
        assert direct_count >= counters["tasks_done"] - 2
    else:
        assert direct_count == 0

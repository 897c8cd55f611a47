"""Guarantee 7 shown by a fuzzer that knows the protocol: every message type built field by
field with edge values, sent over real sockets to a live server's data port, to its
workers' result sockets, and to a live client (through a hostile fake server beside
a real one). Afterwards nothing crashed, nothing raised inside a handler, and a whole epoch
is served exactly once.

CI sends a few thousand messages (``DATASERVER_FUZZ_COUNT`` scales it); ``fuzz_long.py``
is the long run.
"""

from __future__ import annotations

import json
import os
from typing import Any

import pytest
from clients import make_client
from conftest import Server
from fuzz_targets import (
    FakeServer,
    run_data_port,
    run_worker_results,
    welcome_of,
)

from dataserver_client import DataServerClient, DataServerError

pytestmark = pytest.mark.timeout(900)

COUNT = int(os.environ.get("DATASERVER_FUZZ_COUNT", "1000"))
FLAT = ("--dataset", "ds_plugins:flat", "--dataset-args", json.dumps({"n": 48}))


def epoch_indices(client: DataServerClient, epoch: int) -> list[int]:
    client.set_epoch(epoch)
    return sorted(i for b in client for idx in b.indices for i in idx)


def test_fuzzed_messages_on_every_server_socket_cost_nothing_but_themselves(
    start_server: Any,
) -> None:
    server: Server = start_server(*FLAT, workers=2)
    welcome = welcome_of(server.address)
    sent = run_data_port(server.address, 2 * COUNT + COUNT // 2)
    sent += run_worker_results(list(welcome.results), COUNT // 2)
    assert sent >= 3 * COUNT * 0.9

    stats = server.stats()
    assert server.proc.poll() is None
    assert stats["workers_alive"] == 2 and stats["workers_started"] == 2  # no worker died
    rejected = stats["rejected"]
    assert rejected.get("internal", 0) == 0, rejected  # no handler raised: decode caught it all
    assert rejected.get("malformed", 0) > COUNT // 4, rejected
    # The server still serves a whole epoch, exactly once, to a new client.
    with make_client(server.address, batch_size=8, image_size=(32, 32)) as c:
        assert epoch_indices(c, 0) == list(range(48))
        assert c.stats()["rejected"] == {}


def test_fuzzed_messages_from_a_hostile_server_cost_the_client_nothing_but_themselves(
    start_server: Any,
) -> None:
    server: Server = start_server(*FLAT, workers=2)
    fake = FakeServer(welcome_of(server.address), COUNT)
    fake.start()
    failed_epochs = 0
    with make_client(
        [server.address, fake.address],
        batch_size=4,
        image_size=(32, 32),
        timeout=60,
    ) as client:
        epoch = 0
        while not fake.done.is_set():
            # A hostile server may fail an epoch (an ERROR about the session, a different
            # dataset), never the client's thread; each new epoch starts clean.
            try:
                got = epoch_indices(client, epoch)
                assert got == list(range(48))
            except DataServerError:
                failed_epochs += 1
            epoch += 1
            assert epoch < 10_000
        assert fake.error is None, fake.error
        assert fake.sent >= COUNT * 0.9 and fake.tasks_seen > 0
        # The fake is gone: its tasks move to the real server, and epochs are exact again.
        assert epoch_indices(client, epoch) == list(range(48))
        stats = client.stats()
        assert stats["rejected"].get("internal", 0) == 0, stats["rejected"]
        assert sum(stats["rejected"].values()) > 0
    assert server.stats()["rejected"].get("internal", 0) == 0

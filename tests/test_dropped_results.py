"""A dropped direct-result connection costs a re-send at most, never a ban (issue 39, item
1): the client's TCP connections to the workers' result ports are killed from outside
(``ss -K``, as root) four times a second through whole epochs, with one server and with
two; the epoch completes exactly once, its batches bit-identical to an undisturbed run, and
no server is banned."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import threading
from typing import Any

import pytest
from batches import snap
from clients import make_client
from conftest import Server
from fuzz_targets import welcome_of

from dataserver_client import DataServerClient

pytestmark = pytest.mark.timeout(240)

N = 240
SLOW = ("--dataset", "ds_plugins:slow", "--dataset-args", json.dumps({"n": N, "ms": 25}))
SMALL: dict[str, Any] = {"batch_size": 8, "image_size": (32, 32), "timeout": 30}
KILLS = 160  # connections killed before the drops stop (at an epoch's end) ...
EPOCHS = 8  # ... or after this many epochs


def _result_ports(server: Server) -> list[int]:
    return [int(e.rsplit(":", 1)[1]) for e in welcome_of(server.address).results]


class Dropper:
    """Kills every established connection to ``ports`` about every ``period`` seconds, in a
    thread of its own, until stopped; counts the connections it killed."""

    def __init__(self, ports: list[int], period: float = 1.0) -> None:
        self.ports = ports
        self.period = period
        self.killed = 0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def __enter__(self) -> Dropper:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join(15)

    def _run(self) -> None:
        while not self._stop.wait(self.period):
            for port in self.ports:
                out = subprocess.run(
                    ["ss", "-K", "dst", "127.0.0.1", "dport", "=", str(port)],
                    capture_output=True,
                    text=True,
                    timeout=10,
                )
                self.killed += out.stdout.count("ESTAB")


def _epoch(client: DataServerClient, n: int) -> list[dict[str, Any]]:
    client.set_epoch(n)
    return [snap(b) for b in client]


@pytest.mark.parametrize("servers", [1, 2])
def test_result_connections_dropped_through_epochs_cost_a_resend_never_a_ban(
    servers: int,
) -> None:
    """The ban was a race (an answer forwarded through the front, read in the same pass
    as the drop that asked its task again): about one in a hundred drops. Drops go on,
    four a second, over whole epochs until ``KILLS`` connections died (or ``EPOCHS``)."""
    if os.geteuid() != 0 or shutil.which("ss") is None:
        pytest.skip("needs root and ss (iproute2) to kill connections")
    # TCP results only (a client on the server's host takes ipc, which ss cannot cut).
    started = [Server(*SLOW, "--cache-gb", "0", "--no-local-results") for _ in range(servers)]
    try:
        addresses = [s.address for s in started]
        ports = [p for s in started for p in _result_ports(s)]
        disturbed: dict[int, list[dict[str, Any]]] = {}
        with make_client(addresses, **SMALL) as client:
            _epoch(client, 0)  # connected, warm
            with Dropper(ports, period=0.25) as dropper:
                for n in range(1, EPOCHS + 1):
                    disturbed[n] = _epoch(client, n)
                    if dropper.killed >= KILLS:
                        break
            stats = client.stats()
        if dropper.killed == 0:
            pytest.skip("ss -K killed nothing here (kernel without SOCK_DESTROY)")
        with make_client(addresses, **SMALL) as client:  # undisturbed
            reference = {n: _epoch(client, n) for n in disturbed}
    finally:
        for s in started:
            s.stop()
    for n, got in disturbed.items():
        delivered = sorted(i for b in got for idx in b["indices"] for i in idx)
        assert delivered == list(range(N)), n  # every index, exactly once
        assert got == reference[n], n  # bit for bit
    assert stats["rejected"].get("bad_server", 0) == 0, stats
    assert stats["rejected"].get("wrong_answer", 0) == 0, stats
    assert all(s["state"] != "banned" for s in stats["servers"]), stats["servers"]
    assert dropper.killed >= servers * 2

"""Multi-host behaviour on one machine: a server in its own network namespace, reached over
a veth pair, is cut off mid-epoch (link down: no RST, packets just vanish) and later comes
back. Needs root and iproute2; skipped otherwise."""

from __future__ import annotations

import json
import os
import secrets
import shutil
import subprocess
import time
from collections.abc import Iterator
from typing import Any

import pytest
from conftest import Server, wait_until

from dataserver_client import DataServerClient

pytestmark = [pytest.mark.timeout(180), pytest.mark.netns]


def ip(*args: str) -> None:
    subprocess.run(["ip", *args], check=True, capture_output=True, timeout=20)


class Host:
    """A network namespace joined to this one by a veth pair: 10.213.N.1 here, .2 there."""

    def __init__(self) -> None:
        tag = secrets.token_hex(3)
        self.ns = f"ds{tag}"
        self.here, self.there = f"dsh{tag}", f"dsn{tag}"
        net = int(tag, 16) % 250 + 1
        self.here_ip, self.there_ip = f"10.213.{net}.1", f"10.213.{net}.2"
        ip("netns", "add", self.ns)
        ip("link", "add", self.here, "type", "veth", "peer", "name", self.there)
        ip("link", "set", self.there, "netns", self.ns)
        ip("addr", "add", f"{self.here_ip}/24", "dev", self.here)
        ip("link", "set", self.here, "up")
        ip("-n", self.ns, "addr", "add", f"{self.there_ip}/24", "dev", self.there)
        ip("-n", self.ns, "link", "set", self.there, "up")
        ip("-n", self.ns, "link", "set", "lo", "up")

    def cut(self) -> None:
        ip("link", "set", self.here, "down")

    def mend(self) -> None:
        ip("link", "set", self.here, "up")

    def close(self) -> None:
        subprocess.run(["ip", "link", "del", self.here], capture_output=True, timeout=20)
        subprocess.run(["ip", "netns", "del", self.ns], capture_output=True, timeout=20)


@pytest.fixture
def host() -> Iterator[Host]:
    if os.geteuid() != 0 or shutil.which("ip") is None:
        pytest.skip("needs root and iproute2 (ip netns)")
    try:
        h = Host()
    except (subprocess.CalledProcessError, OSError) as exc:
        pytest.skip(f"cannot create a network namespace here: {exc}")
    yield h
    h.close()


class NsServer(Server):
    """A ``dataserver serve`` started inside a namespace with ``ip netns exec``."""

    def __init__(self, ns: str, *args: str, **kwargs: Any) -> None:
        self.prefix = ["ip", "netns", "exec", ns]
        super().__init__(*args, **kwargs)

    def command(self) -> list[str]:
        return [*self.prefix, *super().command()]


def test_a_server_cut_off_mid_epoch_hands_over_and_is_taken_back(
    host: Host, start_server: Any
) -> None:
    dataset = ("--dataset", "ds_plugins:slow", "--dataset-args", json.dumps({"n": 96, "ms": 15}))
    remote = NsServer(host.ns, *dataset, workers=2, bind=f"tcp://{host.there_ip}:0")
    try:
        local = start_server(*dataset, workers=2)
        with DataServerClient(
            [remote.address, local.address],
            batch_size=8,
            image_size=(32, 32),
            device="cpu",
            timeout=30,
        ) as c:
            c.set_epoch(0)
            got = []
            start = time.monotonic()
            for n, batch in enumerate(c):
                got.append(batch)
                if n == 2:
                    host.cut()
                    cut_at = time.monotonic()
            done = time.monotonic()
            state = {s["address"]: s["state"] for s in c.stats()["servers"]}
            assert state[remote.address] == "lost"
            assert sorted(i for b in got for idx in b.indices for i in idx) == list(range(96))
            assert done - cut_at < 20, (
                "tasks of the cut-off server moved after the heartbeat timeout"
            )
            assert done - start < 30
            # Mend the link: the client handshakes again and uses the server again.
            host.mend()
            assert wait_until(
                lambda: (
                    {s["address"]: s["state"] for s in c.stats()["servers"]}[remote.address]
                    == "ready"
                ),
                20,
            )
            before = remote.stats()["counters"].get("tasks_done", 0)
            c.set_epoch(1)
            assert sorted(i for b in c for idx in b.indices for i in idx) == list(range(96))
            assert remote.stats()["counters"].get("tasks_done", 0) > before
    finally:
        remote.stop()


def test_a_link_that_flaps_mid_epoch_costs_time_not_samples(host: Host) -> None:
    """The server's link goes down for a second and comes back (shorter than the heartbeat
    timeout): whatever was in flight is retransmitted or asked again; the epoch is exact
    and takes seconds, not the timeout."""
    dataset = ("--dataset", "ds_plugins:slow", "--dataset-args", json.dumps({"n": 96, "ms": 15}))
    remote = NsServer(host.ns, *dataset, workers=2, bind=f"tcp://{host.there_ip}:0")
    try:
        with DataServerClient(
            remote.address, batch_size=8, image_size=(32, 32), device="cpu", timeout=30
        ) as c:
            c.set_epoch(0)
            got = []
            start = time.monotonic()
            for n, batch in enumerate(c):
                got.append(batch)
                if n in (2, 7):
                    host.cut()
                    time.sleep(1.0)
                    host.mend()
            elapsed = time.monotonic() - start
        assert sorted(i for b in got for idx in b.indices for i in idx) == list(range(96))
        assert elapsed < 20, f"{elapsed:.1f} s"
    finally:
        remote.stop()

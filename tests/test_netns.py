"""Multi-host behaviour on one machine: a server in its own network namespace, reached over
a veth pair, is cut off mid-epoch (link down: no RST, packets just vanish) and later comes
back; and a multi-node rehearsal, namespaces as nodes on a bridge: two data nodes, a
trainer node with two gloo ranks that find the data tier by DNS, a third data node that
joins mid-epoch and one that is cut off. Needs root and iproute2; skipped otherwise."""

from __future__ import annotations

import json
import os
import secrets
import shutil
import subprocess
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from clients import make_client
from conftest import Server, wait_until
from netns_nodes import Cluster, NsServer, Ranks, ip, publish, start_node_servers

from dataserver_client.plan.epoch import epoch_order, shard_of

pytestmark = [pytest.mark.timeout(180), pytest.mark.netns]


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


def test_a_server_cut_off_mid_epoch_hands_over_and_is_taken_back(
    host: Host, start_server: Any
) -> None:
    dataset = ("--dataset", "ds_plugins:slow", "--dataset-args", json.dumps({"n": 96, "ms": 15}))
    remote = NsServer(host.ns, *dataset, workers=2, bind=f"tcp://{host.there_ip}:0")
    try:
        local = start_server(*dataset, workers=2)
        with make_client(
            [remote.address, local.address],
            batch_size=8,
            image_size=(32, 32),
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
            # The epoch may end first (its tasks there expired and moved): the silent server
            # is declared lost at the heartbeat timeout all the same.
            assert wait_until(
                lambda: (
                    {s["address"]: s["state"] for s in c.stats()["servers"]}[remote.address]
                    == "lost"
                ),
                10,
            )
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
        with make_client(remote.address, batch_size=8, image_size=(32, 32), timeout=30) as c:
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


# ------------------------------------------------------------ the multi-node rehearsal

REHEARSAL_N = 1280  # samples; 20 ms each: two 2-worker nodes make ~200/s, three ~300/s
SIM = [
    "--dataset",
    "dataserver.data.simulated:simulated",
    "--dataset-args",
    json.dumps({"n": REHEARSAL_N, "ms": 20, "size": 32}),
    "--cache-gb",
    "0",
]
DATA_PORT = 7600  # every data node has a namespace of its own: the same port on each
NODES = {"a": 1, "b": 2, "c": 3, "t": 10}  # data nodes A, B, C; the trainer node T


@pytest.fixture
def cluster() -> Iterator[Cluster]:
    if os.geteuid() != 0 or shutil.which("ip") is None:
        pytest.skip("needs root and iproute2 (ip netns)")
    try:
        c = Cluster(NODES)
    except (subprocess.CalledProcessError, OSError) as exc:
        pytest.skip(f"cannot create a network namespace here: {exc}")
    yield c
    c.close()


@pytest.fixture
def node_servers(cluster: Cluster) -> Iterator[list[Server]]:
    """Servers the test starts; stopped before the namespaces they run in go."""
    started: list[Server] = []
    yield started
    for server in started:
        server.stop()


@pytest.fixture
def ranks() -> Iterator[list[Ranks]]:
    started: list[Ranks] = []
    yield started
    for r in started:
        r.close()


@pytest.mark.timeout(240)
def test_a_multi_node_rehearsal_one_node_joins_one_is_cut_off_exactly_once(
    cluster: Cluster, node_servers: list[Server], ranks: list[Ranks], tmp_path: Path
) -> None:
    """Namespaces play nodes: data nodes A and B, a trainer node T with two gloo ranks that
    name the data tier by one DNS name (T's hosts file). Mid-epoch a third data node C
    joins by discovery and B's cable is pulled (the ranks notice by heartbeat timeout).
    Each rank's epoch is exactly its shard, once, and bit-identical to an undisturbed run
    (the same ranks first run the epoch from a plain server on T's loopback)."""
    began = time.monotonic()

    def mark(what: str) -> None:
        print(f"[{time.monotonic() - began:6.1f} s] {what}", flush=True)

    addr = {name: cluster.ip(host) for name, host in NODES.items()}
    hosts = cluster.resolver("t")
    publish(hosts, "data.test", addr["a"], addr["b"])
    data = {name: f"tcp://{addr[name]}:{DATA_PORT}" for name in ("a", "b", "c")}
    specs = {name: (cluster.namespaces[name], data[name], 2) for name in data}
    specs["plain"] = (cluster.namespaces["t"], f"tcp://127.0.0.1:{DATA_PORT}", 4)
    node = start_node_servers(specs, SIM, node_servers)
    mark("servers up")

    go = tmp_path / "go"
    name = f"tcp://data.test:{DATA_PORT}"
    run = Ranks(name, node["plain"].address, go, cluster.exec_prefix("t"), 29500, hold=6)
    ranks.append(run)
    run.at(5, timeout=150)  # (after the reference epoch) both hold before step 6: A and B
    mark("ranks at step 5 (A, B)")
    assert all(len(r) == 6 for r in run.records["rehearsal"])
    assert node["c"].stats()["sessions"] == 0

    published = time.monotonic()
    publish(hosts, "data.test", addr["a"], addr["b"], addr["c"])  # C joins by discovery
    assert wait_until(lambda: node["c"].stats()["sessions"] == 2, 20)
    join_s = time.monotonic() - published
    mark("C has both ranks' sessions")
    run.hold(14)
    run.at(13)
    mark("ranks at step 13 (A, B, C)")
    c_done = lambda: node["c"].stats()["counters"].get("tasks_done", 0)  # noqa: E731
    assert wait_until(lambda: c_done() > 0, 10), "the node that joined was given no task"
    c_before_cut = c_done()

    run.hold(10**9)
    run.at(16)
    cut_at = time.monotonic()
    cluster.cut("b")  # B stays in DNS: only the heartbeat timeout tells
    mark("B cut off")
    run.finish()
    after_cut_s = time.monotonic() - cut_at
    mark("epoch done")
    c_stats = node["c"].stats()
    assert after_cut_s < 30, f"B's tasks moved late: the epoch ended {after_cut_s:.1f} s after"
    after = [t for t in run.times[0] if t > cut_at]
    stall_s = max(b - a for a, b in zip([cut_at, *after], after, strict=False))

    shards = [
        shard_of(epoch_order(REHEARSAL_N, 11, 0, True), rank, 2, drop_last=False).tolist()
        for rank in (0, 1)
    ]
    assert not set(shards[0]) & set(shards[1])
    assert sorted(shards[0] + shards[1]) == list(range(REHEARSAL_N))
    for rank in (0, 1):
        got, want = run.records["rehearsal"][rank], run.records["reference"][rank]
        for records in (got, want):
            delivered = [i for r in records for image in r["indices"] for i in image]
            assert delivered == shards[rank], f"rank {rank}: not its shard exactly once"
            assert [r["step"] for r in records] == list(range(len(records)))
        assert [r["mode"] for r in got] == [r["mode"] for r in want]
        assert [r["indices"] for r in got] == [r["indices"] for r in want]
        assert [r["digest"] for r in got] == [r["digest"] for r in want], (
            f"rank {rank}: not bit-identical"
        )
    assert {"regular", "stitch"} <= {r["mode"] for r in run.records["rehearsal"][0]}

    for rank in (0, 1):
        stats = run.stats["rehearsal"][rank]
        assert stats is not None
        servers = {s["address"]: s for s in stats["servers"]}
        assert set(servers) == set(data.values())
        assert servers[data["b"]]["state"] == "lost", servers
        assert servers[data["c"]]["results"] > 0, f"rank {rank} got nothing from C"
        assert stats.get("servers_joined") == 1 and not stats.get("servers_left"), stats
    assert c_stats["counters"].get("tasks_done", 0) > c_before_cut
    # B's outstanding tasks moved: asked again when it was lost, or (a cut server answers
    # nothing, so its tasks age past the hedge delay first) hedged to a peer before that.
    moved = [
        (run.stats["rehearsal"][r] or {}).get("reissued", 0)
        + (run.stats["rehearsal"][r] or {}).get("hedged", 0)
        for r in (0, 1)
    ]
    assert sum(moved) > 0, "B had nothing outstanding to move when it was cut"
    print(
        f"\nrehearsal: C joined {join_s:.2f} s after DNS; after B's cut the longest wait for"
        f" a batch {stall_s:.1f} s, the epoch done in {after_cut_s:.1f} s;"
        f" C ran {c_before_cut} tasks before the cut, {c_stats['counters'].get('tasks_done')}"
        f" in all; tasks moved {moved}; test {time.monotonic() - began:.1f} s"
    )

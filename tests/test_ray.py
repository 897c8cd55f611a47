"""The data tier on a real multi-node Ray cluster (``ray.cluster_utils.Cluster`` on this
machine: a head with 2 logical CPUs for the trainers and two nodes with 1 CPU and a custom
``data`` resource each, every node at 127.0.0.1, no dashboard, 80 MB object stores).

The tier's servers are real ``dataserver serve`` processes run by Ray actors; the trainers are
Ray Train workers (``examples/ray_train.py``, gloo on loopback) or this process, each a
``DataServerClient("ray://NAME")`` whose discovery polls the tier's named actor. Exactly once
is checked from the indices every rank saw. Skipped without ray (``pip install -e ".[ray]"``).
"""

from __future__ import annotations

import contextlib
import importlib.util
import json
import os
import subprocess
import sys
import time
import uuid
from collections import Counter
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
from clients import make_client
from conftest import wait_until

pytestmark = [
    pytest.mark.timeout(480),
    pytest.mark.skipif(  # (ray.train is checked in the fixture: importing it imports ray)
        importlib.util.find_spec("ray") is None, reason='needs ray: pip install -e ".[ray]"'
    ),
]

ROOT = Path(__file__).resolve().parent.parent
N = 320  # samples of the slow dataset: 10 ms each, one 1-worker server makes ~100/s
SLOW = {
    "dataset": "dataserver.data.simulated:simulated",
    "dataset_args": {"n": N, "ms": 10, "size": 32},
    "serve_args": ["--cache-gb", "0"],
}
NODE: dict[str, Any] = {"node_ip_address": "127.0.0.1", "object_store_memory": 80 * 1024 * 1024}
# Set before ray is imported and before any node starts (every Ray process inherits them):
# nodes at 127.0.0.1 (Ray otherwise takes this machine's interface address), gloo on
# loopback, no usage reporting; the marker finds the servers this module started.
ENV = {
    "RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER": "0",
    "GLOO_SOCKET_IFNAME": "lo",
    "RAY_USAGE_STATS_ENABLED": "0",
    "RAY_TRAIN_METRICS_ENABLED": "0",
}


@dataclass
class Rig:
    ray: Any
    cluster: Any
    data_nodes: set[str]
    marker: str


def _environ(pid: int) -> bytes:
    try:
        return Path(f"/proc/{pid}/environ").read_bytes()
    except OSError:
        return b""


def _cmdline(pid: int) -> str:
    try:
        return Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode()
    except OSError:
        return ""


def server_processes(marker: str) -> list[tuple[int, str]]:
    """Live ``dataserver serve`` fronts and workers started under this module's cluster."""
    tag = f"DATASERVER_RAY_TEST={marker}".encode()
    out = []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        pid = int(entry.name)
        cmd = _cmdline(pid)
        if ("dataserver.cli serve" in cmd or "dataserver.server.worker.worker" in cmd) and tag in (
            _environ(pid)
        ):
            out.append((pid, cmd[:120]))
    return out


def alive(pid: int) -> bool:
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except OSError:
        return False
    return state != "Z"


def children(pid: int) -> list[int]:
    out = []
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                stat = (entry / "stat").read_text().rsplit(")", 1)[1].split()
            except OSError:
                continue
            if int(stat[1]) == pid:
                out.append(int(entry.name))
    return out


def maps(pid: int) -> str:
    try:
        return Path(f"/proc/{pid}/maps").read_text()
    except OSError:
        return ""


@pytest.fixture(scope="module")
def rig() -> Iterator[Rig]:
    marker = uuid.uuid4().hex
    saved = {k: os.environ.get(k) for k in [*ENV, "DATASERVER_RAY_TEST"]}
    pytest.importorskip("ray.train", reason='needs ray[train]: pip install -e ".[ray]"')
    os.environ.update(ENV, DATASERVER_RAY_TEST=marker)
    import ray
    import ray._private.ray_constants as constants
    from ray.cluster_utils import Cluster

    constants.ENABLE_RAY_CLUSTER = False  # (the variable above, should ray be imported already)
    cluster = None
    try:
        cluster = Cluster(
            initialize_head=True,
            head_node_args={"num_cpus": 2, "include_dashboard": False, **NODE},
        )
        nodes = [cluster.add_node(num_cpus=1, resources={"data": 2}, **NODE) for _ in range(2)]
        cluster.wait_for_nodes()
        ray.init(address=cluster.address)
        yield Rig(ray, cluster, {n.node_id for n in nodes}, marker)
    finally:
        ray.shutdown()
        if cluster is not None:
            cluster.shutdown()
        for pid, _ in server_processes(marker):  # none should be left: stop them anyway
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, 9)
        for k, v in saved.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v


@pytest.fixture
def tiers(rig: Rig) -> Iterator[Callable[..., Any]]:
    """Start tiers (1-worker servers on the ``data`` nodes); each is shut down after."""
    from dataserver_client.integrations.ray import DataTier

    started: list[Any] = []

    def start(name: str, servers: int = 2, **kw: Any) -> Any:
        kw = {"workers": 1, "resources": {"data": 1}, "drain_seconds": 5, **kw}
        tier = DataTier.start(name, servers=servers, **kw)
        started.append(tier)
        return tier

    yield start
    for tier in started:
        try:
            tier.shutdown()
        except Exception as exc:  # already shut down by the test
            print(f"shutdown {tier}: {exc!r}")


def client_for(address: str, **kw: Any) -> Any:

    kw = {
        "batch_size": 8,
        "image_size": (32, 32),
        "rank": 0,
        "world_size": 1,
        "discovery_interval": 0.2,
        "timeout": 60.0,
        **kw,
    }
    return make_client(address, **kw)


def exactly_once(indices: list[int], n: int) -> None:
    twice = [i for i, c in Counter(indices).items() if c > 1]
    missing = sorted(set(range(n)) - set(indices))
    assert not twice and not missing, f"duplicated {twice[:10]}, missing {missing[:10]}"


def flat(batch: Any) -> list[int]:
    return [int(i) for image in batch.indices for i in image]


def test_the_tier_starts_on_the_data_nodes_and_serves(rig: Rig, tiers: Any) -> None:
    t0 = time.monotonic()
    tier = tiers("t-start")
    started = time.monotonic() - t0
    addresses = tier.addresses()
    servers = tier.servers()
    print(f"tier of 2 ready in {started:.1f} s: {addresses}")
    assert len(addresses) == 2 and all(a.startswith("tcp://127.0.0.1:") for a in addresses)
    assert {s["node_id"] for s in servers} == rig.data_nodes  # one on each data node
    # Neither the servers (front and workers) nor the actors running them load torch.
    for s in servers:
        for pid in [s["pid"], *children(s["pid"]), s["actor_pid"]]:
            assert maps(pid), pid
            assert "libtorch" not in maps(pid), f"{pid} ({_cmdline(pid)[:80]}) loaded torch"

    # Another job of the cluster (a process that joins it with address="auto", from the
    # client's I/O thread) finds the tier by name and is served through ray://t-start.
    code = (
        "from dataserver_client import DataServerClient\n"
        "from dataserver_client.integrations.ray import DataTier\n"
        "import json, ray\n"
        "with DataServerClient('ray://t-start', batch_size=4, image_size=(32, 32), rank=0,\n"
        "                      world_size=1, device='cpu') as client:\n"
        "    client.set_epoch(0)\n"
        "    batch = next(iter(client))\n"
        "    print(json.dumps([DataTier.get('t-start').addresses(), len(batch.indices)]))\n"
    )
    env = dict(os.environ, RAY_ADDRESS=rig.cluster.address)
    run = subprocess.run(
        [sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=120
    )
    assert run.returncode == 0, run.stderr[-3000:]
    assert json.loads(run.stdout.splitlines()[-1]) == [addresses, 4]
    with client_for("ray://t-start", batch_size=4) as client:
        client.set_epoch(0)
        batch = next(iter(client))
        assert batch.images.shape[0] == 4
        assert {s["address"] for s in client.stats()["servers"]} == set(addresses)


def test_a_bad_dataset_fails_the_start_with_serves_own_error(rig: Rig, tiers: Any) -> None:
    from dataserver_client.integrations.ray import DataTier

    with pytest.raises(RuntimeError, match=r"cannot import 'no\.such\.module'"):
        tiers("t-bad", servers=1, dataset="no.such.module:factory")
    with pytest.raises(ValueError, match="no data tier named 't-bad'"):
        DataTier.get("t-bad")
    assert not server_processes(rig.marker)
    from dataserver_client import DataServerError

    with pytest.raises(DataServerError, match="no such Ray data tier"):
        client_for("ray://t-bad")
    with pytest.raises(ValueError, match="a Ray data tier is ray://NAME"):
        client_for("ray://bad name")


def _ray_train(rig: Rig) -> Any:
    """examples/ray_train.py as a module whose functions Ray ships by value."""
    spec = importlib.util.spec_from_file_location("ray_train", ROOT / "examples" / "ray_train.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules["ray_train"] = module
    spec.loader.exec_module(module)
    rig.ray.cloudpickle.register_pickle_by_value(module)
    return module


def _records(where: Path) -> dict[int, list[dict[str, Any]]]:
    out = {}
    for path in sorted(where.glob("rank-*.jsonl")):
        rank = int(path.stem.split("-")[1])
        out[rank] = [json.loads(line) for line in path.read_text().splitlines()]
    return out


TRAIN_ARGS = ["--batch-size", "8", "--image-size", "64", "--discovery-interval", "0.5"]
IMAGES = 96  # synthetic images: 48 per rank, 6 steps of 8


def _summary(out: str) -> str:
    """The driver's last line of ``trained ...`` (Ray forwards the workers' output to this
    process too, prefixed with the worker's name, at any time)."""
    lines = [line for line in out.splitlines() if line.startswith("trained ")]
    assert lines, out[-3000:]
    return lines[-1]


def _seen(rows: list[dict[str, Any]], epoch: int) -> list[int]:
    return [i for r in rows if r["epoch"] == epoch for im in r["indices"] for i in im]


def test_ray_train_trains_exactly_once_and_resumes_mid_epoch(
    rig: Rig, tiers: Any, tmp_path: Path, capsys: Any
) -> None:
    """``examples/ray_train.py``: a 2-worker TorchTrainer trains epoch 0 whole and 3 of the 6
    steps of epoch 1 (``--steps 9``), then a second fit (``--resume``) restores the run's last
    checkpoint (the loader's state) and trains the rest of epoch 1. Each epoch holds every
    index exactly once over the two ranks' disjoint shards, and no batch is stale."""
    tiers("t-train", dataset=f"synthetic:images={IMAGES},seed=0")
    example = _ray_train(rig)
    argv = ["--tier", "t-train", "--trainers", "2", "--epochs", "2", "--name", "run"]
    argv += ["--storage", str(tmp_path / "runs"), "--record", str(tmp_path / "rec"), *TRAIN_ARGS]
    t0 = time.monotonic()
    assert example.main([*argv, "--steps", "9"]) == 0
    fit = time.monotonic() - t0
    first = _summary(capsys.readouterr().out)
    assert example.main(argv) == 2  # the run exists: continuing it takes --resume
    t0 = time.monotonic()
    assert example.main([*argv, "--resume"]) == 0
    refit = time.monotonic() - t0
    second = _summary(capsys.readouterr().out)
    with capsys.disabled():
        print(f"\nfit 1 ({fit:.0f} s): {first}\nfit 2, resumed ({refit:.0f} s): {second}")
    assert first == f"trained 2 epochs, {IMAGES + IMAGES // 2} samples on 2 ranks, 0 stale"
    assert second == f"trained 1 epochs, {IMAGES // 2} samples on 2 ranks, 0 stale"
    records = _records(tmp_path / "rec")
    assert sorted(records) == [0, 1]
    for rows in records.values():  # epoch 0; epoch 1 up to the stop, then from it
        assert [(r["epoch"], r["step"]) for r in rows] == [(0, s) for s in range(6)] + [
            (1, s) for s in range(6)
        ]
    for epoch in (0, 1):
        shards = [_seen(rows, epoch) for rows in records.values()]
        assert not set(shards[0]) & set(shards[1])  # disjoint shards
        exactly_once(shards[0] + shards[1], IMAGES)


def test_a_dead_server_is_restarted_and_a_killed_actor_replaced_mid_epoch(
    rig: Rig, tiers: Any
) -> None:
    """Mid-epoch, server A's serve process is SIGKILLed (its actor restarts it, on the same
    ports) and server B's actor is killed with ``ray.kill`` (its server gets SIGTERM from the
    kernel and drains; the tier starts a new server elsewhere). Nothing is lost."""
    ray = rig.ray
    tier = tiers("t-kill", **SLOW)
    a, b = tier.servers()
    seen: list[int] = []
    when: dict[str, float] = {}
    with client_for(tier.address) as client:
        client.set_epoch(0)
        for step, batch in enumerate(client):
            seen += flat(batch)
            if step == 5:
                os.kill(a["pid"], 9)
                when["a"] = time.monotonic()
            if step == 15:
                ray.kill(b["actor"])
                when["b"] = time.monotonic()
        stats = client.stats()
    exactly_once(seen, N)
    assert len(seen) == N
    assert wait_until(lambda: not alive(b["pid"]), 30)  # PR_SET_PDEATHSIG: SIGTERM, a drain
    b_gone = time.monotonic() - when["b"]
    assert wait_until(lambda: len(tier.addresses()) == 2, 60)
    now = {s["serial"]: s for s in tier.servers()}
    assert now[a["serial"]]["restarts"] == 1 and now[a["serial"]]["address"] == a["address"]
    assert b["serial"] not in now and b["address"] not in tier.addresses()  # replaced
    print(
        f"A {a['address']} restarted on its ports; B {b['address']}'s server gone "
        f"{b_gone:.1f} s after ray.kill; tier now {tier.addresses()}; client: "
        f"lost {stats['servers_lost']}, left {stats['servers_left']}, "
        f"joined {stats['servers_joined']}"
    )


def test_scale_up_and_down_mid_epoch_loses_nothing(rig: Rig, tiers: Any) -> None:
    tier = tiers("t-scale", servers=1, **SLOW)
    seen: list[int] = []
    drained: list[dict[str, Any]] = []
    times: dict[str, float] = {}
    with client_for(tier.address) as client:
        client.set_epoch(0)
        for step, batch in enumerate(client):
            seen += flat(batch)
            if step == 3:
                t0 = time.monotonic()
                up = tier.scale(3)
                times["up"] = time.monotonic() - t0
                assert len(up) == 3
                assert wait_until(lambda: client.stats()["servers_joined"] >= 2, 10)
                times["joined"] = time.monotonic() - t0
            if step == 20:
                before = tier.servers()
                t0 = time.monotonic()
                left = tier.scale(1)
                drained = [s for s in before if s["address"] not in left]
                assert len(left) == 1 and len(drained) == 2
        stats = client.stats()
    exactly_once(seen, N)
    assert wait_until(lambda: not any(alive(s["pid"]) for s in drained), 30)
    times["drained"] = time.monotonic() - t0
    assert stats["servers_joined"] >= 2 and stats["servers_left"] >= 2, stats
    assert wait_until(lambda: len(tier.servers()) == 1, 10)  # the drained actors ended
    print(
        f"scale 1 -> 3 -> 1 under an epoch of {N}: {times}, tasks per server "
        f"{[(s['address'], s['results']) for s in stats['servers']]}"
    )


def test_shutdown_leaves_no_server_behind(rig: Rig, tiers: Any) -> None:
    from dataserver_client.integrations.ray import DataTier

    tier = tiers("t-down")
    pids = [p for s in tier.servers() for p in [s["pid"], *children(s["pid"])]]
    assert len(pids) == 4 and all(alive(p) for p in pids)
    t0 = time.monotonic()
    tier.shutdown()
    took = time.monotonic() - t0
    assert not [p for p in pids if alive(p)]
    assert not server_processes(rig.marker)
    with pytest.raises(ValueError):
        DataTier.get("t-down")
    print(f"shutdown of 2 servers: {took:.2f} s")

"""Issue 40, item 4: peers told apart beyond loopback, and working sessions kept.

(a) uid 65534 filling ``--max-sessions`` through the host's own non-loopback address
refused root's job at once (``session_limit``): the uid was asked of the kernel only for
127.0.0.0/8, so both were one peer, that address. (b) One session from each of 24 other
addresses evicted 3 of the 4 ranks of a one-node job (the node was "the peer holding the
most"); a working peer within its share now keeps its sessions and the newcomer is refused.

The host's own address is one end of a veth pair to a network namespace (10.213.N.1 here);
the other addresses are the namespace's (10.213.N.2 and 24 more), where the job and the
flood run (``ip netns exec``). Needs root and iproute2; skipped otherwise."""

from __future__ import annotations

import json
import os
import secrets
import shutil
import socket
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from conftest import server_env
from test_bounds import honest_epoch

from dataserver.tcpinfo import loopback_uid

pytestmark = [pytest.mark.timeout(240), pytest.mark.netns]

HERE = Path(__file__).resolve().parent
NOBODY = 65534
SAMPLES = 192
OTHERS = 24


def ip(*args: str) -> None:
    subprocess.run(["ip", *args], check=True, capture_output=True, timeout=20)


class Host:
    """A network namespace joined to this one by a veth pair: 10.213.N.1 here, .2 there,
    and ``extra`` more addresses there (.10 on)."""

    def __init__(self, extra: int) -> None:
        tag = secrets.token_hex(3)
        self.ns = f"dsp{tag}"
        self.here, self.there = f"dsph{tag}", f"dspn{tag}"
        net = f"10.213.{int(tag, 16) % 250 + 1}"
        self.here_ip, self.there_ip = f"{net}.1", f"{net}.2"
        self.others = [f"{net}.{10 + i}" for i in range(extra)]
        ip("netns", "add", self.ns)
        try:
            ip("link", "add", self.here, "type", "veth", "peer", "name", self.there)
            ip("link", "set", self.there, "netns", self.ns)
            ip("addr", "add", f"{self.here_ip}/24", "dev", self.here)
            ip("link", "set", self.here, "up")
            for address in [self.there_ip, *self.others]:
                ip("-n", self.ns, "addr", "add", f"{address}/24", "dev", self.there)
            ip("-n", self.ns, "link", "set", self.there, "up")
            ip("-n", self.ns, "link", "set", "lo", "up")
        except BaseException:
            self.close()
            raise

    def there_cmd(self, *args: str) -> list[str]:
        return ["ip", "netns", "exec", self.ns, *args]

    def close(self) -> None:
        subprocess.run(["ip", "link", "del", self.here], capture_output=True, timeout=20)
        subprocess.run(["ip", "netns", "del", self.ns], capture_output=True, timeout=20)


@pytest.fixture
def host() -> Iterator[Host]:
    if os.geteuid() != 0 or shutil.which("ip") is None:
        pytest.skip("needs root and iproute2 (ip netns)")
    with (
        socket.create_server(("127.0.0.1", 0)) as listener,
        socket.create_connection(listener.getsockname()),
    ):
        conn, _ = listener.accept()
        with conn:
            if loopback_uid(conn.fileno()) != os.getuid():
                pytest.skip("the kernel's sock_diag does not name a loopback peer here")
    try:
        h = Host(OTHERS)
    except (subprocess.CalledProcessError, OSError) as exc:
        pytest.skip(f"cannot create a network namespace here: {exc}")
    yield h
    h.close()


class Child:
    """A script of tests/ run as a child (its stdin a pipe: closing it ends a flood)."""

    def __init__(self, cmd: list[str]) -> None:
        self.proc = subprocess.Popen(
            cmd,
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
            env=server_env(),
        )

    def line(self) -> str:
        assert self.proc.stdout is not None
        got = self.proc.stdout.readline()
        if not got:
            self.proc.wait(30)
            assert self.proc.stderr is not None
            raise AssertionError(f"{self.proc.args!r}: {self.proc.stderr.read()[-3000:]}")
        return got

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
        self.proc.wait(30)


@pytest.fixture
def children() -> Iterator[list[Child]]:
    started: list[Child] = []
    yield started
    for child in started:
        child.stop()


def flood(*args: str) -> list[str]:
    return [sys.executable, str(HERE / "peers_flood.py"), *args]


def test_another_user_on_the_hosts_own_address_is_told_apart(
    host: Host, start_server: Any, children: list[Child]
) -> None:
    """(a): uid 65534 opens 16 sessions (2 connections) at the server's address, the host's
    own non-loopback one (10.213.N.1), filling ``--max-sessions 16``, and keeps them beating;
    root's job on the same address gets its epoch: it was refused at once (one peer, the
    address, held every place)."""
    server = start_server(
        "--dataset",
        f"synthetic:images={SAMPLES // 4},seed=1",
        "--max-sessions",
        "16",
        workers=1,
        bind=f"tcp://{host.here_ip}:0",
    )
    assert host.here_ip in server.address
    nobody = Child(flood(server.address, "--per", "16", "--uid", str(NOBODY)))
    children.append(nobody)
    kinds = json.loads(nobody.line())
    assert kinds == ["welcome"] * 16, kinds
    assert server.stats()["sessions"] == 16
    assert honest_epoch(server) == list(range(SAMPLES // 4))
    assert server.stats()["sessions_evicted"] >= 1


def test_a_working_job_keeps_its_ranks_when_newcomers_fill_the_cap(
    host: Host, start_server: Any, children: list[Child], tmp_path: Path
) -> None:
    """(b): a 4-rank job from one address (10.213.N.2) is working; one session from each of
    24 other addresses (``--max-sessions 25``: 21 places left) fills the cap, and the last
    3 are refused ``session_limit``, the job's ranks kept: each delivers its whole shard with
    no error, no session evicted (3 of the 4 ranks were)."""
    dataset = json.dumps({"n": SAMPLES, "ms": 5})
    server = start_server(
        "--dataset",
        "ds_plugins:slow",
        "--dataset-args",
        dataset,
        "--max-sessions",
        str(4 + OTHERS - 3),
        workers=1,
        bind=f"tcp://{host.here_ip}:0",
    )
    go = tmp_path / "go"
    job = Child(
        host.there_cmd(sys.executable, str(HERE / "peers_job.py"), server.address, "--go", str(go))
    )
    children.append(job)
    assert job.line().strip() == "working"
    assert server.stats()["sessions"] == 4
    others = Child(host.there_cmd(*flood(server.address, "--sources", ",".join(host.others))))
    children.append(others)
    kinds = json.loads(others.line())
    stats = server.stats()
    go.touch()
    assert len(kinds) == OTHERS, kinds
    assert kinds.count("welcome") == OTHERS - 3, kinds
    assert kinds.count("session_limit") == 3, kinds
    assert stats["sessions"] == 4 + OTHERS - 3
    ranks = json.loads(job.line())
    assert sorted(i for r in ranks.values() for i in r["indices"]) == list(range(SAMPLES))
    assert all(not r["errors"] for r in ranks.values()), ranks
    assert server.stats()["sessions_evicted"] == 0

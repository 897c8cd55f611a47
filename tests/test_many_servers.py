"""A client against many servers (issue 28, item 3): the descriptors a server costs it, its
open-files limit raised, results through the fronts when direct connections do not fit,
a clear error when not even the servers' sockets do; and the parts that keep its cost per
task flat in the number of servers (the poller, the links by free credit, the deadlines).

The servers are the scale bench's fakes (``dataserver.bench.scale fakes``: one process,
real sockets, answering every task at once); each client runs in a process of its own
(``many_servers_client.py``), so that its descriptor limit is its own.
"""

from __future__ import annotations

import json
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import zmq
from conftest import TESTS, server_env

from dataserver.bench.scale import role
from dataserver_client.net.fds import FdBudget
from dataserver_client.net.linkindex import LinkIndex
from dataserver_client.net.serverlink import ServerLink
from dataserver_client.net.watch import Watch

pytestmark = pytest.mark.timeout(240)

SERVERS = 64
DATASET = 4096  # the fakes' dataset_len


@pytest.fixture(scope="module")
def fakes() -> Iterator[list[str]]:
    """The addresses of ``SERVERS`` fake servers in one process (the scale bench's own
    ``fakes`` role, stopped when the module's tests are done)."""
    with role("fakes", "--count", str(SERVERS), "--workers", "2", timeout=60) as (_, ready):
        yield list(ready["addresses"])


def run_client(tmp_path: Path, addresses: list[str], *flags: str) -> dict[str, Any]:
    path = tmp_path / "addresses.json"
    path.write_text(json.dumps(addresses))
    cmd = [sys.executable, str(TESTS / "many_servers_client.py"), str(path), *flags]
    proc = subprocess.run(cmd, capture_output=True, text=True, env=server_env(), timeout=200)
    assert proc.returncode == 0, proc.stderr[-3000:]
    out = dict(json.loads(proc.stdout.strip().splitlines()[-1]))
    out["log"] = proc.stderr
    return out


def test_many_servers_fds_limit_and_routing(tmp_path: Path, fakes: list[str]) -> None:
    """64 servers: the soft limit starts low and is raised to the hard one; each server
    costs the client its link's sockets and three connections (front, control, the fake's
    one worker); an epoch comes whole, spread over the servers, every result direct."""
    out = run_client(tmp_path, fakes, "--limit", "1024,8192")
    assert out["limit_before"] == [1024, 8192]
    assert out["limit_after"] == [8192, 8192]
    per_server = ServerLink.FDS + 1  # (+ the one direct result connection to its worker)
    assert out["fds_opened"] <= SERVERS * per_server + 24, out["fds_opened"]
    assert out["fds_opened"] >= SERVERS * ServerLink.SOCKETS, out["fds_opened"]
    assert sorted(out["indices"]) == list(range(DATASET))  # every index once
    used = [s for s in out["servers"] if s["results"] > 0]
    assert len(used) >= SERVERS // 2, len(used)  # the tasks went all over
    assert sum(s["results"] for s in out["servers"]) >= DATASET // 2
    fds = out["fds"]
    assert fds["servers"] == SERVERS and fds["direct"] == SERVERS
    assert fds["through_front"] == 0 and fds["short_by"] == 0


def test_servers_announcing_the_same_categories_cost_the_client_one_copy(
    tmp_path: Path, fakes: list[str]
) -> None:
    """Issue 40 item 7: each link keeps its server's WELCOME, and a WELCOME carried a copy of
    the dataset's categories: 3,600 names of 256 characters (what fits a WELCOME's 1 MiB
    header) are ~1 MiB decoded, so every server found (by DNS: a thousand) cost the trainer
    that much again. An accepted WELCOME
    now holds the job's one copy (servers announcing other categories are refused): 64
    servers announcing them cost about what 64 announcing none do."""
    with role(
        "fakes", "--count", str(SERVERS), "--workers", "2", "--categories", "3600", timeout=60
    ) as (_, ready):
        named = run_client(tmp_path, list(ready["addresses"]), "--batches", "8", "--traced")
    assert "error" not in named, named["error"]
    plain = run_client(tmp_path, fakes, "--batches", "8", "--traced")
    extra = named["traced_mib"] - plain["traced_mib"]
    # One copy (the job's, and client.categories): a few MiB; one a link was ~64 MiB.
    assert extra < 16, (named["traced_mib"], plain["traced_mib"])


def test_short_budget_sends_results_through_fronts(tmp_path: Path, fakes: list[str]) -> None:
    """A limit that leaves room for the servers' sockets and only 20 direct connections:
    the other servers' results come through their fronts (the epoch is whole all the same),
    and the log says what to raise, and by how much."""
    out = run_client(tmp_path, fakes, "--spare", "20")
    fds = out["fds"]
    assert 0 < fds["direct"] < SERVERS, fds
    assert fds["through_front"] == SERVERS - fds["direct"]
    assert fds["short_by"] >= fds["through_front"]
    assert sorted(out["indices"]) == list(range(DATASET))
    assert "its results come through its front" in out["log"]
    assert "raise it by at least" in out["log"]


def test_too_few_fds_for_the_servers_is_a_clear_error(tmp_path: Path, fakes: list[str]) -> None:
    """A hard limit below what the servers' sockets need: the constructor says how many
    descriptors the servers need and which limit to raise."""
    out = run_client(tmp_path, fakes, "--limit", "400,400")
    err = out.get("error", "")
    assert "not enough file descriptors" in err, out
    assert f"{SERVERS} server(s) need about" in err
    assert "RLIMIT_NOFILE" in err and "raise the hard limit to at least" in err


# ---------------------------------------------------------------- flat costs, in process


class _Link:
    """What the index reads of a link, counting each read of ``free``."""

    def __init__(self, free: int) -> None:
        self._free = free
        self.reads = 0
        self.ready = True
        self.sends: dict[int, float] = {}

    @property
    def free(self) -> int:
        self.reads += 1
        return self._free

    def set_free(self, free: int, index: Any) -> None:
        self._free = free
        index.moved(self)

    def sent_at(self, task_id: int) -> float | None:
        return self.sends.get(task_id)


def test_best_link_reads_few_links() -> None:
    """The link with the most free credit, from the heap: a pick reads the links at its
    top, not all 1,024."""
    index: Any = LinkIndex()  # (driven with stand-in links)
    links = [_Link(1 + i % 7) for i in range(1024)]
    for link in links:
        index.moved(link)
    for link in links:
        link.reads = 0
    best = index.best()
    assert best is not None and best.free == 7
    assert sum(link.reads for link in links) <= 4
    skip = {best}
    other = index.best(skip)
    assert other is not None and other is not best and other.free == 7
    best.set_free(0, index)
    assert index.best() is not best
    links[3].set_free(50, index)
    assert index.best() is links[3]
    for link in links:
        link.set_free(0, index)
    assert index.best() is None


def test_deadlines_come_from_a_heap() -> None:
    """Tasks past the deadline are found by send time: the answered ones and those sent
    again later are not late; a link not in use keeps its late tasks for when it is."""
    index: Any = LinkIndex()  # (driven with stand-in links)
    a, b = _Link(1), _Link(1)
    for i, (link, when) in enumerate([(a, 1.0), (b, 2.0), (a, 3.0), (b, 10.0)]):
        link.sends[i] = when
        index.sent(link, i, when, new=True)
    assert index.outstanding == 4
    del a.sends[0]  # answered
    index.let_go(1)
    b.sends[1] = 9.0  # sent again later
    index.sent(b, 1, 9.0, new=False)
    assert index.late(5.0) == {a: [2]}
    b.ready = False
    late = index.late(9.5)
    assert late == {b: [1]}
    index.park(b, late[b])
    assert index.late(9.5) == {}
    b.ready = True
    index.moved(b)
    assert index.late(9.5) == {b: [1]}


def test_watch_reports_ready_sockets_only() -> None:
    """The epoll poller: a socket with a message is reported (again while messages are
    left), one without is not; a send on a socket makes it be asked again."""
    ctx: zmq.Context[Any] = zmq.Context()
    watch = Watch()
    try:
        pairs = []
        for i in range(50):
            a, b = ctx.socket(zmq.PAIR), ctx.socket(zmq.PAIR)
            a.bind(f"inproc://w{i}")
            b.connect(f"inproc://w{i}")
            watch.register(b)
            pairs.append((a, b))
        assert watch.poll(0) == []
        pairs[7][0].send(b"x")
        pairs[7][0].send(b"y")
        deadline = time.monotonic() + 5
        ready: list[Any] = []
        while not ready and time.monotonic() < deadline:
            ready = watch.poll(100)
        assert [s for s, _ in ready] == [pairs[7][1]]
        pairs[7][1].recv()  # one of two read: still readable, reported again
        assert [s for s, _ in watch.poll(0)] == [pairs[7][1]]
        pairs[7][1].recv()
        assert watch.poll(0) == []
        # A send that takes the signal of a message that came meanwhile: touched, asked.
        pairs[3][0].send(b"z")
        time.sleep(0.05)
        pairs[3][1].send(b"back")  # (processes the socket's commands: the signal is taken)
        watch.touch(pairs[3][1])
        assert [s for s, _ in watch.poll(0)] == [pairs[3][1]]
        with pytest.raises(ValueError, match="POLLIN"):
            watch.register(pairs[0][0], zmq.POLLOUT)
        for a, b in pairs:
            watch.unregister(b)
            a.close(0)
            b.close(0)
    finally:
        watch.close()
        ctx.term()


def test_budget_message_names_the_limit() -> None:
    budget = FdBudget(limit=1000, hard=4000, base=100, per_server=8, reserve=256)
    assert budget.problem(80) is None  # 100 + 256 + 640 = 996
    why = budget.problem(100) or ""
    assert "need about 1156" in why and "raise it by 156 (ulimit -n 1156)" in why
    low = FdBudget(limit=1000, hard=1000, base=100, per_server=8, reserve=256)
    assert "raise the hard limit to at least 1156" in (low.problem(100) or "")
    assert budget.join() is None
    assert budget.take("tcp://a:1", 600) is True
    assert budget.room() == 1000 - 364 - 600
    assert budget.take("tcp://b:1", 100) is False
    assert budget.stats().through_front == 1 and budget.short_by() == 100 - 36
    budget.give("tcp://a:1", 600)
    assert budget.take("tcp://b:1", 100) is True and budget.stats().through_front == 0

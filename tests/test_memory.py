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
from clients import make_client
from conftest import PLUGINS, server_env
from fuzz_targets import welcome_of as fetch_welcome
from fuzzing import AUTH, task_header

from dataserver import protocol
from dataserver.protocol import MsgType
from dataserver.security import reply_id

MB = 1 << 20


def rss(pid: int) -> int:
    with open(f"/proc/{pid}/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) * 1024
    return 0


def rss_parts(pid: int) -> tuple[int, int]:
    """(resident memory of this process alone, resident shared memory it maps): the store
    of prepared sources is mapped by every worker and counted in each one's VmRSS."""
    fields = {}
    with open(f"/proc/{pid}/status") as f:
        for line in f:
            key, _, value = line.partition(":")
            if key in ("RssAnon", "RssFile", "RssShmem"):
                fields[key] = int(value.split()[0]) * 1024
    return fields["RssAnon"] + fields["RssFile"], fields["RssShmem"]


def tree_rss(pids: list[int]) -> int:
    """The server tree's resident memory, shared memory counted once."""
    parts = [rss_parts(p) for p in pids]
    return sum(own for own, _ in parts) + max(shared for _, shared in parts)


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
        done = server.stats()["counters"].get("images_done", 0)
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
    with make_client(server.address, batch_size=8, image_size=(256, 256), prefetch=2) as c:
        c.set_epoch(0)
        next(iter(c))
        time.sleep(2.0)  # the trainer stalls: nothing more is planned than prefetch allows
        done = server.stats()["counters"]["images_done"]
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
        sock.send_multipart(protocol.pack(MsgType.HELLO, {"session": session, "auth": AUTH}))
        before = rss(server.pid)
        for task_id in range(1, 3001):  # far beyond any credit, at 512 x 512 each
            header = task_header(session, task_id, images=[[task_id % 64]], side=512)
            sock.send_multipart(protocol.pack(MsgType.TASK, header))
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
    with make_client(server.address, batch_size=8, image_size=(32, 32)) as c:
        c.set_epoch(0)
        assert sum(len(b) for b in c) == 64


@pytest.mark.timeout(300)
def test_twenty_thousand_sessions_asking_the_largest_tasks_leave_the_server_tree_bounded(
    start_server: Any,
) -> None:
    """20,000 HELLOs, the largest tasks allowed from every session that got in, results
    never read (through the front, and straight from the workers to 32 of the sessions):
    the server tree's RSS stays under a bound set by the flags, and it keeps serving."""
    side, queued_mb, cache_mb = 1024, 32, 256
    server = start_server(
        "--dataset",
        "ds_plugins:flat",
        "--dataset-args",
        json.dumps({"n": 64}),
        "--max-sessions",
        "256",
        "--max-image-side",
        str(side),
        "--max-queued-mb",
        str(queued_mb),
        "--cache-gb",
        str(cache_mb / 1024),
        workers=2,
    )
    pids = [server.pid, *server.worker_pids()]
    # The bound: per process, what it needs at rest plus what the caps let it hold for
    # clients (queued tasks and unread results, --max-queued-mb each) plus two canvases,
    # plus the store of prepared sources (--cache-gb) once.
    canvas = 3 * side * side
    bound = tree_rss(pids) + len(pids) * (queued_mb * MB + 2 * canvas) + cache_mb * MB + 64 * MB
    honest = make_client(server.address, batch_size=8, image_size=(64, 64))
    ctx = zmq.Context()
    socks: list[zmq.Socket[Any]] = []

    def dealer(endpoint: str, identity: bytes | None = None) -> zmq.Socket[Any]:
        s = ctx.socket(zmq.DEALER)
        s.setsockopt(zmq.LINGER, 0)
        s.setsockopt(zmq.RCVHWM, 1)
        s.setsockopt(zmq.RCVBUF, 4096)
        s.setsockopt(zmq.SNDHWM, 1_000_000)
        if identity is not None:
            s.setsockopt(zmq.ROUTING_ID, identity)
        s.connect(endpoint)
        socks.append(s)
        return s

    peak = 0
    try:
        results = list(fetch_welcome(server.address).results)
        sessions = [b"%016d" % i for i in range(20_000)]
        for sid in sessions[:32]:  # these also take results straight from the workers
            for endpoint in results:
                dealer(endpoint, reply_id(sid))
        # 40 connections: one may hold at most 8 sessions (SESSIONS_PER_CONNECTION).
        attackers = [dealer(server.address) for _ in range(40)]
        attacker = attackers[0]
        for n, sid in enumerate(sessions):
            hello = protocol.pack(MsgType.HELLO, {"session": sid, "auth": sid})
            attackers[n % len(attackers)].send_multipart(hello)
        for task_id, sid in enumerate(sessions * 2, 1):  # the largest task allowed, twice each
            header = task_header(sid, task_id, images=[[task_id % 64]], side=side, auth=sid)
            attacker.send_multipart(protocol.pack(MsgType.TASK, header))
        # Meanwhile the honest client, connected before, is served (its fair share).
        honest.set_epoch(0)
        assert sorted(i for b in honest for idx in b.indices for i in idx) == list(range(64))
        deadline = time.monotonic() + 150
        while time.monotonic() < deadline:  # until the front has read the whole attack
            peak = max(peak, tree_rss(pids))
            stats = server.stats()
            c = stats["counters"]
            refused = stats["rejected"].get("session_limit", 0)
            refused += stats["rejected"].get("connection_sessions", 0)
            read = c.get("hellos", 0) + refused
            answered = c.get("tasks_done", 0) + c.get("tasks_failed", 0)
            # (on a loaded machine the front may drop an attacker's connection before it
            # read all of it: a peer that reads nothing answers no ZMTP PING either)
            gone = c.get("data_disconnects", 0) >= len(attackers)
            received = c.get("tasks_received", 0)
            if answered == received and (gone or (read > 20_000 and received >= 2 * 255)):
                break
            time.sleep(0.2)
        stats = server.stats()
        print(
            f"\nserver tree RSS peak {peak / MB:.0f} MiB (bound {bound / MB:.0f} MiB); "
            f"sessions {stats['sessions']}; rejected {stats['rejected']}; "
            f"counters {stats['counters']}"
        )
        rejected = stats["rejected"]
        refused = rejected.get("session_limit", 0) + rejected.get("connection_sessions", 0)
        # Every HELLO read past the first 256 sessions was refused (the honest one is 257th).
        assert stats["counters"]["hellos"] <= 257 and refused >= 10_000
        c = stats["counters"]  # unread results were capped (by bytes, or by the pipe's HWM)
        dropped = c.get("results_dropped_front", 0) + c.get("results_dropped_worker", 0)
        assert dropped + c.get("send_dropped_full", 0) > 0
        assert stats["workers_started"] == 2  # no worker died (of memory or otherwise)
        assert peak < bound
        # Every place is taken (255 attackers and the honest client), unless the front
        # dropped the attackers' connections (their sessions then expire, beating never);
        # a new client takes the place of a session silent for 5 s, and gets its epoch.
        full = stats["sessions"] == 256
        assert full or gone, stats["sessions"]
        time.sleep(5.5)
        with make_client(server.address, batch_size=8, image_size=(64, 64)) as c:
            c.set_epoch(1)
            assert sorted(i for b in c for idx in b.indices for i in idx) == list(range(64))
        assert server.stats()["sessions_evicted"] >= 1 or not full
    finally:
        honest.close()
        for s in socks:
            s.close(linger=0)
        ctx.term()


@pytest.mark.timeout(120)
def test_a_task_larger_than_the_budget_is_refused_before_a_worker_allocates(
    start_server: Any,
) -> None:
    """Issue 25 item 7: 64 images of 2048x2048 (768 MiB of canvas) asked in a few hundred
    bytes of TASK are refused by the front, naming --max-task-mb, before any worker
    allocates (each worker grew by ~1 GiB); the workers' RSS stays put."""
    server = start_server("--max-image-side", "2048", "--cache-gb", "0", workers=2)
    workers = server.worker_pids()
    before = tree_rss(workers)
    ctx = zmq.Context()
    sock = ctx.socket(zmq.DEALER)
    sock.setsockopt(zmq.LINGER, 0)
    sock.connect(server.address)
    try:
        sid = b"budget-probe-000"
        sock.send_multipart(protocol.pack(MsgType.HELLO, {"session": sid, "auth": sid}))
        assert sock.poll(10_000), "no WELCOME"
        welcome = protocol.decode(sock.recv_multipart())
        assert isinstance(welcome, protocol.Welcome) and welcome.max_task_bytes == 64 << 20
        for task_id in range(1, 5):
            header = task_header(sid, task_id, images=[[i] for i in range(64)], side=2048)
            header["auth"] = sid
            sock.send_multipart(protocol.pack(MsgType.TASK, header))
            assert sock.poll(10_000), "no answer to the task"
            answer = protocol.decode(sock.recv_multipart())
            assert isinstance(answer, protocol.ErrorMsg) and answer.kind == "limit"
            assert "--max-task-mb 64" in answer.message and "768 MiB" in answer.message
        time.sleep(0.5)
        assert tree_rss(workers) - before < 64 * MB
        stats = server.stats()
        assert stats["rejected"]["limit"] == 4 and stats["counters"].get("tasks_received", 0) == 0
        assert stats["limits"]["max_task_mb"] == 64
    finally:
        sock.close(linger=0)
        ctx.term()


@pytest.mark.timeout(120)
def test_a_client_cuts_its_batches_into_tasks_that_fit_the_budget(start_server: Any) -> None:
    """A server taking at most 1 MiB of output a task: a batch of 16 images of 256x256
    (3 MiB) goes in tasks of at most 5 images, none refused; the epoch is whole."""
    server = start_server(
        "--dataset", "synthetic:images=64,seed=3", "--max-image-side", "256",
        "--max-task-mb", "1", workers=2,
    )  # fmt: skip
    with make_client(server.address, batch_size=16, image_size=(256, 256)) as c:
        c.set_epoch(0)
        batches = list(c)
    assert sorted(i for b in batches for idx in b.indices for i in idx) == list(range(64))
    stats = server.stats()
    assert stats["rejected"].get("limit", 0) == 0
    assert stats["counters"]["tasks_received"] >= 4 * len(batches)  # (16 images / 5 a task)


def test_a_budget_below_one_image_is_refused_naming_both_flags() -> None:
    out = subprocess.run(
        [sys.executable, "-m", "dataserver.cli", "serve", "--max-task-mb", "8"],
        capture_output=True, text=True, timeout=60, env=server_env(),
    )  # fmt: skip
    assert out.returncode != 0
    assert "--max-task-mb 8" in out.stderr and "--max-image-side 4096" in out.stderr

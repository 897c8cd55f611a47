"""Every buffer bounded, every peer accountable (the isolation issue, point 4): idle
connections are dropped, STATS is cheap, public and rate-limited, a worker death at the fd
limit is survived, an endless message stalls no one and its memory goes back at hang-up,
and the metrics port follows --bind and holds no thread per client."""

from __future__ import annotations

import encodings.idna  # noqa: F401  (uid 65534's children connect by name; no venv reads)
import json
import os
import resource
import select
import shutil
import signal
import socket
import subprocess
import sys
import threading
import time
import urllib.request
from typing import Any

import msgspec
import pytest
import zmq
from clients import make_client
from conftest import Server, run_epoch_collecting_errors, wait_until
from fuzz_targets import welcome_of
from zmtp import (
    accept_as,
    closed_by_peer,
    frame_header,
    handshake,
    read_message,
    send_message,
)

from dataserver.counting import Counts
from dataserver.protocol import ErrorMsg, Heartbeat, Hello, Stats, decode
from dataserver.server.conns import CONNS_PER_SESSION, ConnTracker
from dataserver.server.counts import Reject
from dataserver.server.front.capacity import fds_allow
from dataserver.server.memory import FRONT_TRIM_THRESHOLD, keep_large_blocks
from dataserver.tcpinfo import loopback_uid

pytestmark = pytest.mark.timeout(240)

SAMPLES = 32


def host_port(endpoint: str) -> tuple[str, int]:
    host, port = endpoint.removeprefix("tcp://").rsplit(":", 1)
    return host, int(port)


def honest_epoch(server: Server, epoch: int = 0) -> list[int]:
    """One whole epoch of an honest client; the indices delivered (sorted)."""
    with make_client(server.address, batch_size=4, image_size=(32, 32), timeout=60) as client:
        delivered, errors = run_epoch_collecting_errors(client, epoch)
    assert not errors, errors
    return sorted(delivered)


def rss_mib(pid: int) -> int:
    with open(f"/proc/{pid}/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) // 1024
    raise AssertionError("no VmRSS")


def threads(pid: int) -> int:
    return len(os.listdir(f"/proc/{pid}/task"))


def test_idle_connections_are_dropped_while_an_honest_client_works(start_server: Any) -> None:
    # 8 s: past the front's first ZMTP PING (5 s), which a libzmq peer answers by itself.
    server = start_server(
        "--dataset", f"synthetic:images={SAMPLES}", "--idle-timeout", "8", workers=2
    )
    host, port = host_port(server.address)
    raw = [handshake(host, port) for _ in range(150)]  # no libzmq: answers nothing
    ctx: zmq.Context[Any] = zmq.Context()
    dealers = []
    for _ in range(150):  # libzmq peers: they answer PINGs, and would reconnect
        d = ctx.socket(zmq.DEALER)
        d.setsockopt(zmq.RECONNECT_IVL, -1)
        d.setsockopt(zmq.LINGER, 0)
        d.connect(server.address)
        dealers.append(d)
    try:
        assert wait_until(lambda: server.stats()["connections"] >= 300, 10)
        assert honest_epoch(server) == list(range(SAMPLES))  # while they idle
        assert all(closed_by_peer(s, 20) for s in raw)
        assert wait_until(lambda: server.stats()["rejected"].get("data_idle_dropped", 0) >= 300, 10)
        assert wait_until(lambda: server.stats()["connections"] <= 2, 10)  # (this probe)
        assert honest_epoch(server, 1) == list(range(SAMPLES))
    finally:
        for s in raw:
            s.close()
        ctx.destroy(linger=0)


def test_stats_is_public_cheap_and_rate_limited(start_server: Any) -> None:
    server = start_server("--dataset", f"synthetic:images={SAMPLES}", workers=2)
    stats = server.stats()
    for private in ("pid", "worker_pids", "endpoints"):
        assert private not in stats
    assert "path" not in (stats["store"] or {})
    assert sorted(server.worker_pids()) == sorted(server.worker_pids())  # from /proc
    assert len(server.worker_pids()) == 2

    ctx: zmq.Context[Any] = zmq.Context()
    flood = ctx.socket(zmq.DEALER)
    flood.setsockopt(zmq.LINGER, 0)
    flood.setsockopt(zmq.RCVHWM, 0)
    flood.connect(server.address)
    request = Stats().encode()
    answered = 0
    stop = threading.Event()

    def flooding() -> None:
        nonlocal answered
        while not stop.is_set():
            for _ in range(50):
                flood.send_multipart(request)
            while flood.poll(0):
                decode(flood.recv_multipart())
                answered += 1
            time.sleep(0.005)

    started = time.monotonic()
    thread = threading.Thread(target=flooding)
    thread.start()
    try:
        assert honest_epoch(server) == list(range(SAMPLES))  # served while flooded
    finally:
        stop.set()
        thread.join()
        elapsed = time.monotonic() - started
        while flood.poll(500):
            decode(flood.recv_multipart())
            answered += 1
        ctx.destroy(linger=0)
    time.sleep(0.5)  # (the bucket refills)
    after = server.stats()
    # At most the burst and the sustained rate (20/s) were answered; the rest was dropped.
    assert answered <= 40 + 20 * elapsed + 5
    assert after["rejected"]["stats_rate"] > answered


class LowFdServer(Server):
    """A server started with 256 fds, soft and hard (``prlimit`` execs it: same pid)."""

    def __init__(self, *args: str, **kwargs: Any) -> None:
        super().__init__(*args, nofile=256, **kwargs)


@pytest.mark.skipif(shutil.which("prlimit") is None, reason="needs util-linux prlimit")
def test_a_worker_death_at_the_fd_limit_is_survived() -> None:
    server = LowFdServer("--dataset", f"synthetic:images={SAMPLES}", workers=2)
    try:
        host, port = host_port(server.address)
        idle = []
        for _ in range(200):
            try:
                idle.append(handshake(host, port, timeout=5))
            except OSError:  # (beyond the front's cap, a connection is shut down at once)
                pass
        # Beyond the cap a newcomer is shut down while every held connection is fresh
        # (under 2 s); after that, the idlest held one makes room.
        time.sleep(2.5)
        stats = server.stats()
        cap = stats["limits"]["max_connections"]
        assert cap < 256 and stats["connections"] <= cap
        assert honest_epoch(server) == list(range(SAMPLES))

        # A worker dies while the connections are held: replaced (the cap left it fds).
        os.kill(server.worker_pids()[0], signal.SIGKILL)
        assert wait_until(lambda: server.stats()["workers_started"] == 3, 30)
        assert wait_until(lambda: server.stats()["workers_alive"] == 2, 30)

        # No fd left at all (a soft limit of 16: below every free fd number; not lower, as
        # poll(2) refuses more items than the limit): the replacement of the next dead
        # worker fails with EMFILE, is logged, counted and tried again.
        assert all(str(fd) in os.listdir(f"/proc/{server.pid}/fd") for fd in range(16))
        resource.prlimit(server.pid, resource.RLIMIT_NOFILE, (16, 256))
        os.kill(server.worker_pids()[0], signal.SIGKILL)
        assert wait_until(lambda: "cannot start worker" in server.read_stderr(), 20)
        assert server.proc.poll() is None
        resource.prlimit(server.pid, resource.RLIMIT_NOFILE, (256, 256))  # fds free up
        assert wait_until(lambda: server.stats()["workers_alive"] == 2, 30)
        stats = server.stats()
        assert stats["worker_spawn_failures"] >= 1 and stats["workers_started"] == 4
        assert honest_epoch(server, 1) == list(range(SAMPLES))
    finally:
        for s in idle:
            s.close()
        server.stop()


class FdLimitServer(Server):
    """A server started with ``nofile`` fds, soft and hard."""

    def __init__(self, nofile: int, *args: str, **kwargs: Any) -> None:
        super().__init__(*args, nofile=nofile, **kwargs)


def worker_endpoints(server: Server) -> list[str]:
    """The workers' TCP result endpoints, as a WELCOME names them to anyone."""
    return list(welcome_of(server.address).results)


def fds(pid: int) -> int:
    return len(os.listdir(f"/proc/{pid}/fd"))


def _results_dropped(server: Server, *reasons: str) -> int:
    """The result connections the workers shut down for any of ``reasons``."""
    rejected = server.stats()["rejected"]
    return sum(rejected.get(f"results_{reason}_dropped", 0) for reason in reasons)


@pytest.mark.skipif(shutil.which("prlimit") is None, reason="needs util-linux prlimit")
def test_connections_to_a_workers_result_port_cannot_take_its_fds(coco_dir: Any) -> None:
    """Issue 25 item 5: 2,100 idle connections to one worker's result port took it to its
    fd limit: another job's sample failed with 'Too many open files' and a worker aborted
    in libzmq's ipc listener when a local job connected. A worker keeps its result
    connections within ``results_budget`` (the fd limit less a reserve: 768 of 1,024 here),
    unclaimed ones shut down first, and past the idle timeout every unclaimed one: no
    worker dies, and a job reading JPEGs from disk (no store) is served meanwhile."""
    server = FdLimitServer(
        1024, "--dataset", f"coco:{coco_dir / 'annotations.json'}", "--cache-gb", "0",
        "--idle-timeout", "5", workers=2,
    )  # fmt: skip
    idle: list[socket.socket] = []
    ctx: zmq.Context[Any] = zmq.Context()
    try:
        endpoint = worker_endpoints(server)[0]
        host, port = host_port(endpoint)
        workers = sorted(server.worker_pids())
        for _ in range(1100):  # more than the worker has fds
            try:
                idle.append(handshake(host, port, timeout=5))
            except OSError:  # (shut down by the worker before the handshake ended)
                pass
        peak = max(fds(pid) for pid in workers)
        assert peak < 1024 - 64, peak  # the worker kept fds for its own work
        assert wait_until(  # (unclaimed ones are kept apart, the oldest go: issue 40)
            lambda: _results_dropped(server, "over_limit", "unclaimed") >= 1100 - 768, 10
        ), server.stats()["rejected"]
        with make_client(  # a local job: its results come by the workers' ipc sockets
            server.address, batch_size=4, image_size=(64, 64), timeout=60
        ) as client:
            for epoch in range(2):
                delivered, errors = run_epoch_collecting_errors(client, epoch)
                assert not errors, errors
                assert sorted(delivered) == list(range(48))
        # Silent ones go (raw ones answer no ZMTP PING either); libzmq peers answer PINGs
        # but claim nothing: past the idle timeout (no less than 4 claim periods) they go.
        assert all(closed_by_peer(s, 40) for s in idle)
        dealers = []
        for _ in range(100):
            d = ctx.socket(zmq.DEALER)
            d.setsockopt(zmq.RECONNECT_IVL, -1)
            d.setsockopt(zmq.LINGER, 0)
            d.connect(endpoint)
            dealers.append(d)
        assert wait_until(
            lambda: _results_dropped(server, "idle", "unclaimed", "over_limit") >= 1100, 40
        ), server.stats()["rejected"]
        stats = server.stats()
        assert stats["workers_started"] == 2 and sorted(server.worker_pids()) == workers
        assert "Too many open files" not in server.read_stderr()
    finally:
        for s in idle:
            s.close()
        ctx.destroy(linger=0)
        server.stop()


def test_an_endless_message_to_a_worker_is_cut_off(start_server: Any) -> None:
    """Issue 25 item 8, a worker's result port (clients send only claims there; a frame is
    at most 1 KiB): a message of 1 KiB frames that never ended held 128 MiB in the worker,
    226 MiB after the sender hung up. Cut off at 64 KiB unfinished (checked 4 times a
    second); the worker lives and serves."""
    server = start_server("--dataset", f"synthetic:images={SAMPLES}", workers=1)
    assert honest_epoch(server, 2) == list(range(SAMPLES))
    (worker,) = server.worker_pids()
    before = rss_mib(worker)
    host, tcp_port = host_port(worker_endpoints(server)[0])
    sender = handshake(host, tcp_port, b"DEALER")
    chunk = (frame_header(1000, True) + b"\x00" * 1000) * 1024  # ~1 MiB of 1 KB frames
    sent = 0
    try:
        deadline = time.monotonic() + 30
        while time.monotonic() < deadline:
            sender.sendall(chunk)
            sent += 1
            time.sleep(0.02)
    except OSError:
        pass
    finally:
        sender.close()
    assert sent < 32, f"not cut off after {sent} MiB"
    assert wait_until(
        lambda: server.stats()["rejected"].get("results_unfinished_dropped", 0) == 1, 5
    )
    held = rss_mib(worker) - before
    assert held < 64, held
    assert honest_epoch(server, 1) == list(range(SAMPLES))
    assert server.worker_pids() == [worker]
    print(f"\nendless message to a worker: cut after {sent} MiB; worker RSS +{held} MiB")


def test_an_endless_message_is_cut_off_and_its_memory_goes_back(start_server: Any) -> None:
    """Issue 25 item 8: libzmq bounds a frame, not the frames of a message; a message that
    never ended held 1,024 MiB in the front (data port). Its connection is shut down once it holds 32 MiB unfinished (the kernel's bytes received
    on it against its complete messages), an honest job is served meanwhile, and the
    memory is back within 5 s."""
    server = start_server("--dataset", f"synthetic:images={SAMPLES}", workers=2)
    host, tcp_port = host_port(server.address)
    assert honest_epoch(server, 2) == list(range(SAMPLES))  # (what serving takes, first)
    before = rss_mib(server.pid)
    sender = handshake(host, tcp_port, b"DEALER")
    chunk = frame_header(1 << 20, True) + b"\x00" * (1 << 20)  # 1 MiB frames, all "more"
    sent = 0
    cut = threading.Event()
    stop = threading.Event()

    def send() -> None:  # bounded: 256 MiB or 30 s, never the message's end
        nonlocal sent
        deadline = time.monotonic() + 30
        try:
            while sent < 256 and time.monotonic() < deadline and not stop.is_set():
                sender.sendall(chunk)
                sent += 1
                time.sleep(0.02)
        except OSError:
            cut.set()

    thread = threading.Thread(target=send)
    thread.start()
    try:
        assert honest_epoch(server) == list(range(SAMPLES))  # while the message grows
        assert cut.wait(30), f"not cut off after {sent} MiB"
    finally:
        stop.set()
        thread.join()
        sender.close()
    assert sent < 128, sent
    assert server.stats()["rejected"].get("data_unfinished_dropped", 0) == 1
    # libzmq freed the frames with the connection, and the front gave the pages back: all
    # but what glibc keeps at an arena's top by design (FRONT_TRIM_THRESHOLD, 16 MiB: CI
    # saw 16 MiB held, here 2-14), while frames kept would hold the 32 MiB cut-off or more.
    bound = FRONT_TRIM_THRESHOLD // (1 << 20) + 8
    assert wait_until(lambda: rss_mib(server.pid) - before < bound, 5), rss_mib(server.pid) - before
    assert honest_epoch(server, 1) == list(range(SAMPLES))


def test_a_servers_endless_message_is_cut_off_in_the_trainer(start_server: Any) -> None:
    """Issue 25 item 8, the trainer's side: a hostile server (no libzmq) welcomes the
    client as the real one would, then sends one message that never ends; it held +771 MiB
    in the trainer until the client closed. A connection may hold what the server's
    outstanding answers can take (and 64 MiB): past that the server is dropped, its sockets
    closed, and the epoch completes, exactly once, from the honest server."""
    server = start_server("--dataset", f"synthetic:images={SAMPLES}", workers=2)
    welcome = welcome_of(server.address)
    listener = socket.create_server(("127.0.0.1", 0))
    hostile = f"tcp://127.0.0.1:{listener.getsockname()[1]}"
    sent = 0
    closed = threading.Event()

    def serve() -> None:
        nonlocal sent
        listener.settimeout(30)
        try:
            conn = accept_as(listener)
        except OSError:
            return
        with conn:
            hello = decode(read_message(conn))
            assert isinstance(hello, Hello)
            reply = msgspec.structs.replace(
                welcome, session=hello.session, results=(), local=(), local_proof=b""
            )
            send_message(conn, [bytes(memoryview(f)) for f in reply.encode()])
            chunk = frame_header(1 << 20, True) + b"\x00" * (1 << 20)
            deadline = time.monotonic() + 60
            try:
                while time.monotonic() < deadline:  # one message, never its last frame
                    conn.sendall(chunk)
                    sent += 1
            except OSError:
                closed.set()

    thread = threading.Thread(target=serve, daemon=True)
    thread.start()
    # What the client holds, not what glibc caches: a trainer's heap trim threshold is
    # glibc's dynamic one, which this long-lived process raised to 2x the largest block it
    # freed (a 32 MiB array: 64 MiB kept at an arena's top, where malloc_trim does not
    # reach; 70 MiB "held" in one CI run). Pinned here as a fresh trainer has it, small.
    keep_large_blocks(mmap_threshold=1 << 20, trim_threshold=FRONT_TRIM_THRESHOLD)
    before = rss_mib(os.getpid())
    try:
        with make_client(
            [server.address, hostile], batch_size=4, image_size=(32, 32), timeout=60,
        ) as client:  # fmt: skip
            delivered, errors = run_epoch_collecting_errors(client, 0)
            assert closed.wait(30), f"not cut off after {sent} MiB"
            rejected = client.stats()["rejected"]
            assert rejected.get("unfinished_message", 0) == 1 and rejected["bad_server"] == 1
            assert not errors and sorted(delivered) == list(range(SAMPLES))
            # The connection and what it held are gone, the client still open.
            assert wait_until(lambda: rss_mib(os.getpid()) - before < 64, 5), (
                rss_mib(os.getpid()) - before
            )
            held = rss_mib(os.getpid()) - before
    finally:
        listener.close()
        thread.join(10)
    print(f"\nhostile server's endless message: cut after {sent} MiB; trainer +{held} MiB")


def test_a_slowloris_does_not_hold_the_connection_cap(start_server: Any) -> None:
    """Issue 25 item 2: 320 connections each sending 80 bytes a second of a message they
    never finish held the connection cap (320 at --max-sessions 16) and an honest job got
    'no progress for 20 s'. Only complete, authentic messages count as activity, and at
    the cap a connection of no live session goes first, never the newcomer: the honest
    job is served, and the slow ones are dropped as idle."""
    server = start_server(
        "--dataset", f"synthetic:images={SAMPLES}", "--max-sessions", "16",
        "--idle-timeout", "6", workers=2,
    )  # fmt: skip
    cap = server.stats()["limits"]["max_connections"]
    assert cap == CONNS_PER_SESSION * 16 + 256
    host, port = host_port(server.address)
    slow = []
    for _ in range(cap):
        try:
            slow.append(handshake(host, port, timeout=5))
        except OSError:
            pass
        slow[-1].sendall(frame_header(1 << 16, True))  # a 64 KiB frame, begun
    stop = threading.Event()

    def trickle() -> None:  # 80 bytes a second on each, never a whole frame
        while not stop.is_set():
            for s in slow:
                try:
                    s.sendall(b"\x00" * 80)
                except OSError:
                    pass
            stop.wait(1.0)

    thread = threading.Thread(target=trickle)
    thread.start()
    try:
        assert wait_until(lambda: server.stats()["connections"] >= cap - 4, 10)
        assert honest_epoch(server) == list(range(SAMPLES))  # the cap is full of them
        assert honest_epoch(server, 1) == list(range(SAMPLES))
        rejected = server.stats()["rejected"]
        assert rejected.get("data_over_limit_dropped", 0) >= 1
        # Sending bytes is not activity: past --idle-timeout every slow one is dropped.
        assert wait_until(
            lambda: server.stats()["rejected"].get("data_idle_dropped", 0) >= len(slow) - 20, 20
        )
    finally:
        stop.set()
        thread.join()
        for s in slow:
            s.close()


def test_metrics_follow_bind_and_hold_no_thread_per_client(start_server: Any) -> None:
    server = start_server(
        "--dataset", f"synthetic:images={SAMPLES}", "--metrics-port", "0", workers=1
    )
    port = server.stats()["metrics_port"]
    # --bind tcp://127.0.0.1:0, so the metrics listen on loopback only.
    with open(f"/proc/{server.pid}/net/tcp") as f:
        listening = [line.split()[1] for line in f.readlines()[1:] if line.split()[3] == "0A"]
    assert f"0100007F:{port:04X}" in listening
    base = threads(server.pid)
    slow = [socket.create_connection(("127.0.0.1", port)) for _ in range(60)]
    try:
        for s in slow[:30]:
            s.sendall(b"GET /metrics HTTP/1.1\r\n")  # and never the end of the request
        assert threads(server.pid) <= base
        time.sleep(1)  # (past 0.5 s, the oldest of them makes room for a newcomer)
        with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5) as reply:
            assert reply.status == 200 and b"dataserver_workers" in reply.read()
        # Over the cap (32) or past 5 s, every slow one is closed by the server.
        assert all(closed_by_peer(s, 10) for s in slow)
    finally:
        for s in slow:
            s.close()


def test_a_scrape_flood_is_refused_by_peer_and_another_peer_is_answered(
    start_server: Any,
) -> None:
    """Issue 25 item 9: 16 threads scraping the metrics port as fast as they could cost
    the front's process +0.41 of a core. A peer is answered at most 50 times a second
    (bursts of 100); a connection over its rate is closed as accepted, and past 50 of those
    in a second the listener pauses. Another peer (uid 65534 from 127.0.0.2: over loopback
    a peer is its user since issue 40) is answered meanwhile."""
    if os.getuid() != 0:
        pytest.skip("needs root to act as uid 65534")
    server = start_server(
        "--dataset", f"synthetic:images={SAMPLES}", "--metrics-port", "0",
        "--metrics-bind", "0.0.0.0", workers=1,
    )  # fmt: skip
    port = server.stats()["metrics_port"]
    stop = threading.Event()
    answered = 0

    def flood() -> None:
        nonlocal answered
        while not stop.is_set():
            try:
                with socket.create_connection(("127.0.0.1", port), timeout=2) as s:
                    s.sendall(b"GET /metrics HTTP/1.1\r\n\r\n")
                    if s.recv(12).startswith(b"HTTP/1.1 200"):
                        answered += 1
            except OSError:
                pass

    threads = [threading.Thread(target=flood) for _ in range(16)]
    for t in threads:
        t.start()
    try:
        time.sleep(3)
        started = time.monotonic()
        reply = _scrape_as_nobody(port)  # another peer (another user): its own rate
        assert reply.startswith(b"HTTP/1.1 200") and b"dataserver_workers" in reply
        assert time.monotonic() - started < 10
        elapsed = time.monotonic() - started + 3
    finally:
        stop.set()
        for t in threads:
            t.join()
    assert answered <= 100 + 50 * (elapsed + 2), answered  # the burst and the rate
    assert wait_until(lambda: server.stats()["rejected"].get("scrape_rate", 0) >= 50, 5)


NOBODY = 65534


def _scrape_as_nobody(port: int) -> bytes:
    """One scrape of the metrics port by uid 65534 from 127.0.0.2 (a forked child): the
    reply's bytes."""
    read, write = os.pipe()
    pid = os.fork()
    if pid == 0:
        try:
            os.close(read)
            os.setgroups([])
            os.setgid(NOBODY)
            os.setuid(NOBODY)
            with socket.create_connection(
                ("127.0.0.1", port), timeout=10, source_address=("127.0.0.2", 0)
            ) as s:
                s.sendall(b"GET /metrics HTTP/1.1\r\n\r\n")
                while chunk := s.recv(65536):
                    os.write(write, chunk)
        finally:
            os._exit(0)
    os.close(write)
    reply = b""
    try:
        while chunk := os.read(read, 65536):
            reply += chunk
    finally:
        os.close(read)
        os.waitpid(pid, 0)
    return reply


def _sessions_as_nobody(address: str, conns: int, per_conn: int, report: int) -> int:
    """A child of uid 65534 that opens sessions at ``address`` over loopback: on ``conns``
    connections one after another, ``per_conn`` HELLOs each (each connection's answers
    awaited before the next); it writes the answers' kinds as a JSON list to fd
    ``report``, then keeps its sessions beating (HEARTBEAT every 0.5 s) until killed. Its
    pid."""
    pid = os.fork()
    if pid:
        return pid
    try:
        os.setgroups([])
        os.setgid(NOBODY)
        os.setuid(NOBODY)
        ctx: zmq.Context[Any] = zmq.Context()
        held, kinds = [], []
        for c in range(conns):
            s = ctx.socket(zmq.DEALER)
            s.setsockopt(zmq.LINGER, 0)
            s.connect(address)
            for i in range(per_conn):
                sid = b"nobody-%02d-%02d-abc" % (c, i)
                s.send_multipart(Hello(session=sid, auth=sid).encode())
                held.append((s, sid))
            for _ in range(per_conn):
                if not s.poll(10_000):
                    os._exit(2)
                answer = decode(s.recv_multipart())
                kinds.append(answer.kind if isinstance(answer, ErrorMsg) else "welcome")
            for t, sid in held:  # (alive meanwhile: a session silent 5 s may be replaced)
                t.send_multipart(Heartbeat(session=sid, auth=sid).encode())
        os.write(report, json.dumps(kinds).encode() + b"\n")
        while True:
            for s, sid in held:
                s.send_multipart(Heartbeat(session=sid, auth=sid).encode())
                while s.poll(0):
                    s.recv_multipart()
            time.sleep(0.5)
    finally:
        os._exit(1)


def test_a_message_read_before_its_connections_accept_event_charges_its_user() -> None:
    """CI (stop 33): the honest job's HELLO was read before the front had handled its
    connection's ACCEPTED event, so the cap charged it as everyone at 127.0.0.1, the peer
    the other user's sessions (read early too) were charged as: refused. A connection the
    front does not know yet is looked up at once."""
    if os.getuid() != 0:
        pytest.skip("needs root for uid 65534's side")
    conns = ConnTracker(idle_timeout=60, limit=100, rejected=Counts(Reject), max_unfinished=1 << 20)
    with socket.create_server(("127.0.0.1", 0)) as listener:
        port = listener.getsockname()[1]
        child = os.fork()
        if child == 0:  # uid 65534 connects and waits to be closed (nobody may not run
            try:  # this venv's python: a fork, with nothing but system calls)
                os.setuid(NOBODY)
                c = socket.socket()
                c.connect(("127.0.0.1", port))
                c.recv(1)
            finally:
                os._exit(0)
        try:
            listener.settimeout(30)
            conn, address = listener.accept()
            with conn:
                named = loopback_uid(conn.fileno())
                if named is None:
                    pytest.skip("the kernel's sock_diag does not name a loopback peer here")
                assert named == NOBODY
                assert conns.peer_of(conn.fileno(), address[0]) == f"uid:{NOBODY}"
                conns.accepted("data", conn.fileno())
                assert conns.peer_of(conn.fileno(), address[0]) == f"uid:{NOBODY}"
        finally:
            os.kill(child, signal.SIGKILL)
            os.waitpid(child, 0)
    assert conns.peer_of(-1, "127.0.0.1") == "127.0.0.1"  # (no SRCFD: the address)


@pytest.mark.parametrize("cap", ["flag", "fds"])
def test_one_peer_cannot_hold_every_session(start_server: Any, cap: str) -> None:
    """Issue 25, item 1, with its "peer": a local user, uid 65534 (on the host every user
    shares 127.0.0.1; a loopback connection's peer is the uid at its other end, which the
    kernel's sock_diag names; a remote one's, its address). It opens sessions on 8
    connections, 10 each: each connection holds at most 8 (the rest refused
    ``connection_sessions``), and four of them fill the server's 32 places (``flag``:
    ``--max-sessions 32``; ``fds``: the cap its fd limit allows, issue 28: a server
    started with the fd limit that allows 32); they keep beating. An honest job of another
    user (root, also from 127.0.0.1) takes the place of one of them and gets its epoch: it
    was refused at once with ``session_limit``, by one connection holding every place, and
    then by uid 65534 sharing its address."""
    if os.getuid() != 0:
        pytest.skip("needs root to act as uid 65534")
    with (
        socket.create_server(("127.0.0.1", 0)) as listener,
        socket.create_connection(listener.getsockname()),
    ):
        conn, _ = listener.accept()
        with conn:
            named = loopback_uid(conn.fileno())
    if named != os.getuid():
        pytest.skip("the kernel's sock_diag does not name a loopback peer here")
    dataset = ("--dataset", f"synthetic:images={SAMPLES},seed=1")
    if cap == "flag":
        server = start_server(*dataset, "--max-sessions", "32", workers=1)
    else:
        nofile = next(n for n in range(64, 1024) if fds_allow(n, 1) == 32)
        server = start_server(*dataset, workers=1, nofile=nofile)
        limits = server.stats()["limits"]
        assert limits["max_sessions"] == 32, limits
        assert f"fd limit {nofile}" in limits["max_sessions_why"], limits
    r, w = os.pipe()
    child = _sessions_as_nobody(server.address, 8, 10, w)
    os.close(w)
    try:
        ready, _, _ = select.select([r], [], [], 60)
        assert ready, "the other user's sessions did not open"
        kinds = json.loads(os.read(r, 1 << 16))
        # Connections 1-4: 8 sessions each, 2 refused; 5-8: every place taken, by this peer
        # (on a loaded machine one of its first may have been silent 5 s, and replaced).
        assert kinds.count("welcome") >= 32 and len(kinds) == 80, kinds
        refused_here = kinds.count("connection_sessions")
        assert refused_here >= 8 and refused_here % 2 == 0
        assert kinds.count("welcome") + kinds.count("session_limit") == 80 - refused_here
        assert server.stats()["sessions"] == 32
        assert honest_epoch(server) == list(range(SAMPLES))
        stats = server.stats()
        assert stats["sessions_evicted"] >= 1
        assert stats["rejected"]["connection_sessions"] == refused_here
    finally:
        os.close(r)
        os.kill(child, signal.SIGKILL)
        os.waitpid(child, 0)


def test_the_operator_is_answered_under_a_stats_flood(start_server: Any) -> None:
    """Issue 25 item 3: a local user sending STATS 100 times a second left `dataserver stats
    --check` answered 2 times of 10. On the server's host, as its user, the command asks
    over the admin socket in the server's 0700 state dir (found from ADDR), with a rate of
    its own: 10 of 10, while the flood is refused at the public rate."""
    server = start_server("--dataset", f"synthetic:images={SAMPLES}", workers=1)
    stop = threading.Event()

    def flood() -> None:
        ctx = zmq.Context()
        s = ctx.socket(zmq.DEALER)
        s.setsockopt(zmq.LINGER, 0)
        s.connect(server.address)
        try:
            while not stop.is_set():
                s.send_multipart(Stats().encode())
                while s.poll(0):
                    s.recv_multipart()
                time.sleep(0.01)
        finally:
            s.close(linger=0)
            ctx.term()

    flooder = threading.Thread(target=flood, daemon=True)
    flooder.start()
    try:
        time.sleep(2.5)  # the public bucket (20/s, bursts of 40) is long empty
        answered = 0
        for _ in range(10):
            out = subprocess.run(
                [sys.executable, "-m", "dataserver.cli", "stats", server.address, "--check",
                 "--timeout", "2"],
                capture_output=True, text=True, timeout=60,
            )  # fmt: skip
            answered += out.returncode == 0
    finally:
        stop.set()
        flooder.join(10)
    assert answered == 10
    assert server.stats()["rejected"]["stats_rate"] > 20  # the flood was refused meanwhile


def test_the_operator_reaches_the_server_at_the_address_named(start_server: Any) -> None:
    """Two servers hold one port number on two addresses of this host (as nodes played by
    network namespaces do, on one file system), and a third on that port was SIGKILLed:
    `dataserver stats ADDR` answers from the server bound at ADDR, each time."""
    gone = start_server("--dataset", "synthetic:images=24", workers=1)
    port = int(gone.address.rsplit(":", 1)[1])
    os.kill(gone.proc.pid, signal.SIGKILL)
    gone.proc.wait(30)
    one = start_server(
        "--dataset", "synthetic:images=32", workers=1, bind=f"tcp://127.0.0.1:{port}"
    )
    two = start_server(
        "--dataset", "synthetic:images=48", workers=1, bind=f"tcp://127.0.0.2:{port}"
    )
    for server, images in ((one, 32), (two, 48), (one, 32)):
        out = subprocess.run(
            [sys.executable, "-m", "dataserver.cli", "stats", server.address, "--json",
             "--timeout", "5"],
            capture_output=True, text=True, timeout=60,
        )  # fmt: skip
        assert out.returncode == 0, out.stderr
        assert json.loads(out.stdout)["dataset_len"] == images, server.address


def test_the_public_sockets_queue_thousands_of_connections_before_accept(
    start_server: Any,
) -> None:
    """Issue 28: 10,000 sessions reconnecting at once overflowed libzmq's listen backlog of
    100 (the kernel answered with SYN cookies; handshakes failed; every reconnect was made
    3x over). The data and result ports listen with a backlog of 4,096, or what
    the kernel's somaxconn allows (``ss`` shows a listener's backlog as its Send-Q)."""
    if shutil.which("ss") is None:
        pytest.skip("no ss here")
    with open("/proc/sys/net/core/somaxconn") as f:
        want = min(4096, int(f.read()))
    server = start_server("--dataset", f"synthetic:images={SAMPLES}", workers=1)
    for endpoint in (server.address, worker_endpoints(server)[0]):
        _, port = host_port(endpoint)
        out = subprocess.run(
            ["ss", "-ltnH", f"sport = :{port}"], capture_output=True, text=True, check=True
        ).stdout.split()
        assert out and out[0] == "LISTEN", (endpoint, out)
        assert int(out[2]) == want, (endpoint, out)

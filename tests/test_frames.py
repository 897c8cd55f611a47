"""Issue 40, item 1: messages of empty frames. libzmq keeps ~64 bytes for every frame and an
empty frame is 2 bytes on the wire, so a bound on bytes let 8 MB of unfinished empty frames
grow the front by 244 MiB, and the front read every frame of a message before its 16-frame
check (500,000 frames a second took its core). The attackers here are real processes of
another user (uid 65534, a fork that speaks ZMTP over a plain socket: ``zmtp.py``)."""

from __future__ import annotations

import encodings.idna  # noqa: F401  (uid 65534's child connects by name; it may not read the venv)
import os
import signal
import socket
import time
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import pytest
import zmq
from conftest import Server, wait_until
from test_bounds import SAMPLES, honest_epoch, host_port, rss_mib, worker_endpoints
from zmq.utils.monitor import recv_monitor_message
from zmtp import frame_header, handshake

from dataserver.counting import Counts
from dataserver.server.conns import ConnTracker
from dataserver.server.counts import Reject
from dataserver.server.memory import FRONT_TRIM_THRESHOLD

pytestmark = pytest.mark.timeout(240)

NOBODY = 65534
EMPTY_MORE = frame_header(0, True)  # one empty frame, more to come: 2 bytes on the wire


def _need_root() -> None:
    if os.getuid() != 0:
        pytest.skip("needs root to act as uid 65534")


@contextmanager
def as_nobody(attack: Any) -> Iterator[int]:
    """``attack()`` run in a child of uid 65534 (a fork: system calls and this module's
    stdlib ZMTP only); killed and reaped on the way out. Its pid."""
    pid = os.fork()
    if pid == 0:
        code = 1
        try:
            os.setgroups([])
            os.setgid(NOBODY)
            os.setuid(NOBODY)
            attack()
            code = 0
        finally:
            os._exit(code)
    try:
        yield pid
    finally:
        os.kill(pid, signal.SIGKILL)
        os.waitpid(pid, 0)


def _unfinished_flood(host: str, port: int, wire: int, chunk: int = 256 << 10) -> None:
    """Connect, send ``wire`` bytes of empty frames of one message that never ends, paced
    (a chunk each 20 ms), then hold the connection until it is closed."""
    sock = handshake(host, port, b"DEALER")
    block = EMPTY_MORE * (chunk // 2)
    sent = 0
    try:
        while sent < wire:
            sock.sendall(block)
            sent += len(block)
            time.sleep(0.02)
        sock.settimeout(None)
        while sock.recv(4096):
            pass
    except OSError:
        pass


def test_credit_from_tiny_messages_does_not_hide_an_unfinished_message() -> None:
    """The byte credit a connection earned from many tiny whole messages (64 bytes counted
    per frame read, 2 sent) let a later unfinished message pass the bound uncut: 20,000
    one-frame messages earned ~1.2 MB. A connection is credited what its messages took on
    the wire, and its unfinished bytes weigh what their frames may cost: 200 KiB of empty
    frames (6.4 MiB in libzmq) is over a 4 MiB bound."""
    _need_root()
    rejected: Counts[Reject] = Counts(Reject)
    tracker = ConnTracker(idle_timeout=60, limit=100, rejected=rejected, max_unfinished=4 << 20)
    ctx: zmq.Context[Any] = zmq.Context()
    router = ctx.socket(zmq.ROUTER)
    router.setsockopt(zmq.LINGER, 0)
    monitor = router.get_monitor_socket(zmq.EVENT_ACCEPTED)
    router.bind("tcp://127.0.0.1:0")
    host, port = host_port(router.getsockopt_string(zmq.LAST_ENDPOINT))
    tiny = 20_000

    def attack() -> None:
        sock = handshake(host, port, b"DEALER")
        sock.sendall(frame_header(0, False) * tiny)  # 20,000 whole messages, one empty frame
        time.sleep(1.0)
        sock.sendall(EMPTY_MORE * (100 << 10))  # then 200 KiB of a message never finished
        sock.settimeout(None)
        while sock.recv(4096):
            pass

    try:
        with as_nobody(attack):
            assert monitor.poll(10_000)
            tracker.accepted("data", recv_monitor_message(monitor)["value"])
            read = 0
            deadline = time.monotonic() + 30
            while read < tiny and time.monotonic() < deadline:
                if router.poll(100):
                    while True:
                        try:
                            frames = router.recv_multipart(zmq.NOBLOCK, copy=False)
                        except zmq.Again:
                            break
                        tracker.read(frames, skip=1)
                        read += 1
            assert read == tiny
            cut = False
            deadline = time.monotonic() + 10
            while not cut and time.monotonic() < deadline:
                tracker.check(time.monotonic())
                cut = rejected.get(Reject.DATA_UNFINISHED_DROPPED) == 1
                time.sleep(0.1)
            assert cut, "200 KiB of unfinished empty frames after 20,000 tiny messages: not cut"
    finally:
        monitor.close(linger=0)
        router.close(linger=0)
        ctx.term()


def test_unfinished_empty_frames_are_weighed_by_what_they_cost(start_server: Any) -> None:
    """uid 65534, no session, sends 8 MB of empty frames of a message it never finishes
    (paced, 12 MB a second) and holds the connection: they grew the front by 244 MiB (260
    still held after it left), never cut (8 MB is under the 32 MiB byte bound). Weighed at
    32 bytes of memory a byte, the connection is cut, the memory goes back, and an honest
    job is served."""
    _need_root()
    server: Server = start_server("--dataset", f"synthetic:images={SAMPLES}", workers=1)
    assert honest_epoch(server, 2) == list(range(SAMPLES))
    host, port = host_port(server.address)
    before = rss_mib(server.pid)
    with as_nobody(lambda: _unfinished_flood(host, port, 8 << 20)):
        assert wait_until(
            lambda: server.stats()["rejected"].get("data_unfinished_dropped", 0) >= 1, 20
        ), "8 MB of unfinished empty frames: the connection was not cut"
        bound = FRONT_TRIM_THRESHOLD // (1 << 20) + 16
        assert wait_until(lambda: rss_mib(server.pid) - before < bound, 10), (
            rss_mib(server.pid) - before
        )
        held = rss_mib(server.pid) - before
        assert honest_epoch(server, 1) == list(range(SAMPLES))
    print(f"\n8 MB of unfinished empty frames to the front: cut, +{held} MiB after")


def _whole_floods(host: str, port: int, seconds: float) -> None:
    """One message of 500,000 empty frames (1 MB) a second, for ``seconds``; a connection
    cut is made again."""
    message = EMPTY_MORE * 499_999 + frame_header(0, False)
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline:
        try:
            sock = handshake(host, port, b"DEALER", timeout=5)
        except OSError:
            time.sleep(0.1)
            continue
        try:
            while time.monotonic() < deadline:
                sock.sendall(message)
                time.sleep(1.0)
        except OSError:
            pass
        finally:
            sock.close()


@pytest.mark.parametrize("target", ["front", "worker"])
def test_a_message_of_too_many_frames_is_cut_at_its_17th_frame(
    start_server: Any, target: str
) -> None:
    """uid 65534 sends the data port one message of 500,000 empty frames (1 MB) a second:
    the front read every frame before its 16-frame check and every honest job died with "no
    progress" (to a worker's result port: 33-104x slower). At the 17th frame its connection
    is shut down and its uid barred for a minute (its new connections shut down as they
    come); an honest job gets its epoch."""
    _need_root()
    server: Server = start_server("--dataset", f"synthetic:images={SAMPLES}", workers=1)
    if target == "front":
        (host, port), counter = host_port(server.address), "data"
    else:
        (host, port), counter = host_port(worker_endpoints(server)[0]), "results"
    assert honest_epoch(server, 2) == list(range(SAMPLES))
    with as_nobody(lambda: _whole_floods(host, port, 60)):
        assert wait_until(
            lambda: server.stats()["rejected"].get(f"{counter}_frames_dropped", 0) >= 1, 20
        )
        started = time.monotonic()
        assert honest_epoch(server, 0) == list(range(SAMPLES))
        took = time.monotonic() - started
        rejected = server.stats()["rejected"]
    assert rejected.get(f"{counter}_barred_dropped", 0) >= 1, rejected
    print(f"\n{target}: floods of 500,000-frame messages: honest epoch {took:.2f} s; {rejected}")


def test_a_hostile_servers_message_of_too_many_frames_bans_it_unread(start_server: Any) -> None:
    """The trainer's side: a server that sends one whole message of 2,000,000 empty frames
    (4 MB) cost the client 51-92x before the ban (every frame read off). The client stops
    at the 17th frame, bans the server and closes its sockets (libzmq frees the rest)."""
    import msgspec
    from clients import make_client
    from conftest import run_epoch_collecting_errors
    from fuzz_targets import welcome_of
    from zmtp import accept_as, read_message, send_message

    from dataserver.protocol import Hello, decode

    server: Server = start_server("--dataset", f"synthetic:images={SAMPLES}", workers=2)
    welcome = welcome_of(server.address)
    listener = socket.create_server(("127.0.0.1", 0))
    listener.settimeout(30)
    hostile = f"tcp://127.0.0.1:{listener.getsockname()[1]}"

    def serve() -> None:
        conn = accept_as(listener)
        hello = decode(read_message(conn))
        assert isinstance(hello, Hello)
        reply = msgspec.structs.replace(
            welcome, session=hello.session, results=(), local=(), local_proof=b""
        )
        send_message(conn, [bytes(memoryview(f)) for f in reply.encode()])
        flood = EMPTY_MORE * 1_999_999 + frame_header(0, False)
        while True:
            conn.sendall(flood)
            time.sleep(0.5)

    pid = os.fork()
    if pid == 0:
        try:
            serve()
        finally:
            os._exit(0)
    listener.close()
    try:
        with make_client(
            [server.address, hostile], batch_size=4, image_size=(32, 32), timeout=60
        ) as client:
            started = time.monotonic()
            delivered, errors = run_epoch_collecting_errors(client, 0)
            took = time.monotonic() - started
            assert wait_until(
                lambda: client.stats()["rejected"].get("too_many_frames", 0) >= 1, 20
            ), client.stats()["rejected"]
            delivered2, errors2 = run_epoch_collecting_errors(client, 1)
            rejected = client.stats()["rejected"]
        assert not errors and sorted(delivered) == list(range(SAMPLES))
        assert not errors2 and sorted(delivered2) == list(range(SAMPLES))
        assert rejected["too_many_frames"] == 1 and rejected["bad_server"] == 1, rejected
    finally:
        os.kill(pid, signal.SIGKILL)
        os.waitpid(pid, 0)
    print(f"\nhostile server's 2,000,000-frame messages: epoch {took:.2f} s")

"""Issue 28, item 2: 10,000 ranks on one tier. A server takes as many sessions as its fd
limit allows (not a fixed 1,024), tells its clients how often to beat for its load, and a
client follows within its bounds, losing a silent server after its heartbeat timeout, or
two intervals and a second when the interval is slower. Real servers (``dataserver serve``), real clients, raw ZeroMQ sessions; fake
servers where a server must say what a real one never would."""

from __future__ import annotations

import os
import signal
import threading
import time
from collections.abc import Iterator
from typing import Any

import msgspec
import pytest
import zmq
from clients import make_client
from conftest import wait_until

from dataserver.protocol import Bye, ErrorMsg, Heartbeat, Hello, Welcome, decode
from dataserver.security import new_secret, session_id
from dataserver.server.front.capacity import fds_allow
from dataserver_client.net.beats import CEILING_S, FLOOR_S

pytestmark = pytest.mark.timeout(180)

N = 32
DATA = ("--dataset", f"synthetic:images={N},seed=2")
SMALL: dict[str, Any] = dict(batch_size=4, image_size=(32, 32), shared_memory=False)


def epoch_indices(client: Any) -> list[int]:
    client.set_epoch(0)
    return sorted(i for batch in client for idx in batch.indices for i in idx)


class Raw:
    """Sessions of a raw DEALER (one connection): HELLO, the answer, BYE."""

    def __init__(self, ctx: zmq.Context[Any], address: str) -> None:
        self.sock = ctx.socket(zmq.DEALER)
        self.sock.setsockopt(zmq.LINGER, 0)
        self.sock.connect(address)
        self.sessions: list[tuple[bytes, bytes]] = []

    def hello(self) -> Any:
        """Open one more session; the server's answer (WELCOME or ERROR)."""
        sid, secret = session_id(), new_secret()
        self.sock.send_multipart(Hello(session=sid, auth=secret).encode())
        assert self.sock.poll(10_000), "no answer to HELLO"
        answer = decode(self.sock.recv_multipart())
        if isinstance(answer, Welcome):
            self.sessions.append((sid, secret))
        return answer

    def bye(self) -> None:
        for sid, secret in self.sessions:
            self.sock.send_multipart(Bye(session=sid, auth=secret).encode())
        self.sessions.clear()


@pytest.fixture
def ctx() -> Iterator[zmq.Context[Any]]:
    context: zmq.Context[Any] = zmq.Context()
    yield context
    context.destroy(linger=0)


# ---------------------------------------------------------------- the session cap


def test_the_session_cap_follows_the_fd_limit(start_server: Any, ctx: zmq.Context[Any]) -> None:
    """Servers started with fd limits of 256 and 512 take the sessions those allow (1 fd a
    session on the front, less its reserve), not a fixed 1,024: STATS says how many and
    why; the one past the cap is refused at once, naming the fd limit."""
    low = start_server(*DATA, workers=1, nofile=256)
    high = start_server(*DATA, workers=1, nofile=512)
    caps = {256: fds_allow(256, 1), 512: fds_allow(512, 1)}
    assert 16 < caps[256] < caps[512] < 1024
    for server, nofile in ((low, 256), (high, 512)):
        limits = server.stats()["limits"]
        assert limits["max_sessions"] == caps[nofile], limits
        assert limits["max_sessions_why"].startswith(f"derived: fd limit {nofile} "), limits
    raws = [Raw(ctx, low.address) for _ in range(caps[256] // 8 + 1)]  # 8 sessions each
    answers = [raws[i // 8].hello() for i in range(caps[256] + 1)]
    assert all(isinstance(a, Welcome) for a in answers[:-1])
    refused = answers[-1]
    assert isinstance(refused, ErrorMsg) and refused.kind == "session_limit", refused
    assert "fd limit 256" in refused.message, refused.message
    assert low.stats()["sessions"] == caps[256]


def test_a_max_sessions_above_what_the_fds_allow_is_clamped(start_server: Any) -> None:
    """``--max-sessions 5000`` on a server whose fds allow fewer: clamped, with a warning
    naming the fd limit, and STATS says so; one within them stands as given."""
    over = start_server(*DATA, "--max-sessions", "5000", workers=1, nofile=256)
    limits = over.stats()["limits"]
    assert limits["max_sessions"] == fds_allow(256, 1)
    assert limits["max_sessions_why"].startswith(
        f"--max-sessions 5000 clamped to {fds_allow(256, 1)}"
    )
    assert "--max-sessions 5000: this process's fds allow" in over.read_stderr()
    within = start_server(*DATA, "--max-sessions", "12", workers=1, nofile=256)
    assert within.stats()["limits"]["max_sessions"] == 12


# ---------------------------------------------------------------- the heartbeat interval


def test_the_client_beats_at_the_interval_its_server_sets(
    start_server: Any, ctx: zmq.Context[Any]
) -> None:
    """``--heartbeat-rate 1``: the server asks for one beat a second from all its sessions
    together. With the client alone it beats every second; three more sessions (raw, on
    connections of their own) and it is told 4 s, and beats that slowly, never lost; they
    leave and, three intervals later, it is back at 1 s. Its epoch is whole, nothing
    refused."""
    server = start_server(*DATA, "--heartbeat-rate", "1", workers=1)
    with make_client(server.address, timeout=30, **SMALL) as client:

        def beat() -> float:
            return float(client.stats()["servers"][0]["heartbeat_s"])

        assert wait_until(lambda: beat() == 1.0, 10), beat()
        raws = [Raw(ctx, server.address) for _ in range(3)]
        assert all(isinstance(r.hello(), Welcome) for r in raws)
        assert wait_until(lambda: server.stats()["heartbeat_interval_s"] == 4.0, 5)
        assert wait_until(lambda: beat() == 4.0, 8), beat()
        before = server.stats()["counters"]["heartbeats"]
        time.sleep(8.5)
        beats = server.stats()["counters"]["heartbeats"] - before
        assert 1 <= beats <= 3, beats  # at 0.5 s: 17
        assert client.stats()["servers"][0]["state"] == "ready"
        for r in raws:
            r.bye()
        assert wait_until(lambda: beat() == 1.0, 25), beat()  # (down after 3 intervals: 12 s)
        assert epoch_indices(client) == list(range(N))
        assert client.stats()["rejected"].get("heartbeat_interval", 0) == 0


class BeatServer:
    """A fake server that asks for a beat every ``ms`` (in its WELCOME and every heartbeat
    reply) and counts the heartbeats it gets."""

    def __init__(self, ms: int) -> None:
        self.ms = ms
        self.beats: list[float] = []
        self.ctx: zmq.Context[Any] = zmq.Context()
        self.data = self.ctx.socket(zmq.ROUTER)
        self.data.setsockopt(zmq.LINGER, 0)
        self.address = f"tcp://127.0.0.1:{self.data.bind_to_random_port('tcp://127.0.0.1')}"
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()

    def _run(self) -> None:
        try:
            while not self._stop.is_set():
                if not self.data.poll(50):
                    continue
                peer, *frames = self.data.recv_multipart()
                msg = decode(frames)
                reply: Welcome | Heartbeat
                if isinstance(msg, Hello):
                    reply = Welcome(
                        session=msg.session,
                        server_id="beat-server",
                        dataset_len=N,
                        fingerprint="beat",
                        workers=1,
                        credit=4,
                        heartbeat_ms=self.ms,
                    )
                elif isinstance(msg, Heartbeat):
                    self.beats.append(time.monotonic())
                    reply = Heartbeat(server_id="beat-server", heartbeat_ms=self.ms)
                else:
                    continue
                self.data.send_multipart([peer, *reply.encode()])
        finally:
            self.data.close(linger=0)
            self.ctx.term()

    def close(self) -> None:
        self._stop.set()
        self._thread.join(5)


@pytest.mark.parametrize(
    "ms, followed",
    [(2000, True), (int(FLOOR_S * 1000) // 2, False), (int(CEILING_S * 1000) * 6, False)],
)
def test_the_interval_a_server_may_ask_for_is_bounded(ms: int, followed: bool) -> None:
    """A server asking for a beat every 2 s is followed; one asking for half the floor (a
    client made to beat 8 times a second) or six times the ceiling is refused, counted
    ``heartbeat_interval``, and the client beats at its own 0.5 s."""
    fake = BeatServer(ms)
    try:
        with make_client(fake.address, timeout=10, **SMALL) as client:
            time.sleep(1.0)
            start = len(fake.beats)
            time.sleep(6.0)
            beats = len(fake.beats) - start
            stats = client.stats()
        link = stats["servers"][0]
        if followed:
            assert link["heartbeat_s"] == ms / 1000
            assert 2 <= beats <= 4, beats
            assert stats["rejected"].get("heartbeat_interval", 0) == 0
        else:
            assert link["heartbeat_s"] == 0.5
            assert 9 <= beats <= 14, beats
            assert stats["rejected"]["heartbeat_interval"] >= 2  # WELCOME and replies
        assert link["state"] == "ready"
    finally:
        fake.close()


def frozen_for(server: Any, client: Any) -> float:
    """Freeze the server's front (SIGSTOP: its connections stay open, it answers nothing)
    until the client has lost it: how long that took."""
    os.kill(server.pid, signal.SIGSTOP)
    try:
        frozen = time.monotonic()
        assert wait_until(lambda: client.stats()["servers"][0]["state"] == "lost", 40)
        return time.monotonic() - frozen
    finally:
        os.kill(server.pid, signal.SIGCONT)


@pytest.mark.parametrize("rate, interval", [("2000", 0.5), ("0.1", 10.0)])
def test_a_frozen_server_is_lost_within_the_failover_time_of_its_interval(
    start_server: Any, rate: str, interval: float
) -> None:
    """A server that goes silent is lost after the client's heartbeat timeout (3 s) while
    it asks for beats every 0.5 s (a server of up to 1,000 sessions at the default rate),
    and after two intervals and a second when it asks for fewer: at 10 s (``--heartbeat-rate
    0.1``, one session) the client stays with it while idle for longer than the interval
    (a fixed 3 s timeout would have dropped it), and loses it within 21 s of a freeze."""
    server = start_server(*DATA, "--heartbeat-rate", rate, workers=1)
    with make_client(server.address, timeout=60, **SMALL) as client:

        def link() -> dict[str, Any]:
            return dict(client.stats()["servers"][0])

        assert wait_until(lambda: link()["heartbeat_s"] == interval, 10), link()
        time.sleep(interval + 2)
        assert link()["state"] == "ready" and server.stats()["sessions"] == 1
        elapsed = frozen_for(server, client)
    failover = max(3.0, 2 * interval + 1)
    assert failover - interval - 1 <= elapsed < failover + 1.5, (elapsed, failover)


# ---------------------------------------------------------------- older clients


class OldWelcome(msgspec.Struct):
    """A WELCOME as a client before issue 28 decoded it: no ``heartbeat_ms``. (It also
    required ``control``, the endpoint of the front's control socket, which protocol 8
    dropped: a client that requires it speaks protocol 7 and is refused by version.)"""

    session: bytes
    server_id: str
    dataset_len: int
    credit: int


def test_a_client_that_knows_no_interval_is_served(
    start_server: Any, ctx: zmq.Context[Any]
) -> None:
    """An older client reads WELCOME and heartbeat replies without the field (msgspec
    passes over what it does not know) and beats at its own 0.5 s: the server keeps its
    session, answers every beat, and a current client beside it gets its epoch."""
    server = start_server(*DATA, "--heartbeat-rate", "1", workers=1)
    sock = ctx.socket(zmq.DEALER)
    sock.setsockopt(zmq.LINGER, 0)
    sock.connect(server.address)
    sid, secret = session_id(), new_secret()
    sock.send_multipart(Hello(session=sid, auth=secret).encode())
    assert sock.poll(10_000)
    frames = sock.recv_multipart()
    assert msgspec.msgpack.decode(frames[2])["heartbeat_ms"] >= 500  # said, and ...
    old = msgspec.msgpack.decode(frames[2], type=OldWelcome)  # ... passed over
    assert old.session == sid and old.dataset_len == N
    answered = 0
    with make_client(server.address, timeout=30, **SMALL) as client:
        for _ in range(12):
            sock.send_multipart(Heartbeat(session=sid, auth=secret).encode())
            time.sleep(0.5)
            while sock.poll(0):
                answered += isinstance(decode(sock.recv_multipart()), Heartbeat)
        assert epoch_indices(client) == list(range(N))
    assert answered >= 10
    assert server.stats()["sessions"] == 1  # the old one, still held (the client said BYE)
    assert server.stats()["rejected_total"] == 0


def test_a_steering_client_holds_one_connection_on_the_front(start_server: Any) -> None:
    """Issue 28, item 2: a session's CONTROL rides its data connection, so a client that
    steers (feedback flips and control values) holds one connection on a server's front
    (there is no control port): 1 fd a session, what the session cap counts."""
    server = start_server(*DATA, workers=1)
    with make_client(server.address, timeout=30, **SMALL) as client:
        client.set_epoch(0)
        it = iter(client)
        next(it)
        client.feedback(0.0)  # (low loss ratio: stitch)
        client.control(flag=1)
        next(it)
        client.feedback(1.0)
        for _ in it:
            pass
        steered = server.stats()
    assert steered["counters"]["controls"] >= 2, steered["counters"]
    assert steered["counters"]["data_connections"] == 1, steered["counters"]

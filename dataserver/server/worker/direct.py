"""A worker's direct result path: a ROUTER that clients connect to, each connection named
by the reply id of its session's secret (``security.reply_id``), so results go straight to
the client instead of through the front, and only the session's owner can be that name.

Bounds: ``Outbox`` caps the bytes of results sent but not yet written (per session and in
all); a result over the caps is not sent, and the client is told to ask again.

Ownership, with CURVE: a connection may be addressed as session S only after it *claimed*
S (a HELLO on that connection) with the key S is tagged with, and it cannot be taken over
while it lives (no ROUTER_HANDOVER: a second connection naming S is refused). A claim holds
until that connection drops (``ZMQ_SRCFD`` names the connection a claim came by, the
monitor names the one that dropped); until then results take the path through the front.
Without CURVE, the name comes from the session's secret: a reconnecting client takes its
name back at once (ROUTER_HANDOVER).

Admission (issue 40 item 2): any secret names its own connection, so a name proves nothing
about the front having admitted a session, and a peer with none had filled the cap with
"claimed" connections. A claim must carry ``claim``, the tag the front's WELCOME gave the
session (``security.claim_tag``: keyed by what only the front and its workers hold, bound
to the session id and the name); one without it is refused and its connection shut down
(``results_claim_dropped``). Connections that claimed nothing are kept apart from the
claimed ones: at most ``unclaimed_budget`` of them (the oldest goes) and for
``UNCLAIMED_S`` each (``results_unclaimed_dropped``), so a peer with no session can neither
take an admitted one's place nor, by reconnecting, the fds kept for the dataset's reads.

Connections (issue 25 items 5 and 8): clients claim on every result connection as it comes
up and every ``CLAIM_S`` seconds after, CURVE or not, and only those claims (authentic:
the name is the reply id of the secret they carry) are activity. ``ResultConns`` judges
the connections from a thread of its own (a task can run for seconds; a flood of connects
must not wait for it): one silent past the idle timeout, one holding more than
``RESULTS_UNFINISHED`` of a message never finished, one beyond ``results_budget`` (fds
kept for the dataset's reads below the limit) is shut down, unclaimed ones first. 2,100 idle
connections had taken a worker to its fd limit: a sample failed with ``Too many open
files`` and a worker aborted in libzmq's ipc listener.
"""

from __future__ import annotations

import hmac
import logging
import threading
import time
from typing import Any

import zmq
from zmq.utils.monitor import parse_monitor_message

from dataserver.counting import Counts
from dataserver.protocol import Hello, ProtocolError, Result, decode
from dataserver.security import CLAIM_S, claim_tag, owns, reply_id, start_server_curve
from dataserver.server.config import bindable
from dataserver.server.conns import (
    CHECK_S,
    ConnTracker,
    Gate,
    peer_socket_options,
    read_message,
)
from dataserver.server.counts import Reject
from dataserver.server.outbox import Outbox, tracked

log = logging.getLogger("dataserver.worker")

RESULTS_HWM = 16  # messages per client pipe; the Outbox bounds the bytes
MAX_CLAIMS = 4096
RESULTS_IDLE_MIN = 4 * CLAIM_S  # a result connection's idle timeout: --idle-timeout, no less
RESULTS_UNFINISHED = 64 << 10  # a connection's bytes of an unfinished message (claims: ~100)
RESULTS_UNFINISHED_TOTAL = 8 << 20  # ... and all connections' together
UNCLAIMED_S = 3.0  # a result connection's time to claim (a client claims as it comes up)


def unclaimed_budget(limit: int) -> int:
    """How many result connections that claimed nothing a worker keeps (of ``limit``)."""
    return max(16, limit // 8)


class ResultConns:
    """The TCP connections of a result socket (``ConnTracker``), followed from its monitor
    and judged by a thread of their own. The worker's thread reports what it reads
    (``read``, ``heard``) and learns which connections dropped (``gone``)."""

    def __init__(
        self,
        ctx: zmq.Context[Any],
        sock: zmq.Socket[Any],
        idle_timeout: float,
        limit: int,
        curve: bool = False,
    ) -> None:
        self.lock = threading.Lock()
        self._dropped = Counts(Reject)  # ``results_<reason>``, since ``take_dropped``
        self.tracker = ConnTracker(
            max(idle_timeout, RESULTS_IDLE_MIN),
            limit,
            self._dropped,
            RESULTS_UNFINISHED,
            live=lambda name: True,  # a claim is a live session's (its secret checked)
            total_unfinished=RESULTS_UNFINISHED_TOTAL,
            every=CHECK_S / 4,  # (an unfinished message grows at the sender's pace)
            curve=curve,
            unclaimed=(unclaimed_budget(limit), UNCLAIMED_S),
        )
        # Its monitor drained by a thread of its own into a queue without bound (``Gate``):
        # libzmq drops a monitor's events past 1,000 unread, and a connection whose
        # ACCEPTED was lost was never judged (a reconnect churn took a worker to its fd
        # limit).
        monitor = sock.get_monitor_socket(zmq.EVENT_ACCEPTED | zmq.EVENT_DISCONNECTED)
        self.gate = Gate(ctx, monitor, self.tracker.barred)
        self._gone: list[int] = []  # fds dropped since the worker's thread last asked
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="result-conns", daemon=True)
        self._thread.start()

    def _run(self) -> None:
        poller = zmq.Poller()
        poller.register(self.gate.events, zmq.POLLIN)
        while not self._stop.is_set():
            if poller.poll(int(CHECK_S * 250)):
                self._events()
            with self.lock:
                self.tracker.check(time.monotonic())

    def _events(self) -> None:
        for _ in range(4096):
            try:
                frames = self.gate.events.recv_multipart(zmq.NOBLOCK)
            except zmq.Again:
                return
            event = parse_monitor_message(frames[:2])
            with self.lock:
                if frames[2:] == [Gate.BARRED]:  # (shut down by the gate)
                    self._dropped.count(Reject.RESULTS_BARRED_DROPPED)
                elif event["event"] == zmq.EVENT_ACCEPTED:
                    self.tracker.accepted("results", event["value"])
                else:
                    self.tracker.disconnected(event["value"])
                    self._gone.append(event["value"])

    def read(self, frames: list[Any]) -> int:
        """A message came (a ROUTER's: the first frame is the name): its connection's fd."""
        with self.lock:
            return self.tracker.read(frames, skip=1)

    def flooded(self, fd: int) -> None:
        """Connection ``fd`` sent a message of too many frames (``ConnTracker.flooded``)."""
        with self.lock:
            self.tracker.flooded("results", fd)

    def heard(self, fd: int, name: bytes) -> None:
        with self.lock:
            self.tracker.heard(fd, name)

    def refuse(self, fd: int) -> None:
        """Connection ``fd`` claimed with no admitted session's tag: shut it down."""
        with self.lock:
            self.tracker.refuse("results", fd)

    def take_dropped(self) -> dict[Reject, int]:
        """The connections shut down since the last call, by ``results_<reason>``."""
        with self.lock:
            return self._dropped.take()

    def gone(self) -> list[int]:
        """The fds of connections dropped since the last call."""
        with self.lock:
            out, self._gone = self._gone, []
        return out

    def close(self) -> None:
        self._stop.set()
        self._thread.join(timeout=5)
        self.gate.close()


class DirectResults:
    """The ROUTER clients connect to for this worker's results."""

    def __init__(
        self,
        ctx: zmq.Context[Any],
        bind: str,
        curve: tuple[str, str] | None,
        max_queued_bytes: int,
        local: str | None = None,
        idle_timeout: float = 30.0,
        limit: int = 4096,
        claim_key: bytes = b"",
    ) -> None:
        self.curve = curve
        self.claim_key = claim_key  # (the front's: ``security.CLAIM_KEY_ENV``)
        self.outbox = Outbox(max_queued_bytes)
        self.claims: dict[bytes, int] = {}  # (CURVE) claimed names, each with its connection
        self.sock = ctx.socket(zmq.ROUTER)
        self.sock.setsockopt(zmq.LINGER, 0)
        self.sock.setsockopt(zmq.ROUTER_MANDATORY, 1)  # unknown client: we hear it, fall back
        self.sock.setsockopt(zmq.ROUTER_HANDOVER, 0 if curve else 1)
        self.sock.setsockopt(zmq.SNDHWM, RESULTS_HWM)
        self.sock.setsockopt(zmq.RCVHWM, 16)
        self.sock.setsockopt(zmq.MAXMSGSIZE, 1024)  # clients only send claims here
        peer_socket_options(self.sock)  # dead peers dropped, handshakes bounded
        self.auth = None
        if curve is not None:
            self.auth = start_server_curve(ctx, curve[0], curve[1], [self.sock])
        self.conns = ResultConns(ctx, self.sock, idle_timeout, limit, curve is not None)
        self.sock.bind(bindable(bind))
        self.endpoint = self.sock.getsockopt_string(zmq.LAST_ENDPOINT)
        # Clients on this host connect here instead (a unix socket: about 40% less CPU per
        # byte on both sides than TCP over loopback).
        self.local = ""
        if local is not None and not bind.startswith("ipc://"):
            self.sock.bind(local)
            self.local = local

    def read_claims(self) -> None:
        """Take the claims (HELLOs) that came, after forgetting those of connections that
        dropped. Each turn of the worker's loop, and before a send."""
        for fd in self.conns.gone():
            for name in [name for name, at in self.claims.items() if at == fd]:
                del self.claims[name]
        for _ in range(256):
            try:  # (a frame at a time, at most MAX_FRAMES: ``conns.read_message``)
                frames = read_message(self.sock, 1, self.conns.flooded)
            except zmq.Again:
                return
            if frames is None:
                continue
            fd = self.conns.read(frames)
            if len(frames) >= 2:
                self._claim(frames, fd)

    def _claim(self, frames: list[Any], fd: int) -> None:
        try:
            msg = decode(frames[1:])
        except ProtocolError:
            return
        name = frames[0].bytes
        # A connection is named by the reply id of a session's secret: claiming it
        # needs the secret, and with CURVE the key the session id is tagged with.
        if not isinstance(msg, Hello) or msg.auth is None or reply_id(msg.auth) != name:
            return
        # ... and the front's tag: the session is one it admitted.
        if not hmac.compare_digest(msg.claim, claim_tag(self.claim_key, msg.session, name)):
            self.conns.refuse(fd)
            return
        if self.curve is not None:
            try:
                user = str(frames[1].get("User-Id") or "")
            except zmq.ZMQError:
                user = ""
            if not owns(msg.session, user):
                return
            if name in self.claims or len(self.claims) < MAX_CLAIMS:
                self.claims[name] = fd
        self.conns.heard(fd, name)

    def send(self, out: Result, route: bytes) -> bool | str:
        """Send ``out`` straight to its client, whose result connections are named ``route``
        (the reply id of its session's secret): True if sent, False when that client cannot
        be reached here (the front forwards it), or why it may not be sent (over a cap)."""
        self.read_claims()
        if self.curve is not None and route not in self.claims:
            return False
        nbytes = out.pixels.nbytes if out.pixels is not None else 0
        refused = self.outbox.refuse(out.session, nbytes)
        if refused is not None:
            return refused
        frames = out.encode()
        image = tracked(frames[3]) if out.pixels is not None else None
        parts = [*frames[:3], image, *frames[4:]] if image is not None else frames
        try:
            self.sock.send_multipart([route, *parts], zmq.NOBLOCK, copy=False)
        except zmq.ZMQError as exc:
            if exc.errno in (zmq.EHOSTUNREACH, zmq.EAGAIN):
                self.claims.pop(route, None)
                return False
            raise
        self.outbox.sent(out.session, nbytes, image.tracker if image is not None else None)
        return True

    def close(self, linger_ms: int = 0) -> None:
        """Close; ``linger_ms`` > 0 (a stop the front asked for, as at the end of a drain)
        gives results still queued in ZeroMQ that long to leave."""
        self.conns.close()
        self.sock.disable_monitor()
        self.sock.close(linger=linger_ms)
        if self.auth is not None:
            self.auth.stop()

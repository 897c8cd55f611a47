"""A worker's direct result path: a ROUTER that clients connect to, each connection named
by the reply id of its session's secret (``security.reply_id``), so results go straight to
the client instead of through the front, and only the session's owner can be that name.

Bounds: ``Outbox`` caps the bytes of results sent but not yet written (per session and in
all); a result over the caps is not sent, and the client is told to ask again.

Ownership, with CURVE: a connection may be addressed as session S only after it *claimed*
S (a HELLO on that connection) with the key S is tagged with, and it cannot be taken over
while it lives (no ROUTER_HANDOVER: a second connection naming S is refused). A claim
holds until a connection to this socket drops (any: which one, ZeroMQ does not say), and
clients claim again with every heartbeat; until then results take the path through the
front. Without CURVE, the name itself is the proof (it comes from the session's secret): a
reconnecting client takes its name back at once (ROUTER_HANDOVER), and no claim is asked.
"""

from __future__ import annotations

import logging
from typing import Any

import zmq
from zmq.utils.monitor import recv_monitor_message

from dataserver.protocol import Hello, ProtocolError, Result, decode
from dataserver.security import owns, reply_id, start_server_curve
from dataserver.server.config import bindable
from dataserver.server.conns import peer_socket_options
from dataserver.server.outbox import Outbox, tracked

log = logging.getLogger("dataserver.worker")

RESULTS_HWM = 16  # messages per client pipe; the Outbox bounds the bytes
MAX_CLAIMS = 4096


class DirectResults:
    """The ROUTER clients connect to for this worker's results."""

    def __init__(
        self,
        ctx: zmq.Context[Any],
        bind: str,
        curve: tuple[str, str] | None,
        max_queued_bytes: int,
        local: str | None = None,
    ) -> None:
        self.curve = curve
        self.outbox = Outbox(max_queued_bytes)
        self.claims: set[bytes] = set()
        self.sock = ctx.socket(zmq.ROUTER)
        self.sock.setsockopt(zmq.LINGER, 0)
        self.sock.setsockopt(zmq.ROUTER_MANDATORY, 1)  # unknown client: we hear it, fall back
        self.sock.setsockopt(zmq.ROUTER_HANDOVER, 0 if curve else 1)
        self.sock.setsockopt(zmq.SNDHWM, RESULTS_HWM)
        self.sock.setsockopt(zmq.RCVHWM, 16)
        self.sock.setsockopt(zmq.MAXMSGSIZE, 1024)  # clients only send claims here
        peer_socket_options(self.sock)  # dead peers dropped, handshakes bounded
        self.auth = None
        self.monitor: zmq.Socket[Any] | None = None
        if curve is not None:
            self.auth = start_server_curve(ctx, curve[0], curve[1], [self.sock])
            self.monitor = self.sock.get_monitor_socket(zmq.EVENT_DISCONNECTED)
        self.sock.bind(bindable(bind))
        self.endpoint = self.sock.getsockopt_string(zmq.LAST_ENDPOINT)
        # Clients on this host connect here instead (a unix socket: about 40% less CPU per
        # byte on both sides than TCP over loopback).
        self.local = ""
        if local is not None and not bind.startswith("ipc://"):
            self.sock.bind(local)
            self.local = local

    def _read_claims(self) -> None:
        """Take the claims (HELLOs) that came, after forgetting every claim if a
        connection dropped."""
        if self.monitor is not None:
            try:
                while recv_monitor_message(self.monitor, zmq.NOBLOCK):
                    self.claims.clear()  # a connection dropped: which one, we cannot tell
            except zmq.Again:
                pass
        for _ in range(256):
            try:
                frames = self.sock.recv_multipart(zmq.NOBLOCK, copy=False)
            except zmq.Again:
                return
            if self.curve is not None and len(frames) >= 2:
                self._claim(frames)

    def _claim(self, frames: list[Any]) -> None:
        try:
            msg = decode(frames[1:])
        except ProtocolError:
            return
        name = frames[0].bytes
        # A connection is named by the reply id of a session's secret: claiming it
        # needs the secret, and with CURVE the key the session id is tagged with.
        if not isinstance(msg, Hello) or msg.auth is None or reply_id(msg.auth) != name:
            return
        try:
            user = str(frames[1].get("User-Id") or "")
        except zmq.ZMQError:
            user = ""
        if owns(msg.session, user) and len(self.claims) < MAX_CLAIMS:
            self.claims.add(name)

    def send(self, out: Result, route: bytes) -> bool | str:
        """Send ``out`` straight to its client, whose result connections are named ``route``
        (the reply id of its session's secret): True if sent, False when that client cannot
        be reached here (the front forwards it), or why it may not be sent (over a cap)."""
        self._read_claims()
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
                self.claims.discard(route)
                return False
            raise
        self.outbox.sent(out.session, nbytes, image.tracker if image is not None else None)
        return True

    def close(self, linger_ms: int = 0) -> None:
        """Close; ``linger_ms`` > 0 (a stop the front asked for, as at the end of a drain)
        gives results still queued in ZeroMQ that long to leave."""
        if self.monitor is not None:
            self.sock.disable_monitor()
            self.monitor.close(linger=0)
        self.sock.close(linger=linger_ms)
        if self.auth is not None:
            self.auth.stop()

"""The sockets a link opens to one server: the options every client DEALER shares
(``dealer``: message size cap, reconnects, ZMTP heartbeats, CURVE), the connection events
its monitors report (``MONITORED``), and reading those events (``monitor_events``). Used by
``ServerLink`` (opening) and ``Links`` (what the events mean)."""

from __future__ import annotations

from typing import Any

import zmq
from zmq.utils.monitor import recv_monitor_message

CLIENT_MAX_MSG = 1 << 30  # results are images: allow large ones, refuse absurd ones
HEARTBEAT_IVL_MS = 5_000  # ZMTP PINGs on every connection to a server ...
HEARTBEAT_TIMEOUT_MS = 15_000  # ... dropped when nothing comes back for this long
MONITORED = (
    zmq.EVENT_HANDSHAKE_SUCCEEDED
    | zmq.EVENT_CONNECTED
    | zmq.EVENT_DISCONNECTED
    | zmq.EVENT_HANDSHAKE_FAILED_AUTH
    | zmq.EVENT_HANDSHAKE_FAILED_PROTOCOL
    | zmq.EVENT_HANDSHAKE_FAILED_NO_DETAIL
)


def dealer(ctx: zmq.Context[Any], curve: dict[str, bytes] | None) -> zmq.Socket[Any]:
    """A DEALER with the options every client socket to a server shares."""
    sock = ctx.socket(zmq.DEALER)
    sock.setsockopt(zmq.LINGER, 0)
    sock.setsockopt(zmq.MAXMSGSIZE, CLIENT_MAX_MSG)
    sock.setsockopt(zmq.RECONNECT_IVL, 100)
    sock.setsockopt(zmq.RECONNECT_IVL_MAX, 1000)
    # ZMTP heartbeats: a connection whose peer answers nothing (gone without a FIN, or a
    # server that stopped reading) is dropped by libzmq, with what it held.
    sock.setsockopt(zmq.HEARTBEAT_IVL, HEARTBEAT_IVL_MS)
    sock.setsockopt(zmq.HEARTBEAT_TIMEOUT, HEARTBEAT_TIMEOUT_MS)
    sock.setsockopt(zmq.HEARTBEAT_TTL, HEARTBEAT_TIMEOUT_MS)
    if curve:
        sock.curve_serverkey = curve["server_public"]
        sock.curve_publickey = curve["public"]
        sock.curve_secretkey = curve["secret"]
    return sock


def monitor_events(monitor: zmq.Socket[Any]) -> list[Any]:
    """The events waiting on a socket's ``monitor``, read without blocking."""
    out: list[Any] = []
    while True:
        try:
            out.append(recv_monitor_message(monitor, zmq.NOBLOCK))
        except zmq.Again:
            return out

"""How often the client beats to each server, and how it knows a server is gone (issue 28).

A server tells the interval it wants (``heartbeat_ms`` in its WELCOME and heartbeat replies:
its load sets it, ``dataserver.server.beats``). The client follows it within its own bounds,
``FLOOR_S`` to ``CEILING_S``: a server cannot make it beat faster or slower than that, and a
value outside them is refused (counted ``heartbeat_interval``; the link keeps the interval
it had). A server that says nothing (an older one) leaves it at the client's own
``heartbeat_interval``.

Loss detection no longer waits on heartbeat answers, which a server beating clients every
10 s would make 20 s late: the connection to each front carries ZMTP heartbeats
(``loss_detection``), a PING every third of ``heartbeat_timeout`` answered by the server's
libzmq (not its Python loop), and libzmq drops a connection that answers nothing for the
other two thirds: a server gone, frozen or cut off is lost within ``heartbeat_timeout``
(3 s), whatever the interval. The silence check on answers stays, for a server whose
libzmq answers while its loop does not (``PacedBeat.silence_s``): at the floor that is
``heartbeat_timeout`` as before, above it a few intervals.
"""

from __future__ import annotations

from typing import Any

import zmq

FLOOR_S = 0.25  # the fastest a server may make a client beat
CEILING_S = 10.0  # the slowest
MISSED_BEATS = 2  # answers a server may miss (beyond a second's slack) before it is silent


def loss_detection(sock: zmq.Socket[Any], timeout_s: float) -> None:
    """ZMTP heartbeats on a connection to a front: a PING every ``timeout_s / 3``; libzmq
    drops the connection (``EVENT_DISCONNECTED``: the link is lost) when nothing came back
    for ``2 * timeout_s / 3`` after one, so a gone server is seen within ``timeout_s``.
    The server is told to drop us after ``HEARTBEAT_TTL`` without a word (our PINGs)."""
    ping_ms = max(100, round(timeout_s * 1000 / 3))
    sock.setsockopt(zmq.HEARTBEAT_IVL, ping_ms)
    sock.setsockopt(zmq.HEARTBEAT_TIMEOUT, max(100, round(timeout_s * 1000) - ping_ms))


class PacedBeat:
    """One link's heartbeat interval: the client's own until its server says otherwise."""

    def __init__(self, own_s: float) -> None:
        self.own_s = own_s
        self.interval_s = own_s

    def told(self, ms: int | None) -> bool:
        """The server asked for ``ms`` (0 or None: it said nothing). False: refused (out of
        ``FLOOR_S``..``CEILING_S``); the interval stays what it was."""
        if not ms:
            return True
        seconds = ms / 1000
        if not FLOOR_S <= seconds <= CEILING_S:
            return False
        self.interval_s = seconds
        return True

    def silence_s(self, timeout_s: float) -> float:
        """How long a server may send nothing before it counts as silent: ``timeout_s`` at
        an interval as fast as the client's own, else a few intervals (the ZMTP
        heartbeats catch a gone server within ``timeout_s`` meanwhile)."""
        return max(timeout_s, MISSED_BEATS * self.interval_s + 1.0)

"""How often the client beats to each server, and how it knows a server is gone (issue 28).

A server tells the interval it wants (``heartbeat_ms`` in its WELCOME and heartbeat replies:
its load sets it, ``dataserver.server.beats``). The client follows it within its own bounds,
``FLOOR_S`` to ``CEILING_S``: a server cannot make it beat faster or slower than that, and a
value outside them is refused (counted ``heartbeat_interval``; the link keeps the interval
it had). A server that says nothing (an older one) leaves it at the client's own
``heartbeat_interval``.

How soon a gone server is seen. A server killed, or whose host closes its connections, is
lost at once (the connection drops: ``EVENT_DISCONNECTED``). One that goes silent (frozen,
cut off) is lost when no answer came for ``PacedBeat.silence_s``: ``heartbeat_timeout``
(3 s) while the interval is at most a third of it, as before, else two intervals and a
second: 3 s up to 2,000 sessions on a server at the default ``--heartbeat-rate``, 5 s at
4,000 (2 s beats), 11 s at 10,000 (5 s), 21 s at 20,000 (10 s). ZMTP heartbeats every
second on the front connection would keep 3 s at any interval, but were measured to cost
more than the beats they save: 3,000 sessions PINGing each second (2 s timeout) made
~100 reconnects a second on a loaded 2-core host (a PONG late by 2 s drops a connection,
and the reconnects load the front further), none with PINGs every 5 s (the setting kept:
``sockets.dealer``). DESIGN-NOTES, "Scale model: 10,000 ranks".
"""

from __future__ import annotations

FLOOR_S = 0.25  # the fastest a server may make a client beat
CEILING_S = 10.0  # the slowest
MISSED_BEATS = 2  # answers a server may miss (beyond a second's slack) before it is silent


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
        """How long a server may send nothing before it counts as silent (lost):
        ``timeout_s`` while the interval leaves room for a few answers in it, else two
        intervals and a second (the failover time a slower interval costs)."""
        return max(timeout_s, MISSED_BEATS * self.interval_s + 1.0)

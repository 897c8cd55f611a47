"""How often this server asks its clients to beat: set for its load (issue 28, item 2).

A client beats every 0.5 s by default; at 1,000 sessions that is 2,000 heartbeats a second,
~0.2 of the front's one core (64-109 us each), and at 10,000 sessions it would fill it. The
front tells each client the interval to beat at, in its WELCOME and in every heartbeat
reply (``heartbeat_ms``), so that all its sessions together send about ``rate`` a second
(``--heartbeat-rate``): ``sessions / rate`` seconds, in steps of ``STEP_S``, never below
``FLOOR_S`` (what clients beat at by default) nor above ``ceiling`` (at most ``CEILING_S``,
and a third of ``--session-ttl`` and of ``--idle-timeout``, so a session beating at it is
never forgotten nor its connection dropped as idle). It goes up as soon as the sessions
call for it (each HELLO updates it: the newcomer's WELCOME carries the interval of the
count it makes) and down only once they have been a step below for three intervals (no
flapping at a boundary, and no spiral: sessions a backlogged front let expire do not send
every other session back to beating fast).

A client keeps the interval within its own bounds (``dataserver_client.net.beats``); a server
that goes silent is lost after ``heartbeat_timeout`` (3 s) up to a third of it, else two
intervals and a second (5 s at 4,000 sessions, 11 s at 10,000, at the default rate). A
client that does not know the field (older) beats at its own interval, as before.
"""

from __future__ import annotations

import math

FLOOR_S = 0.5  # clients' default interval: a lightly loaded server asks nothing else
CEILING_S = 10.0
STEP_S = 0.5
DEFAULT_RATE = 2000.0  # heartbeats a second from all sessions together (~0.15 of a core)
TTL_BEATS = 3  # beats a session may miss before --session-ttl / --idle-timeout forget it
SETTLE_BEATS = 3  # intervals a lower session count must last before the interval goes down


class BeatRule:
    """The interval this server asks its clients to beat at, for its session count."""

    def __init__(self, rate: float, session_ttl: float, idle_timeout: float) -> None:
        if rate <= 0:
            raise ValueError(f"heartbeat rate must be > 0, got {rate}")
        self.rate = rate
        self.ceiling = max(
            FLOOR_S, min(CEILING_S, session_ttl / TTL_BEATS, idle_timeout / TTL_BEATS)
        )
        self.interval_s = FLOOR_S
        self._lower_since: float | None = None  # since when a lower interval is due

    def _for(self, sessions: int) -> float:
        want = math.ceil(sessions / self.rate / STEP_S) * STEP_S
        return min(self.ceiling, max(FLOOR_S, want))

    def update(self, sessions: int, now: float) -> bool:
        """The session count is now ``sessions`` (at ``now``, monotonic seconds): whether
        the interval changed. Up at once (a HELLO updates it: a newcomer is told the
        interval of the count it makes); down only once a lower one has been due for
        ``SETTLE_BEATS`` intervals (sessions that went silent at once, expired by a
        backlog, do not bring every other session back to beating fast)."""
        want = self._for(sessions)
        if want > self.interval_s:
            self.interval_s, self._lower_since = want, None
            return True
        if want < self.interval_s and self._for(int(sessions * 1.25)) < self.interval_s:
            if self._lower_since is None:
                self._lower_since = now
            elif now - self._lower_since >= SETTLE_BEATS * self.interval_s:
                self.interval_s, self._lower_since = want, None
                return True
            return False
        self._lower_since = None
        return False

    @property
    def interval_ms(self) -> int:
        return round(self.interval_s * 1000)

    def evict_after(self) -> float:
        """How long a session must be silent before a newcomer may take its place when
        every place is taken: a few of its beats (5 s at the floor, as before)."""
        return max(5.0, TTL_BEATS * self.interval_s)

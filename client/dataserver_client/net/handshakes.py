"""How often one server's handshake is acted on (issue 39, item 3): a server that sends its
WELCOME again and again (a flapping link, a crash-looping pod) must not stall the job.

A WELCOME whose bytes are the last one's is that message again: not decoded, and nothing
checked, moved or planned again (``ServerLink.welcome_unchanged``). One that changes
something (a new server id: a restart) is decoded and acted on at most ``RATE`` a second
per server after a burst of ``BURST``; one that comes faster is held (the latest only) and
acted on in its turn (``WelcomeMemo.due``). No sockets, no threads.
"""

from __future__ import annotations

import hashlib
from typing import Any

from dataserver.protocol import Welcome

RATE = 1.0  # handshakes acted on per second and server, on average ...
BURST = 4.0  # ... and at most this many at once


class HeldWelcome(Exception):
    """A WELCOME not decoded now: its server's handshakes came faster than ``RATE`` (it is
    held, the latest only, for ``WelcomeMemo.due``)."""


class WelcomeMemo:
    """One link's WELCOMEs as they arrive, before they are decoded: the last one decoded,
    known by a digest of its bytes (the same bytes again are the same message, not decoded
    again: a WELCOME announcing 65,536 sample sizes takes ~27 ms to decode and check, its
    digest ~0.1 ms), and a token bucket for new ones: past ``BURST``, ``RATE`` a second;
    one that comes faster is held (the latest only), never dropped: ``due`` gives it back
    in its turn, so the last word of a server that really restarted is only later."""

    def __init__(self, rate: float = RATE, burst: float = BURST) -> None:
        self.rate = rate
        self.burst = burst
        self._tokens = burst
        self._at = 0.0
        self._digest = b""
        self._msg: Welcome | None = None
        self._held: list[bytes] | None = None
        self._held_fd = -1  # the connection the held one came by

    @staticmethod
    def digest(frames: list[Any]) -> bytes:
        h = hashlib.blake2b(digest_size=16)
        for frame in frames:
            h.update(memoryview(frame))
        return h.digest()

    def recall(self, digest: bytes) -> Welcome | None:
        """The message last kept under ``digest``, if it is that one."""
        return self._msg if digest == self._digest else None

    def keep(self, digest: bytes, msg: Welcome) -> None:
        self._digest, self._msg = digest, msg

    def swap(self, kept: Welcome, same: Welcome) -> None:
        """Keep ``same`` (equal to ``kept``, sharing more with what the client holds
        anyway) in place of ``kept``, if ``kept`` is the message kept."""
        if self._msg is kept:
            self._msg = same

    def _take(self, now: float) -> bool:
        self._tokens = min(self.burst, self._tokens + (now - self._at) * self.rate)
        self._at = now
        if self._tokens < 1.0:
            return False
        self._tokens -= 1.0
        return True

    def admit(self, now: float, frames: list[Any], fd: int = -1) -> None:
        """A new WELCOME (that came by connection ``fd``) may be decoded now; else it is
        held (replacing one held before) and ``HeldWelcome`` raised."""
        if self._take(now):
            self._held = None
            return
        self._held = [bytes(memoryview(f)) for f in frames]
        self._held_fd = fd
        raise HeldWelcome

    @property
    def holding(self) -> bool:
        return self._held is not None

    def due(self, now: float) -> tuple[list[bytes], int] | None:
        """The frames of the WELCOME held back, and the connection it came by, once its
        turn came (taken: the caller decodes and acts on them)."""
        if self._held is None or not self._take(now):
            return None
        frames, self._held = self._held, None
        return frames, self._held_fd

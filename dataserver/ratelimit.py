"""``TokenBucket``: a rate limit, ``rate`` events a second on average and at most ``burst`` at
once. The server's front uses it for STATS (``statsview``), admin requests (``front``),
scrapes (``scrape``), size announcements (``announce``) and session state changes
(``sessions``). Standard library only, no state shared between buckets.
"""

from __future__ import annotations

import time


class TokenBucket:
    """``rate`` events per second on average, at most ``burst`` at once."""

    def __init__(self, rate: float, burst: float) -> None:
        self.rate = rate
        self.burst = burst
        self.tokens = burst
        self.at = time.monotonic()

    def peek(self, now: float | None = None) -> bool:
        """Whether ``take`` would succeed now (nothing taken)."""
        now = time.monotonic() if now is None else now
        return min(self.burst, self.tokens + (now - self.at) * self.rate) >= 1.0

    def take(self, now: float | None = None) -> bool:
        now = time.monotonic() if now is None else now
        self.tokens = min(self.burst, self.tokens + (now - self.at) * self.rate)
        self.at = now
        if self.tokens < 1.0:
            return False
        self.tokens -= 1.0
        return True

"""``Announced``: the per-sample (h, w) a server answers SIZES with, and how often.

A dataset's ``sizes`` (``spec.dataset_sizes``: an int32 (N, 2) table, N up to
``MAX_ANNOUNCED_SIZES``) are held once, by the front; WELCOME carries only their count and
digest, and a client that needs them asks for them a chunk at a time (SIZES, at most
``SIZES_CHUNK`` pairs). What one request may cost the front is bounded: a reply is a view
of the table (no copy) of at most 512 KiB, sent within the outbox's per-session and total
bounds (``Outlet.send_charged``); each session is answered at ``SIZES_RATE`` a second
(``SIZES_BURST`` at once), and all sessions together at ``TOTAL_RATE``, so that many
sessions cannot take the loop either. Requests over a rate are dropped unanswered,
counted (``rejected["sizes_rate"]``); an honest client asks no faster and asks again.
"""

from __future__ import annotations

import time
from collections import OrderedDict

import numpy as np

from dataserver.protocol.messages import (
    SIZES_BURST,
    SIZES_RATE,
    SampleSizes,
    sizes_digest,
)
from dataserver.ratelimit import TokenBucket

TOTAL_RATE = 16 * SIZES_RATE  # SIZES answers a second over all sessions (512 MiB/s at most)
BUCKETS_KEPT = 4096  # sessions whose rate is remembered (least recently asking forgotten)


class Announced:
    """The table of one front, its digest, and the rate its chunks are answered at."""

    def __init__(self, table: np.ndarray | None) -> None:
        """``table``: the dataset's checked sizes (``dataset_sizes``), or None."""
        self.table = table
        self.count = 0 if table is None else len(table)
        self.digest = b"" if table is None else sizes_digest(table)
        self._total = TokenBucket(TOTAL_RATE, TOTAL_RATE)
        self._buckets: OrderedDict[bytes, TokenBucket] = OrderedDict()

    def allow(self, session: bytes, now: float | None = None) -> bool:
        """Whether a SIZES request of ``session`` may be answered now (one token of its own
        bucket and of the total taken when it may)."""
        now = time.monotonic() if now is None else now
        bucket = self._buckets.get(session)
        if bucket is None:
            bucket = TokenBucket(SIZES_RATE, SIZES_BURST)
            self._buckets[session] = bucket
            if len(self._buckets) > BUCKETS_KEPT:
                self._buckets.popitem(last=False)
        else:
            self._buckets.move_to_end(session)
        if not (bucket.peek(now) and self._total.peek(now)):
            return False
        return bucket.take(now) and self._total.take(now)

    def problem(self, start: int, count: int) -> str | None:
        """Why samples ``start`` .. ``start + count`` cannot be answered, or None."""
        if self.table is None:
            return "this server's dataset announces no sizes"
        if start + count > self.count:
            return f"samples {start}..{start + count} are beyond the {self.count} announced"
        return None

    def chunk(self, session: bytes, start: int, count: int) -> SampleSizes:
        """The reply to a request ``problem`` found nothing wrong with: a view of the table."""
        assert self.table is not None
        hw = self.table[start : start + count]
        return SampleSizes(session=session, start=start, count=count, digest=self.digest, hw=hw)

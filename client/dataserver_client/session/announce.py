"""``SizeFetch``: the dataset's per-sample (h, w), asked of one server a chunk at a time.

WELCOME announces only how many sizes a server has and their digest
(``DatasetInfo.sizes_count``/``sizes_digest``, the same on every server of the job); the
table itself is asked for only when a trainer needs it (``client.size_array()``, e.g.
Ultralytics' rect validation), in chunks of ``SIZES_CHUNK`` (SIZES requests), at most
``WINDOW`` outstanding and no faster than the server answers a session (``SIZES_RATE``,
``SIZES_BURST``). Chunks lost or dropped (a server over its rate drops them unanswered)
are asked again after ``ASK_AGAIN_S``. One server answers a fetch: if it is lost, the
fetch starts again from another, so that whatever is wrong is that server's.

A server asked for sizes is refused (banned: ``Handlers._bad_server``) when it answers a
chunk with another digest than the one announced, a chunk of another range than this client asks
(chunks are ``[k * SIZES_CHUNK, ...)``), one it was never asked for, or chunks whose whole
does not have the announced digest. Owned by the engine; only the I/O thread touches it.
"""

from __future__ import annotations

import time
from concurrent.futures import Future
from typing import TYPE_CHECKING

import numpy as np

from dataserver.protocol import SampleSizes, sizes_digest
from dataserver.protocol.messages import SIZES_BURST, SIZES_CHUNK, SIZES_RATE
from dataserver_client.errors import DataServerError

if TYPE_CHECKING:
    from dataserver_client.net.serverlink import ServerLink

WINDOW = 4  # SIZES requests outstanding at once
ASK_AGAIN_S = 1.0  # nothing answered for this long: the outstanding chunks are asked again


class SizeFetch:
    """One fetch of ``count`` sizes of digest ``digest``; ``future`` gets the read-only
    int32 (count, 2) table once every chunk came and the whole has that digest."""

    def __init__(self, count: int, digest: bytes) -> None:
        self.count = count
        self.digest = digest
        self.future: Future[np.ndarray] = Future()
        self.chunks = (count + SIZES_CHUNK - 1) // SIZES_CHUNK
        self._table = np.zeros((count, 2), np.int32)
        self._link: ServerLink | None = None  # the server asked now
        self._asked_of: set[str] = set()  # the address of every server this fetch asked
        self._asked: dict[int, float] = {}  # chunk -> when it was asked (of ``_link``)
        self._missing: list[int] = []  # chunks to ask for (last first)
        self._got = 0  # chunks received from ``_link``
        self._have = np.zeros(self.chunks, bool)
        self._tokens = SIZES_BURST
        self._at = time.monotonic()
        self._progress = self._at
        self.restarts = 0
        self.problem: str | None = None  # the last server refused for its sizes: why

    def _span(self, chunk: int) -> tuple[int, int]:
        start = chunk * SIZES_CHUNK
        return start, min(SIZES_CHUNK, self.count - start)

    def _start_with(self, link: ServerLink, now: float) -> None:
        """Ask ``link`` for every chunk, from the first (what another server sent is
        dropped: one server answers a fetch)."""
        if self._link is not None:
            self.restarts += 1
        self._link = link
        self._asked_of.add(link.address)
        self._asked.clear()
        self._missing = list(range(self.chunks - 1, -1, -1))
        self._have[:] = False
        self._got = 0
        self._progress = now

    def pump(self, usable: list[ServerLink], now: float) -> None:
        """Ask for what is missing of a usable link (ready, announcing these sizes):
        the one asked so far while it stays usable, else the first of ``usable``."""
        if self.future.done():
            return
        if self._link not in usable:
            if not usable:
                if self.problem is not None:  # (the servers that were left lied)
                    self.fail(DataServerError(f"the dataset's sizes: {self.problem}"))
                return
            self._start_with(usable[0], now)
        link = self._link
        assert link is not None  # (one of ``usable``)
        if self._asked and now - self._progress > ASK_AGAIN_S:  # lost or dropped
            self._missing.extend(sorted(self._asked, reverse=True))
            self._asked.clear()
            self._progress = now
        self._tokens = min(SIZES_BURST, self._tokens + (now - self._at) * SIZES_RATE)
        self._at = now
        while self._missing and len(self._asked) < WINDOW and self._tokens >= 1.0:
            chunk = self._missing[-1]
            start, n = self._span(chunk)
            ask = SampleSizes(session=link.session, auth=link.secret, start=start, count=n)
            if not link.send(ask.encode()):
                return
            self._missing.pop()
            self._asked[chunk] = now
            self._tokens -= 1.0

    def on_chunk(self, link: ServerLink, msg: SampleSizes, now: float) -> str | None:
        """A SIZES reply from ``link``: kept, or ignored (a late copy, an earlier
        server's); what is wrong with it when ``link`` is to be refused, or None."""
        problem = self._take(link, msg, now)
        if problem is not None:
            self.problem = f"{link.address}: {problem}"
        return problem

    def _take(self, link: ServerLink, msg: SampleSizes, now: float) -> str | None:
        if self.future.done() or link is not self._link:
            return None  # (an earlier server of this fetch, or a copy after the end)
        if msg.digest != self.digest:
            return (
                f"it sent sizes of digest {msg.digest.hex()}, not the {self.digest.hex()} "
                "its WELCOME announced"
            )
        chunk, off = divmod(msg.start, SIZES_CHUNK)
        if off or chunk >= self.chunks or self._span(chunk) != (msg.start, msg.count):
            return (
                f"it sent sizes {msg.start}..{msg.start + msg.count}, not a chunk this "
                f"client asks of {self.count} sizes"
            )
        if self._have[chunk]:
            return None  # (asked again, and the first answer came after all)
        if chunk not in self._asked and chunk not in self._missing:
            return f"it sent sizes {msg.start}..{msg.start + msg.count} it was not asked for"
        self._table[msg.start : msg.start + msg.count] = msg.hw
        self._have[chunk] = True
        self._asked.pop(chunk, None)
        if chunk in self._missing:
            self._missing.remove(chunk)
        self._got += 1
        self._progress = now
        if self._got < self.chunks:
            return None
        if sizes_digest(self._table) != self.digest:
            # Every chunk came from this one server: the lie is its own; start again.
            self._link = None
            self._asked.clear()
            self._missing = []
            return "the sizes it sent do not make the digest its WELCOME announced"
        self._table.setflags(write=False)
        self.future.set_result(self._table)
        return None

    def asked(self, link: ServerLink) -> bool:
        """Whether ``link`` was asked for sizes by this fetch."""
        return getattr(link, "address", None) in self._asked_of

    def fail(self, error: BaseException) -> None:
        if not self.future.done():
            self.future.set_exception(error)

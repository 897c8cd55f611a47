"""Results handed to ZeroMQ but not yet written to the network, bounded.

A client that stops reading (or never did) leaves the results sent to it in ZeroMQ's pipe
for its connection. High-water marks bound that per connection in messages, not bytes,
and not in total over connections; this bounds it in bytes, in total and per session.
Each large frame is sent zero-copy with a ``MessageTracker``: its bytes count until ZeroMQ
has written it to the kernel (for a client that reads, within moments). A result that
would exceed a bound is not sent; the sender tells the client (ERROR "dropped"), whose
task is then asked again, so an honest client loses only time.
"""

from __future__ import annotations

from collections import Counter, deque
from typing import Any

import zmq

PER_SESSION = 8  # results a session may have waiting in a pipe at once


class Outbox:
    """Bytes of sent-but-unwritten results, per session and in total."""

    def __init__(self, max_bytes: int, per_session: int = PER_SESSION) -> None:
        self.max_bytes = max_bytes
        self.per_session = per_session
        self.nbytes = 0
        self._waiting: deque[tuple[zmq.MessageTracker, bytes, int]] = deque()
        self._by_session: Counter[bytes] = Counter()

    def _prune(self) -> None:
        # Trackers finish roughly in send order; stop at the first unfinished one, and look
        # past it only when everything else would be refused.
        while self._waiting and self._waiting[0][0].done:
            self._release(*self._waiting.popleft()[1:])

    def _release(self, session: bytes, nbytes: int) -> None:
        self.nbytes -= nbytes
        self._by_session[session] -= 1
        if self._by_session[session] <= 0:
            del self._by_session[session]

    def _prune_all(self) -> None:
        keep: deque[tuple[zmq.MessageTracker, bytes, int]] = deque()
        for item in self._waiting:
            if item[0].done:
                self._release(item[1], item[2])
            else:
                keep.append(item)
        self._waiting = keep

    def refuse(self, session: bytes, nbytes: int) -> str | None:
        """Why a result of ``nbytes`` for ``session`` may not be sent now, or None."""
        self._prune()
        for attempt in range(2):
            if self._by_session[session] >= self.per_session:
                why = f"{self._by_session[session]} results to this client are still unread"
            elif self.nbytes + nbytes > self.max_bytes:
                why = f"{self.nbytes} bytes of results wait to be read; at most {self.max_bytes}"
            else:
                return None
            if attempt == 0:
                self._prune_all()
        return why

    def sent(self, session: bytes, nbytes: int, tracker: zmq.MessageTracker | None) -> None:
        """A result went to ZeroMQ; ``tracker`` says when its big frame is written."""
        if tracker is None or tracker.done:
            return
        self.nbytes += nbytes
        self._by_session[session] += 1
        self._waiting.append((tracker, session, nbytes))


def tracked(data: Any) -> zmq.Frame:
    """A zero-copy frame over ``data`` whose tracker tells when ZeroMQ is done with it."""
    return zmq.Frame(getattr(data, "buffer", data), track=True, copy=False)

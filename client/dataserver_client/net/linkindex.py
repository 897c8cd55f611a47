"""What the I/O thread asks of every server link, kept so that asking costs the same at
1,024 servers as at one: the link with the most free credit (a heap), the tasks sent
longest ago (a heap of send times, for the answer deadline), and how many tasks are
outstanding in all.

Each ``ServerLink`` tells its index when its free credit may have changed (``moved``) and
when it sent or let go of tasks (``sent``, ``let_go``); the index never writes a link's
fields, it reads ``free`` and ``sent_at``. Entries are dropped lazily: a heap entry that no
longer matches its link is thrown away when it comes to the top, and each heap is rebuilt
when stale entries outnumber live ones. No sockets; the I/O thread is the only caller.
"""

from __future__ import annotations

import heapq
import itertools
from collections.abc import Iterable
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from dataserver_client.net.serverlink import ServerLink

REBUILD_SLACK = 64  # stale entries allowed beyond the live ones before a rebuild


class LinkIndex:
    """The links by free credit and the outstanding tasks by send time."""

    def __init__(self) -> None:
        self._seq = itertools.count()
        self._free: list[tuple[int, int, ServerLink]] = []  # (-free, seq, link)
        self._entry: dict[ServerLink, int] = {}  # link -> the seq of its live free entry
        self._sends: list[tuple[float, int, int, ServerLink]] = []  # (when, seq, task, link)
        self._gone: set[ServerLink] = set()  # links removed: their entries are stale
        self._parked: dict[ServerLink, list[int]] = {}  # late while not in use (``park``)
        self.outstanding = 0  # tasks outstanding on every link together

    # ------------------------------------------------------------ free credit

    def moved(self, link: ServerLink) -> None:
        """``link``'s free credit may have changed."""
        if link in self._parked and link.ready:
            self._unpark(link)
        free = link.free
        if free <= 0 or link in self._gone:
            self._entry.pop(link, None)
            return
        seq = next(self._seq)
        self._entry[link] = seq
        heapq.heappush(self._free, (-free, seq, link))
        if len(self._free) > 2 * len(self._entry) + REBUILD_SLACK:
            self._free = [e for e in self._free if self._entry.get(e[2]) == e[1]]
            heapq.heapify(self._free)

    def best(self, skip: Iterable[ServerLink] = ()) -> ServerLink | None:
        """The link with the most free credit, leaving out ``skip`` (of equal ones, the one
        whose credit changed first); None when none has any."""
        heap, aside, found = self._free, [], None
        skipped = skip if isinstance(skip, set | frozenset) else set(skip)
        while heap:
            entry = heap[0]
            neg, seq, link = entry
            if self._entry.get(link) != seq or -neg != link.free:
                heapq.heappop(heap)  # stale: its link moved since (or has no credit)
                if self._entry.get(link) == seq:
                    self._entry.pop(link)
                    self.moved(link)
                continue
            if link in skipped:
                aside.append(heapq.heappop(heap))
                continue
            found = link
            break
        for entry in aside:
            heapq.heappush(heap, entry)
        return found

    def forget(self, link: ServerLink) -> None:
        """``link`` is removed: none of its entries counts any more."""
        self._gone.add(link)
        self._entry.pop(link, None)
        self._parked.pop(link, None)

    # ------------------------------------------------------------ outstanding tasks

    def sent(self, link: ServerLink, task_id: int, when: float, new: bool) -> None:
        """``link`` sent ``task_id`` at ``when`` (``new``: it was not outstanding there)."""
        self.outstanding += int(new)
        heapq.heappush(self._sends, (when, next(self._seq), task_id, link))
        if len(self._sends) > 4 * max(1, self.outstanding) + REBUILD_SLACK:
            self._sends = [
                e for e in self._sends if e[3] not in self._gone and e[3].sent_at(e[2]) == e[0]
            ]
            heapq.heapify(self._sends)

    def let_go(self, n: int) -> None:
        """``n`` tasks are no longer outstanding (answered, expired, moved)."""
        self.outstanding -= n

    def late(self, before: float) -> dict[ServerLink, list[int]]:
        """The tasks still outstanding that were sent at ``before`` or earlier, by link,
        oldest first: their entries leave the heap (the caller expires them)."""
        out: dict[ServerLink, list[int]] = {}
        heap = self._sends
        while heap and heap[0][0] <= before:
            when, _, task_id, link = heapq.heappop(heap)
            if link not in self._gone and link.sent_at(task_id) == when:
                out.setdefault(link, []).append(task_id)
        return out

    def park(self, link: ServerLink, task_ids: list[int]) -> None:
        """Entries ``late`` returned that the caller does not expire (the link is not in
        use now): kept aside, back in the heap once the link is ready again (``moved``)."""
        self._parked.setdefault(link, []).extend(task_ids)

    def _unpark(self, link: ServerLink) -> None:
        for task_id in self._parked.pop(link, []):
            when = link.sent_at(task_id)
            if when is not None:
                heapq.heappush(self._sends, (when, next(self._seq), task_id, link))

"""Second copies of slow servers' tasks (``hedging.py`` judges the servers): each tick,
which servers are outliers (routing leaves them out), the tasks waiting on a server past its
hedge delay queued for a copy elsewhere, the outliers due a probe given one; the queued
copies sent ahead of new tasks. Owned by the ``Handlers`` (handlers.py), which the engine's
loop calls; changes the ledger, the links and the hedging only through their methods.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable

from dataserver_client.counts import Count
from dataserver_client.engine.dispatch import Sender
from dataserver_client.engine.parts import Parts
from dataserver_client.net.links import Links
from dataserver_client.net.serverlink import ServerLink
from dataserver_client.session.ledger import TaskRecord

log = logging.getLogger("dataserver_client")


class Hedges:
    """The task ids waiting for a second copy, in order, and what queues and sends them.
    ``servers_changed``: the outliers changed (the ready servers' routing is redone)."""

    def __init__(
        self, parts: Parts, links: Links, sender: Sender, servers_changed: Callable[[], None]
    ) -> None:
        self._hedging = parts.hedging
        self._ledger = parts.ledger
        self._counters = parts.counters
        self._links = links
        self._sender = sender
        self._servers_changed = servers_changed
        self._queued: dict[int, None] = {}  # task ids waiting for a second copy, in order

    def tick(self, now: float) -> None:
        """Slow servers (``hedging.py``), each tick: judge which are outliers (routing
        leaves them out when that changes, and what a new one holds is hedged at once);
        queue for a second copy each task that has waited on a server past its hedge delay
        (``send``), and give that server no new task meanwhile; give each outlier
        due a probe a copy of a task out with a healthy server, to see whether it
        recovered."""
        hedging = self._hedging
        ready = self._links.ready()
        before = hedging.outliers
        if hedging.judge(ready, now):
            outliers = [lk.address for lk in hedging.outliers]
            log.info("slow servers (copies only until they recover): %s", outliers or "none")
            self._servers_changed()
        if not hedging.enabled or len(ready) < 2:
            self._queued.clear()
            hedging.lag((), len(ready))
            return
        for link in hedging.outliers - before:  # (set aside: what it holds waits on nothing)
            self._queue(link, 0.0, now)
        behind = [
            link
            for link, delay in hedging.delays(ready).items()
            if self._queue(link, delay, now) and link not in hedging.outliers
        ]
        hedging.lag(behind, len(ready) - len(hedging.outliers))
        for outlier in hedging.outliers:
            if hedging.probe_due(outlier, now):
                self._probe(outlier, ready, now)
        self.send()

    def _queue(self, link: ServerLink, delay: float, now: float) -> bool:
        """Queue for a second copy each task out with ``link`` for ``delay`` or longer;
        whether there was one (hedged already or not: the server is behind)."""
        late = False
        for task_id, sent in link.outstanding.items():  # (oldest first; not changed here)
            if now - sent < delay:
                break
            late = True
            if _hedgeable(self._ledger.get(task_id), link):
                self._queued[task_id] = None
        return late

    def send(self) -> None:
        """Send the queued second copies while a server that has none of the task has
        free credit: the engine calls this before new tasks go out (a hedged task's batch
        is the one the trainer waits on sooner); never to an outlier."""
        while self._queued:
            task_id = next(iter(self._queued))
            rec = self._ledger.get(task_id)
            if rec is None or rec.link is None or not _hedgeable(rec, rec.link):
                del self._queued[task_id]
                continue
            skip = set(self._hedging.outliers) | {rec.link}
            if rec.avoid is not None and time.monotonic() < rec.avoid_until:
                skip.add(rec.avoid)
            target = self._links.best(skip)
            if target is None:
                return  # (no credit free: the next turn tries again)
            del self._queued[task_id]
            if self._sender.hedge(rec, target):
                self._counters.count(Count.HEDGED)

    def _probe(self, outlier: ServerLink, ready: list[ServerLink], now: float) -> None:
        """Give ``outlier`` a copy of the newest task out with a healthy server: its answer
        time is measured (a probe never holds a batch: the healthy copy answers it)."""
        for link in ready:
            if link is outlier or link in self._hedging.outliers or not link.outstanding:
                continue
            rec = self._ledger.get(next(reversed(link.outstanding)))
            if rec is not None and _hedgeable(rec, link) and outlier.free > 0:
                if self._sender.hedge(rec, outlier, probe=True):
                    self._hedging.probed(outlier, now)
                    self._counters.count(Count.HEDGED)
                return


def _hedgeable(rec: TaskRecord | None, link: ServerLink) -> bool:
    """Whether ``rec``, out with ``link``, may get a second copy: still wanted, sent there
    last, not hedged yet, no poison probe (those count their answers: one copy each)."""
    return (
        rec is not None
        and rec.link is link
        and rec.hedge is None
        and rec.probe_of is None
        and not rec.probes_left
    )

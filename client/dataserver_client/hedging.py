"""Slow servers: the answer latencies each server shows, when a task waiting on one is
hedged (sent to a second server as well), and which servers are outliers that get no new
work but a probe now and then.

A server whose answers are right but slow (an overloaded node, a GC pause, a congested
link, a failing disk) would otherwise hold every batch that has a task there. Results are
deterministic and the ledger takes one answer a task (the first; the other copy is
cancelled, or dropped as late when it comes), so a second copy is harmless: it costs the
work of one task on a server that had credit free.

- **Hedge.** A task outstanding on a server for longer than the hedge delay of that server
  (``HEDGE_FACTOR`` x the median over its peers that are not outliers of their
  ``HEDGE_QUANTILE`` of their last ``WINDOW`` answer times, never below ``HEDGE_FLOOR_S``)
  is sent once more, to the peer with the most free credit (never an outlier), queued
  ahead of new tasks (its batch is the one the trainer waits on sooner). With no slow
  server about 1 task in 20 outlasts its peers' p95, fewer past 1.25 times it, and a hedge
  waits for credit to come free: the extra work is bounded by that share.
- **Outliers.** A server whose typical latency (the median of its last ``RECENT`` answers,
  or the age of its oldest unanswered task when that is larger: a server that answers
  nothing is seen too) is over ``OUTLIER_FACTOR`` x its peers' median and over
  ``OUTLIER_FLOOR_S`` gets no task of its own and no hedge: keys stop routing to it. When
  it has nothing outstanding, at most every ``PROBE_S``, it gets a probe: a copy of a task
  out with a healthy server (never on a batch's critical path; not cancelled, so its
  answer time is measured), and once ``MIN_TYPICAL`` answers since put it within
  ``RECOVER`` x that bar it is used again.
  Never every ready server at once.

No sockets, no threads: the I/O thread is the only caller. ``Handlers.hedge`` acts on it.
"""

from __future__ import annotations

import bisect
from collections import deque
from collections.abc import Hashable, Iterable
from dataclasses import dataclass
from typing import Generic, Protocol, TypeVar

WINDOW = 32  # recent answer latencies kept a server (its p95)
RECENT = 8  # the last answers its typical latency is the median of (recovery is seen soon)
MIN_SEEN = 4  # answers from a server before its p95 is believed (a hedge delay)
MIN_TYPICAL = 3  # ... before its median is (whether it is an outlier)
HEDGE_QUANTILE = 0.95
HEDGE_FACTOR = 1.25
HEDGE_FLOOR_S = 0.05  # never hedge a task younger than this
OUTLIER_FACTOR = 4.0
OUTLIER_FLOOR_S = 0.15  # a server answering within this is never an outlier
RECOVER = 0.5  # an outlier is used again once within half the bar that made it one
PROBE_S = 0.5  # an outlier gets one probe at most this often, when it has nothing out


class Peer(Hashable, Protocol):
    """What the policy reads of a server link: its unanswered tasks (id -> when sent,
    oldest first: ``ServerLink.outstanding``)."""

    @property
    def outstanding(self) -> dict[int, float]: ...


def _oldest(peer: Peer) -> float | None:
    return next(iter(peer.outstanding.values()), None)


P = TypeVar("P", bound=Peer)


@dataclass(frozen=True)
class Figures:
    """The latency figures the policy uses, for ``client.stats()["hedging"]``."""

    enabled: bool
    hedge_delay_s: float | None  # the least delay before a hedge over the servers now
    p50_s: dict[str, float]  # each server's median answer time (its last RECENT answers)
    p95_s: dict[str, float]
    outliers: list[str]  # servers getting probes only (copies of tasks out elsewhere)


def _quantile(ordered: list[float], q: float) -> float:
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))]


def _median_without(ordered: list[float], own: float | None) -> float | None:
    """The median of ``ordered`` less one entry equal to ``own`` (None: ``own`` is not in
    it): the peers' median without sorting again for each server."""
    if own is not None:
        pos = bisect.bisect_left(ordered, own)
        n = len(ordered) - 1
        if n <= 0:
            return None
        k = n // 2
        return ordered[k] if k < pos else ordered[k + 1]
    return ordered[len(ordered) // 2] if ordered else None


class _Seen:
    """One server's recent answer latencies and the quantiles drawn from them."""

    def __init__(self) -> None:
        self.recent: deque[float] = deque(maxlen=WINDOW)
        self.count = 0
        self.p50 = 0.0
        self.p95 = 0.0

    def add(self, latency: float) -> None:
        self.recent.append(latency)
        self.count += 1
        if self.count <= MIN_SEEN or self.count % 8 == 0:  # (the p95 of 32 moves slowly)
            self.p95 = _quantile(sorted(self.recent), HEDGE_QUANTILE)
        last = sorted(
            self.recent[i] for i in range(max(0, len(self.recent) - RECENT), len(self.recent))
        )
        self.p50 = _quantile(last, 0.5)

    @property
    def believed(self) -> bool:
        return len(self.recent) >= MIN_SEEN


class Hedging(Generic[P]):
    """The latency picture of the servers and the hedging policy drawn from it. ``enabled``
    False (``DataServerClient(hedge=False)``): latencies are still kept and shown, nothing
    is hedged and no server is set aside."""

    def __init__(self, enabled: bool = True) -> None:
        self.enabled = enabled
        self._seen: dict[P, _Seen] = {}
        self._outliers: frozenset[P] = frozenset()
        self._probed: dict[P, float] = {}  # outlier -> when it was last given a task

    # ------------------------------------------------------------ observing

    def observe(self, peer: P, latency: float) -> None:
        """``peer`` answered a task sent ``latency`` seconds ago (late answers too)."""
        seen = self._seen.get(peer)
        if seen is None:
            seen = self._seen[peer] = _Seen()
        seen.add(latency)

    def forget(self, peer: P) -> None:
        """``peer`` is gone (removed): nothing of it counts any more."""
        self._seen.pop(peer, None)
        self._probed.pop(peer, None)
        self._outliers = self._outliers - {peer}

    # ------------------------------------------------------------ judging

    def _typical(self, peer: P, now: float) -> float | None:
        seen = self._seen.get(peer)
        oldest = _oldest(peer)
        waited = now - oldest if oldest is not None else 0.0
        if seen is None or len(seen.recent) < MIN_TYPICAL:
            return waited if waited > 0 else None
        return max(seen.p50, waited)

    def _answered(self, peer: P, count: int) -> bool:
        seen = self._seen.get(peer)
        return seen is not None and len(seen.recent) >= count

    def judge(self, ready: list[P], now: float) -> bool:
        """Decide which of ``ready`` are outliers now; True when that changed."""
        outliers: set[P] = set()
        if self.enabled and len(ready) > 1:
            typical = {p: self._typical(p, now) for p in ready}
            ordered = sorted(t for t in typical.values() if t is not None)
            for peer in ready:
                mine = typical[peer]
                reference = _median_without(ordered, mine)
                if peer in self._outliers and not self._answered(peer, MIN_TYPICAL):
                    outliers.add(peer)  # (until its probes answered: then judged again)
                    continue
                if mine is None or reference is None:
                    continue
                bar = max(OUTLIER_FLOOR_S, OUTLIER_FACTOR * reference)
                if mine > (bar * RECOVER if peer in self._outliers else bar):
                    outliers.add(peer)  # (the lower bar back in: no flapping at the edge)
            if len(outliers) == len(ready):  # (never every server: someone must work)
                outliers.clear()
        changed = outliers != self._outliers
        for peer in outliers - self._outliers:
            self._probed[peer] = now  # (its tasks out are its probe: the next after PROBE_S)
            self._seen.pop(peer, None)  # (judged from here on by its answers since)
        self._outliers = frozenset(outliers)
        return changed

    @property
    def outliers(self) -> frozenset[P]:
        """The servers that get no new work but probes (``probe_due``)."""
        return self._outliers

    def usable(self, ready: Iterable[P]) -> list[P]:
        """``ready`` less the outliers: the servers keys route over."""
        return [p for p in ready if p not in self._outliers]

    def probe_due(self, peer: P, now: float) -> bool:
        """Whether the outlier ``peer`` may be given a probe now (it has nothing out)."""
        return _oldest(peer) is None and now - self._probed.get(peer, 0.0) >= PROBE_S

    def probed(self, peer: P, now: float) -> None:
        """The outlier ``peer`` was given a probe at ``now``."""
        if peer in self._outliers:
            self._probed[peer] = now

    def _p95(self, peer: P) -> float | None:
        seen = self._seen.get(peer)
        if peer in self._outliers or seen is None or not seen.believed:
            return None
        return seen.p95

    def delays(self, ready: list[P]) -> dict[P, float]:
        """How long a task may wait on each of ``ready`` before it is hedged: from the
        answer times of its peers that are not outliers (the median of their p95s, x
        ``HEDGE_FACTOR``, at least ``HEDGE_FLOOR_S``); a server left out while none of its
        peers has answered enough to say (and all while hedging is off)."""
        if not self.enabled:
            return {}
        own = {p: self._p95(p) for p in ready}
        ordered = sorted(v for v in own.values() if v is not None)
        out = {}
        for peer in ready:
            reference = _median_without(ordered, own[peer])
            if reference is not None:
                out[peer] = max(HEDGE_FLOOR_S, HEDGE_FACTOR * reference)
        return out

    def figures(self, ready: list[P], name: dict[P, str]) -> Figures:
        delays = list(self.delays(ready).values())
        return Figures(
            self.enabled,
            round(min(delays), 4) if delays else None,
            {name[p]: round(s.p50, 4) for p, s in self._seen.items() if p in name},
            {name[p]: round(s.p95, 4) for p, s in self._seen.items() if p in name},
            sorted(name[p] for p in self._outliers if p in name),
        )

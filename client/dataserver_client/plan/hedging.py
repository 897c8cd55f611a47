"""Slow servers: the answer times each server shows, when a task waiting on one is hedged
(sent to a second server as well), which servers are outliers that get no new work but a
probe now and then, and which are behind (no new task until they catch up).

A server whose answers are right but slow (an overloaded node, a GC pause, a congested
link, a failing disk) would otherwise hold every batch that has a task there. Results are
deterministic and the ledger takes one answer a task (the first; the other copy is
cancelled, or dropped as late when it comes), so a second copy is harmless: it costs the
work of one task on a server that had credit free.

Two figures a server, from its answers:

- its **latencies** (sent to answered, queueing there included; the last ``WINDOW``): what
  a task waits on it, the hedge delay's measure;
- its **service times** (answered less the later of when the task was sent and when the
  server answered the one before; the last ``RECENT``): how long it takes a task once the
  tasks before it are done, whatever its queue. A probe (one task on an idle server) and a
  task behind three others are measured alike: a server throttled to a tenth of its speed
  shows ten times its peers' service time whether it has work queued or not, where its
  latency alone looked like its peers' once its queue was empty.

- **Hedge.** A task outstanding on a server for longer than the hedge delay of that server
  (``HEDGE_FACTOR`` x the median over its peers that are not outliers of their
  ``HEDGE_QUANTILE`` of their latencies, never below ``HEDGE_FLOOR_S``) is sent once more,
  to the peer with the most free credit (never an outlier), queued ahead of new tasks (its
  batch is the one the trainer waits on sooner). With no slow server about 1 task in 20
  outlasts its peers' p95, fewer past 1.25 times it, and a hedge waits for credit to come
  free: the extra work is bounded by that share.
- **Behind.** A server with a task outstanding past its hedge delay gets no new task
  until it has none (``behind``): a stalled server is not given more to hold while the
  judgement below is made. Never every usable server.
- **Outliers.** A server is an outlier when its typical service time (the median of its
  last ``RECENT``) is over ``OUTLIER_FACTOR`` x its peers' median and over
  ``OUTLIER_FLOOR_S``, or when a task of it has waited ``STUCK_FACTOR`` x its hedge delay
  while its peers answered ``OVERTAKEN`` tasks sent after it (a server that answers
  nothing is seen too, within a few of its peers' answer times; a start that is slow
  everywhere, first decodes on a loaded machine, overtakes nothing and sets none aside).
  An outlier gets no task of its own and no hedge: keys stop routing to it, and what it
  holds is hedged at once. When it has nothing outstanding, at most every ``PROBE_S``, it
  gets a probe: a copy of a task out with a healthy server (never on a batch's critical
  path; not cancelled, so its answer time is measured). It is used again once its answers
  since (``MIN_TYPICAL``, doubled each time it is set aside again within ``REFLAG_S`` of
  coming back, at most ``MAX_STRIKES`` times) are every one within ``RECOVER`` x that bar:
  a server whose answers are bimodal (throttled: stopped, then quick) stays aside.
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
RECENT = 8  # the last service times its typical one is the median of (recovery seen soon)
MIN_SEEN = 4  # answers from a server before its p95 is believed (a hedge delay)
MIN_TYPICAL = 3  # ... before its median is (whether it is an outlier)
HEDGE_QUANTILE = 0.95
HEDGE_FACTOR = 1.25
HEDGE_FLOOR_S = 0.05  # never hedge a task younger than this
OUTLIER_FACTOR = 4.0
OUTLIER_FLOOR_S = 0.05  # a server whose service time is within this is never an outlier
STUCK_FACTOR = 2.0  # a task waiting this many hedge delays makes its server an outlier,
OVERTAKEN = 8  # ... once its peers answered this many tasks sent after it
RECOVER = 0.5  # an outlier is used again once within half the bar that made it one
PROBE_S = 0.5  # an outlier gets one probe at most this often, when it has nothing out
REFLAG_S = 10.0  # set aside again this soon after coming back: twice the answers to return
MAX_STRIKES = 3  # (at most MIN_TYPICAL << MAX_STRIKES answers)


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
    p50_s: dict[str, float]  # each server's median latency (its last RECENT answers)
    p95_s: dict[str, float]  # ... and the p95 of its last WINDOW
    service_s: dict[str, float]  # each server's median service time (its last RECENT)
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
    """One server's recent latencies and service times, and the quantiles drawn from them."""

    def __init__(self) -> None:
        self.recent: deque[float] = deque(maxlen=WINDOW)
        self.service: deque[float] = deque(maxlen=RECENT)
        self.count = 0
        self.p50 = 0.0
        self.p95 = 0.0
        self.typical = 0.0  # the median of ``service``

    def add(self, latency: float, service: float) -> None:
        self.recent.append(latency)
        self.service.append(service)
        self.count += 1
        if self.count <= MIN_SEEN or self.count % 8 == 0:  # (the p95 of 32 moves slowly)
            self.p95 = _quantile(sorted(self.recent), HEDGE_QUANTILE)
        last = sorted(
            self.recent[i] for i in range(max(0, len(self.recent) - RECENT), len(self.recent))
        )
        self.p50 = _quantile(last, 0.5)
        self.typical = _quantile(sorted(self.service), 0.5)

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
        self._behind: frozenset[P] = frozenset()
        self._probed: dict[P, float] = {}  # outlier -> when it was last given a task
        self._freed: dict[P, float] = {}  # server -> when it last answered (or cancelled)
        self._answers: deque[tuple[float, P]] = deque(maxlen=4 * WINDOW)  # (sent, server)
        self._back: dict[P, float] = {}  # server -> when it last came back from aside
        self._strikes: dict[P, int] = {}  # server -> times set aside again soon after

    # ------------------------------------------------------------ observing

    def observe(self, peer: P, sent: float, now: float) -> None:
        """``peer`` answered at ``now`` a task sent at ``sent`` (late answers too): its
        latency, and its service time (from the later of ``sent`` and its answer before)."""
        seen = self._seen.get(peer)
        if seen is None:
            seen = self._seen[peer] = _Seen()
        start = max(sent, self._freed.get(peer, sent))
        self._freed[peer] = now
        self._answers.append((sent, peer))
        seen.add(now - sent, now - start)

    def freed(self, peer: P, now: float) -> None:
        """``peer`` gave back a task unrun at ``now`` (CANCELLED): the next task it answers
        was not behind that one."""
        self._freed[peer] = now

    def forget(self, peer: P) -> None:
        """``peer`` is gone (removed): nothing of it counts any more."""
        self._seen.pop(peer, None)
        self._strikes.pop(peer, None)
        self._answers = deque((a for a in self._answers if a[1] is not peer), WINDOW * 4)
        for table in (self._probed, self._freed, self._back):
            table.pop(peer, None)
        self._outliers = self._outliers - {peer}
        self._behind = self._behind - {peer}

    # ------------------------------------------------------------ judging

    def _typical(self, peer: P) -> float | None:
        """Its typical service time (an outlier: the worst of its last answers, as many as
        it must give to be judged again), once it has answered enough to say."""
        seen = self._seen.get(peer)
        if seen is None or len(seen.service) < MIN_TYPICAL:
            return None
        if peer in self._outliers:
            need = self._needed(peer)
            n = len(seen.service)
            return max(seen.service[i] for i in range(max(0, n - need), n))
        return seen.typical

    def _needed(self, peer: P) -> int:
        """Answers an outlier gives before it is judged again."""
        return min(RECENT, MIN_TYPICAL << self._strikes.get(peer, 0))

    def _slow(self, peer: P, now: float, delay: float | None, ordered: list[float]) -> bool:
        """Whether ``peer`` is an outlier now: a task of it waiting ``STUCK_FACTOR`` hedge
        delays (``delay``); an outlier that has not answered enough since; a typical service
        time over the bar (over half of it, for an outlier: no flapping at the edge) set by
        ``ordered``, the typical ones of the servers in use."""
        oldest = _oldest(peer)
        late = oldest is not None and delay is not None and now - oldest > STUCK_FACTOR * delay
        if late and self._overtaken(peer, oldest):  # type: ignore[arg-type]
            return True
        aside = peer in self._outliers
        seen = self._seen.get(peer)
        if aside and (seen is None or len(seen.service) < self._needed(peer)):
            return True  # (until its probes answered: then judged again)
        mine = self._typical(peer)
        reference = _median_without(ordered, None if aside else mine)
        if mine is None or reference is None:
            return False
        bar = max(OUTLIER_FLOOR_S, OUTLIER_FACTOR * reference)
        return mine > (bar * RECOVER if aside else bar)

    def _overtaken(self, peer: P, sent: float) -> bool:
        """Whether ``peer``'s peers answered ``OVERTAKEN`` tasks sent after ``sent``."""
        n = 0
        for when, other in reversed(self._answers):  # (newest answers first)
            if when > sent and other is not peer:
                n += 1
                if n >= OVERTAKEN:
                    return True
        return False

    def judge(self, ready: list[P], now: float) -> bool:
        """Decide which of ``ready`` are outliers now; True when that changed."""
        outliers: set[P] = set()
        if self.enabled and len(ready) > 1:
            delays = self.delays(ready)
            in_use = (self._typical(p) for p in ready if p not in self._outliers)
            ordered = sorted(t for t in in_use if t is not None)
            outliers = {p for p in ready if self._slow(p, now, delays.get(p), ordered)}
            if len(outliers) == len(ready):  # (never every server: someone must work)
                outliers.clear()
        changed = outliers != self._outliers
        for peer in outliers - self._outliers:
            self._probed[peer] = now  # (its tasks out are its probe: the next after PROBE_S)
            self._seen.pop(peer, None)  # (judged from here on by its answers since)
            if now - self._back.get(peer, -REFLAG_S) < REFLAG_S:  # (back too soon: flapping)
                self._strikes[peer] = min(MAX_STRIKES, self._strikes.get(peer, 0) + 1)
            else:
                self._strikes.pop(peer, None)
        for peer in self._outliers - outliers:
            self._back[peer] = now
        self._outliers = frozenset(outliers)
        return changed

    @property
    def outliers(self) -> frozenset[P]:
        """The servers that get no new work but probes (``probe_due``)."""
        return self._outliers

    def usable(self, ready: Iterable[P]) -> list[P]:
        """``ready`` less the outliers: the servers keys route over."""
        return [p for p in ready if p not in self._outliers]

    def lag(self, behind: Iterable[P], usable: int) -> None:
        """``behind``: the servers with a task out past its hedge delay now (of ``usable``
        servers that are not outliers); they get no new task until they catch up, unless
        that is every one of them."""
        late = frozenset(behind)
        self._behind = late if self.enabled and len(late) < usable else frozenset()

    @property
    def aside(self) -> frozenset[P]:
        """The servers that get no new task now: the outliers and those behind."""
        return self._outliers | self._behind

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
            {name[p]: round(s.typical, 4) for p, s in self._seen.items() if p in name},
            sorted(name[p] for p in self._outliers if p in name),
        )

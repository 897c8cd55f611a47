"""The front's fetcher: a dataset's bytes in object storage fetched before a worker needs
them, into the fetch cache its workers read (``dataserver.data.remote``, ``fetchcache``).

What to fetch comes from the sessions, never guessed: the sources of every task the front
admits (queued here: needed soonest) and the sample indices a session's plan asks next
(``Task.ahead``: the client knows its epoch's order exactly; each list replaces the last,
in order). A pool of ``--max-fetches`` threads runs the GETs (obstore releases the GIL
while a request is out; the retries, budget and errors are the workers' own code,
``Fetcher``), bounded together by requests in flight (``--max-fetches``) and bytes in
flight (``--max-fetch-mb``: a range's length, or for a whole object the largest object
fetched so far, ``GUESS_BYTES`` until one is), and charged to the session that
asked: a session with work waiting may have at most its share (the bounds over the
sessions that want something) in flight, so one session cannot take every slot. Sessions
are served in turn; within one, a queued task's sources before the plan's next ones.

A shard's sample the plan names (not a queued task's: that one is needed soonest) is
fetched by its block (``blocks``: ``ShardDataset.block``, ~4 MiB of the shard) with one
byte-range GET, every sample in it kept in the cache under its own range, where the cache
holds ``BLOCKS_IN_CACHE`` blocks and the block fits the session's share of bytes.

Nothing here touches the front's objects: the front calls ``want`` from its loop, reads
``snapshot`` for STATS, and takes the fetch tally (``Fetcher.take_tally``) to count it.
"""

from __future__ import annotations

import threading
from collections import OrderedDict, deque
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from typing import Any

from dataserver.data.fetchcache import cache_key
from dataserver.data.remote import Fetcher, is_remote
from dataserver.data.shards import Block

Where = tuple[str, int | None, int | None]  # (url, start, length)
Parts = tuple[tuple[int, int], ...]  # a block's samples: (start, length) each
# Blocks are fetched only where the fetch cache holds this many of them, so the samples a
# block brings stay until the plan reaches them (a smaller cache: one range a sample).
BLOCKS_IN_CACHE = 32
GUESS_BYTES = 1 << 20  # a whole object's charge before any has been fetched
MAX_QUEUED = 1 << 14  # a session's queued tasks' sources kept (beyond: the oldest dropped)
SEEN_MAX = 1 << 18  # the plan's samples a session's record of those taken may hold


@dataclass
class _Wants:
    """One session's: sources of its queued tasks, its plan's next samples, and what it has
    in flight (requests, charged bytes)."""

    now: deque[int] = field(default_factory=lambda: deque(maxlen=MAX_QUEUED))
    ahead: deque[int] = field(default_factory=deque)
    running: int = 0
    bytes: int = 0
    # the samples taken already in ``epoch`` (looked at: found cached, in flight, or
    # started), from a queued task or the plan: a new plan list repeats most of the last,
    # and a task's sources were most often named ahead, so those are not looked at again
    # (each look costs a cache lookup under its lock and a mark's stat)
    seen: set[int] = field(default_factory=set)
    epoch: int = -1

    def busy(self) -> bool:
        """Whether anything of this session's waits or is in flight."""
        return bool(self.running or self.now or self.ahead)

    def pop(self) -> tuple[int, bool] | None:
        """The next sample to look at, and whether a queued task wants it (needed now)."""
        while self.now:
            index = self.now.popleft()
            if index not in self.seen:
                self.seen.add(index)
                return index, True
        if self.ahead:
            index = self.ahead.popleft()
            self.seen.add(index)
            return index, False
        return None

    def unpop(self, index: int) -> None:
        """``index`` (just popped) is the first to take again."""
        self.seen.discard(index)
        self.now.appendleft(index)

    def at(self, epoch: int) -> None:
        """What comes now is of ``epoch``: what was seen in another is looked at again."""
        if epoch != self.epoch or len(self.seen) > SEEN_MAX:
            self.epoch = epoch
            self.seen.clear()

    def plan(self, ahead: list[int]) -> None:
        """The plan's next samples (replacing the last list), less those taken already."""
        self.ahead = deque(i for i in ahead if i not in self.seen)


@dataclass(frozen=True)
class PrefetchStats:
    """STATS ``prefetch``: the fetcher's bounds, what it has out and what it did."""

    max_fetches: int
    max_bytes_in_flight: int
    in_flight: int
    bytes_in_flight: int
    peak_in_flight: int
    peak_bytes_in_flight: int  # (charged, as the bound counts them)
    queued: int  # indices waiting, all sessions
    sessions: int  # sessions with something queued or in flight
    fetched: int  # objects fetched into the cache
    found: int  # indices asked for whose bytes the cache held (or were in flight)
    failed: int  # objects given up on (the worker reads it again and names the error)
    ahead_lists: int  # plan lists received (``Task.ahead``)
    blocks: int = 0  # of ``fetched``: blocks of shards (several samples in one GET)


class Prefetcher:
    """See the module's docstring. ``locate``: (url, start, length) of samples (the dataset's
    ``locations``); ``live``: whether a session is still open (a closed one's wants go);
    ``blocks``: the block of a shard holding a sample (``ShardDataset.block``), fetched
    whole by one byte-range GET into the cache, a sample at a time otherwise."""

    def __init__(
        self,
        fetcher: Fetcher,
        locate: Callable[[list[int]], list[Where]],
        max_fetches: int,
        max_bytes: int,
        live: Callable[[bytes], bool],
        blocks: Callable[[int], Block] | None = None,
    ) -> None:
        self.fetcher = fetcher
        self._locate = locate
        self._blocks = blocks
        self._max = max(1, max_fetches)
        self._max_bytes = max(1, max_bytes)
        self._live = live
        self._cond = threading.Condition()
        self._sessions: OrderedDict[bytes, _Wants] = OrderedDict()  # the next to serve first
        self._out: dict[str, bytes] = {}  # cache key -> session, in flight
        self._running = 0
        self._bytes = 0
        self._peak = 0
        self._peak_bytes = 0
        self._largest = 0  # the largest whole object fetched (a whole object's charge)
        self._fetched = self._found = self._failed = self._lists = 0
        self._blocks_fetched = 0
        self._stopped = False
        self._threads: list[threading.Thread] = []

    def start(self) -> None:
        for n in range(self._max):
            thread = threading.Thread(target=self._run, name=f"prefetch-{n}", daemon=True)
            thread.start()
            self._threads.append(thread)

    def stop(self) -> None:
        with self._cond:
            self._stopped = True
            self._cond.notify_all()

    def want(
        self, session: bytes, now: Iterable[int], ahead: Iterable[int] = (), epoch: int = 0
    ) -> None:
        """``session`` asks for ``now`` (a queued task's sources) and, when ``ahead`` is not
        empty, names its plan's next samples in ``epoch`` (replacing the list it named
        before)."""
        with self._cond:
            # (a session's record is kept while it is open, idle or not: what it has seen
            # this epoch is what spares looking at each new plan list whole)
            wants = self._sessions.get(session)
            if wants is None:
                wants = self._sessions[session] = _Wants()
            wants.at(epoch)
            wants.now.extend(now)
            ahead = list(ahead)
            if ahead:
                wants.plan(ahead)
                self._lists += 1
            # One thread wakes; each that takes a fetch wakes the next while work waits (a
            # thread per index would wake for nothing: most are found fetched already).
            self._cond.notify()

    def _charge(self, where: Where) -> int:
        length = where[2]
        return length if length is not None else (self._largest or GUESS_BYTES)

    def _next(self) -> tuple[bytes, str, Where, int, Parts] | None:
        """The next fetch to start, charged (under the lock), or None: nothing waits that
        the bounds allow now."""
        if self._running >= self._max:
            return None
        for session in list(self._sessions):
            if not self._live(session):
                wants = self._sessions[session]
                wants.now.clear()  # (a closed session: its fetches out are forgotten as they end)
                wants.ahead.clear()
                if not wants.running:
                    del self._sessions[session]
        active = sum(1 for w in self._sessions.values() if w.busy())
        if not active:
            return None
        share = max(1, self._max // active)
        share_bytes = max(1, self._max_bytes // active)
        for session in list(self._sessions):
            wants = self._sessions[session]
            if not wants.now and not wants.ahead:
                continue
            job = self._take(session, wants, share, share_bytes)
            if isinstance(job, str):
                return None
            if job is not None:
                return job
        return None

    def _waiting(self) -> bool:
        """Whether some session has samples not yet looked at (under the lock)."""
        return any(w.now or w.ahead for w in self._sessions.values())

    def _take(
        self, session: bytes, wants: _Wants, share: int, share_bytes: int
    ) -> tuple[bytes, str, Where, int, Parts] | str | None:
        """``session``'s next fetch within its share, charged; "full": the server's bytes in
        flight leave no room for it now; None: nothing of this session's to start."""
        while wants.running < share and wants.bytes < share_bytes:
            popped = wants.pop()
            if popped is None:
                return None
            index, needed_now = popped
            where = self._locate([index])[0]
            if not is_remote(where[0]):
                continue
            key = cache_key(*where)
            if key in self._out or self.fetcher.holds(key) or self.fetcher.marked(key):
                self._found += 1
                continue
            parts: Parts = ()
            # (a queued task's sample: its own range, soonest; the plan's: by the block)
            block = None if needed_now else self._block(index, share_bytes)
            if block is not None:
                url, start, length, parts = block
                key = f"{url}|{start}|block"
                if key in self._out:  # (its block is on its way)
                    self._found += 1
                    continue
                where = (url, start, length)
            charge = self._charge(where)
            if self._running and self._bytes + charge > self._max_bytes:
                wants.unpop(index)  # (the first again: it waits for room)
                return "full"
            self._sessions.move_to_end(session)  # (the next session first next time)
            self._out[key] = session
            wants.running += 1
            wants.bytes += charge
            self._running += 1
            self._bytes += charge
            self._peak = max(self._peak, self._running)
            self._peak_bytes = max(self._peak_bytes, self._bytes)
            return session, key, where, charge, parts
        return None

    def _block(self, index: int, share_bytes: int) -> Block | None:
        """The block to fetch for ``index``, or None: a sample at a time (no blocks, a cache
        too small to keep them, or a block over the session's share of bytes in flight)."""
        if self._blocks is None:
            return None
        block = self._blocks(index)
        length = block[2]
        room = self.fetcher.cache_bytes()
        if length > share_bytes or room < BLOCKS_IN_CACHE * length or len(block[3]) < 2:
            return None
        return block

    def _fetch(self, where: Where, parts: Parts) -> int:
        """GET ``where`` into the cache (a block: as its ``parts``); its size, -1 when it
        failed (counted by the fetcher; a worker reads it again and names the error)."""
        try:
            if parts:
                url, start, length = where
                assert start is not None and length is not None
                return self.fetcher.fetch_block_to_cache(url, start, length, parts)
            return self.fetcher.fetch_to_cache(*where)
        except Exception:  # (a FetchError, counted by the fetcher; never the thread's end)
            return -1

    def _run(self) -> None:
        while True:
            with self._cond:
                job = self._next()
                while job is None:
                    if self._stopped:
                        return
                    self._cond.wait(1.0)  # (a session gone is noticed within a second)
                    job = self._next()
                if self._running < self._max and self._waiting():
                    self._cond.notify()  # (the next fetch, if any, to another thread)
            session, key, where, charge, parts = job
            size = self._fetch(where, parts)
            with self._cond:
                del self._out[key]
                self._running -= 1
                self._bytes -= charge
                if size < 0:
                    self._failed += 1
                else:
                    self._fetched += 1
                    self._blocks_fetched += bool(parts)
                    if where[2] is None:
                        self._largest = max(self._largest, size)
                wants = self._sessions.get(session)
                if wants is not None:
                    wants.running -= 1
                    wants.bytes -= charge
                self._cond.notify()

    def snapshot(self) -> PrefetchStats:
        with self._cond:
            return PrefetchStats(
                max_fetches=self._max,
                max_bytes_in_flight=self._max_bytes,
                in_flight=self._running,
                bytes_in_flight=self._bytes,
                peak_in_flight=self._peak,
                peak_bytes_in_flight=self._peak_bytes,
                queued=sum(len(w.now) + len(w.ahead) for w in self._sessions.values()),
                sessions=sum(1 for w in self._sessions.values() if w.busy()),
                fetched=self._fetched,
                found=self._found,
                failed=self._failed,
                ahead_lists=self._lists,
                blocks=self._blocks_fetched,
            )


def prefetcher_for(dataset: Any, fetcher: Fetcher, **bounds: Any) -> Prefetcher | None:
    """A ``Prefetcher`` for a dataset that says where its samples' bytes are
    (``locations``), else None (a user's dataset: its workers fetch as it does)."""
    locate = getattr(dataset, "locations", None)
    if locate is None:
        return None
    return Prefetcher(fetcher, locate, blocks=getattr(dataset, "block", None), **bounds)

"""How often STATS is answered, and the store's usage it reports.

STATS needs no session: anyone who reaches the data port may ask. So the answer
(``view.ServerView``) is built from counters the front keeps as things change (the store's
usage is read at most once a second, in housekeeping, never per request), and requests are
answered at a bounded rate: a token bucket per kind of peer, one for peers on this host
(loopback or ipc: the health probes) and one for everyone else, so a flood from the network
cannot silence a probe. Requests over the rate are dropped unanswered and counted as
``Reject.STATS_RATE`` (``stats_rate``).
"""

from __future__ import annotations

import ipaddress
from typing import Any

from dataserver.counting import Counts
from dataserver.data.fetchcache import MemCache, directory_usage
from dataserver.ratelimit import TokenBucket
from dataserver.server.counts import Reject
from dataserver.server.front.view import FetchCacheUsage, StoreUsage
from dataserver.server.store import Store

STATS_RATE = 20.0  # answers per second, sustained, per bucket
STATS_BURST = 40.0  # answers at once after a quiet spell
USAGE_EVERY_S = 1.0  # the store's usage (a scan of its table under its lock) at most this often


def is_local(peer_address: str) -> bool:
    """Whether libzmq's ``Peer-Address`` of a message is on this host: loopback, or not an
    IP address at all (ipc peers)."""
    try:
        ip = ipaddress.ip_address(peer_address)
    except ValueError:  # (libzmq names an ipc peer by its credentials)
        return True
    mapped = getattr(ip, "ipv4_mapped", None)
    return bool(ip.is_loopback or (mapped is not None and mapped.is_loopback))


def peer_address(frame: Any) -> str:
    try:
        return str(frame.get("Peer-Address") or "")
    except Exception:  # (zmq.ZMQError, or a frame without properties)
        return ""


class StatsView:
    """The rate of public STATS answers of one front, and the store usage they report."""

    def __init__(
        self,
        rejected: Counts[Reject],
        store: Store | None,
        fetch_cache: tuple[str, str, int] | None = None,
        fetch_mem: MemCache | None = None,
    ) -> None:
        """``fetch_cache``: (directory, "memory" or "disk", budget) of the fetch cache;
        ``fetch_mem``: its memfds in memory (what is read there, not the directory)."""
        self._fetch_mem = fetch_mem
        self._rejected = rejected
        self._store = store
        self._fetch_dir = fetch_cache
        self._fetch_usage = (
            None if fetch_cache is None else FetchCacheUsage(fetch_cache[1], 0, 0, fetch_cache[2])
        )
        self._buckets = {
            True: TokenBucket(STATS_RATE, STATS_BURST),  # on this host
            False: TokenBucket(STATS_RATE, STATS_BURST),
        }
        # The store's usage as last read (none read yet: empty, at its full size).
        self._usage = None if store is None else StoreUsage(0, 0, store.capacity)
        self._usage_at = float("-inf")

    def allow(self, frame: Any) -> bool:
        """Whether to answer this STATS request (the frame it came in); counted if not."""
        if self._buckets[is_local(peer_address(frame))].take():
            return True
        self._rejected.count(Reject.STATS_RATE)
        return False

    def refresh(self, now: float) -> None:
        """Housekeeping: read the store's usage if the last read is a second old."""
        if now - self._usage_at < USAGE_EVERY_S:
            return
        self._usage_at = now
        if self._store is not None:
            self._usage = StoreUsage(**self._store.usage())
        if self._fetch_mem is not None:
            u = self._fetch_mem.usage()
            self._fetch_usage = FetchCacheUsage(u.where, u.files, u.bytes, u.budget)
        elif self._fetch_dir is not None:
            directory, where, budget = self._fetch_dir
            files, nbytes = directory_usage(directory)
            self._fetch_usage = FetchCacheUsage(where, files, nbytes, budget)

    @property
    def fetch_usage(self) -> FetchCacheUsage | None:
        """The fetch cache's usage as last read; None without one."""
        return self._fetch_usage

    @property
    def usage(self) -> StoreUsage | None:
        """The store's usage as last read; None without a store."""
        return self._usage

"""``ServerView``: one immutable read model of a server, for everything that reports on it.

The front's loop builds one from its collaborators' public methods (``Front.view``), in its
own thread: a STATS request gets a fresh one, and housekeeping publishes one (twice a
second) for the metrics endpoint, whose HTTP thread reads only the last published view,
never the front, pool, scheduler or router themselves. So no other thread reads state the
loop is changing, and everything one report shows was read at one moment.

Nothing in it names a pid, path or endpoint of the server (STATS needs no session: anyone
who reaches the data port may ask); the front logs those for the operator.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import asdict, dataclass
from types import MappingProxyType
from typing import Any

from dataserver.counting import Counts
from dataserver.server.counts import Count
from dataserver.server.front.prefetch import PrefetchStats


@dataclass(frozen=True)
class StoreUsage:
    """What the store holds, as its last read saw it (read at most once a second)."""

    entries: int
    bytes: int
    capacity_bytes: int
    committed_bytes: int = 0  # reserved memory (all of it from the start, where it could be had)
    # The share of the largest dataset seen that the store keeps (1.0: all; below it when
    # that dataset's sources, at the mean entry's size, would not fit: ``store.admission.admitted``).
    admitted: float = 1.0
    mean_entry_bytes: int = 0
    admission: str = ""  # why it keeps what it keeps (``Store.usage``)


@dataclass(frozen=True)
class FetchCacheUsage:
    """What the fetch cache holds (all workers' shares), as its last read saw it: encoded
    bytes fetched from object stores (``dataserver.data.fetchcache``)."""

    where: str  # "memory" or "disk" (--fetch-cache DIR)
    files: int
    bytes: int
    capacity_bytes: int  # --fetch-cache-gb


@dataclass(frozen=True)
class Limits:
    """The caps this server enforces (from its flags)."""

    max_sessions: int
    max_image_side: int
    max_queued_mb: int
    max_connections: int | None
    idle_timeout_s: float
    max_task_mb: int
    max_sessions_why: str = ""  # derived from the fd limit, or --max-sessions (``capacity``)


@dataclass(frozen=True)
class ServerView:
    """A server's figures at one moment. Immutable: its counters are read-only copies."""

    server_id: str
    started: float  # time.time() the front started
    taken: float  # time.time() this view was built
    metrics_port: int | None
    dataset_len: int
    fingerprint: str
    workers: int  # the number the server runs
    workers_alive: int  # processes alive
    workers_ready: int  # live workers that said READY
    workers_busy: int  # workers holding at least one task
    workers_started: int  # starts ever, the first set included
    worker_spawn_failures: int
    queue_depth: int
    queued_bytes: int
    results_unread_bytes: int
    sessions: int
    sessions_evicted: int
    connections: int | None
    draining_for_s: float | None  # None: not draining
    limits: Limits
    store: StoreUsage | None  # None: the server has no store
    sources: str  # "stored", "fresh:not-deterministic" or "fresh:no-store" (Front.sources)
    counters: Mapping[str, int]  # read-only copies (``frozen``) of ``Count``s
    rejected: Mapping[str, int]  # ... of ``Reject``s
    heartbeat_interval_s: float = 0.5  # what clients are told to beat at (``beats.BeatRule``)
    fetch_cache: FetchCacheUsage | None = None  # None: no fetch cache
    prefetch: PrefetchStats | None = None  # None: the front fetches nothing ahead

    @staticmethod
    def frozen(counts: Counts[Any]) -> Mapping[str, int]:
        """A read-only copy of ``counts`` (taken in the loop's thread)."""
        return MappingProxyType(counts.snapshot())

    @property
    def worker_restarts(self) -> int:
        """Workers started to replace one that exited."""
        return max(0, self.workers_started - self.workers)

    def _store_stats(self) -> dict[str, Any] | None:
        if self.store is None:
            return None
        decoded = self.counters.get(Count.SOURCES_DECODED, 0)
        reused = self.counters.get(Count.SOURCES_REUSED, 0)
        return {
            "entries": self.store.entries,
            "bytes": self.store.bytes,
            "capacity_bytes": self.store.capacity_bytes,
            "committed_bytes": self.store.committed_bytes,
            "admitted": self.store.admitted,
            "mean_entry_bytes": self.store.mean_entry_bytes,
            "admission": self.store.admission,
            "hit_rate": round(reused / (decoded + reused), 4) if decoded + reused else None,
        }

    def as_stats(self) -> dict[str, Any]:
        """The STATS answer (what ``dataserver stats`` prints)."""
        limits = self.limits
        return {
            "server_id": self.server_id,
            "uptime_s": round(self.taken - self.started, 1),
            "metrics_port": self.metrics_port,
            "dataset_len": self.dataset_len,
            "fingerprint": self.fingerprint,
            "workers": self.workers,
            "workers_alive": self.workers_alive,
            "workers_busy": self.workers_busy,
            "workers_started": self.workers_started,
            "worker_spawn_failures": self.worker_spawn_failures,
            "queue_depth": self.queue_depth,
            "draining": None if self.draining_for_s is None else {"for_s": self.draining_for_s},
            "queued_bytes": self.queued_bytes,
            "results_unread_bytes": self.results_unread_bytes,
            "sessions": self.sessions,
            "sessions_evicted": self.sessions_evicted,
            "connections": self.connections,
            "heartbeat_interval_s": self.heartbeat_interval_s,
            "limits": {
                "max_sessions": limits.max_sessions,
                "max_sessions_why": limits.max_sessions_why,
                "max_image_side": limits.max_image_side,
                "max_queued_mb": limits.max_queued_mb,
                "max_connections": limits.max_connections,
                "idle_timeout_s": limits.idle_timeout_s,
                "max_task_mb": limits.max_task_mb,
            },
            "store": self._store_stats(),
            "fetch_cache": None if self.fetch_cache is None else asdict(self.fetch_cache),
            "prefetch": None if self.prefetch is None else asdict(self.prefetch),
            "sources": self.sources,
            "counters": dict(self.counters),  # (declared names only, in their order: ``frozen``)
            "rejected": dict(self.rejected),
            "rejected_total": sum(self.rejected.values()),
        }

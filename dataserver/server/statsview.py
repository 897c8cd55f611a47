"""What a STATS request is answered with, and how often.

STATS needs no session: anyone who reaches the data port may ask. So the answer is built
from counters the front keeps as things change (the store's usage is read at most once a
second, in housekeeping, never per request), it names no pid, path or endpoint of the
server (the front logs those for the operator), and requests are answered at a bounded
rate: a token bucket per kind of peer, one for peers on this host (loopback or ipc: the
health probes) and one for everyone else, so a flood from the network cannot silence a
probe. Requests over the rate are dropped unanswered and counted as
``rejected["stats_rate"]``.
"""

from __future__ import annotations

import ipaddress
import time
from typing import TYPE_CHECKING, Any

from dataserver.server.conns import ConnTracker

if TYPE_CHECKING:
    from dataserver.server.front import Front

STATS_RATE = 20.0  # answers per second, sustained, per bucket
STATS_BURST = 40.0  # answers at once after a quiet spell
USAGE_EVERY_S = 1.0  # the store's usage (a scan of its table under its lock) at most this often


class TokenBucket:
    """``rate`` events per second on average, at most ``burst`` at once."""

    def __init__(self, rate: float, burst: float) -> None:
        self.rate = rate
        self.burst = burst
        self.tokens = burst
        self.at = time.monotonic()

    def take(self, now: float | None = None) -> bool:
        now = time.monotonic() if now is None else now
        self.tokens = min(self.burst, self.tokens + (now - self.at) * self.rate)
        self.at = now
        if self.tokens < 1.0:
            return False
        self.tokens -= 1.0
        return True


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
    """The public STATS answer of one front."""

    def __init__(self, front: Front) -> None:
        self.front = front
        self.buckets = {
            True: TokenBucket(STATS_RATE, STATS_BURST),  # on this host
            False: TokenBucket(STATS_RATE, STATS_BURST),
        }
        self.usage: dict[str, Any] | None = None  # the store's, as last read
        self._usage_at = float("-inf")
        self.conns: ConnTracker | None = None

    def allow(self, frame: Any) -> bool:
        """Whether to answer this STATS request (the frame it came in); counted if not."""
        if self.buckets[is_local(peer_address(frame))].take():
            return True
        self.front.rejected["stats_rate"] += 1
        return False

    def refresh(self, now: float) -> None:
        """Housekeeping: read the store's usage if the last read is a second old."""
        store = self.front.store
        if store is None or now - self._usage_at < USAGE_EVERY_S:
            return
        self._usage_at = now
        self.usage = dict(store.usage())

    def _store(self) -> dict[str, Any] | None:
        front = self.front
        if front.store is None:
            return None
        decoded = front.counters.get("sources_decoded", 0)
        reused = front.counters.get("sources_reused", 0)
        usage = self.usage or {"entries": 0, "bytes": 0, "capacity_bytes": front.store.capacity}
        return {
            **usage,
            "hit_rate": round(reused / (decoded + reused), 4) if decoded + reused else None,
        }

    def answer(self) -> dict[str, Any]:
        """The counters ``dataserver stats`` prints: no pid, path or endpoint in them."""
        front = self.front
        config = front.config
        conns = self.conns
        return {
            "server_id": front.server_id,
            "uptime_s": round(time.time() - front.started, 1),
            "metrics_port": front.metrics.port if front.metrics is not None else None,
            "dataset_len": front.dataset_len,
            "fingerprint": front.fingerprint,
            "workers": front.n_workers,
            "workers_alive": front.pool.alive(),
            "workers_busy": front.workers.busy(),
            "workers_started": front.pool.started_total,
            "worker_spawn_failures": front.pool.spawn_failures,
            "queue_depth": front.scheduler.queued,
            "draining": None
            if front.draining_since is None
            else {"for_s": round(time.monotonic() - front.draining_since, 2)},
            "queued_bytes": front.scheduler.queued_bytes,
            "results_unread_bytes": front.outbox.nbytes,
            "sessions": len(front.scheduler.sessions),
            "sessions_evicted": front.scheduler.evicted,
            "connections": None if conns is None else len(conns.conns),
            "limits": {
                "max_sessions": config.max_sessions,
                "max_image_side": config.max_image_side,
                "max_queued_mb": config.max_queued_mb,
                "max_connections": None if conns is None else conns.limit,
                "idle_timeout_s": config.idle_timeout,
            },
            "store": self._store(),
            "counters": dict(front.counters),
            "rejected": dict(front.rejected),
            "rejected_total": sum(front.rejected.values()),
        }

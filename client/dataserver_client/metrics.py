"""What a trainer cares about: how long ``next()`` waits for data, and samples per second.

``ClientMetrics.taken`` runs in the trainer's thread once per batch handed out: a bisect
into fixed buckets and a few integer updates, no lock. Everything else (``summary`` for
``client.stats()``, the Prometheus collector) reads those numbers when asked, possibly from
another thread, and never writes them; the histogram's count is derived from its buckets,
so a scrape in the middle of an update still sees a consistent histogram.

With ``DataServerClient(metrics_port=PORT)`` the trainer process serves, on its own registry
(two clients in one process do not collide)::

    dataserver_client_data_wait_seconds{rank}     histogram  the wait in each next()
    dataserver_client_samples_total{rank}         counter    samples handed to the trainer
    dataserver_client_samples_per_second{rank}    gauge      over the last WINDOW_S seconds
"""

from __future__ import annotations

import bisect
import math
import threading
import time
from collections import deque
from collections.abc import Iterator
from typing import Any

from prometheus_client import CollectorRegistry
from prometheus_client.core import (
    CounterMetricFamily,
    GaugeMetricFamily,
    HistogramMetricFamily,
    Metric,
)
from prometheus_client.exposition import start_wsgi_server
from prometheus_client.registry import Collector

# Upper bounds, seconds: a batch that was ready costs ~0.1 ms; a pool that cannot keep up
# makes the trainer wait for a whole batch (tens of ms to seconds).
WAIT_BUCKETS = (
    0.0001,
    0.00025,
    0.0005,
    0.001,
    0.0025,
    0.005,
    0.01,
    0.025,
    0.05,
    0.1,
    0.25,
    0.5,
    1.0,
    2.5,
    5.0,
    10.0,
    30.0,
)
RECENT = 1024  # waits kept for the percentiles in stats()
WINDOW_S = 10.0  # samples/s over this many recent seconds
TICKS = 4096  # batches remembered for the window (more than 10 s of fast batches is fine)


class ClientMetrics:
    """Data-wait histogram and samples/s of one client."""

    def __init__(self, rank: int) -> None:
        self.rank = rank
        self.buckets = [0] * (len(WAIT_BUCKETS) + 1)  # the last: above every bound (+Inf)
        self.wait_sum = 0.0
        self.waits = 0
        self.samples = 0
        self._recent = [0.0] * RECENT  # a ring of the latest waits
        self._ticks: deque[tuple[float, int]] = deque(maxlen=TICKS)  # (time, samples so far)
        now = time.perf_counter()
        self._origin = now
        self._epoch_start = now
        self._epoch_samples = 0
        self._httpd: Any = None
        self._thread: threading.Thread | None = None
        self.port: int | None = None

    # ------------------------------------------------------------ trainer thread

    def epoch_started(self) -> None:
        self._epoch_start = time.perf_counter()
        self._epoch_samples = 0

    def taken(self, wait_s: float, samples: int, now: float) -> None:
        """One batch of ``samples`` samples handed out at ``now`` (``time.perf_counter()``)
        after ``wait_s`` seconds of waiting."""
        self.buckets[bisect.bisect_left(WAIT_BUCKETS, wait_s)] += 1
        self._recent[self.waits % RECENT] = wait_s
        self.wait_sum += wait_s
        self.waits += 1
        self.samples += samples
        self._epoch_samples += samples
        self._ticks.append((now, self.samples))

    # ------------------------------------------------------------ readers

    def samples_per_s(self) -> float:
        """Samples handed out over the last ``WINDOW_S`` seconds (or since the client
        started, when that is shorter), per second."""
        now = time.perf_counter()
        span = min(WINDOW_S, now - self._origin)
        ticks = _copy(self._ticks)
        if span <= 0 or not ticks:
            return 0.0
        start = now - span
        i = bisect.bisect_left(ticks, (start, -1))
        before = ticks[i - 1][1] if i > 0 else 0  # samples handed out by the window's start
        return (ticks[-1][1] - before) / span

    def summary(self) -> dict[str, Any]:
        """``client.stats()``'s ``data_wait`` and ``samples_per_s``."""
        buckets = list(self.buckets)
        count = sum(buckets)
        recent = sorted(self._recent[: min(count, RECENT)])
        cumulative: dict[str, int] = {}
        total = 0
        for bound, n in zip((*WAIT_BUCKETS, math.inf), buckets, strict=True):
            total += n
            cumulative["+Inf" if bound == math.inf else f"{bound:g}"] = total
        now = time.perf_counter()
        epoch_span = now - self._epoch_start
        return {
            "data_wait": {
                "count": count,
                "sum_s": round(self.wait_sum, 6),
                "mean_ms": round(1e3 * self.wait_sum / count, 3) if count else None,
                "p50_ms": _percentile_ms(recent, 0.50),
                "p90_ms": _percentile_ms(recent, 0.90),
                "p99_ms": _percentile_ms(recent, 0.99),
                "recent": len(recent),  # the waits the percentiles are taken over
                "buckets": cumulative,  # upper bound (s) -> waits at or under it
            },
            "samples_per_s": {
                "recent": round(self.samples_per_s(), 2),
                "window_s": WINDOW_S,
                "epoch": round(self._epoch_samples / epoch_span, 2) if epoch_span > 0 else 0.0,
                "samples": self.samples,
            },
            "metrics_port": self.port,
        }

    # ------------------------------------------------------------ Prometheus endpoint

    def serve(self, port: int, addr: str = "0.0.0.0") -> None:
        """Answer Prometheus scrapes on ``addr:port`` (0: any free port; ``self.port`` says
        which) with this client's own registry. Raises ``OSError`` naming the port."""
        registry = CollectorRegistry(auto_describe=True)
        registry.register(_Collector(self))
        try:
            self._httpd, self._thread = start_wsgi_server(port, addr, registry)
        except OSError as exc:
            raise OSError(
                exc.errno,
                f"DataServerClient: metrics_port {port}: cannot listen on {addr}:{port}: "
                f"{exc.strerror}",
            ) from None
        self.port = int(self._httpd.server_port)

    def close(self) -> None:
        """Stop the endpoint, if any (idempotent)."""
        httpd, self._httpd = self._httpd, None
        if httpd is None:
            return
        httpd.shutdown()
        httpd.server_close()
        if self._thread is not None:
            self._thread.join(5.0)


class _Collector(Collector):
    """Reads a ``ClientMetrics`` when a scrape comes."""

    def __init__(self, metrics: ClientMetrics) -> None:
        self.metrics = metrics

    def collect(self) -> Iterator[Metric]:
        m = self.metrics
        rank = [str(m.rank)]
        buckets = list(m.buckets)
        cumulative: list[tuple[str, float]] = []
        total = 0
        for bound, n in zip((*WAIT_BUCKETS, math.inf), buckets, strict=True):
            total += n
            cumulative.append(("+Inf" if bound == math.inf else repr(bound), total))
        wait = HistogramMetricFamily(
            "dataserver_client_data_wait_seconds",
            "Seconds next() waited for the batch it returned.",
            labels=["rank"],
        )
        wait.add_metric(rank, cumulative, m.wait_sum)
        yield wait
        samples = CounterMetricFamily(
            "dataserver_client_samples",
            "Dataset samples handed to the trainer (a stitched image holds k).",
            labels=["rank"],
        )
        samples.add_metric(rank, m.samples)
        yield samples
        rate = GaugeMetricFamily(
            "dataserver_client_samples_per_second",
            f"Samples handed to the trainer per second over the last {WINDOW_S:g} s.",
            labels=["rank"],
        )
        rate.add_metric(rank, m.samples_per_s())
        yield rate


def _copy(ticks: deque[tuple[float, int]]) -> list[tuple[float, int]]:
    """A list of a deque the trainer's thread may be appending to."""
    for _ in range(8):
        try:
            return list(ticks)
        except RuntimeError:  # mutated during iteration
            continue
    return []


def _percentile_ms(ordered: list[float], q: float) -> float | None:
    if not ordered:
        return None
    i = min(len(ordered) - 1, max(0, math.ceil(q * len(ordered)) - 1))
    return round(ordered[i] * 1e3, 3)

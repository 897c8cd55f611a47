"""Prometheus metrics of a server (``dataserver serve --metrics-port PORT``).

An HTTP server (``scrape.py``: one thread of the front, no thread per client, the page
rendered at most twice a second) answers scrapes, on ``--metrics-bind`` (default: the
interface of ``--bind``). Counters and gauges come from the last ``ServerView`` the front's
loop published (``ViewCollector``; the loop publishes one twice a second, so a figure is at
most about a second old): the HTTP thread is handed a callable that returns that view, and
never sees the front, its pool, scheduler or router. The two histograms are observed by
the front's loop from the timings every worker puts in its DONE or RESULT
(``observe_task``: a few microseconds per task; ``prometheus_client``'s histograms lock).

Names (kept: deploy manifests and dashboards use them)::

    dataserver_samples_served_total          counter  output images delivered
    dataserver_decode_seconds                histogram  decode + fit of one source (store miss)
    dataserver_task_seconds                  histogram  a worker's time per task
    dataserver_fetch_seconds                 histogram  one GET from an object store (workers' TALLY)
    dataserver_fetches_total, dataserver_fetch_bytes_total, dataserver_fetch_retries_total
                                             counter  object-store reads (workers' TALLY, the front's)
    dataserver_fetch_errors_total            counter  objects given up on, by kind
    dataserver_fetches_in_flight, dataserver_fetch_bytes_in_flight, dataserver_fetches_queued
                                             gauge    the front's fetcher (prefetch.py)
    dataserver_queue_depth                   gauge    tasks queued in the front
    dataserver_workers_busy                  gauge    workers holding a task
    dataserver_workers                       gauge    live workers (said READY)
    dataserver_sessions                      gauge    client sessions open
    dataserver_rejected_messages_total       counter  by reason
    dataserver_worker_restarts_total         counter  workers started beyond the first set
    dataserver_cache_hits_total              counter  sources served from the store   (store only)
    dataserver_cache_misses_total            counter  sources decoded                  (store only)
    dataserver_cache_bytes                   gauge    bytes the store holds            (store only)
    dataserver_cache_capacity_bytes          gauge    the store's size                 (store only)
    dataserver_cache_committed_bytes         gauge    its memory reserved              (store only)
    dataserver_cache_admitted_ratio          gauge    share of the dataset it keeps    (store only)
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Iterator

from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

from dataserver.server.counts import FETCH_ERROR_KINDS, Count, fetch_errors
from dataserver.server.front.scrape import ScrapeServer
from dataserver.server.front.view import ServerView, StoreUsage

log = logging.getLogger("dataserver.metrics")

# Seconds: a decode of a small JPEG takes ~1 ms, a large one tens of ms; a task is a run of
# up to 64 images (stitched ones hold k sources each).
FETCH_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0)
DECODE_BUCKETS = (0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0)
TASK_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0)
US = 1e-6


class MetricsPortError(RuntimeError):
    """``--metrics-port`` cannot be listened on (taken, or not allowed); one line."""


class ViewCollector(Collector):
    """The server's counters and gauges, from the view ``view()`` returns when a scrape
    comes (nothing before the loop published its first)."""

    def __init__(self, view: Callable[[], ServerView | None]) -> None:
        self._view = view

    def collect(self) -> Iterator[Metric]:
        view = self._view()
        if view is None:
            return
        yield CounterMetricFamily(
            "dataserver_samples_served",
            "Output images delivered (a stitched image counts once).",
            value=view.counters.get(Count.IMAGES_DONE, 0),
        )
        yield GaugeMetricFamily(
            "dataserver_queue_depth",
            "Tasks queued in the front, not yet given to a worker.",
            value=view.queue_depth,
        )
        yield GaugeMetricFamily(
            "dataserver_workers_busy",
            "Worker processes holding at least one task.",
            value=view.workers_busy,
        )
        yield GaugeMetricFamily(
            "dataserver_workers",
            "Live worker processes (started and ready).",
            value=view.workers_ready,
        )
        yield GaugeMetricFamily("dataserver_sessions", "Client sessions open.", value=view.sessions)
        family = CounterMetricFamily(
            "dataserver_rejected_messages",
            "Messages and connections refused, by reason.",
            labels=["reason"],
        )
        for reason, n in sorted(view.rejected.items()):  # (every declared reason counted so far)
            family.add_metric([reason], n)
        yield family
        yield CounterMetricFamily(
            "dataserver_worker_restarts",
            "Worker processes started to replace one that exited.",
            value=view.worker_restarts,
        )
        if view.store is not None:
            yield from _cache(view, view.store)
        for name, count, what in (
            ("dataserver_fetches", Count.FETCHES, "GETs from object stores answered."),
            ("dataserver_fetch_bytes", Count.FETCH_BYTES, "Bytes fetched from object stores."),
            ("dataserver_fetch_retries", Count.FETCH_RETRIES, "GETs tried again."),
        ):
            yield CounterMetricFamily(name, what, value=view.counters.get(count, 0))
        errors = CounterMetricFamily(
            "dataserver_fetch_errors",
            "Objects given up on (retries spent), by kind.",
            labels=["kind"],
        )
        for kind in FETCH_ERROR_KINDS:
            errors.add_metric([kind], view.counters.get(fetch_errors(kind), 0))
        yield errors
        if view.prefetch is not None:
            p = view.prefetch
            for name, value, what in (
                ("dataserver_fetches_in_flight", p.in_flight, "Object-store requests out now."),
                (
                    "dataserver_fetch_bytes_in_flight",
                    p.bytes_in_flight,
                    "Bytes of object-store requests out now (as --max-fetch-mb counts them).",
                ),
                ("dataserver_fetches_queued", p.queued, "Samples waiting to be fetched ahead."),
            ):
                yield GaugeMetricFamily(name, what, value=value)


def _cache(view: ServerView, usage: StoreUsage) -> Iterator[Metric]:
    yield CounterMetricFamily(
        "dataserver_cache_hits",
        "Sources a task found in the store (or waited for while another worker made them).",
        value=view.counters.get(Count.SOURCES_REUSED, 0),
    )
    yield CounterMetricFamily(
        "dataserver_cache_misses",
        "Sources decoded and fitted by a worker.",
        value=view.counters.get(Count.SOURCES_DECODED, 0),
    )
    yield GaugeMetricFamily(
        "dataserver_cache_bytes", "Bytes of sources the store holds.", value=usage.bytes
    )
    yield GaugeMetricFamily(
        "dataserver_cache_capacity_bytes",
        "The store's size in bytes.",
        value=usage.capacity_bytes,
    )
    yield GaugeMetricFamily(
        "dataserver_cache_committed_bytes",
        "Bytes of the store's memory reserved (all of it from the start, where it could be had).",
        value=usage.committed_bytes,
    )
    yield GaugeMetricFamily(
        "dataserver_cache_admitted_ratio",
        "Share of the dataset's sources the store keeps (below 1 for a dataset larger than it).",
        value=usage.admitted,
    )


class ServerMetrics:
    """The metrics endpoint of one front: its registry, histograms and HTTP server.
    ``view`` returns the server's latest published ``ServerView`` (called from the HTTP
    thread: it must only read what the loop published)."""

    def __init__(
        self, view: Callable[[], ServerView | None], port: int, addr: str = "0.0.0.0"
    ) -> None:
        self.registry = CollectorRegistry(auto_describe=True)
        self.decode_seconds = Histogram(
            "dataserver_decode_seconds",
            "Seconds a worker spent reading, decoding and fitting one source (a store miss).",
            buckets=DECODE_BUCKETS,
            registry=self.registry,
        )
        self.task_seconds = Histogram(
            "dataserver_task_seconds",
            "Seconds a worker spent on one task (a run of one batch's images).",
            buckets=TASK_BUCKETS,
            registry=self.registry,
        )
        self.fetch_seconds = Histogram(
            "dataserver_fetch_seconds",
            "Seconds one GET of an object (or byte range) from an object store took.",
            buckets=FETCH_BUCKETS,
            registry=self.registry,
        )
        self.collector = ViewCollector(view)
        self.registry.register(self.collector)
        self._server: ScrapeServer | None = None
        try:
            self._server = ScrapeServer(addr, port, self.render)
        except OSError as exc:
            why = exc.strerror or str(exc)
            raise MetricsPortError(
                f"--metrics-port {port}: cannot listen on {addr}:{port}: {why} "
                "(--metrics-bind chooses the interface)"
            ) from None
        self.port = self._server.port  # (port 0: the one the kernel chose)
        log.info("metrics on http://%s:%d/metrics", addr, self.port)

    def render(self) -> tuple[bytes, str]:
        """The exposition page (the text format every Prometheus reads)."""
        return generate_latest(self.registry), CONTENT_TYPE_LATEST

    def observe_fetches(self, fetch_us: tuple[int, ...]) -> None:
        """Workers' object-store GET latencies (from their TALLY)."""
        for us in fetch_us:
            self.fetch_seconds.observe(us * US)

    def observe_task(self, task_us: int, decode_us: tuple[int, ...] | None) -> None:
        """A worker's timings for one task (from its DONE or RESULT; 0: an old worker)."""
        if task_us:
            self.task_seconds.observe(task_us * US)
        for us in decode_us or ():
            self.decode_seconds.observe(us * US)

    @property
    def rate_refused(self) -> int:
        """Scrape connections closed unanswered: their peer over its rate."""
        return self._server.rate_refused if self._server is not None else 0

    @property
    def total_refused(self) -> int:
        """Scrape connections closed unanswered: all peers together over their rate."""
        return self._server.total_refused if self._server is not None else 0

    def stop(self) -> None:
        """Stop answering scrapes (idempotent)."""
        server, self._server = self._server, None
        if server is not None:
            server.stop()

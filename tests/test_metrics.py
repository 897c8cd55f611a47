"""Prometheus metrics: ``dataserver serve --metrics-port`` and
``DataServerClient(metrics_port=...)``, scraped over HTTP and read with
``prometheus_client``'s own parser; and the client's ``stats()`` figures behind them."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import urllib.request
from typing import Any

import pytest
import zmq
from clients import make_client
from conftest import server_env, wait_until
from prometheus_client.metrics_core import Metric
from prometheus_client.parser import text_string_to_metric_families

from dataserver_client import DataServerClient

pytestmark = pytest.mark.timeout(120)

SERVER_FAMILIES = {
    "dataserver_samples_served": "counter",
    "dataserver_decode_seconds": "histogram",
    "dataserver_task_seconds": "histogram",
    "dataserver_queue_depth": "gauge",
    "dataserver_workers_busy": "gauge",
    "dataserver_workers": "gauge",
    "dataserver_sessions": "gauge",
    "dataserver_rejected_messages": "counter",
    "dataserver_worker_restarts": "counter",
}
CACHE_FAMILIES = {
    "dataserver_cache_hits": "counter",
    "dataserver_cache_misses": "counter",
    "dataserver_cache_bytes": "gauge",
    "dataserver_cache_capacity_bytes": "gauge",
}


def scrape(port: int) -> dict[str, Metric]:
    """The families an endpoint serves, parsed by prometheus_client."""
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5) as reply:
        assert reply.status == 200
        text = reply.read().decode()
    return {family.name: family for family in text_string_to_metric_families(text)}


def value(families: dict[str, Metric], name: str, sample: str = "", **labels: str) -> float:
    """The value of ``name + sample`` (e.g. ``_total``, ``_count``) with these labels."""
    family = families[name]
    for s in family.samples:
        if s.name == name + sample and all(s.labels.get(k) == v for k, v in labels.items()):
            return float(s.value)
    raise KeyError(f"{name}{sample} {labels}: not among {[s.name for s in family.samples]}")


def take(client: DataServerClient, batches: int) -> int:
    """Take ``batches`` batches of epoch 0; the images delivered."""
    client.set_epoch(0)
    it = iter(client)
    return sum(len(next(it)) for _ in range(batches))


def send_junk(address: str) -> None:
    """A message no server understands, on the data socket."""
    ctx: zmq.Context[Any] = zmq.Context.instance()
    sock = ctx.socket(zmq.DEALER)
    sock.setsockopt(zmq.LINGER, 0)
    try:
        sock.connect(address)
        sock.send_multipart([b"\x00not a dataserver message", b"junk"])
        sock.poll(2000)  # the server answers ERROR: it has counted it by then
    finally:
        sock.close(linger=0)


def test_both_endpoints_serve_their_metrics(start_server: Any) -> None:
    server = start_server(
        "--dataset", "synthetic:images=64,seed=1", "--metrics-port", "0", "--cache-mb", "64"
    )
    port = server.stats()["metrics_port"]
    assert isinstance(port, int) and port > 0
    with make_client(
        server.address,
        batch_size=4,
        image_size=(64, 64),
        shuffle=False,
        metrics_port=0,
    ) as client:
        client_port = client.stats()["metrics_port"]
        assert isinstance(client_port, int) and client_port not in (0, port)
        delivered = take(client, 5)
        assert delivered == 20

        # --- the trainer's endpoint
        fams = scrape(client_port)
        assert fams["dataserver_client_data_wait_seconds"].type == "histogram"
        assert fams["dataserver_client_samples"].type == "counter"
        assert fams["dataserver_client_samples_per_second"].type == "gauge"
        wait = "dataserver_client_data_wait_seconds"
        assert value(fams, wait, "_count", rank="0") == 5
        assert value(fams, wait, "_bucket", rank="0", le="+Inf") == 5
        assert value(fams, wait, "_sum", rank="0") > 0
        assert value(fams, "dataserver_client_samples", "_total", rank="0") == 20
        assert value(fams, "dataserver_client_samples_per_second", rank="0") > 0

        # --- client.stats() has the same figures
        stats = client.stats()
        dw = stats["data_wait"]
        assert dw["count"] == 5 and dw["buckets"]["+Inf"] == 5 and dw["sum_s"] > 0
        assert 0 <= dw["p50_ms"] <= dw["p90_ms"] <= dw["p99_ms"]
        counts = list(dw["buckets"].values())
        assert counts == sorted(counts)  # cumulative
        rate = stats["samples_per_s"]
        assert rate["samples"] == 20 and rate["recent"] > 0 and rate["epoch"] > 0

        # --- the server's endpoint
        def served_all() -> bool:
            fams = scrape(port)
            return value(fams, "dataserver_samples_served", "_total") >= delivered

        # (a worker tells the front DONE after its RESULT went to the client)
        assert wait_until(served_all, 10)
        fams = scrape(port)
        for name, kind in {**SERVER_FAMILIES, **CACHE_FAMILIES}.items():
            assert fams[name].type == kind, name
        assert value(fams, "dataserver_task_seconds", "_count") > 0
        assert value(fams, "dataserver_task_seconds", "_sum") > 0
        # A fresh server decoded every source it served: store misses, each one timed.
        misses = value(fams, "dataserver_cache_misses", "_total")
        assert misses >= delivered
        assert wait_until(  # (a scrape may fall between two DONEs' counters and timings)
            lambda: (
                value(scrape(port), "dataserver_decode_seconds", "_count")
                == value(scrape(port), "dataserver_cache_misses", "_total")
            ),
            10,
        )
        assert value(fams, "dataserver_cache_capacity_bytes") == 64 << 20
        # (the store's usage is read at most once a second, the page rendered twice)
        assert wait_until(lambda: 0 < value(scrape(port), "dataserver_cache_bytes") <= 64 << 20, 5)
        assert value(fams, "dataserver_workers") == 2
        assert value(fams, "dataserver_sessions") == 1
        assert 0 <= value(fams, "dataserver_workers_busy") <= 2
        assert value(fams, "dataserver_queue_depth") >= 0
        assert value(fams, "dataserver_worker_restarts", "_total") == 0

        # Junk on the data port is rejected and counted, by reason.
        def malformed() -> float:
            try:
                return value(
                    scrape(port), "dataserver_rejected_messages", "_total", reason="malformed"
                )
            except KeyError:
                return 0.0

        before = malformed()
        send_junk(server.address)
        assert wait_until(lambda: malformed() >= before + 1, 10)

        # A killed worker is replaced: a restart, and the live count comes back.
        os.kill(server.worker_pids()[0], signal.SIGKILL)
        assert wait_until(
            lambda: value(scrape(port), "dataserver_worker_restarts", "_total") == 1, 20
        )
        assert wait_until(lambda: value(scrape(port), "dataserver_workers") == 2, 20)

        # Epoch 1 takes the same samples again: the store serves those decoded above.
        client.set_epoch(1)
        taken = sum(len(b) for b in client)
        assert taken == 64
        assert wait_until(lambda: value(scrape(port), "dataserver_cache_hits", "_total") > 0, 10)
    # The session is gone once the client said BYE.
    assert wait_until(lambda: value(scrape(port), "dataserver_sessions") == 0, 10)


def test_without_a_store_there_are_no_cache_metrics(start_server: Any) -> None:
    server = start_server(
        "--dataset",
        "synthetic:images=16,seed=1",
        "--metrics-port",
        "0",
        "--cache-gb",
        "0",
        workers=1,
    )
    fams = scrape(server.stats()["metrics_port"])
    for name, kind in SERVER_FAMILIES.items():
        assert fams[name].type == kind, name
    assert not [name for name in fams if name.startswith("dataserver_cache")]
    assert value(fams, "dataserver_workers") == 1


def test_metrics_are_off_by_default(synthetic_server: Any) -> None:
    assert synthetic_server.stats()["metrics_port"] is None
    with make_client(synthetic_server.address, batch_size=4, image_size=(32, 32)) as client:
        stats = client.stats()
        assert stats["metrics_port"] is None
        assert stats["data_wait"]["count"] == 0 and stats["data_wait"]["p50_ms"] is None
        assert stats["samples_per_s"]["samples"] == 0
        take(client, 2)
        assert client.stats()["data_wait"]["count"] == 2


def test_two_clients_in_one_process_each_serve_their_own(synthetic_server: Any) -> None:
    kwargs: dict[str, Any] = {"batch_size": 4, "image_size": (32, 32)}
    address = synthetic_server.address
    with (
        make_client(address, rank=0, world_size=2, metrics_port=0, **kwargs) as a,
        make_client(address, rank=1, world_size=2, metrics_port=0, **kwargs) as b,
    ):
        take(a, 3)
        take(b, 1)
        fa = scrape(a.stats()["metrics_port"])
        fb = scrape(b.stats()["metrics_port"])
        wait = "dataserver_client_data_wait_seconds"
        assert value(fa, wait, "_count", rank="0") == 3
        assert value(fb, wait, "_count", rank="1") == 1
        with pytest.raises(KeyError):
            value(fa, wait, "_count", rank="1")
        # A port that is taken is a clear error at construction.
        with pytest.raises(OSError, match="metrics_port"):
            make_client(address, metrics_port=a.stats()["metrics_port"], **kwargs)


def test_a_taken_metrics_port_makes_serve_exit_with_one_line() -> None:
    with socket.socket() as taken:
        taken.bind(("0.0.0.0", 0))
        taken.listen()
        port = taken.getsockname()[1]
        proc = subprocess.run(
            [
                sys.executable,
                "-m",
                "dataserver.cli",
                "serve",
                "--workers",
                "1",
                "--dataset",
                "synthetic:images=8",
                "--bind",
                "tcp://127.0.0.1:0",
                "--metrics-port",
                str(port),
            ],
            capture_output=True,
            text=True,
            timeout=60,
            env=server_env(),
        )
    assert proc.returncode != 0
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1, proc.stderr
    assert f"--metrics-port {port}" in lines[0] and "Traceback" not in proc.stderr


def test_a_bad_metrics_port_is_refused() -> None:
    proc = subprocess.run(
        [sys.executable, "-m", "dataserver.cli", "serve", "--metrics-port", "70000"],
        capture_output=True,
        text=True,
        timeout=60,
        env=server_env(),
    )
    assert proc.returncode == 2 and "--metrics-port" in proc.stderr
    with pytest.raises(ValueError, match="metrics_port"):
        make_client("tcp://127.0.0.1:1", metrics_port=-1)

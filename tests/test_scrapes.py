"""Issue 40, item 7 (scrapes): limits per peer where a peer on this host is its uid, not
its address, and a bound over every peer together. The scrapers here are real processes
of other users (forks that set their uid and scrape with the standard library)."""

from __future__ import annotations

import encodings.idna  # noqa: F401  (the uid's children may not read the venv)
import os
import signal
import socket
import struct
import threading
import time
from typing import Any

import pytest
from conftest import wait_until
from test_bounds import SAMPLES

from dataserver.server.front.scrape import QUIET_RATE, TOTAL_BURST, TOTAL_RATE

pytestmark = pytest.mark.timeout(180)


def _scrape(port: int, source: str = "127.0.0.1", timeout: float = 2.0) -> bool:
    try:
        with socket.create_connection(
            ("127.0.0.1", port), timeout=timeout, source_address=(source, 0)
        ) as s:
            s.sendall(b"GET /metrics HTTP/1.1\r\n\r\n")
            return s.recv(12).startswith(b"HTTP/1.1 200")
    except OSError:
        return False


def _scraper(
    uid: int, port: int, source: str, seconds: float, report: int, threads: int = 4
) -> int:
    """A child of ``uid`` scraping from ``source`` as fast as it can for ``seconds`` (on
    ``threads`` connections at once); it writes how many were answered to fd ``report``.
    Its pid."""
    pid = os.fork()
    if pid:
        return pid
    try:
        os.setgroups([])
        os.setgid(uid)
        os.setuid(uid)
        answered = [0]
        deadline = time.monotonic() + seconds

        def loop() -> None:
            while time.monotonic() < deadline:
                if _scrape(port, source):
                    answered[0] += 1

        running = [threading.Thread(target=loop) for _ in range(threads)]
        for t in running:
            t.start()
        for t in running:
            t.join()
        os.write(report, struct.pack("I", answered[0]))
    finally:
        os._exit(0)


def _metrics_server(start_server: Any) -> tuple[Any, int]:
    if os.getuid() != 0:
        pytest.skip("needs root to act as other users")
    server = start_server(
        "--dataset", f"synthetic:images={SAMPLES}", "--metrics-port", "0", workers=1
    )  # fmt: skip
    return server, int(server.stats()["metrics_port"])


def _reap(pids: list[int]) -> None:
    for pid in pids:
        try:
            os.kill(pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
        os.waitpid(pid, 0)


def test_another_user_on_the_same_address_does_not_take_the_operators_scrapes(
    start_server: Any,
) -> None:
    """uid 65534 scraping from 127.0.0.1 as fast as it can halved the operator's scrapes
    (9-10 of 20), both charged as the address. Over loopback the peer is the uid: the
    operator (root, also 127.0.0.1) is answered 20 of 20 at 10 a second."""
    server, port = _metrics_server(start_server)
    read, write = os.pipe()
    flood = _scraper(65534, port, "127.0.0.1", 8.0, write, threads=32)
    try:
        time.sleep(3)  # its burst long spent
        answered = 0
        for _ in range(20):
            answered += _scrape(port)
            time.sleep(0.1)
        (flooded,) = struct.unpack("I", os.read(read, 4))
    finally:
        _reap([flood])
        os.close(read)
        os.close(write)
    assert answered >= 19, answered
    assert flooded > 0  # (the flood was answered at its own rate)
    assert wait_until(lambda: server.stats()["rejected"].get("scrape_rate", 0) >= 50, 5)


def test_scrapes_of_many_peers_are_bounded_together(start_server: Any) -> None:
    """24 users, each from an address of its own (127.0.1.N), scraping as fast as they can:
    each peer's rate (50 a second) let them take 24 x 50 a second (from 240 loopback
    addresses: +0.45-0.81 of the front's core). All peers together are answered at most
    100 a second (bursts of 200), and the operator, not seen for 2 s between its scrapes,
    from a reserve of its own."""
    server, port = _metrics_server(start_server)
    seconds = 8.0
    read, write = os.pipe()
    started = time.monotonic()
    pids = [_scraper(61000 + i, port, f"127.0.1.{i + 1}", seconds, write) for i in range(24)]
    try:
        time.sleep(1.5)
        operator = 0
        for _ in range(3):  # (as Prometheus does, every 15 s: here every 2.1 s)
            operator += _scrape(port, timeout=3)
            time.sleep(2.1)
        total = sum(struct.unpack("I", os.read(read, 4))[0] for _ in pids)
        elapsed = time.monotonic() - started
    finally:
        _reap(pids)
        os.close(read)
        os.close(write)
    bound = TOTAL_BURST + TOTAL_RATE * elapsed + 2 * QUIET_RATE * (1 + elapsed)
    assert total <= bound, (total, bound)
    assert operator == 3, operator
    assert wait_until(lambda: server.stats()["rejected"].get("scrape_total", 0) >= 1, 5)
    print(f"\n24 users scraping for {elapsed:.1f} s: {total} answered (bound {bound:.0f})")

"""Issue 40, item 2: claims on a worker's result port. Any secret named its own connection, so
uid 65534 with no session "claimed" every worker's result connections and took the cap from
an honest job; and a reconnect churn took a worker to 2,048 of its 2,048 fds. A claim now
carries the tag the front's WELCOME gave an admitted session (``security.claim_tag``), and
connections that claimed nothing are kept apart, few and briefly (``server/worker/direct.py``).
The attackers are real processes of another user (uid 65534, stdlib ZMTP: ``zmtp.py``)."""

from __future__ import annotations

import encodings.idna  # noqa: F401  (uid 65534's child connects by name; it may not read the venv)
import hashlib
import os
import shutil
import socket
import threading
import time
from typing import Any

import pytest
from clients import make_client
from conftest import Server, wait_until
from test_bounds import fds, host_port, worker_endpoints
from test_frames import as_nobody
from zmtp import handshake, send_message

from dataserver.protocol import Hello
from dataserver.security import new_secret, reply_id, session_id

pytestmark = [
    pytest.mark.timeout(180),
    pytest.mark.skipif(shutil.which("prlimit") is None, reason="needs util-linux prlimit"),
]

NOFILE = 1024  # the server's fd limit (a worker keeps 768 result connections of it)
IMAGES = 48


def _need_root() -> None:
    if os.getuid() != 0:
        pytest.skip("needs root to act as uid 65534")


def _server(start_server: Any) -> Server:
    # TCP result connections for the honest job too (no ipc), one worker: the one attacked.
    return start_server(
        "--dataset", f"synthetic:images={IMAGES},seed=5", "--no-local-results",
        workers=1, nofile=NOFILE,
    )  # fmt: skip


def _epoch(server: Server, epoch: int = 0) -> dict[int, str]:
    """One whole epoch of an honest client: each index delivered, with its pixels' digest
    (delivered twice: fails)."""
    out: dict[int, str] = {}
    with make_client(server.address, batch_size=4, image_size=(32, 32), timeout=60) as client:
        client.set_epoch(epoch)
        for batch in client:
            images = batch.images.numpy()
            for idx, image in zip((i for ids in batch.indices for i in ids), images, strict=True):
                assert idx not in out, f"index {idx} delivered twice"
                out[idx] = hashlib.blake2b(image.tobytes()).hexdigest()
    return out


def _forged_claims(host: str, port: int, claims: list[list[bytes]], names: list[bytes]) -> None:
    """uid 65534: connect as each name and claim it with its own secret (no session at the
    front), holding every connection; again as each is shut down."""
    held: list[socket.socket] = []
    while True:
        for frames, name in zip(claims, names, strict=True):
            try:
                sock = handshake(host, port, timeout=2, identity=name)
                send_message(sock, frames)
                held.append(sock)
            except OSError:
                continue
        time.sleep(0.2)


def _refused(server: Server) -> int:
    rejected = server.stats()["rejected"]
    return sum(rejected.get(f"results_{r}_dropped", 0) for r in ("claim", "unclaimed"))


def test_a_forged_claim_takes_no_result_connection(start_server: Any) -> None:
    """uid 65534, with no session, claims 2,000 result connections of the only worker with
    secrets of its own while an honest job runs: every claim read is refused and its
    connection shut down (``results_claim_dropped``), the rest go unclaimed, none takes an
    honest connection's place over the cap, and the honest epoch completes, each sample
    once, bit-identical to one without the attack."""
    _need_root()
    server = _server(start_server)
    reference = _epoch(server)
    assert sorted(reference) == list(range(IMAGES))
    host, port = host_port(worker_endpoints(server)[0])
    secrets = [new_secret() for _ in range(2000)]
    names = [reply_id(s) for s in secrets]
    claims = [Hello(session=session_id(), auth=s).encode() for s in secrets]
    direct_before = server.stats()["counters"].get("results_direct", 0)
    with as_nobody(lambda: _forged_claims(host, port, claims, names)):
        # (most go unread: past the unclaimed budget the oldest of the peer holding the
        # most go, before their claims are read)
        assert wait_until(lambda: _refused(server) >= 2000, 30), server.stats()["rejected"]
        attacked = _epoch(server)
        stats = server.stats()
    assert attacked == reference
    # (Not asserted: that the honest results still come straight from the worker. Under this
    # flood the unclaimed budget, shared by every peer, may drop the honest connection before
    # its claim is read, and its results then come through the front: seen 0-14 of 48 direct
    # on a loaded 2-core machine. Charging unclaimed connections per peer is what is left.)
    print(
        "direct results under the flood:",
        stats["counters"].get("results_direct", 0) - direct_before,
    )
    assert stats["rejected"].get("results_claim_dropped", 0) >= 1
    assert stats["rejected"].get("results_over_limit_dropped", 0) == 0, stats["rejected"]


def _churn(host: str, port: int) -> None:
    """uid 65534: connect as fast as it can, holding up to 3,000 connections (closing the
    oldest past that), never claiming."""
    held: list[socket.socket] = []
    while True:
        try:
            sock = socket.create_connection((host, port), timeout=1)
        except OSError:
            time.sleep(0.001)
            continue
        held.append(sock)
        if len(held) > 3000:
            held.pop(0).close()


def _cpu_s(pid: int) -> float:
    with open(f"/proc/{pid}/stat") as f:
        fields = f.read().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def test_a_reconnect_churn_is_shut_down_and_an_honest_job_completes(start_server: Any) -> None:
    """uid 65534 connects to a worker's result port as fast as it can for 6 s, holding
    thousands, never claiming: its connections are shut down as unclaimed (oldest first,
    none lost to libzmq's monitor dropping events), an honest job run meanwhile completes,
    each sample once, bit-identical, and the worker's fds come back down. (Its peak is
    printed, not bounded: on a loaded host libzmq's I/O thread accepts faster than the
    worker's Python thread is scheduled to shut connections down; see issue 40.)"""
    _need_root()
    server = _server(start_server)
    reference = _epoch(server)
    host, port = host_port(worker_endpoints(server)[0])
    (worker,) = server.worker_pids()
    peak = 0
    stop = threading.Event()

    def watch() -> None:
        nonlocal peak
        while not stop.is_set():
            try:
                peak = max(peak, fds(worker))
            except OSError:
                pass
            time.sleep(0.02)

    watcher = threading.Thread(target=watch, daemon=True)
    watcher.start()
    cpu0, t0 = _cpu_s(worker), time.monotonic()
    with as_nobody(lambda: _churn(host, port)):
        time.sleep(3)
        attacked = _epoch(server, 0)
        time.sleep(max(0.0, 6 - (time.monotonic() - t0)))
        cpu = (_cpu_s(worker) - cpu0) / (time.monotonic() - t0)
    stop.set()
    watcher.join()
    dropped = server.stats()["rejected"].get("results_unclaimed_dropped", 0)
    print(f"worker peak fds {peak} of {NOFILE}; CPU {cpu:.2f} of a core; {dropped} dropped")
    assert dropped >= 500
    assert attacked == reference
    assert wait_until(lambda: fds(worker) < 200, 10), fds(worker)

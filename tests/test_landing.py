"""Landing: a worker on the client's host writes results straight into the client's
shared-memory batch buffers. The batches are the same as over the socket, the buffer has
no name on the file system (a sealed memfd, handed over a unix socket), a sealed region
can be written by nobody, a worker takes no buffer but a client's of its own user, and a
server that says "landed" without writing is caught."""

from __future__ import annotations

import fcntl
import json
import os
import select
import shutil
import socket
import tempfile
import threading
from pathlib import Path
from typing import Any

import msgpack
import msgspec
import pytest
import torch
import zmq
from clients import make_client

from dataserver.counting import Counts
from dataserver.landing import HEADER, LandingArea, hand_over, land_mac
from dataserver.protocol import Hello, Task, Welcome, decode
from dataserver.security import host_proof, proof_ends
from dataserver.server.counts import WorkerCount
from dataserver.server.worker.landings import Landings
from dataserver_client import DataServerClient, DataServerError

pytestmark = pytest.mark.timeout(120)

NOBODY = 65534
FLAT = ("--dataset", "ds_plugins:flat", "--dataset-args", json.dumps({"n": 64}))
KW: dict[str, Any] = {"batch_size": 8, "image_size": (48, 64), "seed": 4}


def batches(client: DataServerClient, epoch: int = 0) -> list[tuple[Any, torch.Tensor, Any]]:
    client.set_epoch(epoch)
    return [(b.indices, b.images.clone(), b.targets) for b in client]


def assert_same(a: list[Any], b: list[Any]) -> None:
    assert len(a) == len(b)
    for (i1, im1, t1), (i2, im2, t2) in zip(a, b, strict=True):
        assert i1 == i2 and torch.equal(im1, im2)
        for x, y in zip(t1, t2, strict=True):
            assert torch.equal(x["boxes"], y["boxes"]) and torch.equal(x["labels"], y["labels"])


def landing_names() -> list[str]:
    shm = Path("/dev/shm")
    return [p.name for p in shm.iterdir() if p.name.startswith("dataserver-land")]


def serve(landings: Landings, rounds: int = 4) -> None:
    """Let a worker's side handle what is waiting on its landing sockets."""
    for _ in range(rounds):
        ready, _, _ = select.select(landings.fds(), [], [], 0.05)
        for fd in ready:
            landings.on_readable(fd)


def memfd(size: int, seals: int = fcntl.F_SEAL_SHRINK | fcntl.F_SEAL_GROW) -> int:
    fd = os.memfd_create("test", os.MFD_CLOEXEC | os.MFD_ALLOW_SEALING)
    os.ftruncate(fd, size)
    if seals:
        fcntl.fcntl(fd, fcntl.F_ADD_SEALS, seals)
    return fd


def copy_of(area: LandingArea, seals: int) -> int:
    """A memfd with ``area``'s header (magic, token, layout) but the seals given."""
    fd = memfd(len(area.map), seals)
    os.pwrite(fd, bytes(area.map[:HEADER]), 0)
    return fd


def test_results_land_in_a_nameless_buffer_and_equal_those_over_the_socket(
    start_server: Any,
) -> None:
    server = start_server(*FLAT)
    with make_client(server.address, shared_memory=False, **KW) as c:
        sent = batches(c)
        assert c.stats().get("results_landed", 0) == 0
        assert c._engine.parts.landing is None
    with make_client(server.address, **KW) as c:
        area = c._engine.parts.landing
        assert area is not None
        assert os.readlink(f"/proc/self/fd/{area.fd}").startswith("/memfd:")
        c.set_epoch(0)
        landed = []
        for b in c:  # while the job runs: nothing on the file system names the buffer
            landed.append((b.indices, b.images.clone(), b.targets))
            names = [p.name for p in Path("/dev/shm").iterdir()]
            assert not [
                n
                for n in names
                if "land" in n or any(lk.session.hex() in n for lk in c._engine.links or ())
            ]
        stats = c.stats()
    assert stats["results_landed"] >= 1 and not stats["rejected"].get("landed_unsealed")
    assert_same(sent, landed)


def test_no_buffer_and_no_landing_for_a_server_not_proven_to_share_the_host(
    start_server: Any,
) -> None:
    """Without ipc endpoints (so without the host token beside them) a server is treated
    as remote: the buffer is handed to none of its workers, and no task names it."""
    server = start_server(*FLAT, "--no-local-results")
    with make_client(server.address, **KW) as c:
        got = batches(c)
        assert c._engine.links is not None
        for link in c._engine.links.links:
            assert link.handover is not None and not link.handover.socks
            assert not link.can_land
        stats = c.stats()
    assert len(got) == 8 and stats.get("results_landed", 0) == 0


def test_letterboxed_and_stitched_batches_land_exactly_in_fresh_and_reused_regions(
    start_server: Any,
) -> None:
    """Letterbox padding must be zero whether a region is fresh (never written: the worker
    does not clear it) or reused (the worker clears it): more batches than regions, both
    modes, compared with the socket path."""
    server = start_server("--dataset", "synthetic:images=96,seed=2", workers=2)
    kw: dict[str, Any] = {"batch_size": 4, "image_size": (64, 64), "seed": 1}

    def run(shared: bool) -> list[tuple[Any, torch.Tensor]]:
        out = []
        with make_client(server.address, shared_memory=shared, **kw) as c:
            for epoch, mode in ((0, "regular"), (1, "stitch")):
                c.set_mode(mode)
                c.set_epoch(epoch)
                out += [(b.indices, b.images.clone()) for b in c]
            if shared:
                assert c.stats().get("results_landed", 0) > 2 * (c.config.prefetch + 5)
        return out

    for (i1, im1), (i2, im2) in zip(run(False), run(True), strict=True):
        assert i1 == i2 and torch.equal(im1, im2)


def test_the_buffer_cannot_be_shrunk_or_grown() -> None:
    """Sealed: a mapping of it can never SIGBUS for a page cut off, by anyone."""
    area = LandingArea(2, 4096, 4)
    try:
        for size in (0, len(area.map) - 1, len(area.map) + 4096):
            with pytest.raises(PermissionError):
                os.ftruncate(area.fd, size)
        with pytest.raises(PermissionError):  # and the seals cannot be taken off
            fcntl.fcntl(area.fd, fcntl.F_ADD_SEALS, fcntl.F_SEAL_WRITE)
    finally:
        area.close()


def test_a_sealed_region_is_written_by_nobody() -> None:
    area = LandingArea(2, 3 * 4 * 4 * 2, 2)
    landings = Landings()
    assert landings.add(os.dup(area.fd), b"s", area.token) is None
    try:
        gen = area.generation(1)
        shape = (2, 3, 4, 4)
        with landings.target(b"s", area.token, 1, gen, area.offset(1), shape) as dest:
            assert dest is not None
            dest.pixels[...] = 7
            dest.seal(5)
        assert (area.buffer(1) == 7).all() and area.sealed(1, (0, 1), gen, 5)
        assert area.seal(1) and area.generation(1) == gen + 1
        with landings.target(b"s", area.token, 1, gen, area.offset(1), shape) as dest:
            assert dest is None  # a late writer of the old generation: nothing to write into
        # While a writer holds the region, the client cannot seal it (it tries again later).
        with landings.target(b"s", area.token, 1, gen + 1, area.offset(1), shape) as dest:
            assert dest is not None
            pid = os.fork()
            if pid == 0:  # another process (POSIX locks are per process)
                os._exit(0 if not area.seal(1) else 1)
            _, status = os.waitpid(pid, 0)
            assert os.waitstatus_to_exitcode(status) == 0
    finally:
        landings.close()
        area.close()


def test_a_late_writer_of_an_old_generation_does_not_hold_the_region() -> None:
    """A task whose region was sealed since it was sent is composed for the socket
    (``dest`` None) while the client has given the region to another batch: the client
    seals that batch meanwhile. (The lock was held through the compose: a server holding
    each answer 3 s kept a later batch in the region from being delivered for 6 s.)"""
    area = LandingArea(2, 3 * 4 * 4 * 2, 2)
    landings = Landings()
    assert landings.add(os.dup(area.fd), b"s", area.token) is None
    try:
        gen = area.generation(1)
        assert area.seal(1)  # (the region's batch was delivered: a new batch uses it)
        with landings.target(b"s", area.token, 1, gen, area.offset(1), (2, 3, 4, 4)) as dest:
            assert dest is None  # (composed for the socket: this takes the time)
            pid = os.fork()
            if pid == 0:  # the client, another process (POSIX locks are per process)
                os._exit(0 if area.seal(1) else 1)
            _, status = os.waitpid(pid, 0)
            assert os.waitstatus_to_exitcode(status) == 0, "the client could not seal"
    finally:
        landings.close()
        area.close()


def test_a_worker_writes_only_inside_the_region_of_a_registered_buffer_of_that_session() -> None:
    area = LandingArea(2, 3 * 4 * 4 * 2, 2)
    landings = Landings()
    assert landings.add(os.dup(area.fd), b"s", area.token) is None
    try:
        shape = (1, 3, 4, 4)
        gen, at = area.generation(0), area.offset(0)
        for session, token, region, offset in (
            (b"s", "0" * 32, 0, at),  # a token nobody registered
            (b"other", area.token, 0, at),  # another session naming this one's token
            (b"s", area.token, 2, at),  # no such region
            (b"s", area.token, 0, at - 1),  # before the region
            (b"s", area.token, 0, at + 1),  # not on an image's boundary
            (b"s", area.token, 0, area.offset(1)),  # past its slots (the next region's bytes)
            (b"s", area.token, 0, 10**9),  # beyond the buffer
        ):
            with landings.target(session, token, region, gen, offset, shape) as dest:
                assert dest is None, (session, token, region, offset)
        with landings.target(b"s", area.token, 0, gen, at + 48, shape) as dest:
            assert dest is not None  # the second image's slot
        assert landings.add(os.dup(area.fd), b"other", area.token) is not None  # first wins
    finally:
        landings.close()
        area.close()


def test_a_worker_refuses_a_buffer_not_sealed_against_shrinking_and_other_bad_fds(
    tmp_path: Path,
) -> None:
    area = LandingArea(1, 4096, 1)
    counters = Counts(WorkerCount)
    landings = Landings(counters)
    regular = tmp_path / "plain"
    regular.write_bytes(bytes(area.map[:HEADER]) + bytes(len(area.map) - HEADER))
    pipe = os.pipe()
    try:
        bad = {
            "unsealed": copy_of(area, 0),
            "grow only": copy_of(area, fcntl.F_SEAL_GROW),
            "too small": memfd(64),
            "a plain file": os.open(regular, os.O_RDWR),
            "a pipe": pipe[0],
        }
        for what, fd in bad.items():
            why = landings.add(fd, b"s", area.token)
            assert why is not None, what
        assert "shrink" in (landings.add(copy_of(area, 0), b"s", area.token) or "")
        other = LandingArea(1, 4096, 1)  # sealed, but its header holds another token
        assert landings.add(os.dup(other.fd), b"s", area.token) is not None
        other.close()
        assert counters.get(WorkerCount.LANDING_REFUSED_FD) == len(bad) + 2 and not landings.fds()
        with landings.target(b"s", area.token, 0, 1, area.offset(0), (1, 1, 1, 64)) as dest:
            assert dest is None
        # Through the socket, as a client hands it over: refused, counted, nothing kept.
        landings.listen(str(tmp_path / "land-x"))
        conn = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET)
        conn.connect(str(tmp_path / "land-x"))
        hello = msgpack.packb({"session": b"s", "token": area.token})
        unsealed = copy_of(area, 0)
        socket.send_fds(conn, [hello], [unsealed])
        os.close(unsealed)
        serve(landings)
        assert counters.get(WorkerCount.LANDING_REFUSED_FD) == len(bad) + 3
        assert counters.get(WorkerCount.LANDING_REGISTERED) == 0
        assert conn.recv(1) == b""  # the worker hung up on it
        conn.close()
        # The same client with its real (sealed) buffer is taken.
        kept = hand_over(area, b"s", str(tmp_path / "land-x"))
        assert isinstance(kept, socket.socket)
        serve(landings)
        assert counters.get(WorkerCount.LANDING_REGISTERED) == 1
        kept.close()  # the client goes: the worker lets go of its buffer
        serve(landings)
        with landings.target(b"s", area.token, 0, 1, area.offset(0), (1, 1, 1, 64)) as dest:
            assert dest is None
    finally:
        os.close(pipe[1])
        landings.close()
        area.close()


def open_dir() -> Path:
    """A directory uid 65534 may enter and write (pytest's own are its owner's only)."""
    d = Path(tempfile.mkdtemp(prefix="ds-test-land-"))
    d.chmod(0o777)
    return d


def _as_nobody_hand_over(path: str) -> int:
    """In a child process of uid 65534: hand a well-formed buffer to ``path``. Exit 0 when
    connecting was refused outright (EACCES), 1 when the message went, 2 on anything else."""
    pid = os.fork()
    if pid == 0:
        code = 2
        try:
            os.setgroups([])
            os.setgid(NOBODY)
            os.setuid(NOBODY)
            area = LandingArea(1, 4096, 1)
            sock = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET)
            try:
                sock.connect(path)
            except PermissionError:
                code = 0
            else:
                hello = msgpack.packb({"session": b"s", "token": area.token})
                socket.send_fds(sock, [hello], [area.fd])
                code = 1
        finally:
            os._exit(code)
    _, status = os.waitpid(pid, 0)
    return os.waitstatus_to_exitcode(status)


def test_a_peer_of_another_user_is_refused(start_server: Any) -> None:
    if os.getuid() != 0:
        pytest.skip("needs root to act as uid 65534")
    # A real worker's landing socket is in the server's 0700 directory: not even reachable.
    server = start_server(*FLAT)
    with make_client(server.address, **KW) as c:
        c.set_epoch(0)
        next(iter(c))
        assert c._engine.links is not None
        links = c._engine.links.links
        paths = [p for link in links if link.handover is not None for p in link.handover.socks]
        assert paths
        assert _as_nobody_hand_over(paths[0]) == 0
    # Where the directory would let it in, SO_PEERCRED refuses it (and counts it).
    d = open_dir()
    counters = Counts(WorkerCount)
    landings = Landings(counters)
    landings.listen(str(d / "land-x"))
    os.chmod(d / "land-x", 0o777)
    try:
        assert _as_nobody_hand_over(str(d / "land-x")) == 1
        serve(landings)
        assert counters.get(WorkerCount.LANDING_REFUSED_PEER) == 1
        assert counters.get(WorkerCount.LANDING_REGISTERED) == 0 and len(landings.fds()) == 1
    finally:
        landings.close()
        shutil.rmtree(d)


def test_a_client_hands_its_buffer_to_no_socket_of_another_user() -> None:
    """A server that names a landing socket someone else listens on (a remote server
    naming a path a local user planted) gets nothing: the client checks the listener."""
    if os.getuid() != 0:
        pytest.skip("needs root to act as uid 65534")
    d = open_dir()
    path = str(d / "land-x")
    r, w = os.pipe()
    pid = os.fork()
    if pid == 0:
        try:
            os.setgroups([])
            os.setgid(NOBODY)
            os.setuid(NOBODY)
            listener = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET)
            listener.bind(path)
            listener.listen(1)
            os.write(w, b"1")
            conn, _ = listener.accept()
            _, fds, _, _ = socket.recv_fds(conn, 512, 4)
            os._exit(10 + len(fds))
        finally:
            os._exit(2)
    area = LandingArea(1, 4096, 1)
    try:
        assert os.read(r, 1) == b"1"
        got = hand_over(area, b"s", path)
        assert isinstance(got, str) and "uid 65534" in got
    finally:
        area.close()
        os.kill(pid, 9)
        os.waitpid(pid, 0)
        os.close(r)
        os.close(w)
        shutil.rmtree(d)


def test_a_fifo_planted_in_dev_shm_does_not_hang_a_new_client(start_server: Any) -> None:
    if os.getuid() != 0:
        pytest.skip("needs root to plant as uid 65534")
    fifo = Path("/dev/shm/dataserver-land-x")
    fifo.unlink(missing_ok=True)
    os.mkfifo(fifo, 0o666)
    os.chown(fifo, NOBODY, NOBODY)
    server = start_server(*FLAT)
    try:
        done: list[Any] = []

        def construct() -> None:
            with make_client(server.address, **KW) as c:
                c.set_epoch(0)
                done.append(next(iter(c)).images.shape)

        t = threading.Thread(target=construct, daemon=True)
        t.start()
        t.join(20)  # (the old sweep blocked in open() for as long as nobody wrote)
        assert not t.is_alive() and done == [torch.Size([8, 3, 48, 64])]
    finally:
        fifo.unlink(missing_ok=True)


def test_a_server_that_says_landed_without_writing_is_dropped_and_the_epoch_is_exact(
    start_server: Any,
) -> None:
    honest = start_server(*FLAT)
    liar = start_server(*FLAT, env={"DATASERVER_INJECT_FAULTS": "worker.lie_landed:1"})
    with make_client(honest.address, shared_memory=False, **KW) as c:
        reference = batches(c) + batches(c, 1)
    with make_client([liar.address, honest.address], **KW) as c:
        got = batches(c) + batches(c, 1)
        stats = c.stats()
    assert_same(reference, got)
    assert stats["rejected"].get("landed_unsealed", 0) >= 1
    states = {s["address"]: s["state"] for s in stats["servers"]}
    assert states[liar.address] == "banned" and states[honest.address] == "ready"


def test_with_only_a_lying_server_the_client_fails_instead_of_delivering_stale_images(
    start_server: Any,
) -> None:
    liar = start_server(*FLAT, env={"DATASERVER_INJECT_FAULTS": "worker.lie_landed:1"})
    with make_client(liar.address, timeout=4.0, **KW) as c:
        c.set_epoch(0)
        with pytest.raises(DataServerError, match="landed"):
            for _ in c:
                pass
        assert c.stats()["rejected"].get("landed_unsealed", 0) >= 1


def test_no_landing_buffer_is_named_in_dev_shm_ever() -> None:
    """Nothing to list, plant or sweep: making and closing buffers leaves no name."""
    before = set(landing_names())
    areas = [LandingArea(2, 4096, 2) for _ in range(3)]
    assert set(landing_names()) == before
    for area in areas:
        assert os.readlink(f"/proc/self/fd/{area.fd}") == "/memfd:dataserver-landing (deleted)"
        area.close()


def test_a_buffer_larger_than_a_worker_lands_into_is_refused_and_the_total_is_bounded() -> None:
    """Issue 25 item 6: a same-user job handed over a 48 GiB sparse memfd and the workers
    wrote 1,536 MiB of host memory into it. A buffer whose regions are more than a worker
    lands into for one client (2 GiB) is refused at registration, naming why; and the
    buffers a worker keeps are bounded in bytes (past it, among sessions holding as much, the
    newcomer is refused: first come, first kept)."""
    counters = Counts(WorkerCount)
    landings = Landings(counters)
    big = LandingArea(8, 6 << 30, 16)  # 48 GiB of regions, none of it written
    try:
        why = landings.add(os.dup(big.fd), b"s", big.token)
        assert why is not None and "more than a worker lands into" in why
        assert counters.get(WorkerCount.LANDING_REFUSED_FD) == 1 and not landings.fds()
        # An honest buffer (9 regions of 16 x 512 x 512) is taken.
        honest = LandingArea(9, 16 * 3 * 512 * 512, 16)
        assert landings.add(os.dup(honest.fd), b"h", honest.token) is None
        honest.close()
    finally:
        landings.close()
        big.close()
    small = Landings(counters, reg_bytes=1 << 20, total_bytes=2 << 20)
    areas = [LandingArea(1, 1 << 20, 1) for _ in range(3)]
    try:
        whys = [small.add(os.dup(area.fd), b"s%d" % n, area.token) for n, area in enumerate(areas)]
        assert whys[:2] == [None, None] and whys[2] is not None and "full" in whys[2]
        shape = (1, 3, 8, 8)
        kept = []
        for n, area in enumerate(areas):
            gen, at = area.generation(0), area.offset(0)
            with small.target(b"s%d" % n, area.token, 0, gen, at, shape) as dest:
                kept.append(dest is not None)
        assert kept == [True, True, False]  # 3 MiB asked, 2 MiB kept: the newcomer refused
        assert counters.get(WorkerCount.LANDING_REFUSED_BUDGET) == 1
    finally:
        small.close()
        for area in areas:
            area.close()


def test_a_job_filling_the_landing_budget_never_pushes_out_one_holding_less() -> None:
    """Issue 40 item 7: another job of the same user (same uid: nothing tells them apart
    but their sessions) filled a worker's 8 GiB of landing buffers, and the honest job's
    buffer, the oldest, went first: its landings fell to 13-25%. Past the budget a buffer of
    the session holding the most goes, so the big job's own buffers go and the small job's
    stays, however many buffers or sessions the big one brings; the small job still lands."""
    counters = Counts(WorkerCount)
    mib = 1 << 20
    landings = Landings(counters, reg_bytes=4 * mib, total_bytes=8 * mib)
    honest = LandingArea(1, mib, 1)
    big = [LandingArea(1, 4 * mib, 1) for _ in range(4)]  # one session, four buffers
    many = [LandingArea(1, 2 * mib, 1) for _ in range(4)]  # four sessions, 2 MiB each
    shape = (1, 3, 8, 8)

    def lands(session: bytes, area: LandingArea) -> bool:
        gen, at = area.generation(0), area.offset(0)
        with landings.target(session, area.token, 0, gen, at, shape) as dest:
            return dest is not None

    try:
        assert landings.add(os.dup(honest.fd), b"honest", honest.token) is None
        for area in big:
            landings.add(os.dup(area.fd), b"big", area.token)
        for n, area in enumerate(many):
            landings.add(os.dup(area.fd), b"many%d" % n, area.token)
        assert lands(b"honest", honest)
        # What stays: the honest 1 MiB, and 7 MiB of the others, never one past its share.
        kept = [lands(b"big", a) for a in big] + [
            lands(b"many%d" % n, a) for n, a in enumerate(many)
        ]
        held = sum(4 * k for k in kept[:4]) + sum(2 * k for k in kept[4:])
        assert 1 + held <= 8, kept
        assert counters.get(WorkerCount.LANDING_REFUSED_BUDGET) >= 1
    finally:
        landings.close()
        for area in [honest, *big, *many]:
            area.close()


def test_a_task_lands_only_with_its_clients_mac(tmp_path: Path) -> None:
    """Issue 25 item 11: a fake server that replayed a local server's WELCOME relayed tasks
    naming the trainer's buffer to the real server, whose worker wrote other images over
    slots other servers had delivered (82 images in 16 of 24 batches, never caught). The
    key a client hands over with its buffer (on the unix socket only) makes every landing
    task carry a MAC of what it composes and where: a task forged or altered by whoever
    relays it is not landed (its pixels go over the socket, where the client checks them)."""
    area = LandingArea(2, 4 * 3 * 8 * 8, 4)
    counters = Counts(WorkerCount)
    landings = Landings(counters)
    session = b"s" * 16
    try:
        landings.listen(str(tmp_path / "land-x"))
        conn = hand_over(area, session, str(tmp_path / "land-x"))
        assert isinstance(conn, socket.socket)
        serve(landings)
        assert counters.get(WorkerCount.LANDING_REGISTERED) == 1
        shape = (2, 3, 8, 8)
        base = Task(
            session=session,
            task_id=7,
            plan_version=1,
            epoch=0,
            seed=0,
            images=((0,), (1,)),
            grid=1,
            out_hw=(8, 8),
            fit_hw=(8, 8),
            on_error="raise",
            control_seq=0,
            land_token=area.token,
            land_region=0,
            land_gen=area.generation(0),
            land_offset=area.offset(0),
        )
        honest = msgspec.structs.replace(base, land_mac=land_mac(area.key, base))
        # It survives the wire as the worker reads it.
        read = decode(honest.encode())
        assert isinstance(read, Task) and read.land_mac == honest.land_mac
        honest = read

        def lands(task: Task) -> bool:
            with landings.target(
                task.session, task.land_token, task.land_region, task.land_gen,
                task.land_offset, shape, task,
            ) as dest:  # fmt: skip
                return dest is not None

        assert lands(honest)
        image = 3 * 8 * 8
        forged = [
            base,  # no MAC
            msgspec.structs.replace(base, land_mac=land_mac(b"k" * 32, base)),  # another key
            msgspec.structs.replace(honest, images=((5,), (6,))),  # other images
            msgspec.structs.replace(honest, land_offset=area.offset(0) + 2 * image),  # slots
            msgspec.structs.replace(honest, task_id=8),  # another task's seal
        ]
        assert not any(lands(t) for t in forged)
        assert counters.get(WorkerCount.LANDING_REFUSED_MAC) == len(forged)
        conn.close()
    finally:
        landings.close()
        area.close()


def test_the_host_token_never_goes_on_the_wire(start_server: Any) -> None:
    """Issue 25 item 11: any HELLO read the server's host token in its WELCOME (uid 65534
    in one message), and a fake server replayed it to pass for local. WELCOME now carries
    only a proof for the HELLO's nonce (``host_proof``): no token, a new proof for each
    nonce, and only one who reads the token file (on the host, the server's user) can
    check it."""
    server = start_server("--dataset", "synthetic:images=8,seed=1", workers=1)
    answers = []
    for nonce in (b"a" * 16, b"b" * 16, b""):
        ctx = zmq.Context()
        sock = ctx.socket(zmq.DEALER)
        sock.setsockopt(zmq.LINGER, 0)
        sock.connect(server.address)
        sid = b"proof-probe-0000"
        sock.send_multipart(Hello(session=sid, auth=sid, nonce=nonce).encode())
        assert sock.poll(10_000)
        frames = sock.recv_multipart(copy=False)
        ends = proof_ends(int(frames[0].get(zmq.SRCFD)), server=False)
        welcome = decode([f.bytes for f in frames])
        sock.close(linger=0)
        ctx.term()
        assert isinstance(welcome, Welcome) and welcome.local_token == "" and ends
        answers.append((nonce, ends, welcome))
    local = answers[0][2].local
    assert local and local[0].startswith("ipc://")
    token = (Path(local[0][len("ipc://") :]).parent / "host-token").read_text().strip()
    assert token and all(token.encode() not in w.encode()[2] for _, _, w in answers)
    (n1, e1, w1), (n2, e2, w2), (_, _, w3) = answers
    sid = b"proof-probe-0000"
    assert w1.local_proof == host_proof(token, n1, sid, e1)  # (for that connection)
    assert w2.local_proof == host_proof(token, n2, sid, e2) != w1.local_proof
    assert w1.local_proof != host_proof(token, n1, sid, e2)  # (not for another one)
    assert w3.local_proof == b""  # no nonce, no proof: not taken for local
    # A client on the host still proves it and lands.
    with make_client(server.address, batch_size=4, image_size=(32, 32)) as c:
        c.set_epoch(0)
        assert sum(len(b) for b in c) == 8
        assert c.stats().get("results_landed", 0) >= 1

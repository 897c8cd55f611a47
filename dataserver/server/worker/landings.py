"""A worker's side of landing (``dataserver/landing.py`` has the rules and the byte
layout): the buffers clients on this host handed it, each checked once when it comes and
kept by its token while the client's connection lives, and the destination of a task that
names one, locked and sealed."""

from __future__ import annotations

import fcntl
import hmac
import logging
import mmap
import os
import socket
import stat
import struct
import time
from collections import OrderedDict
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass

import msgpack
import numpy as np

from dataserver.counting import Counts
from dataserver.landing import (
    GEN_AT,
    HEAD,
    HEADER,
    MAGIC,
    MAX_HELLO,
    MAX_REGIONS,
    MAX_SLOTS,
    SEAL_AT,
    SEAL_BYTES,
    land_mac,
    peer_uid,
)
from dataserver.protocol import Task
from dataserver.server.counts import (
    LANDING_REFUSED,
    LandingRefusal,
    WorkerCount,
    landing_refused,
)

log = logging.getLogger("dataserver.worker")

KEEP = 64  # registrations a worker keeps
# The bytes a worker lands into for clients: one buffer's regions at most REG_BYTES (an honest
# client's buffer is its prefetch + lookahead regions of its largest batch: 9 x 12.6 MB at
# 16 x 512 x 512; 9 x 201 MB at 64 x 1024 x 1024 fit too), all buffers it keeps at most
# TOTAL_BYTES. Writes into a client's memfd fault its pages into host memory charged to the
# server; a same-user job handed over a 48 GiB sparse memfd and the workers wrote 1,536 MiB
# into it. Past TOTAL_BYTES (or KEEP buffers) a buffer of the session holding the most goes,
# the newest of that session first; among sessions holding as much, the newest buffer: a job
# that fills the budget never pushes out one that holds less (another job of the same user
# filling 8 GiB had cut an honest job's landings to 13-25%), and a newcomer equal to those
# kept is the one refused (``landing_refused_budget``).
REG_BYTES = 2 << 30
TOTAL_BYTES = 8 << 30
MAX_PENDING = 16  # accepted connections that have not sent their message yet


@dataclass(eq=False)
class _Reg:
    session: bytes
    fd: int
    map: mmap.mmap
    regions: int
    region_bytes: int
    slots: int
    data_at: int
    conn: socket.socket | None
    key: bytes = b""  # its tasks' MAC key (``land_mac``); b"": registered in-process (tests)

    def close(self) -> None:
        try:
            self.map.close()
        except BufferError:
            pass  # a view of it is still alive: the mapping goes with it
        os.close(self.fd)
        if self.conn is not None:
            self.conn.close()


class Target:
    """Where a task lands, locked: ``pixels`` its (N, 3, H, W) bytes of the region;
    ``seal`` (while still inside ``Landings.target``) writes its images' seal records."""

    def __init__(self, pixels: np.ndarray, seals: np.ndarray, generation: int) -> None:
        self.pixels = pixels
        self._seals = seals
        self._generation = generation

    def seal(self, task_id: int) -> None:
        self._seals[:, 0] = self._generation
        self._seals[:, 1] = task_id


class Landings:
    """The worker's side: the landing buffers clients handed it, checked, by token; and,
    with ``listen``, the socket they are handed over on."""

    def __init__(
        self,
        counters: Counts[WorkerCount] | None = None,
        keep: int = KEEP,
        reg_bytes: int = REG_BYTES,
        total_bytes: int = TOTAL_BYTES,
    ) -> None:
        self.keep = keep
        self.reg_bytes = reg_bytes
        self.total_bytes = total_bytes
        self._counters = counters if counters is not None else Counts(WorkerCount)
        self._regs: OrderedDict[str, _Reg] = OrderedDict()
        self._by_conn: dict[int, str] = {}  # connection fd -> token
        self._pending: OrderedDict[int, socket.socket] = OrderedDict()  # fd -> accepted
        self.listener: socket.socket | None = None
        self.path = ""

    # ------------------------------------------------------------ the socket

    def listen(self, path: str) -> None:
        """Listen at ``path`` (in the server's private directory) for hand-overs."""
        try:
            if stat.S_ISSOCK(os.lstat(path).st_mode):
                os.unlink(path)  # left by this slot's worker before (it died): ours to replace
        except FileNotFoundError:
            pass
        sock = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET | socket.SOCK_CLOEXEC)
        try:
            sock.bind(path)
            sock.listen(64)
            sock.setblocking(False)
        except OSError:
            sock.close()
            raise
        self.listener, self.path = sock, path

    def fds(self) -> list[int]:
        """What to poll for reading: the listener, connections yet to speak, and those
        whose registration lives (a drop there lets it go)."""
        if self.listener is None:
            return []
        return [self.listener.fileno(), *self._pending, *self._by_conn]

    def on_readable(self, fd: int) -> None:
        """Handle ``fd`` (one of ``fds()``) being readable; never blocks, never raises
        for what a peer sends."""
        if self.listener is not None and fd == self.listener.fileno():
            self._accept()
        elif fd in self._pending:
            self._receive(self._pending.pop(fd))
        elif fd in self._by_conn:
            # A client sends one message and then only hangs up: anything here ends it.
            reg = self._regs.pop(self._by_conn.pop(fd), None)
            if reg is not None:
                reg.close()

    def _accept(self) -> None:
        assert self.listener is not None
        for _ in range(16):
            try:
                conn, _ = self.listener.accept()
            except (BlockingIOError, InterruptedError):
                return
            except OSError as exc:  # out of fds, say: the client falls back to the socket
                log.warning("landing socket: accept failed: %s", exc)
                return
            try:
                conn.setblocking(False)
                uid = peer_uid(conn)
            except OSError:
                conn.close()
                continue
            if uid != os.getuid():
                conn.close()
                self._refuse("peer", f"a peer of uid {uid} (this worker is uid {os.getuid()})")
                continue
            self._receive(conn)  # a client sends at once: most often it is here already
            if len(self._pending) > MAX_PENDING:
                _, old = self._pending.popitem(last=False)
                old.close()
                self._refuse("silent", "a connection that sent nothing")

    def _receive(self, conn: socket.socket) -> None:
        try:
            data, fds, flags, _ = socket.recv_fds(conn, MAX_HELLO, 4)
        except BlockingIOError:
            self._pending[conn.fileno()] = conn  # woken without data: wait on
            return
        except OSError as exc:
            conn.close()
            self._refuse("fd", f"receive failed: {exc}")
            return
        if not data or len(fds) != 1 or flags & (socket.MSG_CTRUNC | socket.MSG_TRUNC):
            for fd in fds:
                os.close(fd)
            conn.close()
            self._refuse("fd", "not one message with one descriptor")
            return
        try:
            hello = msgpack.unpackb(data, raw=False)
            session, token, key = hello["session"], hello["token"], hello["key"]
            if not isinstance(session, bytes) or not isinstance(token, str):
                raise TypeError("session must be bytes, token text")
            if not isinstance(key, bytes) or len(key) != 32:
                raise TypeError("key must be 32 bytes")
        except Exception as exc:  # whatever the bytes were: refused, counted
            os.close(fds[0])
            conn.close()
            self._refuse("fd", f"a bad hand-over message ({type(exc).__name__})")
            return
        if self.add(fds[0], session, token, conn, key) is not None:
            conn.close()

    def _refuse(self, kind: LandingRefusal, why: str) -> None:
        self._counters.count(landing_refused(kind))
        n = sum(self._counters.get(name) for name in LANDING_REFUSED)
        log.log(logging.WARNING if n <= 5 else logging.DEBUG, "landing refused: %s", why)

    # ------------------------------------------------------------ registrations

    def add(
        self,
        fd: int,
        session: bytes,
        token: str,
        conn: socket.socket | None = None,
        key: bytes = b"",
    ) -> str | None:
        """Register the buffer ``fd`` (owned from now on: closed if refused) for ``token``
        of ``session``; None when it is, else why not (counted)."""
        why = self._check(fd, token, self.reg_bytes)
        if isinstance(why, str) or token in self._regs:
            os.close(fd)
            why = why if isinstance(why, str) else "a second registration of a token"
            self._refuse("fd", why)
            return why
        m, regions, region_bytes, slots, data_at = why
        self._regs[token] = _Reg(session, fd, m, regions, region_bytes, slots, data_at, conn, key)
        if conn is not None:
            self._by_conn[conn.fileno()] = token
        self._counters.count(WorkerCount.LANDING_REGISTERED)
        while len(self._regs) > self.keep or self._held() > self.total_bytes:
            victim = self._over_budget()
            old = self._regs.pop(victim)
            if old.conn is not None:
                self._by_conn.pop(old.conn.fileno(), None)
            old.close()
            if victim == token:
                why = "this worker's landing buffers are full, held by sessions holding as much"
                self._refuse("budget", why)
                return why
        return None

    def _over_budget(self) -> str:
        """The token of the buffer to let go: the newest of the session holding the most
        bytes (among sessions holding as much, the newest buffer)."""
        held: dict[bytes, int] = {}
        newest: dict[bytes, int] = {}
        tokens = list(self._regs)
        for n, reg in enumerate(self._regs.values()):
            held[reg.session] = held.get(reg.session, 0) + reg.regions * reg.region_bytes
            newest[reg.session] = n
        top = max(held.values())
        session = max((s for s in held if held[s] == top), key=lambda s: newest[s])
        return tokens[newest[session]]

    def _held(self) -> int:
        """The bytes of every region of the buffers kept."""
        return sum(r.regions * r.region_bytes for r in self._regs.values())

    @staticmethod
    def _check(
        fd: int, token: str, most: int = REG_BYTES
    ) -> str | tuple[mmap.mmap, int, int, int, int]:
        try:
            st = os.fstat(fd)
            if not stat.S_ISREG(st.st_mode):
                return "not a regular file"
            try:
                seals = fcntl.fcntl(fd, fcntl.F_GET_SEALS)
            except OSError:
                return "not a memfd (no seals)"
            if not seals & fcntl.F_SEAL_SHRINK:
                return "not sealed against shrinking"
            if st.st_size < HEADER:
                return f"{st.st_size} bytes: smaller than the header"
            m = mmap.mmap(fd, st.st_size)
        except OSError as exc:
            return f"cannot map it: {exc}"
        magic, stored, regions, region_bytes, slots, data_at = HEAD.unpack_from(m, 0)
        fits = (
            0 < regions <= MAX_REGIONS
            and 0 < slots <= MAX_SLOTS
            and region_bytes > 0
            and data_at % mmap.PAGESIZE == 0
            and data_at >= SEAL_AT + regions * slots * SEAL_BYTES
            and data_at + regions * region_bytes <= len(m)
        )
        if magic != MAGIC or stored != token.encode(errors="replace") or not fits:
            m.close()
            return "not that client's landing buffer (magic, token or layout)"
        if regions * region_bytes > most:
            m.close()
            return (
                f"its {regions} regions of {region_bytes} bytes are more than a worker lands "
                f"into for one client ({most} bytes)"
            )
        return m, regions, region_bytes, slots, data_at

    @contextmanager
    def target(
        self,
        session: bytes,
        token: str,
        region: int,
        generation: int,
        offset: int,
        shape: tuple[int, ...],
        task: Task | None = None,
    ) -> Iterator[Target | None]:
        """The (N, 3, H, W) destination of a task, locked, if it may land there now (else
        None: send the pixels over the socket). A buffer handed over with a key lands only
        a ``task`` whose ``land_mac`` is right: made by the client that handed it over, for
        these slots and this content (not forged or altered by a server that relays)."""
        reg = self._regs.get(token) if token else None
        if reg is None or reg.session != session:
            yield None
            return
        if reg.key and (
            task is None or not hmac.compare_digest(land_mac(reg.key, task), task.land_mac)
        ):
            self._refuse("mac", "a task naming this buffer without its client's MAC")
            yield None
            return
        self._regs.move_to_end(token)
        n = shape[0]
        image = int(np.prod(shape[1:]))
        nbytes = n * image
        start = reg.data_at + region * reg.region_bytes
        inside = (
            0 <= region < reg.regions
            and n > 0
            and image > 0
            and start <= offset
            and offset + nbytes <= start + reg.region_bytes
            and (offset - start) % image == 0
        )
        slot = (offset - start) // image if inside else 0
        if not inside or slot + n > reg.slots:
            yield None  # not inside the region it names
            return
        # These bytes only (others write theirs). Never blocking: a client holds the lock on
        # a region only while it seals it (microseconds); one that holds it longer (frozen,
        # or hostile) costs this task the landing, not this shared worker its thread.
        if not _lock(reg.fd, nbytes, offset):
            yield None
            return
        current = struct.unpack_from("<Q", reg.map, GEN_AT + 8 * region)[0]
        if current != generation:
            # Sealed (complete, or dropped): nothing may be written there, and the lock goes
            # now, not after this task is composed for the socket. Held through a slow
            # compose, it kept the client from sealing the region it had since given to
            # another batch: a server holding each answer 3 s stalled a batch 6 s.
            fcntl.lockf(reg.fd, fcntl.LOCK_UN, nbytes, offset)
            yield None
            return
        try:
            seal_at = SEAL_AT + SEAL_BYTES * (region * reg.slots + slot)
            seals = np.frombuffer(reg.map, np.uint64, 2 * n, seal_at).reshape(n, 2)
            pixels = np.frombuffer(reg.map, np.uint8, nbytes, offset).reshape(shape)
            yield Target(pixels, seals, generation)
        finally:
            fcntl.lockf(reg.fd, fcntl.LOCK_UN, nbytes, offset)

    def close(self) -> None:
        for reg in self._regs.values():
            reg.close()
        self._regs.clear()
        self._by_conn.clear()
        for conn in self._pending.values():
            conn.close()
        self._pending.clear()
        if self.listener is not None:
            self.listener.close()
            self.listener = None
            try:
                os.unlink(self.path)
            except OSError:
                pass


LOCK_WAIT_S = 0.2


def _lock(fd: int, nbytes: int, offset: int) -> bool:
    """Take the write lock on ``nbytes`` at ``offset``, waiting at most ``LOCK_WAIT_S``."""
    deadline = time.monotonic() + LOCK_WAIT_S
    pause = 0.0002
    while True:
        try:
            fcntl.lockf(fd, fcntl.LOCK_EX | fcntl.LOCK_NB, nbytes, offset)
            return True
        except OSError:
            if time.monotonic() > deadline:
                return False
            time.sleep(pause)
            pause = min(pause * 2, 0.01)

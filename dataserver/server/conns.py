"""The front's file descriptors and the connections peers hold on its public sockets.

libzmq accepts every TCP connection to the data and control sockets and keeps it as long as
the peer does; a peer that finishes the ZMTP handshake and then says nothing costs one fd
and ~23 KiB for ever, and at the fd limit the next honest client (or the replacement of a
dead worker) gets ``EMFILE``. This module keeps that bounded:

- ``raise_fd_limit``: the soft ``RLIMIT_NOFILE`` goes up to the hard one at start.
- ``ConnTracker`` learns every accepted connection's fd from the sockets' monitors
  (``EVENT_ACCEPTED`` carries it) and forgets it at ``EVENT_DISCONNECTED``. It reads the
  kernel's ``TCP_INFO`` of each in housekeeping: a connection that received no more than a
  heartbeat's bytes for ``--idle-timeout`` seconds is shut down (``shutdown(SHUT_RDWR)``:
  libzmq sees its peer go and closes the fd itself). Beyond a cap on connections
  (``fd_budget``: the fd limit less a reserve for the workers, at most a few per session)
  the idlest connection, or the new one when none is idle, is shut down at once.

A control connection (a client's PUB: silent until it steers) counts as active on any
bytes, its libzmq's PONGs included; a data connection needs more than a PONG's.

Why bytes and not ``tcpi_last_data_recv``: the front sends ZMTP PINGs (``HEARTBEAT_IVL``)
to drop dead peers, and a live libzmq peer answers each with a PONG of a few bytes by
itself, so its connection never looks silent; an honest client sends a HEARTBEAT message
(>= 37 bytes) every 0.5 s. The fd is libzmq's, used from its I/O thread: this module only
reads it, and shuts it down through a ``dup`` after checking that it still leads to the
peer recorded at accept (an fd number closed meanwhile may be some other file now).
"""

from __future__ import annotations

import ctypes
import errno
import logging
import os
import resource
import socket
import struct
import time
from collections import Counter
from dataclasses import dataclass
from typing import Any

import zmq

log = logging.getLogger("dataserver.conns")

CHECK_S = 1.0  # how often connections are looked at
# More than a PONG (7 bytes) or PING (9) per check, less than one client HEARTBEAT (37).
ACTIVE_BYTES = 32
FRESH_S = 2.0  # a connection this young is not yet judged idle when the cap is reached
TRIM_S = 10.0  # malloc_trim at most this often (after a disconnect)
HEARTBEAT_IVL_MS = 5_000  # ZMTP PINGs to every peer of the public sockets ...
HEARTBEAT_TIMEOUT_MS = 15_000  # ... which is dropped when nothing comes back for this long
HEARTBEAT_TTL_MS = 15_000  # the peer drops us after this long without a word from us
HANDSHAKE_IVL_MS = 10_000  # a connection that does not finish the ZMTP handshake by then
FDS_BASE = 64  # the front's own: zmq's context, sockets, pidfds, store, logs, metrics
FDS_PER_WORKER = 8  # a pidfd, its backend connection, what starting it takes
CONNS_PER_SESSION = 4  # a client's data and control connection, a probe, a reconnect

_TCP_INFO_LAST_DATA_RECV = 52  # offsets in the kernel's struct tcp_info (linux/tcp.h)
_TCP_INFO_BYTES_RECEIVED = 128
_SOCKADDR_MAX = 128

_libc: ctypes.CDLL | None = None


def _c() -> ctypes.CDLL:
    global _libc
    if _libc is None:
        # The process's own symbols (libc's among them): no ``find_library``, which runs
        # ldconfig in a subprocess.
        _libc = ctypes.CDLL(None, use_errno=True)
    return _libc


def raise_fd_limit() -> tuple[int, int]:
    """Raise the soft ``RLIMIT_NOFILE`` to the hard limit; return (soft, hard) after."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if soft == resource.RLIM_INFINITY:
        return soft, hard
    want = hard if hard != resource.RLIM_INFINITY else max(soft, 1 << 20)
    if soft < want:
        try:
            resource.setrlimit(resource.RLIMIT_NOFILE, (want, hard))
            soft = want
        except (ValueError, OSError) as exc:
            log.warning("cannot raise the fd limit from %d to %d: %s", soft, want, exc)
    return soft, hard


def fd_limit() -> int:
    """This process's soft fd limit (unlimited: a large number)."""
    soft = resource.getrlimit(resource.RLIMIT_NOFILE)[0]
    return 1 << 30 if soft == resource.RLIM_INFINITY else int(soft)


def peer_socket_options(sock: zmq.Socket[Any]) -> None:
    """ZMTP heartbeats (a dead peer is dropped) and a handshake deadline on a socket peers
    connect to."""
    sock.setsockopt(zmq.HEARTBEAT_IVL, HEARTBEAT_IVL_MS)
    sock.setsockopt(zmq.HEARTBEAT_TIMEOUT, HEARTBEAT_TIMEOUT_MS)
    sock.setsockopt(zmq.HEARTBEAT_TTL, HEARTBEAT_TTL_MS)
    sock.setsockopt(zmq.HANDSHAKE_IVL, HANDSHAKE_IVL_MS)


def fd_budget(soft_limit: int, workers: int, max_sessions: int) -> int:
    """How many peer connections the front keeps open at once: the fd limit less what the
    front and its workers need, and no more than ``CONNS_PER_SESSION`` per session."""
    reserve = FDS_BASE + FDS_PER_WORKER * workers
    return max(8, min(soft_limit - reserve, CONNS_PER_SESSION * max_sessions + 256))


def _peer(fd: int) -> bytes | None:
    """The raw peer address of socket ``fd`` (None: not a connected socket)."""
    buf = ctypes.create_string_buffer(_SOCKADDR_MAX)
    size = ctypes.c_uint32(_SOCKADDR_MAX)
    if _c().getpeername(fd, buf, ctypes.byref(size)) != 0:
        return None
    return buf.raw[: size.value]


def _tcp_info(fd: int) -> tuple[int, int | None] | None:
    """(ms since data last arrived, bytes received or None on an old kernel) of TCP socket
    ``fd``; None if it is not one."""
    buf = ctypes.create_string_buffer(256)
    size = ctypes.c_uint32(256)
    if _c().getsockopt(fd, socket.IPPROTO_TCP, socket.TCP_INFO, buf, ctypes.byref(size)) != 0:
        return None
    n = size.value
    if n < _TCP_INFO_LAST_DATA_RECV + 4:
        return None
    (last_recv,) = struct.unpack_from("I", buf.raw, _TCP_INFO_LAST_DATA_RECV)
    received = None
    if n >= _TCP_INFO_BYTES_RECEIVED + 8:
        (received,) = struct.unpack_from("Q", buf.raw, _TCP_INFO_BYTES_RECEIVED)
    return int(last_recv), received


def _shutdown(fd: int, peer: bytes) -> bool:
    """Shut down socket ``fd`` if it still leads to ``peer`` (True: it was)."""
    try:
        dup = os.dup(fd)  # the same socket for the check and the shutdown, whatever fd does
    except OSError:  # (no fd to spare: check and shut down the number itself)
        dup = -1
    target = fd if dup < 0 else dup
    try:
        if _peer(target) != peer:
            return False
        return _c().shutdown(target, socket.SHUT_RDWR) == 0
    finally:
        if dup >= 0:
            os.close(dup)


def malloc_trim() -> bool:
    """Give the heap's free pages back to the kernel (glibc); False where there is none."""
    try:
        return bool(_c().malloc_trim(0))
    except AttributeError:
        return False


@dataclass
class Conn:
    socket: str  # "data" or "control"
    peer: bytes
    accepted: float
    active: float  # when it last sent more than a heartbeat's reply
    received: int | None  # bytes, at the last check


class ConnTracker:
    """Every TCP connection peers hold on the public sockets, by fd; idle ones and ones
    beyond ``limit`` are shut down. Counters: ``<socket>_idle_dropped``,
    ``<socket>_over_limit_dropped`` (in ``rejected``), ``connections_open``."""

    def __init__(self, idle_timeout: float, limit: int, rejected: Counter[str]) -> None:
        self.idle_timeout = idle_timeout
        self.limit = limit
        self.rejected = rejected
        self.conns: dict[int, Conn] = {}
        self._next_check = 0.0
        self._disconnects = 0
        self._next_trim = 0.0
        self.trims = 0
        self._warned = False

    def accepted(self, name: str, fd: int, now: float | None = None) -> None:
        now = time.monotonic() if now is None else now
        peer = _peer(fd)
        info = _tcp_info(fd) if peer is not None else None
        if peer is None or info is None:  # ipc, or gone already: nothing to judge it by
            self.conns.pop(fd, None)
            return
        self.conns[fd] = Conn(name, peer, now, now, info[1])
        if len(self.conns) > self.limit:
            self._over_limit(fd, now)

    def disconnected(self, fd: int) -> None:
        if self.conns.pop(fd, None) is not None:
            self._disconnects += 1

    def _drop(self, fd: int, reason: str) -> None:
        conn = self.conns.pop(fd)
        if _shutdown(fd, conn.peer):
            self.rejected[f"{conn.socket}_{reason}"] += 1
            log.info("%s connection fd %d: %s; shut down", conn.socket, fd, reason)

    def _over_limit(self, new_fd: int, now: float) -> None:
        """One connection too many: shut down the idlest, or ``new_fd`` if none is idle."""
        idlest = min(self.conns, key=lambda fd: self.conns[fd].active)
        conn = self.conns[idlest]
        if now - conn.active < FRESH_S:
            idlest = new_fd
        if not self._warned:
            self._warned = True
            log.warning(
                "%d peer connections: the most this front keeps (fd limit less the workers' "
                "reserve); shutting down the idlest",
                self.limit,
            )
        self._drop(idlest, "over_limit_dropped")

    def check(self, now: float) -> None:
        """Housekeeping: forget closed fds, shut down idle connections, trim the heap after
        disconnects (memory a peer's unfinished message held goes back)."""
        if now < self._next_check:
            return
        self._next_check = now + CHECK_S
        idle_ms = self.idle_timeout * 1000
        for fd, conn in list(self.conns.items()):
            info = _tcp_info(fd)
            if info is None or _peer(fd) != conn.peer:  # closed (a missed event), or reused
                del self.conns[fd]
                continue
            last_recv_ms, received = info
            if received is None:  # an old kernel: any data counts, PONGs too
                if last_recv_ms < CHECK_S * 1000:
                    conn.active = now
            elif conn.received is None or received - conn.received > _active_bytes(conn):
                conn.active = now
            conn.received = received
            if (now - conn.active) * 1000 > idle_ms:
                self._drop(fd, "idle_dropped")
        if self._disconnects and now >= self._next_trim:
            self._disconnects = 0
            self._next_trim = now + TRIM_S
            if malloc_trim():
                self.trims += 1


def _active_bytes(conn: Conn) -> int:
    """Bytes a connection must have sent since the last check to count as active. A
    client's control connection carries nothing until it steers (it publishes, never
    beats), so there the PONGs its libzmq answers the front's PINGs with are enough: it is
    dropped only when its peer is gone. Silent but live control peers are bounded by the
    connection cap (the idlest goes first)."""
    return 0 if conn.socket == "control" else ACTIVE_BYTES


def is_emfile(exc: BaseException) -> bool:
    """True for running out of file descriptors (this process's or the system's)."""
    return isinstance(exc, OSError) and exc.errno in (errno.EMFILE, errno.ENFILE)

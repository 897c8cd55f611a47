"""The front's file descriptors and the connections peers hold on its public sockets.

libzmq accepts every TCP connection to the data socket and keeps it as long as
the peer does; a peer that finishes the ZMTP handshake and then says nothing costs one fd
and ~23 KiB for ever, and at the fd limit the next honest client (or the replacement of a
dead worker) gets ``EMFILE``. This module keeps that bounded:

- ``raise_fd_limit``: the soft ``RLIMIT_NOFILE`` goes up to the hard one at start.
- ``ConnTracker`` learns every accepted connection's fd from the sockets' monitors
  (``EVENT_ACCEPTED`` carries it) and forgets it at ``EVENT_DISCONNECTED``. Every message
  read from a public socket names the fd it came by (``ZMQ_SRCFD``): its bytes are counted
  as consumed, and a message the front accepts as a live session's (its secret checked)
  *ties* the connection to that session and makes it active. Housekeeping reads the
  kernel's ``TCP_INFO`` of each connection, a slice at a time (each connection once a
  second, or at most ``CHECKS_PER_S`` a second: at 20,000 connections each every 5 s):

  - **idle**: a data connection with no authentic message for ``--idle-timeout`` seconds
    is shut down (``shutdown(SHUT_RDWR)``: libzmq sees its peer go and closes the fd). Bytes
    do not count: a slowloris sending 80 bytes a second of a message it never finishes
    is idle like a silent one.
  - **unfinished**: the bytes the kernel received on a connection, less the bytes of the
    complete messages read from it (and the ZMTP handshake and heartbeats), are what
    libzmq holds of a message not yet complete. Over ``max_unfinished`` the connection is
    shut down: libzmq bounds a frame (``MAXMSGSIZE``), not the frames of a message, and a
    multipart message that never ends held 1 GiB in the front.
  - **weighed by frames** (issue 40): libzmq keeps a ``zmq_msg_t`` (64 bytes) for every
    frame, and an empty frame is 2 bytes on the wire: 8 MB of unfinished empty frames grew
    the front by 244 MiB while the byte bound (32 MiB) saw 8 MB. The unfinished bytes are
    weighed at the worst case, ``WEIGHT`` (32) bytes of memory each, against
    ``max_unfinished`` and ``total_unfinished``; a whole message is credited its exact
    bytes on the wire (``wire_bytes``), never more, so the credit many tiny messages
    earned (64 a frame read, 2 sent) cannot hide a later unfinished one.
  - **too many frames** (``read_message``): a message of more than ``MAX_FRAMES`` frames is
    never taken whole: at the first frame too many its connection is shut down, its peer
    (the uid for an end on this host, else the address) barred for ``BAR_S`` (its new connections
    shut down as they come), and the rest read off and dropped. One message of 500,000
    empty frames a second took the front's whole core (~2 us a frame read).
  - **the cap** (``fd_budget``: the fd limit less a reserve for the workers, at most a few
    per session): one connection too many shuts down another, never the newcomer while
    another can go: first the one untied to a live session for longest (a peer that
    connected and never spoke as a session), then the idlest tied one.

Over the house's ~500 lines (about 615): the connection-level defences of the public sockets
in one place (a message read a frame at a time, barred peers and their ``Gate``, the
``ConnTracker``'s idle, unfinished and over-budget connections, the fd budgets), since they
share the per-connection record and the budget.
"""

from __future__ import annotations

import errno
import logging
import os
import resource
import socket
import threading
import time
from collections import OrderedDict, deque
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import zmq
from zmq.utils.monitor import parse_monitor_message

from dataserver.counting import Counts
from dataserver.fdlimit import raise_fd_limit as _raise_fd_limit
from dataserver.protocol import MAX_FRAMES
from dataserver.server.counts import Dropped, Reject, Tracked, dropped
from dataserver.tcpinfo import libc as _c
from dataserver.tcpinfo import loopback_uid, malloc_trim, peer_key
from dataserver.tcpinfo import peer_of as _peer
from dataserver.tcpinfo import tcp_info as _tcp_info

log = logging.getLogger("dataserver.conns")

CHECK_S = 1.0  # how often connections are looked at ...
CHECKS_PER_S = 4000  # ... but no more than this many looks a second (then each less often)
LOOK_AHEAD = 8  # heard connections looked at for one whose session closed (``_over_limit``)
FRAME_COST = 64  # what libzmq keeps of every frame it holds (a zmq_msg_t in its pipe)
MIN_FRAME_WIRE = 2  # the fewest bytes a frame takes on the wire (an empty one's header)
WEIGHT = FRAME_COST // MIN_FRAME_WIRE  # memory an unfinished byte may cost, at worst
CURVE_BOX = 33  # a CURVE MESSAGE's own bytes: name (8), nonce (8), MAC (16), flags (1)
CUT_KEPT_S = 10.0  # a connection shut down for what it held is remembered so long
BAR_S = 60.0  # a peer that sent a message of too many frames: its connections refused so long
HANDSHAKE_BYTES = 4096  # the ZMTP greeting and handshake (CURVE's included), before messages
PING_BYTES_PER_S = 16  # ZMTP PINGs and PONGs a live peer sends (one of ~9 bytes every few s)
UNFINISHED_TOTAL = 256 << 20  # the bytes of unfinished messages all connections may hold
FRESH_S = 2.0  # a connection this young is not yet judged idle when the cap is reached
TRIM_S = 10.0  # malloc_trim at most this often (after a disconnect)
HEARTBEAT_IVL_MS = 5_000  # ZMTP PINGs to every peer of the public sockets ...
HEARTBEAT_TIMEOUT_MS = 15_000  # ... which is dropped when nothing comes back for this long
HEARTBEAT_TTL_MS = 15_000  # the peer drops us after this long without a word from us
HANDSHAKE_IVL_MS = 10_000  # a connection that does not finish the ZMTP handshake by then
# Connections the kernel queues on a listening socket before accept (libzmq's default: 100;
# the kernel clamps it to net.core.somaxconn). Thousands of clients reconnecting at once (a
# restarted server of a 10,000-rank job) overflowed 100: SYN cookies, failed handshakes,
# every reconnect made 3x over in the scale bench.
LISTEN_BACKLOG = 4096
FDS_BASE = 64  # the front's own: zmq's context, sockets, pidfds, store, logs, metrics
FDS_PER_WORKER = 8  # a pidfd, its backend connection, what starting it takes
CONNS_PER_SESSION = 3  # a client's data connection, a probe, a reconnect
WORKER_FDS = 128  # a worker's fds kept from its result connections (``results_budget``)


def raise_fd_limit() -> tuple[int, int]:
    """Raise the soft ``RLIMIT_NOFILE`` to the hard limit (``dataserver.fdlimit``); return
    (soft, hard) after."""
    return _raise_fd_limit(log)


def fd_limit() -> int:
    """This process's soft fd limit (unlimited: a large number)."""
    soft = resource.getrlimit(resource.RLIMIT_NOFILE)[0]
    return 1 << 30 if soft == resource.RLIM_INFINITY else int(soft)


def peer_socket_options(sock: zmq.Socket[Any]) -> None:
    """ZMTP heartbeats (a dead peer is dropped), a handshake deadline and a listen backlog
    for thousands of peers at once, on a socket peers connect to (before its bind)."""
    sock.setsockopt(zmq.HEARTBEAT_IVL, HEARTBEAT_IVL_MS)
    sock.setsockopt(zmq.HEARTBEAT_TIMEOUT, HEARTBEAT_TIMEOUT_MS)
    sock.setsockopt(zmq.HEARTBEAT_TTL, HEARTBEAT_TTL_MS)
    sock.setsockopt(zmq.HANDSHAKE_IVL, HANDSHAKE_IVL_MS)
    sock.setsockopt(zmq.BACKLOG, LISTEN_BACKLOG)


def results_budget(soft_limit: int, max_sessions: int) -> int:
    """How many client connections a worker's direct-result socket keeps open at once:
    one per session (each client's results DEALER connects once to every worker), room
    for reconnects, and never within ``WORKER_FDS`` of the fd limit (the dataset's reads,
    landing registrations, libzmq's own: a worker at its limit failed a sample with
    ``Too many open files`` and aborted in libzmq's ipc listener)."""
    reserve = max(WORKER_FDS, soft_limit // 4)
    return max(8, min(soft_limit - reserve, 2 * max_sessions + 256))


def fd_budget(soft_limit: int, workers: int, max_sessions: int) -> int:
    """How many peer connections the front keeps open at once: the fd limit less what the
    front and its workers need, and no more than ``CONNS_PER_SESSION`` per session."""
    reserve = FDS_BASE + FDS_PER_WORKER * workers
    return max(8, min(soft_limit - reserve, CONNS_PER_SESSION * max_sessions + 256))


def wire_bytes(size: int, curve: bool = False) -> int:
    """The bytes a frame of ``size`` bytes took on the wire (ZMTP 3: a 2-byte header to
    255 bytes, 9 above; with CURVE, a MESSAGE command boxing it)."""
    body = size + CURVE_BOX if curve else size
    return body + (2 if body < 256 else 9)


def _srcfd(frame: Any) -> int:
    try:
        return int(frame.get(zmq.SRCFD))
    except (zmq.ZMQError, AttributeError, TypeError, ValueError):
        return -1


def read_message(
    sock: zmq.Socket[Any], skip: int, flooded: Callable[[int], None]
) -> list[Any] | None:
    """The next whole message on ``sock`` (``zmq.Again`` when none), read a frame at a
    time: ``skip`` frames the socket adds (a ROUTER's identity) and at most ``MAX_FRAMES``
    of the peer's. At the first frame beyond, ``flooded(fd)`` is told the connection (to
    shut it down before more comes), the rest is read off and dropped, and None returned."""
    frames = [sock.recv(zmq.NOBLOCK, copy=False)]
    while frames[-1].more:
        if len(frames) >= MAX_FRAMES + skip:
            flooded(_srcfd(frames[-1]))
            frames.clear()
            while sock.getsockopt(zmq.RCVMORE):  # (~2 us a frame: the peer pays no more)
                sock.recv()
            return None
        frames.append(sock.recv(copy=False))
    return frames


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


class Barred:
    """Peers (``tcpinfo.peer_key``) that sent a message of too many frames, each until
    ``BAR_S`` after its last: their new connections are shut down as they come. Shared by
    the loop and a ``Gate``'s thread (a lock)."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._until: dict[str, float] = {}

    def bar(self, key: str, now: float) -> bool:
        """Bar ``key`` from ``now``; whether it was not barred already."""
        with self._lock:
            new = key not in self._until
            self._until[key] = now + BAR_S
            return new

    def holds(self, fd: int, now: float) -> bool:
        """Whether connection ``fd`` is a barred peer's (asked of the kernel only while
        some peer is barred)."""
        with self._lock:
            for gone in [k for k, until in self._until.items() if until <= now]:
                del self._until[gone]
            if not self._until:
                return False
        key = peer_key(fd)
        with self._lock:
            return key is not None and key in self._until


class Gate:
    """A public socket's monitor read by a thread of its own: a barred peer's new
    connection is shut down the moment it is accepted, even while the loop is busy reading
    off a message of too many frames that came before the bar (~2 us a frame): a peer
    that reconnected at once had its next message whole before the loop saw the
    connection. Every event goes on, in order, to ``events`` (an inproc PAIR the loop
    polls as it polled the monitor); a connection shut down here carries a third frame,
    ``BARRED``."""

    BARRED = b"barred"

    def __init__(self, ctx: zmq.Context[Any], monitor: zmq.Socket[Any], barred: Barred) -> None:
        self._monitor = monitor
        self._barred = barred
        endpoint = f"inproc://dataserver-gate-{id(self):x}"
        self.events = ctx.socket(zmq.PAIR)
        self.events.setsockopt(zmq.RCVHWM, 0)  # (events are small; none may be lost)
        self.events.setsockopt(zmq.LINGER, 0)
        self.events.bind(endpoint)
        self._out = ctx.socket(zmq.PAIR)
        self._out.setsockopt(zmq.SNDHWM, 0)
        self._out.setsockopt(zmq.LINGER, 0)
        self._out.connect(endpoint)
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="conn-gate", daemon=True)
        self._thread.start()

    def _run(self) -> None:
        poller = zmq.Poller()
        poller.register(self._monitor, zmq.POLLIN)
        try:
            while not self._stop.is_set():
                if not poller.poll(250):
                    continue
                for _ in range(4096):
                    try:
                        frames = self._monitor.recv_multipart(zmq.NOBLOCK)
                    except zmq.Again:
                        break
                    self._out.send_multipart(self._judged(frames))
        except zmq.ZMQError:  # (the context is going: the server stops)
            pass
        finally:
            self._out.close(linger=0)
            self._monitor.close(linger=0)

    def _judged(self, frames: list[bytes]) -> list[bytes]:
        event = parse_monitor_message(frames)
        if event["event"] == zmq.EVENT_ACCEPTED:
            fd = int(event["value"])
            if self._barred.holds(fd, time.monotonic()):
                peer = _peer(fd)
                if peer is not None and _shutdown(fd, peer):
                    return [*frames, self.BARRED]
        return frames

    def close(self) -> None:
        self._stop.set()
        self._thread.join(5)
        self.events.close(linger=0)


@dataclass
class Conn:
    socket: Tracked
    peer: bytes
    accepted: float
    active: float  # when it last sent an authentic message
    received: int | None  # bytes the kernel received on it, at the last check
    base: int | None  # ... at accept (its handshake, so far)
    consumed: int = 0  # bytes of the complete messages read from it
    session: bytes | None = None  # the session its last authentic message acted for
    # The user at the other end, on this host (None: remote, or the kernel did not say),
    # asked of the kernel the first time a cap needs it (``ConnTracker.peer_of``).
    uid: int | None = None
    uid_asked: bool = False
    # Who it is for a bar (``tcpinfo.peer_key``), asked when it is shut down for what it
    # held (it must be asked while the connection is there).
    key: str | None = None

    def unfinished(self, now: float) -> int:
        """The bytes libzmq holds of messages not read yet (an estimate from above: what
        the kernel received, less the complete messages, the handshake and heartbeats)."""
        if self.received is None or self.base is None:
            return 0
        slack = HANDSHAKE_BYTES + PING_BYTES_PER_S * int(now - self.accepted + 1)
        return max(0, self.received - self.base - self.consumed - slack)

    def weight(self, now: float) -> int:
        """What its unfinished bytes may cost the process at worst: each a frame's share
        (``WEIGHT``: an empty frame is 2 bytes sent and 64 kept)."""
        return WEIGHT * self.unfinished(now)


class ConnTracker:
    """Every TCP connection peers hold on the public sockets, by fd; idle ones, ones whose
    unfinished messages may cost more than ``max_unfinished`` bytes (``Conn.weight``), ones
    beyond ``limit``, ones that sent a message of too many frames (``flooded``) and new ones
    of a peer barred for that are shut down. Counted in ``rejected`` (``counts.dropped``):
    ``<socket>_idle_dropped``, ``<socket>_unfinished_dropped``,
    ``<socket>_over_limit_dropped``, ``<socket>_frames_dropped``,
    ``<socket>_barred_dropped``. ``live``: whether a session id is still open (a
    connection tied to a closed one counts as untied). ``curve``: its socket's frames come
    boxed (``wire_bytes``)."""

    def __init__(
        self,
        idle_timeout: float,
        limit: int,
        rejected: Counts[Reject],
        max_unfinished: int,
        live: Callable[[bytes], bool] = lambda session: False,
        total_unfinished: int = UNFINISHED_TOTAL,
        every: float = CHECK_S,
        curve: bool = False,
        barred: Barred | None = None,
        unclaimed: tuple[int, float] | None = None,
    ) -> None:
        self.idle_timeout = idle_timeout
        # (most, seconds): connections that never sent an authentic message, kept apart
        # from ``limit`` (the oldest goes beyond ``most``), and each for ``seconds`` at most
        # (``<socket>_unclaimed_dropped``); None: judged by ``limit`` and the idle timeout.
        self.unclaimed = unclaimed
        self.curve = curve
        # Peers that sent a message of too many frames: their connections are shut down
        # as they come (``BAR_S``; a ``Gate`` may share it).
        self.barred = Barred() if barred is None else barred
        self.limit = limit
        self._rejected = rejected
        self.max_unfinished = max_unfinished
        self.total_unfinished = total_unfinished
        self.every = every
        self.live = live
        self.conns: dict[int, Conn] = {}
        # The same connections apart: never heard, in the order they came; heard, the
        # least recently heard first (a victim is found without a scan: issue 40, every
        # accept of a reconnect churn had looked at every connection).
        self._unheard: OrderedDict[int, Conn] = OrderedDict()
        self._heard: OrderedDict[int, Conn] = OrderedDict()
        # Every connection in the order it is looked at (``_due``), a slice at a time: (fd,
        # its Conn: an entry whose fd was closed, or reused, is passed over and let go).
        self._order: deque[tuple[int, Conn]] = deque()
        self._credit = 0.0  # connections owed a look
        self._last_check: float | None = None
        self._held: dict[int, int] = {}  # fd -> its unfinished bytes, at its last look
        self._disconnects = 0
        self._next_trim = 0.0
        # A connection holding much was shut down: trim at the check after (its frames are
        # freed as libzmq closes it), whatever TRIM_S says.
        self._trim_after: float | None = None
        self.trims = 0
        self._warned = False
        # Connections shut down for what they held, by fd, and when: a message of too many
        # frames read off after its connection was cut is its peer's (``flooded``).
        self._cut: dict[int, tuple[Conn, float]] = {}

    def accepted(self, name: Tracked, fd: int, now: float | None = None) -> None:
        now = time.monotonic() if now is None else now
        peer = _peer(fd)
        info = _tcp_info(fd) if peer is not None else None
        if peer is None or info is None:  # ipc, or gone already: nothing to judge it by
            self._forget(fd)
            return
        if self.barred.holds(fd, now):
            self._forget(fd)
            if _shutdown(fd, peer):
                self._rejected.count(dropped(name, "barred_dropped"))
            return
        self._forget(fd)
        conn = self.conns[fd] = self._unheard[fd] = Conn(name, peer, now, now, info[1], info[1])
        self._order.append((fd, conn))
        if len(self.conns) > self.limit:
            self._over_limit(fd, now)
        elif self.unclaimed is not None and len(self._unheard) > self.unclaimed[0]:
            # (the oldest: no peer is asked for, at ~100 us a look, or a reconnect churn
            # outruns the accepts)
            self._drop(next(iter(self._unheard)), "unclaimed_dropped")

    def _forget(self, fd: int) -> Conn | None:
        """Stop following connection ``fd``; its Conn, if it was followed."""
        self._unheard.pop(fd, None)
        self._heard.pop(fd, None)
        return self.conns.pop(fd, None)

    def read(self, frames: list[Any], skip: int = 0) -> int:
        """A message was read (``frames``, of which the first ``skip`` were added by the
        socket, a ROUTER's identity): count its bytes as consumed on its connection. The
        connection's fd, or -1 (ipc, or unknown)."""
        fd = _srcfd(frames[-1])
        if fd < 0:
            return -1
        conn = self.conns.get(fd)
        if conn is not None:  # (its exact bytes: more would hide an unfinished message)
            conn.consumed += sum(wire_bytes(len(f), self.curve) for f in frames[skip:])
        return fd

    def flooded(self, name: Tracked, fd: int, now: float | None = None) -> None:
        """Connection ``fd`` of socket ``name`` sent a message of more than ``MAX_FRAMES``
        frames (counted ``<name>_frames_dropped``, whether or not it was shut down for
        what it held already): shut it down and bar its peer for ``BAR_S`` (``accepted``
        and a ``Gate`` refuse its new connections)."""
        now = time.monotonic() if now is None else now
        cut = self._cut.get(fd)
        conn = cut[0] if cut is not None else self.conns.get(fd)
        key = conn.key if conn is not None and conn.key is not None else None
        if key is None and (fd in self.conns or (conn is None and fd >= 0)):
            key = peer_key(fd)  # (a connection this loop has not seen accepted yet, too)
        if key is not None and self.barred.bar(key, now):
            log.warning(
                "%s sent a message of more than %d frames: its connections are refused for %g s",
                key,
                MAX_FRAMES,
                BAR_S,
            )
        self._rejected.count(dropped(name, "frames_dropped"))
        live = self._forget(fd)
        if live is not None:
            self._held.pop(fd, None)
            live.key = key
            if _shutdown(fd, live.peer):
                self._cut[fd] = (live, now)
        elif conn is None and fd >= 0 and (peer := _peer(fd)) is not None:
            _shutdown(fd, peer)

    def peer_of(self, fd: int, address: str) -> str:
        """Who connection ``fd`` (of remote ``address``) is, for the caps that charge a
        peer: ``uid:N`` for a local user (loopback or the host's own addresses), else the
        address."""
        conn = self.conns.get(fd)
        if conn is None:
            # Not accepted yet as far as this loop knows (its monitor's ACCEPTED not read):
            # ask now, or a local user would be charged as everyone at its address.
            uid = loopback_uid(fd) if fd >= 0 else None
            return address if uid is None else f"uid:{uid}"
        if not conn.uid_asked:
            conn.uid, conn.uid_asked = loopback_uid(fd), True
        return address if conn.uid is None else f"uid:{conn.uid}"

    def heard(self, fd: int, session: bytes, now: float | None = None) -> None:
        """The message just read on ``fd`` was authentic, for ``session``: the connection
        is that session's, and active."""
        conn = self.conns.get(fd)
        if conn is not None:
            conn.session = session
            conn.active = time.monotonic() if now is None else now
            self._unheard.pop(fd, None)
            self._heard[fd] = conn
            self._heard.move_to_end(fd)

    def refuse(self, name: Tracked, fd: int) -> None:
        """The message just read on ``fd`` was a claim no admitted session made: shut the
        connection down (``<name>_claim_dropped``)."""
        if fd in self.conns:
            self._drop(fd, "claim_dropped")
        elif fd >= 0 and (peer := _peer(fd)) is not None and _shutdown(fd, peer):
            self._rejected.count(dropped(name, "claim_dropped"))

    def disconnected(self, fd: int) -> None:
        self._held.pop(fd, None)
        if self._forget(fd) is not None:
            self._disconnects += 1
        if fd in self._cut:
            # One shut down for what it held has gone: libzmq frees its frames as the
            # socket's thread takes the news, trim after that (not TRIM_S later).
            self._trim_after = time.monotonic() + self.every / 2

    def _drop(self, fd: int, reason: Dropped) -> None:
        self._held.pop(fd, None)
        conn = self._forget(fd)
        assert conn is not None
        if reason == "unfinished_dropped":
            conn.key = peer_key(fd)
        if _shutdown(fd, conn.peer):
            if reason == "unfinished_dropped":
                self._cut[fd] = (conn, time.monotonic())
            self._rejected.count(dropped(conn.socket, reason))
            # (a reconnect churn's are thousands a second: not each a log line)
            level = logging.DEBUG if reason == "unclaimed_dropped" else logging.INFO
            log.log(level, "%s connection fd %d: %s; shut down", conn.socket, fd, reason)

    def _tied(self, conn: Conn) -> bool:
        return conn.session is not None and self.live(conn.session)

    def _over_limit(self, new_fd: int, now: float) -> None:
        """One connection too many: shut down one untied to a live session (the one
        untied for longest), else the idlest tied one; the newcomer only when every other
        is a session's and active within ``FRESH_S``. Without a scan: the oldest never
        heard, and the least recently heard (the first few, for one whose session closed)."""
        untied = next((fd for fd in self._unheard if fd != new_fd), None)
        heard = [fd for _, fd in zip(range(LOOK_AHEAD), self._heard, strict=False)]
        closed = [fd for fd in heard if not self._tied(self.conns[fd])]
        candidates = [fd for fd in (untied, *closed[:1]) if fd is not None]
        if candidates:
            victim = min(candidates, key=lambda fd: self.conns[fd].active)
        elif heard:
            victim = heard[0]
            if now - self.conns[victim].active < FRESH_S:
                victim = new_fd
        else:
            victim = new_fd
        if not self._warned:
            self._warned = True
            log.warning(
                "%d peer connections: the most this front keeps (fd limit less the workers' "
                "reserve); shutting down those of no live session first",
                self.limit,
            )
        self._drop(victim, "over_limit_dropped")

    def check(self, now: float) -> None:
        """Housekeeping: look at the connections due (``_due``: each once every ``every``
        seconds, or every ``len / CHECKS_PER_S`` when there are more than that many a
        second's worth): forget closed fds, shut down idle connections and those holding
        too much of unfinished messages; trim the heap after disconnects (memory a peer's
        unfinished message held goes back). A slice a call, not every connection: 20,000
        of them at ~7 us each cost 0.14 of the front's core a second."""
        for fd, conn in self._due(now):
            held = self._judge(fd, conn, now)
            if held:
                self._held[fd] = held
            else:
                self._held.pop(fd, None)
        # Many connections each under the bound: the largest go until the rest fit (their
        # figures as of their last look; the sum is rarely over, so it is rarely sorted).
        total = sum(self._held.values()) if self._held else 0
        if total > self.total_unfinished:
            for fd in sorted(self._held, key=self._held.__getitem__, reverse=True):
                if total <= self.total_unfinished:
                    break
                total -= self._held[fd]
                if fd in self.conns:
                    self._drop(fd, "unfinished_dropped")
                self._trim_after = now + self.every / 2
        for fd in [fd for fd, (_, when) in self._cut.items() if now - when > CUT_KEPT_S]:
            del self._cut[fd]
        soon = self._trim_after is not None and now >= self._trim_after
        if soon or (self._disconnects and now >= self._next_trim):
            self._disconnects = 0
            self._trim_after = None
            self._next_trim = now + TRIM_S
            if malloc_trim():
                self.trims += 1

    def _due(self, now: float) -> list[tuple[int, Conn]]:
        """The connections to look at now, oldest look first: as many as the time since
        the last call is of a round (``every``, or longer past ``CHECKS_PER_S``)."""
        elapsed = now - self._last_check if self._last_check is not None else self.every
        self._last_check = now
        n = len(self.conns)
        if not n:
            self._order.clear()
            return []
        period = max(self.every, n / CHECKS_PER_S)
        self._credit = min(float(n), self._credit + n * max(0.0, elapsed) / period)
        due: list[tuple[int, Conn]] = []
        order = self._order
        while self._credit >= 1 and order:
            fd, conn = order.popleft()
            if self.conns.get(fd) is not conn:  # closed or dropped since (its fd maybe reused)
                continue
            self._credit -= 1
            order.append((fd, conn))
            due.append((fd, conn))
        return due

    def _judge(self, fd: int, conn: Conn, now: float) -> int:
        """Look at one connection: forget it if closed, shut it down if idle or holding
        more than ``max_unfinished``; else the bytes of unfinished messages it holds."""
        info = _tcp_info(fd)
        # Closed (a missed event), or the fd is another connection now: a connection's
        # count never goes back, so only then is its peer asked (a syscall a look saved;
        # a new connection on the fd is also told by its own EVENT_ACCEPTED).
        moved = info is None or (
            info[1] is None or conn.received is None or info[1] < conn.received
        )
        if info is None or (moved and _peer(fd) != conn.peer):
            self._forget(fd)
            return 0
        received = info[1]
        conn.received = received
        unclaimed = self.unclaimed
        if unclaimed is not None and fd in self._unheard and now - conn.accepted > unclaimed[1]:
            self._drop(fd, "unclaimed_dropped")
            return 0
        if now - conn.active > self.idle_timeout:
            self._drop(fd, "idle_dropped")
            return 0
        held = conn.weight(now)
        if held > self.max_unfinished:
            self._drop(fd, "unfinished_dropped")
            self._trim_after = now + self.every / 2
            return 0
        return held


def is_emfile(exc: BaseException) -> bool:
    """True for running out of file descriptors (this process's or the system's)."""
    return isinstance(exc, OSError) and exc.errno in (errno.EMFILE, errno.ENFILE)

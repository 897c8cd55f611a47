"""Landing: results written by a server's workers straight into a client's batch buffers,
in shared memory, when both run on one host. No socket carries the pixels, and the client
copies nothing: its CPU per image goes from the cost of two copies to almost none.

The buffer has no name on the host's file system: the client makes a ``memfd``
(``memfd_create``, close-on-exec), sizes it, and seals it (``F_SEAL_SHRINK``,
``F_SEAL_GROW``, ``F_SEAL_SEAL``: nobody, the client included, can shrink it, so no mapping
of it can ever SIGBUS for a page cut off). There is nothing in ``/dev/shm`` to list (and
learn a session from), plant, sweep or delete.

Hand-over (the client's side here, ``hand_over`` and ``Handover``; the worker's in
``dataserver/server/worker/landings.py``): each worker that serves clients on its host (its ipc
result endpoint ``ipc://<dir>/<name>``) also listens on an ``AF_UNIX``
``SOCK_SEQPACKET`` socket beside it, ``<dir>/land-<name>`` (``landing_socket``), in the
server's private directory (mode 0700: only its own user gets in). The path is derived,
not announced: a client uses it only once it has proven it shares the server's host and
file system by reading the server's host token in that same directory, so announcing it
would add a protocol field and prove nothing more. The client connects, checks with
``SO_PEERCRED`` that the listener is its own user, and sends one message: a msgpack map
``{"session": bytes, "token": str, "key": bytes}`` with the memfd attached (``SCM_RIGHTS``).
The key (32 random bytes) never goes on the network: every TASK that names the buffer
carries ``land_mac``, an HMAC under it of the whole task (what it composes and where it
lands; ``land_mac``), and a worker lands only a task whose MAC is right. A server that
relays tasks (a fake one that replayed a local server's WELCOME, so that the client took
it for local) cannot make a worker write other images, or into other slots; nor with other
control values (the task's ``control_digest`` is under the MAC, and a worker holding other
values refuses it), and since the host proof names its connection a relay is not taken for
local at all (issue 40 item 6). The client keeps the connection open: the worker keeps the buffer exactly as long (the client gone, the
connection drops and the worker lets go of its memory). The worker never blocks on it
(the listener and its connections are polled with its task socket) and refuses, counted
in its counters and logged, a peer of another user (``SO_PEERCRED``), and a descriptor
that is not a regular file sealed against shrinking, too small, or whose header does not
hold the magic and the token the message names. The first registration of a token wins;
at most 64 are kept (least recently used go first, with their connection).

A TASK that may land names the token, the region, its generation and the byte offset of
its first image (never a path); a worker with no registration for the token, or of
another session, sends the pixels over the socket as usual. Clients name landing fields
only in tasks to a server whose workers took the hand-over.

Byte layout of the buffer (little-endian; ``HEADER`` = 4096)::

    0      u64        MAGIC
    8      32 bytes   token (ASCII hex)
    40     u64        regions (1..MAX_REGIONS)
    48     u64        region_bytes
    56     u64        slots: seal records per region (images a batch may hold)
    64     u64        data_at: offset of region 0 (a multiple of the page size)
    128    u64 x regions   each region's generation (from 1; 0 never names a live one)
    4096   16 bytes x regions x slots   seal records: (u64 generation, u64 task id),
                      record (r, s) at 4096 + 16 * (r * slots + s)
    data_at + r * region_bytes   region r: a batch's (N, 3, H, W) uint8 images

Rules that make a late, duplicate or lying writer harmless:

- a worker writes its task's bytes of a region only while holding a POSIX lock on those
  bytes, and only if the region's generation is still the one its task names (so workers
  writing different tasks of one batch do not wait for each other); still under the lock,
  once the images are composed, it writes the seal record (generation, task id) of each
  of its images' slots;
- the client bumps a region's generation while holding a lock on the whole region (which
  no writer can hold a part of meanwhile), the moment its batch is complete (before the
  trainer sees it), or dropped. A writer that comes after finds the generation changed
  and writes nothing (it sends the pixels over the socket instead, which the client then
  drops as unwanted);
- the client accepts a RESULT that says "landed" only if every image's seal record holds
  the generation and task id it sent (``LandingArea.sealed``: two words per image, no pass
  over the pixels); a server that says so without writing is caught, not believed.
"""

from __future__ import annotations

import fcntl
import hashlib
import hmac
import logging
import mmap
import os
import secrets
import socket
import struct
from collections import Counter
from typing import Any

import msgpack
import msgspec
import numpy as np

log = logging.getLogger("dataserver.landing")

MAGIC = 0x324E414C53445331  # "1SDSLAN2"
HEADER = 4096
HEAD = struct.Struct("<Q32sQQQQ")  # magic, token, regions, region bytes, slots, data_at
GEN_AT = 128  # generation words (u64 each) start here
MAX_REGIONS = (HEADER - GEN_AT) // 8
SEAL_AT = HEADER
SEAL_BYTES = 16  # (generation, task id)
MAX_SLOTS = 1 << 16
MAX_HELLO = 512  # bytes of the hand-over message
_SUN_PATH = 107  # sun_path holds 108 bytes, the last a NUL
_SEALS = fcntl.F_SEAL_SHRINK | fcntl.F_SEAL_GROW | fcntl.F_SEAL_SEAL
_CRED = struct.Struct("3i")  # struct ucred: pid, uid, gid


def pid_alive(pid: int) -> bool:
    """Whether process ``pid`` exists (one of another user counts); never for pid <= 0,
    which ``kill`` would take for a process group. (The store uses it; landing buffers
    need no sweeping.)"""
    if pid <= 0:
        return False
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def landing_socket(local_endpoint: str) -> str | None:
    """The landing socket of the worker whose ipc result endpoint is ``local_endpoint``:
    ``land-<name>`` beside it; None when there is none (not ipc, or a path too long for a
    unix socket)."""
    if not local_endpoint.startswith("ipc://"):
        return None
    directory, name = os.path.split(local_endpoint[len("ipc://") :])
    path = os.path.join(directory, "land-" + name)
    return path if directory and name and len(os.fsencode(path)) <= _SUN_PATH else None


def peer_uid(sock: socket.socket) -> int:
    """The user id of the process at the other end of a unix socket (``SO_PEERCRED``)."""
    return _CRED.unpack(sock.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED, _CRED.size))[1]


def _round_up(n: int, to: int) -> int:
    return -(-n // to) * to


class LandingArea:
    """The client's side: a sealed memfd of ``regions`` buffers of ``region_bytes``, and
    ``slots`` seal records per region (the most images a batch holds)."""

    def __init__(self, regions: int, region_bytes: int, slots: int) -> None:
        if not 1 <= regions <= MAX_REGIONS:
            raise ValueError(f"1..{MAX_REGIONS} regions, not {regions}")
        if not 1 <= slots <= MAX_SLOTS or region_bytes < 1:
            raise ValueError(f"1..{MAX_SLOTS} slots and > 0 bytes a region, not {slots}")
        self.token = secrets.token_hex(16)
        # The key its TASKs' landing MACs are made with: handed to workers with the buffer,
        # on the unix socket only, never on the network (``land_mac``).
        self.key = secrets.token_bytes(32)
        self.regions = regions
        self.region_bytes = region_bytes
        self.slots = slots
        self.data_at = _round_up(SEAL_AT + regions * slots * SEAL_BYTES, mmap.PAGESIZE)
        size = self.data_at + regions * region_bytes
        self.fd = os.memfd_create("dataserver-landing", os.MFD_CLOEXEC | os.MFD_ALLOW_SEALING)
        try:
            os.ftruncate(self.fd, size)
            fcntl.fcntl(self.fd, fcntl.F_ADD_SEALS, _SEALS)
            # The header's and seals' pages now; a region's when it is first used (``take``):
            # reserving every region up front cost tens of milliseconds before the first batch.
            os.posix_fallocate(self.fd, 0, self.data_at)
            self.map = mmap.mmap(self.fd, size)
        except BaseException:
            os.close(self.fd)
            raise
        HEAD.pack_into(
            self.map, 0, MAGIC, self.token.encode(), regions, region_bytes, slots, self.data_at
        )
        self._gens = np.frombuffer(self.map, np.uint64, regions, GEN_AT)
        self._gens[:] = 1
        self._seals = np.frombuffer(self.map, np.uint64, regions * slots * 2, SEAL_AT).reshape(
            regions, slots, 2
        )
        self.free = list(range(regions))
        self._reserved: set[int] = set()

    def take(self) -> int | None:
        """A free region, its pages reserved (so a write to it can never fail for want of
        memory); None when none is free, or there is no room for one (the socket it is)."""
        j = self._reserved_free_at()
        if j is not None:  # a reserved one first
            return self.free.pop(j)
        while self.free:
            region = self.free.pop()
            try:
                os.posix_fallocate(self.fd, self.offset(region), self.region_bytes)
            except OSError:
                continue  # no room: this region stays unused
            self._reserved.add(region)
            return region
        return None

    def give(self, region: int) -> None:
        """Region ``region``, taken and sealed (no worker writes it any more), is free again:
        ``take`` hands it out next, its pages still reserved."""
        self.free.append(region)

    def reserved_free(self) -> bool:
        """Whether a free region has its pages reserved already (``take`` is then cheap)."""
        return self._reserved_free_at() is not None

    def _reserved_free_at(self) -> int | None:
        """Where in ``free`` the first region with its pages reserved is, if any."""
        return next((j for j, r in enumerate(self.free) if r in self._reserved), None)

    def buffer(self, region: int) -> np.ndarray:
        """Region ``region`` as a flat uint8 array over the shared memory."""
        return np.frombuffer(self.map, np.uint8, self.region_bytes, self.offset(region))

    def offset(self, region: int) -> int:
        return self.data_at + region * self.region_bytes

    def generation(self, region: int) -> int:
        return int(self._gens[region])

    def sealed(self, region: int, slots: tuple[int, ...], generation: int, task_id: int) -> bool:
        """Whether the worker that says it landed task ``task_id`` (sent with
        ``generation``) wrote every one of its images' seal records."""
        first, n = slots[0] if slots else -1, len(slots)
        if not 0 <= region < self.regions or first < 0 or first + n > self.slots:
            return False
        if slots != tuple(range(first, first + n)):
            return False  # (only a run of consecutive slots lands)
        for g, t in self._seals[region, first : first + n].tolist():
            if g != generation or t != task_id:
                return False
        return True

    def seal(self, region: int) -> bool:
        """Bump the region's generation, so that no writer can touch it any more; False
        (try again later) while a worker holds a lock on a part of it, writing."""
        start = self.offset(region)
        try:
            fcntl.lockf(self.fd, fcntl.LOCK_EX | fcntl.LOCK_NB, self.region_bytes, start)
        except OSError:
            return False
        try:
            self._gens[region] += 1
        finally:
            fcntl.lockf(self.fd, fcntl.LOCK_UN, self.region_bytes, start)
        return True

    def close(self) -> None:
        del self._gens, self._seals
        try:
            self.map.close()
        except BufferError:
            pass  # a batch the trainer keeps still views it: the mapping goes with it
        os.close(self.fd)


def land_mac(key: bytes, task: Any) -> bytes:
    """The MAC a TASK that lands carries (``Task.land_mac``): HMAC-SHA256 under the buffer's
    ``key`` of the task's encoding with ``auth`` and ``land_mac`` cleared, so every field
    that says what is composed, and where it lands, is covered; 16 bytes."""
    body = msgspec.msgpack.encode(msgspec.structs.replace(task, auth=None, land_mac=b""))
    return hmac.new(key, body, hashlib.sha256).digest()[:16]


def hand_over(area: LandingArea, session: bytes, path: str) -> socket.socket | str:
    """Give ``area`` to the worker listening at ``path``: the open connection (keep it:
    the worker keeps the buffer while it is open), or why not. Never blocks."""
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET | socket.SOCK_CLOEXEC)
    try:
        sock.setblocking(False)
        sock.connect(path)
        uid = peer_uid(sock)
        if uid != os.getuid():  # someone else's socket: it gets nothing of ours
            sock.close()
            return f"{path} is uid {uid}'s, not ours"
        hello = msgpack.packb(
            {"session": session, "token": area.token, "key": area.key}, use_bin_type=True
        )
        socket.send_fds(sock, [hello], [area.fd])
    except OSError as exc:
        sock.close()
        return f"{path}: {exc.strerror or exc}"
    return sock


def alive(sock: socket.socket) -> bool:
    """Whether the worker at the other end of a hand-over connection still holds it."""
    try:
        return sock.recv(1, socket.MSG_PEEK | socket.MSG_DONTWAIT) != b""
    except BlockingIOError:
        return True
    except OSError:
        return False


class Handover:
    """The client's side of one server's hand-overs: a live connection to each of its
    workers' landing sockets that took the buffer. ``sync`` (each WELCOME and HEARTBEAT
    of a server proven to be on this host) connects to new workers and to those replaced
    (their connection dropped), at most ``MAX_TRIES`` times a socket."""

    MAX_TRIES = 8

    def __init__(self, area: LandingArea, session: bytes) -> None:
        self.area = area
        self.session = session
        self.socks: dict[str, socket.socket] = {}
        self._tries: Counter[str] = Counter()

    @property
    def ready(self) -> bool:
        """Whether any of the server's workers holds the buffer (tasks may name it; one
        that does not hold it sends the pixels instead)."""
        return bool(self.socks)

    def sync(self, paths: list[str]) -> None:
        for path in [p for p in self.socks if p not in paths]:
            self.socks.pop(path).close()
        for path in paths:
            sock = self.socks.get(path)
            if sock is not None and alive(sock):
                continue
            if sock is not None:
                self.socks.pop(path).close()
            if self._tries[path] >= self.MAX_TRIES:
                continue
            self._tries[path] += 1
            got = hand_over(self.area, self.session, path)
            if isinstance(got, str):
                log.info("landing buffer not handed over: %s", got)
            else:
                self.socks[path] = got

    def close(self) -> None:
        for sock in self.socks.values():
            sock.close()
        self.socks.clear()

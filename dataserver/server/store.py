"""The server's store of prepared sources: decoded and fitted (``pipeline.Source``), in
shared memory that every worker of the server maps, bounded in bytes (``--cache-gb``).

It serves three uses: epochs after the first (a hit skips the decode), several jobs with
the same dataset and image size (same key, same bytes), and zero-stall mode flips (the
sources of the next batch, decoded once, serve whichever mode is decided).

Layout: two anonymous shared memory files (``memfd``) that the front creates and every
worker it starts inherits (``Store.create``, ``Store.attach``). They have no name on the
host: nothing in ``/dev/shm`` to list, plant, sweep or delete (systemd's ``RemoveIPC``
included); they live while a process of the server holds them. Both are sealed against
shrinking and growing once sized, so no process can truncate them under a mapping (SIGBUS).

- the *arena*, a ring of bytes: each entry's image planes (3, h, w) uint8, then its boxes
  (M, 4) float32 and labels (M,) int64, then its sample's file name (UTF-8), contiguous;
- the *index*: a header (magic, capacity, head position, ring size, a dirty flag), an open
  addressing hash table of 64-byte entries (key, state, owner pid, position, shape, the
  sample's original size, the file name's length), and a
  journal of (position, key) in ring order, from which the oldest entries are evicted.

Entries are written at the ring's head; room is made by evicting the oldest entries (an
entry read while in the oldest quarter of the ring is first copied to the head: LRU,
approximately). Positions are monotonic byte counts, so "the bytes of this entry are
intact" is ``head - ring <= position``.

Memory is committed up front: the front reserves (``fallocate``) every page of the arena
and faults each in once when it creates the store, before the server says it is ready
(``commit_s``: ~1 s a GiB on the development VM, where fresh pages cost the most), and each
worker maps the whole committed arena in a thread of its own (``MADV_POPULATE_READ``: ~70 ms
a GiB). A miss is fitted straight into its reserved bytes (``fetch(..., into=True)``), or
else copied in through the maker's mapping: no page is allocated, cleared or faulted while
an epoch runs (lazily reserved pages cost a fresh server's first epoch ~0.5 ms an image:
docs/DESIGN-NOTES.md). If the memory cannot all be had, what could be is kept: the rest is reserved 64 MiB at a time as the head first reaches
it, and where a reservation fails the ring stops growing there instead of the process dying
on a write to a page that cannot be had.

Concurrency: one ``flock`` on the index serialises every change and lookup. A lock belongs
to an open file description, which inherited descriptors share, so each handle opens the
index afresh (``/proc/self/fd``). Readers compose straight from the ring without the lock
and check afterwards (``intact``) that the head has not passed over what they read. A
source being made by one worker is marked PENDING with its pid; another worker that needs
it waits rather than decoding it twice (unless the owner died: every worker is a child of
the one front, in its pid namespace). A process killed in the middle of a change leaves the
dirty flag set; the next one to take the lock empties the index (a cache may lose entries;
a torn table it may not keep).

Size: memfd pages are not bounded by ``/dev/shm``'s size but by memory (and the memory
cgroup: past its limit a reservation is met by the OOM killer, not an error), so the front
sizes the store from what memory there is (``memory.memory_room``).
"""

from __future__ import annotations

import enum
import errno
import fcntl
import hashlib
import logging
import mmap
import os
import stat
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from functools import partial
from typing import Any

import numpy as np

from dataserver.data.pipeline import Source
from dataserver.hashing import MASK64, mix64
from dataserver.landing import pid_alive
from dataserver.memfd import SIZE_SEALS, sealed_memfd

log = logging.getLogger("dataserver.store")

MAGIC = 0x44535354_4F524533  # "DSSTORE3"
EMPTY, PENDING, READY = 0, 1, 2  # an index entry's states
PENDING_WAIT_S = 30.0  # how long to wait for a source another live worker is making
ENTRY_BYTES = 8192  # hash table slots: one per this many bytes of ring
# A dataset larger than the store: the share of the ring its admitted sources may fill (the
# rest is slack, so that sizes above the mean estimate do not push admitted entries out).
ADMIT_SHARE = 0.94
ADMIT_AFTER = 16  # puts before the mean entry size is trusted (until then, admit all)
MIN_ENTRIES = 1024
CHUNK = 64 << 20  # arena pages are reserved this much at a time

_HEADER = np.dtype(
    [
        ("magic", "<u8"),
        ("capacity", "<u8"),
        ("entries", "<u8"),
        ("head", "<u8"),  # bytes ever written: the position of the next write
        ("ring", "<u8"),  # the ring's size: capacity, or less if memory ran out
        ("reserved", "<u8"),  # arena bytes reserved so far
        ("journal_head", "<u8"),
        ("journal_tail", "<u8"),
        ("dirty", "<u8"),
        ("owner", "<u8"),  # pid of the front that made it
        ("puts", "<u8"),  # entries ever stored, and their bytes: the mean entry's size
        ("put_bytes", "<u8"),
        ("population", "<u8"),  # the most sources one family of keys has (a dataset's length)
        ("_pad", "<u8", (3,)),
    ]
)
_ENTRY = np.dtype(
    [
        ("k0", "<u8"),
        ("k1", "<u8"),
        ("state", "<u4"),
        ("pid", "<u4"),
        ("pos", "<u8"),
        ("nbytes", "<u8"),
        ("h", "<u4"),
        ("w", "<u4"),
        ("nboxes", "<u4"),
        ("orig_h", "<u4"),  # the sample's size as read (Source.orig_hw)
        ("orig_w", "<u4"),
        ("nfile", "<u4"),  # bytes of its file name, after its labels
    ]
)
_JOURNAL = np.dtype([("pos", "<u8"), ("k0", "<u8"), ("k1", "<u8")])


def _same_bytes(a: np.ndarray, b: np.ndarray) -> bool:
    """Whether two arrays are views of the very same bytes (planes handed out by
    ``_planes_for`` come back as themselves, or read as (h, w, 3) for an HWC source)."""
    if a is b:
        return True
    return bool(
        a.nbytes == b.nbytes
        and a.__array_interface__["data"][0] == b.__array_interface__["data"][0]
        and a.flags.c_contiguous
        and b.flags.c_contiguous
    )


def store_key(*parts: object) -> tuple[int, int]:
    """A 128-bit key for what determines a prepared source (never (0, 0))."""
    digest = hashlib.blake2b(repr(parts).encode(), digest_size=16).digest()
    k0 = int.from_bytes(digest[:8], "little") or 1
    return k0, int.from_bytes(digest[8:], "little")


def index_keys(base: tuple[int, int], indices: list[int]) -> list[tuple[int, int]]:
    """``store_key(*parts, index)`` for many indices at once, cheaply: ``base`` is
    ``store_key(*parts)``, mixed with each index (128 bits, so distinct keys stay distinct)."""
    b0, b1 = base
    return [(mix64(b0 ^ i) or 1, mix64(b1 + i * 0x9E3779B97F4A7C15 & MASK64)) for i in indices]


def admitted(k1: int, fraction: float) -> bool:
    """Whether the source whose key's second half is ``k1`` is one of the ``fraction`` of
    sources a store keeps when the dataset is larger than it: the same subset every epoch
    and in every worker (a pure function of the key), so what is kept is read again, and no
    put is spent on a source that the ring would evict before it is read (a scan through a
    dataset larger than an LRU or FIFO cache hits nothing)."""
    return fraction >= 1.0 or (k1 >> 11) < fraction * (1 << 53)


def _layout(capacity: int) -> tuple[int, int]:
    entries = max(MIN_ENTRIES, capacity // ENTRY_BYTES)
    index_bytes = _HEADER.itemsize + entries * (_ENTRY.itemsize + _JOURNAL.itemsize)
    return entries, index_bytes


class Claim(enum.Enum):
    """What a process does about a source it needs (``Store._claim``)."""

    HIT = "hit"  # stored: read it
    MINE = "mine"  # this process makes it (its entry is PENDING under this pid)
    BUSY = "busy"  # another live worker makes it: wait for it
    FULL = "full"  # no slot for it: make it, keep it nowhere
    SKIP = "skip"  # not admitted (a dataset larger than the store): make it, keep it nowhere


@dataclass
class StoreStats:
    hits: int = 0
    misses: int = 0
    waits: int = 0  # sources another worker was making, waited for
    evictions: int = 0
    refreshes: int = 0
    skipped: int = 0  # sources made and not admitted (``admitted``)
    torn: int = 0  # reads written over while being used (composed again)


class StoreUnusable(ValueError):
    """What a process was handed is not a store it can map (named in the message)."""


SEALS = SIZE_SEALS


def _reopen(fd: int, size: int, what: str) -> int:
    """A new open file description of the memfd ``fd`` (its own ``flock``), after checking
    that ``fd`` is one: a regular file of ``size`` bytes, sealed against resizing."""
    try:
        st = os.fstat(fd)
    except OSError as exc:
        raise StoreUnusable(f"store {what}: fd {fd}: {exc.strerror}") from None
    # Checked before the open below, which would block on a FIFO.
    if not stat.S_ISREG(st.st_mode) or st.st_size != size:
        raise StoreUnusable(f"store {what}: fd {fd} is not a regular file of {size} bytes")
    try:
        seals = fcntl.fcntl(fd, fcntl.F_GET_SEALS)
    except OSError:
        seals = 0  # not a memfd (or a tmpfs file: no seals either)
    if seals & SEALS != SEALS:
        raise StoreUnusable(f"store {what}: fd {fd} is not sealed against resizing")
    try:
        new = os.open(f"/proc/self/fd/{fd}", os.O_RDWR | os.O_CLOEXEC | os.O_NONBLOCK)
    except OSError as exc:
        raise StoreUnusable(f"store {what}: cannot open fd {fd} again: {exc.strerror}") from None
    again = os.fstat(new)
    if (again.st_dev, again.st_ino) != (st.st_dev, st.st_ino):  # fd changed meanwhile
        os.close(new)
        raise StoreUnusable(f"store {what}: fd {fd} changed while it was opened")
    return new


class Store:
    """One process's view of a server's store: ``create`` (the front) or ``attach`` (its
    workers, and the front's metrics). Closing a handle never removes the store: it goes
    with the last descriptor of it, in whichever process of the server that is."""

    def __init__(
        self,
        index_fd: int,
        arena_fd: int,
        capacity: int,
        create: bool = False,
        populate: bool = False,
    ) -> None:
        """Map the store whose memfds are ``index_fd``, ``arena_fd`` (this handle owns and
        closes them); ``populate``: a process that writes and reads sources maps every
        committed page of the arena, in a thread of its own (``MADV_POPULATE_READ``, 4 MiB
        at a time: ~70 ms a GiB, off the start of the worker and of a replacement), and
        writes through its mapping. Raises ``StoreUnusable`` if its header is not that of a
        store of ``capacity`` bytes."""
        self.capacity = capacity
        self.entries, index_bytes = _layout(capacity)
        self.stats = StoreStats()
        self.commit_s = 0.0  # how long committing the arena took (the creator's handle)
        self._index_fd = index_fd
        self._arena_fd = arena_fd
        self._mapped = False  # every page of the arena is mapped here: write through it
        self._closing = threading.Event()
        self.populated = threading.Event()  # (``populate``) every page of it is mapped here
        # Ring bytes reserved for a source this process is fitting straight into the store
        # (``_planes_for``): key -> (position, bytes reserved, the planes handed out).
        self._placing: dict[tuple[int, int], tuple[int, int, np.ndarray]] = {}
        try:
            self._index_map = mmap.mmap(index_fd, index_bytes)
            committed = int(np.frombuffer(self._index_map, _HEADER, 1, 0)[0]["reserved"])
            # Only a whole committed arena is populated: a read fault on a hole of a memfd
            # allocates a page, which would commit memory the front could not have.
            self._mapped = populate and committed == capacity and not create
            self._arena_map = mmap.mmap(arena_fd, capacity)
        except BaseException:
            os.close(index_fd)
            os.close(arena_fd)
            raise
        buf = memoryview(self._index_map)
        self.header = np.frombuffer(buf, _HEADER, 1, 0)
        off = _HEADER.itemsize
        self.table = np.frombuffer(buf, _ENTRY, self.entries, off)
        off += self.entries * _ENTRY.itemsize
        self.journal = np.frombuffer(buf, _JOURNAL, self.entries, off)
        self.arena = np.frombuffer(memoryview(self._arena_map), np.uint8)
        h = self.header[0]
        if create:
            h["magic"], h["capacity"], h["entries"] = MAGIC, capacity, self.entries
            h["ring"], h["owner"] = capacity, os.getpid()
        elif (int(h["magic"]), int(h["capacity"]), int(h["entries"])) != (
            MAGIC,
            capacity,
            self.entries,
        ):
            self.close()
            raise StoreUnusable(f"not a store of {capacity} bytes (magic, capacity or size)")
        self._pid = os.getpid()
        if self._mapped:
            threading.Thread(target=self._populate, name="store-populate", daemon=True).start()

    @classmethod
    def create(cls, capacity: int, commit: bool = True) -> Store:
        """A new, empty store of ``capacity`` bytes. The index's pages are reserved now,
        and with ``commit`` the arena's too (``commit_s`` says how long that took; what
        memory refuses is reserved later, as the ring first reaches it). Its descriptors
        (``fds``) are for the processes this one starts (``pass_fds``): keep this handle
        open while any may."""
        _, index_bytes = _layout(capacity)
        index_fd = sealed_memfd("dataserver-store-index", index_bytes)
        try:
            os.posix_fallocate(index_fd, 0, index_bytes)
            arena_fd = sealed_memfd("dataserver-store-arena", capacity)
        except BaseException:
            os.close(index_fd)
            raise
        store = cls(index_fd, arena_fd, capacity, create=True)
        if commit:
            start = time.perf_counter()
            store._lock()
            try:
                store._reserve(capacity)
            finally:
                store._unlock()
            store._touch()
            store.commit_s = time.perf_counter() - start
        return store

    def _touch(self) -> None:
        """Fault every reserved page of the arena in once (a read fault of a memfd page
        that ``fallocate`` reserved clears it; on a VM it is also where the host first backs
        it: 0.5-3 s a GiB on the development VM, ~10x the reservation), so that no process
        of the server meets a fresh page later. The mapping made for it goes at once."""
        committed = self.committed
        if committed <= 0 or not _MAP_POPULATE:
            return
        m = mmap.mmap(self._arena_fd, committed, flags=mmap.MAP_SHARED | _MAP_POPULATE)
        m.close()

    @classmethod
    def attach(cls, index_fd: int, arena_fd: int, capacity: int, populate: bool = False) -> Store:
        """Another handle on the store whose memfds are ``index_fd``, ``arena_fd`` (as
        inherited from the front, or the front's own), checked first: regular files of
        the store's sizes, sealed, with a store's header. The given descriptors are left
        open; the handle has its own. ``populate``: see ``Store``. Raises
        ``StoreUnusable`` naming what is wrong."""
        _, index_bytes = _layout(capacity)
        index = _reopen(index_fd, index_bytes, "index")
        try:
            arena = _reopen(arena_fd, capacity, "arena")
        except BaseException:
            os.close(index)
            raise
        return cls(index, arena, capacity, populate=populate)

    @property
    def committed(self) -> int:
        """Arena bytes whose pages are reserved so far."""
        return int(self.header[0]["reserved"])

    @property
    def fds(self) -> tuple[int, int]:
        """The (index, arena) descriptors, for ``attach`` in this or a child process."""
        return self._index_fd, self._arena_fd

    def _populate(self) -> None:
        """Map the arena's pages into this process, a chunk at a time (each call holds the
        GIL for ~0.3 ms), until done or closed. Without ``MADV_POPULATE_READ`` (Linux <
        5.14) the pages are mapped as they are first touched."""
        step = 4 << 20
        try:
            for start in range(0, self.capacity, step):
                if self._closing.is_set():
                    return
                self._arena_map.madvise(
                    _MADV_POPULATE_READ, start, min(step, self.capacity - start)
                )
        except (OSError, ValueError):  # (an older kernel; or closed meanwhile)
            return
        self.populated.set()

    def close(self) -> None:
        """Unmap (once no view of a source read from it is alive: until then, the maps
        stay, and go with the last view) and close the descriptors."""
        self._closing.set()
        del self.header, self.table, self.journal, self.arena
        for m in (self._index_map, self._arena_map):
            try:
                m.close()
            except BufferError:
                pass
        os.close(self._index_fd)
        os.close(self._arena_fd)

    # ------------------------------------------------------------ locking

    def _lock(self) -> None:
        fcntl.flock(self._index_fd, fcntl.LOCK_EX)
        h = self.header[0]
        if int(h["dirty"]):  # a process died mid-change: start afresh
            log.warning("store: a process died while changing it; emptied")
            self.table[:] = 0
            self.journal[:] = 0
            h["journal_head"] = h["journal_tail"] = 0
            h["dirty"] = 0

    def _unlock(self) -> None:
        fcntl.flock(self._index_fd, fcntl.LOCK_UN)

    def _dirty(self, on: bool) -> None:
        self.header[0]["dirty"] = 1 if on else 0

    # ------------------------------------------------------------ hash table

    def _find(self, k0: int, k1: int) -> int:
        """The slot holding the key, or -1."""
        n = self.entries
        table = self.table
        i = k0 % n
        for _ in range(n):
            e = table[i]
            if int(e["state"]) == EMPTY:
                return -1
            if int(e["k0"]) == k0 and int(e["k1"]) == k1:
                return i
            i = (i + 1) % n
        return -1

    def _free_slot(self, k0: int) -> int:
        n = self.entries
        i = k0 % n
        for _ in range(n):
            if int(self.table[i]["state"]) == EMPTY:
                return i
            i = (i + 1) % n
        return -1

    def _delete(self, i: int) -> None:
        """Empty slot ``i``, moving later entries of its cluster back (no tombstones)."""
        n = self.entries
        table = self.table
        table[i] = 0
        j = i
        while True:
            j = (j + 1) % n
            if int(table[j]["state"]) == EMPTY:
                return
            home = int(table[j]["k0"]) % n
            # j may move to i unless its home lies cyclically in (i, j].
            between = (i < home <= j) if i <= j else (home > i or home <= j)
            if not between:
                table[i] = table[j]
                table[j] = 0
                i = j

    # ------------------------------------------------------------ ring

    def _reserve(self, end: int) -> None:
        """Reserve arena pages up to ``end`` (first lap only), in chunks, smaller ones when
        a chunk does not fit; when nothing more fits, the ring ends where reserved pages
        end (a write to a page that cannot be had would kill the process)."""
        h = self.header[0]
        reserved = int(h["reserved"])
        size = CHUNK
        while reserved < end and reserved < self.capacity:
            size = min(size, self.capacity - reserved)
            try:
                os.posix_fallocate(self._arena_fd, reserved, size)
            except OSError as exc:
                if exc.errno not in (errno.ENOSPC, errno.ENOMEM):
                    raise
                if size > (1 << 20):
                    size //= 2
                    continue
                log.warning(
                    "store: shared memory ran out at %d MiB; the store is that big", reserved >> 20
                )
                h["ring"] = max(reserved, 1)
                h["reserved"] = reserved
                return
            reserved += size
        h["reserved"] = reserved

    def _alloc(self, nbytes: int) -> int:
        """Make room for ``nbytes`` at the head (evicting the oldest); return its position,
        or -1 when it cannot be held."""
        h = self.header[0]
        head = int(h["head"])
        ring = int(h["ring"])
        if head < ring:  # first lap: the pages must be reserved first
            self._reserve(min(head + nbytes, self.capacity))
            ring = int(h["ring"])
        if nbytes > ring // 4:
            return -1
        if head % ring + nbytes > ring:  # does not fit before the end: start the next lap
            head += ring - head % ring
        end = head + nbytes
        self._evict_before(end - ring)
        h["head"] = end
        return head

    def _evict_before(self, position: int) -> None:
        """Drop every entry whose bytes begin before ``position``, oldest first."""
        h = self.header[0]
        tail, jhead = int(h["journal_tail"]), int(h["journal_head"])
        n = self.entries
        while tail < jhead:
            rec = self.journal[tail % n]
            pos = int(rec["pos"])
            if pos >= position:
                break
            i = self._find(int(rec["k0"]), int(rec["k1"]))
            if i >= 0 and int(self.table[i]["state"]) == READY and int(self.table[i]["pos"]) == pos:
                self._delete(i)
                self.stats.evictions += 1
            tail += 1
        h["journal_tail"] = tail

    def _journal(self, pos: int, k0: int, k1: int) -> None:
        h = self.header[0]
        n = self.entries
        if int(h["journal_head"]) - int(h["journal_tail"]) >= n:  # full: the oldest goes
            self._evict_before(int(self.journal[int(h["journal_tail"]) % n]["pos"]) + 1)
        jhead = int(h["journal_head"])
        rec = self.journal[jhead % n]
        rec["pos"], rec["k0"], rec["k1"] = pos, k0, k1
        h["journal_head"] = jhead + 1

    def _ready_count(self) -> int:
        h = self.header[0]
        return int(h["journal_head"]) - int(h["journal_tail"])

    # ------------------------------------------------------------ use

    def admit_fraction(self, population: int) -> float:
        """Under the lock: the share of a family of ``population`` sources (one dataset at
        one stored size; the largest one seen is kept for ``usage``) that this store keeps:
        all of them when they fit (or while fewer than ``ADMIT_AFTER`` puts say what an
        entry's size is), else ``ADMIT_SHARE`` of what it can hold (its ring, or its table's
        entries at the mean entry's size) over their estimated bytes (the mean entry's size
        so far, times ``population``)."""
        h = self.header[0]
        if population > int(h["population"]):
            h["population"] = population
        puts = int(h["puts"])
        if population <= 0 or puts < ADMIT_AFTER:
            return 1.0
        mean = int(h["put_bytes"]) / puts
        # What it can hold: its bytes, or the entries its table keeps before it evicts
        # (``_claim``: at three quarters full), whichever is less.
        room = min(int(h["ring"]), self._keepable_entries() * mean)
        need = population * mean
        return min(1.0, ADMIT_SHARE * room / need) if need > 0 else 1.0

    def _keepable_entries(self) -> int:
        """Entries its table keeps before it evicts (``_claim``: at three quarters full)."""
        return self.entries * 3 // 4 - 1

    def _intact_at(self, position: int) -> bool:
        """Under the lock: whether the bytes at ``position`` were not written over since."""
        h = self.header[0]
        return int(h["head"]) - int(h["ring"]) <= position

    def _overrun(self, i: int) -> bool:
        """Under the lock: whether entry ``i``'s bytes were written over (the ring came
        round before the journal let it go); if so it is dropped (never read, never
        refreshed from)."""
        if self._intact_at(int(self.table[i]["pos"])):
            return False
        self._dirty(True)
        self._delete(i)
        self._dirty(False)
        return True

    def _claim(self, k0: int, k1: int, take_over: bool, fraction: float = 1.0) -> tuple[Claim, int]:
        """Under the lock: what this process does about the source ``(k0, k1)``, the one
        rule ``get`` and ``fetch`` share. ``HIT``: it is stored (refreshed; the second
        value is its position). ``MINE``: its entry is now PENDING under this pid, so this
        process makes it (a new entry, one of its own, one whose maker died, or, with
        ``take_over``, one another worker was making for too long). ``BUSY``: another live
        worker is making it. ``FULL``: no slot is free for it (make it, keep it nowhere).
        ``SKIP``: not among the ``fraction`` of its family the store admits (``admitted``).
        An entry read is refreshed only while everything is admitted: a store holding an
        admitted subset keeps it in place (refreshing would push admitted entries out)."""
        i = self._find(k0, k1)
        if i >= 0 and int(self.table[i]["state"]) == READY:
            if not self._overrun(i):
                self.stats.hits += 1
                pos = self._refresh(i) if fraction >= 1.0 else int(self.table[i]["pos"])
                return Claim.HIT, pos
            i = -1  # (dropped: made again)
        if i < 0 and not admitted(k1, fraction):
            return Claim.SKIP, -1
        if i >= 0:  # PENDING
            owner = int(self.table[i]["pid"])
            if not (take_over or owner == self._pid or not pid_alive(owner)):
                return Claim.BUSY, -1
            self._dirty(True)
            self.table[i]["pid"] = self._pid
            self._dirty(False)
            return Claim.MINE, -1
        if self._ready_count() >= self.entries * 3 // 4:  # the table is filling
            self._dirty(True)
            h = self.header[0]
            self._evict_before(int(h["head"]) - int(h["ring"]) // 2)
            self._dirty(False)
        slot = self._free_slot(k0)
        if slot < 0:
            return Claim.FULL, -1
        self._dirty(True)
        e = self.table[slot]
        e["k0"], e["k1"], e["state"], e["pid"] = k0, k1, PENDING, self._pid
        self._dirty(False)
        return Claim.MINE, -1

    def get(
        self, key: tuple[int, int], make: Callable[[], Source], population: int = 0
    ) -> tuple[Source, int]:
        """The source for ``key``: from the store, or made by ``make()`` and stored. While
        another live worker makes the same source, wait for it (at most
        ``PENDING_WAIT_S``) instead of making it twice. Returns (source, position);
        position >= 0 means its arrays are views into the ring: check
        ``intact(position)`` after using them. ``population``: how many sources the key's
        family has (``admit_fraction``; 0: unknown, all admitted)."""
        k0, k1 = key
        deadline = time.monotonic() + PENDING_WAIT_S
        waited = False
        while True:
            self._lock()
            try:
                fraction = self.admit_fraction(population)
                claim, pos = self._claim(k0, k1, time.monotonic() > deadline, fraction)
                if claim is Claim.HIT:
                    self.stats.waits += waited
                    return self._view(k0, k1, pos), pos
            finally:
                self._unlock()
            if claim is Claim.FULL or claim is Claim.SKIP:
                self.stats.skipped += claim is Claim.SKIP
                return make(), -1  # not kept: make it, do not keep it
            if claim is Claim.MINE:
                break
            waited = True
            time.sleep(0.0005)
        self.stats.misses += 1
        try:
            source = make()
        except BaseException:
            self._forget(k0, k1)
            raise
        self._put_many([(key, source)])
        return source, -1

    def fetch(
        self,
        keys: list[tuple[int, int]],
        make: Callable[..., Source],
        population: int = 0,
        into: bool = False,
        recent: bool = False,
        misses: Callable[[list[int]], None] | None = None,
    ) -> tuple[list[Source | None], int]:
        """``get`` for many keys under one lock: the sources (``make(i)`` for the i-th key
        where the store lacks it, or None where ``make`` raised: call ``make(i)`` again to
        see why), and the oldest ring position read (check ``intact`` once after use).
        ``population``: as for ``get``. ``into``: ``make(i, planes_for)`` for a source the
        store will keep, where ``planes_for`` (``pipeline.PlanesFor``) hands the planes'
        place in the store itself: such a source is stored without a copy, and is read from
        the store like a hit (its position counts in the one returned). ``recent``: the
        sources are read again soon (a window mosaic's: each is a partner of the next
        outputs of the epoch, ``mosaic_partners="window"``; a batch the client's lookahead
        composes in both modes: its twin, ``Task.recent``), so every one is kept, as when
        the dataset fits, whatever subset a larger dataset has admitted: the ring keeps
        what is recent, and no source is decoded again for its window (with the subset
        alone, a store half the dataset decoded two sources per mosaic, not one).
        ``misses(ks)``: told the keys this call will make, before it makes any (a dataset
        in object storage starts fetching them all at once)."""
        out: list[Source | None] = [None] * len(keys)
        views: list[int] = []  # positions of hits
        mine: list[int] = []  # keys this call makes
        later: list[int] = []  # keys another live worker is making (or with no slot)
        kept: list[bool] = [True] * len(keys)  # False: made and kept nowhere (not admitted)
        self._lock()
        try:
            fraction = self.admit_fraction(population)
            if recent:
                fraction = 1.0
            for i, (k0, k1) in enumerate(keys):
                claim, pos = self._claim(k0, k1, False, fraction)
                if claim is Claim.HIT:
                    views.append(pos)
                    out[i] = self._view(k0, k1, pos)
                elif claim is Claim.SKIP:
                    kept[i] = False
                    mine.append(i)
                else:
                    (mine if claim is Claim.MINE else later).append(i)
        finally:
            self._unlock()
        if misses is not None and mine + later:
            misses(mine + later)
        placed = self._make_and_keep(keys, mine, kept, make, out, into)
        if placed >= 0:
            views.append(placed)
        for i in later:  # rare: wait for the other worker, one by one
            try:
                out[i], pos = self.get(keys[i], partial(make, i), population)
            except Exception:
                continue
            if pos >= 0:
                views.append(pos)
        return out, min(views, default=-1)

    def _make_and_keep(
        self,
        keys: list[tuple[int, int]],
        mine: list[int],
        kept: list[bool],
        make: Callable[..., Source],
        out: list[Source | None],
        into: bool,
    ) -> int:
        """``fetch``'s misses: make each of ``mine`` into ``out`` (with ``into``, those
        ``kept`` straight into the store), then store those ``kept`` (admitted) under one
        lock; a failed one's PENDING entry is dropped. Returns the oldest position of a
        source made in the store (-1: none)."""
        made: list[tuple[tuple[int, int], Source]] = []
        for i in mine:
            self.stats.misses += 1
            self.stats.skipped += not kept[i]
            try:
                source = make(i, self._planes_for(*keys[i])) if into and kept[i] else make(i)
            except Exception:
                if kept[i]:
                    self._placing.pop(keys[i], None)
                    self._forget(*keys[i])
                continue
            out[i] = source
            if kept[i]:
                made.append((keys[i], source))
        placed = [
            self._placing[key][0]
            for key, source in made
            if key in self._placing and _same_bytes(self._placing[key][2], source.image)
        ]
        if made:
            self._put_many(made)
        return min(placed, default=-1)

    def _planes_for(self, k0: int, k1: int) -> Callable[[int, int, int, int], np.ndarray | None]:
        """``pipeline.PlanesFor`` for the source ``(k0, k1)`` this process is making (its
        entry PENDING, its own): the ring bytes for its planes, boxes, labels and file name
        reserved at the head, and its planes' place there handed out (None: no room, or the
        entry is no longer this process's: new memory, stored by a copy)."""

        def planes_for(h: int, w: int, boxes: int, name: int) -> np.ndarray | None:
            img = 3 * h * w
            nbytes = img + 24 * boxes + name
            self._lock()
            try:
                i = self._find(k0, k1)
                if (
                    i < 0
                    or int(self.table[i]["state"]) != PENDING
                    or int(self.table[i]["pid"]) != self._pid
                ):
                    return None
                self._dirty(True)
                pos = self._alloc(nbytes)
                if pos >= 0:  # journalled now, so the journal stays in ring order
                    self._journal(pos, k0, k1)
                self._dirty(False)
                ring = int(self.header[0]["ring"])
            finally:
                self._unlock()
            if pos < 0:
                return None
            off = pos % ring
            planes = self.arena[off : off + img].reshape(3, h, w)
            self._placing[(k0, k1)] = (pos, nbytes, planes)
            return planes

        return planes_for

    def intact(self, position: int) -> bool:
        """Whether the bytes read at ``position`` were not written over since."""
        if position < 0:
            return True
        self._lock()
        try:
            ok = self._intact_at(position)
        finally:
            self._unlock()
        if not ok:
            self.stats.torn += 1
        return ok

    def _forget(self, k0: int, k1: int) -> None:
        self._lock()
        try:
            i = self._find(k0, k1)
            if (
                i >= 0
                and int(self.table[i]["state"]) == PENDING
                and int(self.table[i]["pid"]) == self._pid
            ):
                self._dirty(True)
                self._delete(i)
                self._dirty(False)
        finally:
            self._unlock()

    def _put_many(self, items: list[tuple[tuple[int, int], Source]]) -> None:
        """Store sources this process made (their entries PENDING, its own), one lock."""
        self._lock()
        try:
            for (k0, k1), source in items:
                self._store_one(k0, k1, source)
        finally:
            self._unlock()

    def _store_one(self, k0: int, k1: int, source: Source) -> None:
        h, w = source.hw
        m = len(source.boxes)
        img = 3 * h * w
        name = source.file.encode()
        nbytes = img + 24 * m + len(name)
        placing = self._placing.pop((k0, k1), None)
        i = self._find(k0, k1)
        if (
            i < 0
            or int(self.table[i]["state"]) != PENDING
            or int(self.table[i]["pid"]) != self._pid
        ):
            return  # taken over meanwhile: the other one will store it
        self._dirty(True)
        # Made in the store itself (``_planes_for``): its planes are in place, unless the
        # ring came round over them meanwhile (then they are dropped, never believed).
        in_store = placing is not None and _same_bytes(placing[2], source.image)
        placed = (
            placing is not None
            and in_store
            and nbytes <= placing[1]
            and self._intact_at(placing[0])
        )
        pos = placing[0] if placing is not None and placed else self._alloc(nbytes)
        i = self._find(k0, k1)  # eviction may have moved our slot
        if pos < 0 or (in_store and not placed):
            if i >= 0:
                self._delete(i)
            self._dirty(False)
            return
        ring = int(self.header[0]["ring"])
        off = pos % ring
        parts = [
            np.ascontiguousarray(source.image).reshape(-1),
            np.ascontiguousarray(source.boxes, np.float32).reshape(-1).view(np.uint8),
            np.ascontiguousarray(source.labels, np.int64).reshape(-1).view(np.uint8),
            np.frombuffer(name, np.uint8),
        ]
        if placed:  # only what follows the planes is written
            _copy_at(self.arena, parts[1:], off + img)
        elif self._mapped:  # the pages are mapped here already: a plain copy
            _copy_at(self.arena, parts, off)
        elif not _write_at(self._arena_fd, parts, off, nbytes):
            arena = self.arena  # (a short write: through the mapping)
            arena[off : off + img] = parts[0]
            arena[off + img : off + img + 16 * m] = parts[1]
            arena[off + img + 16 * m : off + img + 24 * m] = parts[2]
            arena[off + img + 24 * m : off + nbytes] = parts[3]
        e = self.table[i]
        e["pos"], e["nbytes"], e["h"], e["w"], e["nboxes"] = pos, nbytes, h, w, m
        e["orig_h"], e["orig_w"], e["nfile"] = source.orig_hw[0], source.orig_hw[1], len(name)
        e["state"], e["pid"] = READY, 0
        if not placed:  # (a placed one was journalled when its bytes were reserved)
            self._journal(pos, k0, k1)
        hd = self.header[0]
        hd["puts"], hd["put_bytes"] = int(hd["puts"]) + 1, int(hd["put_bytes"]) + nbytes
        self._dirty(False)

    def _view(self, k0: int, k1: int, pos: int) -> Source:
        e = self.table[self._find(k0, k1)]
        h, w, m = int(e["h"]), int(e["w"]), int(e["nboxes"])
        off = pos % int(self.header[0]["ring"])
        img = 3 * h * w
        image = self.arena[off : off + img].reshape(3, h, w)
        boxes = self.arena[off + img : off + img + 16 * m].view(np.float32).reshape(m, 4)
        labels = self.arena[off + img + 16 * m : off + img + 24 * m].view(np.int64)
        nfile = int(e["nfile"])
        name = bytes(self.arena[off + img + 24 * m : off + img + 24 * m + nfile]) if nfile else b""
        orig = (int(e["orig_h"]), int(e["orig_w"]))
        return Source(image, boxes, labels, name.decode(errors="replace"), orig)

    def _refresh(self, i: int) -> int:
        """An entry in the oldest quarter of the ring is copied to the head (so what is
        read stays, and what is not goes first). Returns its (new) position."""
        hd = self.header[0]
        e = self.table[i]
        pos, nbytes, ring = int(e["pos"]), int(e["nbytes"]), int(hd["ring"])
        if pos >= int(hd["head"]) - ring + ring // 4 or nbytes > ring // 4:
            return pos
        k0, k1, h, w, m = int(e["k0"]), int(e["k1"]), int(e["h"]), int(e["w"]), int(e["nboxes"])
        meta = (int(e["orig_h"]), int(e["orig_w"]), int(e["nfile"]))
        data = self.arena[pos % ring : pos % ring + nbytes].copy()
        self._dirty(True)
        new = self._alloc(nbytes)
        ring = int(hd["ring"])
        i = self._find(k0, k1)
        if i < 0:  # evicted to make room for itself (a store of a few entries)
            i = self._free_slot(k0)
            self.table[i]["k0"], self.table[i]["k1"] = k0, k1
        e = self.table[i]
        e["state"], e["pid"], e["pos"], e["nbytes"] = READY, 0, new, nbytes
        e["h"], e["w"], e["nboxes"] = h, w, m
        e["orig_h"], e["orig_w"], e["nfile"] = meta
        self.arena[new % ring : new % ring + nbytes] = data
        self._journal(new, k0, k1)
        self._dirty(False)
        self.stats.refreshes += 1
        return new

    def usage(self) -> dict[str, Any]:
        """Entries and bytes held, bytes committed, and the share of the largest dataset
        seen that it admits (for stats)."""
        self._lock()
        try:
            ready = self.table["state"] == READY
            h = self.header[0]
            puts = int(h["puts"])
            population = int(h["population"])
            admitted = round(self.admit_fraction(population), 4)
            mean = int(h["put_bytes"]) // puts if puts else 0
            return {
                "entries": int(np.count_nonzero(ready)),
                "bytes": int(self.table["nbytes"][ready].sum()),
                "capacity_bytes": int(h["ring"]),
                "committed_bytes": int(h["reserved"]),
                "admitted": admitted,
                "mean_entry_bytes": mean,
                "admission": self._admission(population, puts, mean, admitted),
            }
        finally:
            self._unlock()

    def _admission(self, population: int, puts: int, mean: int, admitted: float) -> str:
        """Why the store keeps what it keeps, in one line (STATS' ``admission``)."""
        if population <= 0 or puts < ADMIT_AFTER:
            return f"all (fewer than {ADMIT_AFTER} sources stored: entry size not known yet)"
        need = population * mean
        if admitted >= 1.0:
            return f"all: {population} sources x {mean} bytes fit in {int(self.header[0]['ring'])}"
        return (
            f"a fixed subset ({admitted:.1%}): {population} sources x {mean} bytes "
            f"({need / 1e6:.0f} MB) exceed what it holds ({int(self.header[0]['ring']) / 1e6:.0f}"
            f" MB, {self._keepable_entries()} entries); the same sources every epoch, so none "
            "is evicted before it is read again"
        )


def _write_at(fd: int, parts: list[np.ndarray], offset: int, nbytes: int) -> bool:
    """Write ``parts`` (``nbytes`` in all) at ``offset`` of the arena with one ``pwritev``,
    not through this process's mapping, where its pages are not mapped here: mapping them
    would cost a minor fault a 4 KiB page (readers map what they read). A fresh store's put
    of a 590 KB source, one process: ~650 us through an unpopulated mapping, ~390 us this
    way. False after a short write."""
    return os.pwritev(fd, [p.data for p in parts], offset) == nbytes


def _copy_at(arena: np.ndarray, parts: list[np.ndarray], offset: int) -> None:
    """Copy ``parts`` one after another into ``arena`` from ``offset``: through a mapping
    whose pages are all mapped (``MAP_POPULATE``), a ``memcpy`` and nothing else (a 590 KB
    source: ~50 us, against ~120 us for ``pwritev``'s page-cache walk)."""
    for part in parts:
        n = part.nbytes
        arena[offset : offset + n] = part
        offset += n


_MAP_POPULATE: int = getattr(mmap, "MAP_POPULATE", 0)  # (Linux; 0: mapped lazily)
_MADV_POPULATE_READ: int = getattr(mmap, "MADV_POPULATE_READ", 22)  # (Linux >= 5.14)

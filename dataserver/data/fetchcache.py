"""The fetch cache: encoded bytes fetched from an object store, kept in memory (``MemCache``:
two sealed memfds the front makes and its workers inherit, no name on the host), or as
files in one directory that every process of a server shares (``--fetch-cache DIR`` on
local disk, ``ByteCache``, kept across restarts).

Each process keeps its own share of the budget (``--fetch-cache-gb`` over the processes
that write): it evicts, oldest first, only the files it wrote (or, at start, the files
whose key falls in its share), so the directory never holds more than the budget and no
two processes fight over one file. Any process reads any file. A file is written whole
under a temporary name and renamed, so a reader sees a complete object or none; a file
gone between a lookup and its read is a miss, fetched again. Nothing here knows a URL's
credentials: the key is a hash of the URL and the byte range.
"""

from __future__ import annotations

import fcntl
import hashlib
import mmap
import os
import tempfile
import threading
from collections import OrderedDict
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from dataserver.memfd import sealed_memfd


@dataclass(frozen=True)
class CacheUsage:
    """What one process's share of the cache holds (``dataserver stats``'s ``fetch_cache``)."""

    where: str  # "memory" or "disk"
    files: int
    bytes: int
    budget: int


def cache_key(url: str, start: int | None, length: int | None) -> str:
    """The file name of an object's bytes (or a range of them)."""
    text = f"{url}|{start}|{length}"
    return hashlib.sha1(text.encode()).hexdigest()


def memory_dir() -> str:
    """A new private directory beside an in-memory cache (whose bytes are in memfds,
    ``MemCache``): what every process of a server reads at start (an annotation file, a
    shard index), in the temporary directory, removed at exit."""
    return tempfile.mkdtemp(prefix="dataserver-fetch-")


class ByteCache:
    """(``--fetch-cache DIR``) One process's view of the shared cache directory (see the module's docstring).

    ``budget``: the bytes this process may keep; ``share``: (its slot, the slots sharing
    the directory), which old files it adopts at start. Errors writing (a full disk or
    ``/dev/shm``) are not errors of the sample: the bytes are just not kept."""

    def __init__(self, directory: str, budget: int, share: tuple[int, int], where: str) -> None:
        self.directory = Path(directory)
        self.budget = max(0, budget)
        self.where = where
        self._mine: OrderedDict[str, int] = OrderedDict()  # key -> size, oldest first
        self._bytes = 0
        slot, slots = share
        if not self.budget:  # a reader only: it adopts (and so evicts) nothing
            return
        try:
            found = sorted(
                (entry.stat().st_mtime, entry.name, entry.stat().st_size)
                for entry in os.scandir(self.directory)
                if entry.is_file() and len(entry.name) == 40
            )
        except OSError:
            found = []
        for _, name, size in found:  # adopt the old files of this share, oldest first
            if int(name[:8], 16) % max(1, slots) == slot:
                self._mine[name] = size
                self._bytes += size
        self._evict(0)

    def get(self, key: str) -> bytes | None:
        """The bytes kept under ``key``, or None."""
        try:
            with open(self.directory / key, "rb") as f:
                data = f.read()
        except OSError:
            return None
        if key in self._mine:
            self._mine.move_to_end(key)
        return data

    def holds(self, key: str) -> bool:
        """Whether ``key``'s bytes are kept (by this process, or any other: a file there)."""
        return key in self._mine or (self.directory / key).exists()

    def put(self, key: str, data: bytes) -> None:
        """Keep ``data`` under ``key`` (within this process's budget; never raises)."""
        size = len(data)
        if size > self.budget or key in self._mine:
            return
        self._evict(size)
        try:
            fd, tmp = tempfile.mkstemp(dir=self.directory, prefix=".part-")
            with os.fdopen(fd, "wb") as f:
                f.write(data)
            os.replace(tmp, self.directory / key)
        except OSError:
            try:
                os.unlink(tmp)
            except (OSError, UnboundLocalError):
                pass
            return
        self._mine[key] = size
        self._bytes += size

    def _evict(self, room: int) -> None:
        """Remove this process's oldest files until ``room`` more bytes fit its budget."""
        while self._mine and self._bytes + room > self.budget:
            key, size = self._mine.popitem(last=False)
            self._bytes -= size
            try:
                os.unlink(self.directory / key)
            except OSError:
                pass

    def usage(self) -> CacheUsage:
        return CacheUsage(self.where, len(self._mine), self._bytes, self.budget)


def directory_usage(directory: str) -> tuple[int, int]:
    """(files, bytes) the cache directory holds now, all processes' shares together (what
    the front states in STATS; a scan, so it reads it at most once a second)."""
    files = total = 0
    try:
        for entry in os.scandir(directory):
            if len(entry.name) == 40:
                try:
                    total += entry.stat().st_size
                except OSError:
                    continue
                files += 1
    except OSError:
        pass
    return files, total


_HEADER = 16  # the index memfd: write position (bytes ever written), slots
_SLOT = 32  # a slot: the key (two u64), its bytes' absolute position, their size
_PROBE = 16  # slots a key may sit in (from its hash on); beyond, the oldest is replaced
_ENTRY_GUESS = 32 << 10  # bytes an entry is taken to hold, to size the slots


class MemCache:
    """The in-memory fetch cache: fetched bytes in two sealed memfds (an index and a ring
    of bytes) that the front creates and its workers inherit, so nothing of it has a name
    on the host: it goes with the last process that maps it, SIGKILL included.

    The bytes are written one after another around the ring; an entry is valid while the
    ring has not come round over it (its position + the capacity >= what was ever
    written), so the oldest go first. A key sits in one of ``_PROBE`` slots from its hash
    (a slot of an overwritten entry is free again; beyond, the oldest is replaced). Every
    access holds an ``flock`` on the process's own open file description of the index (and
    a thread lock): any process reads and writes, none sees a half-written entry."""

    where = "memory"

    def __init__(self, index_fd: int, arena_fd: int) -> None:
        self._fds = (index_fd, arena_fd)
        self.budget = os.fstat(arena_fd).st_size
        self._index_map = mmap.mmap(index_fd, os.fstat(index_fd).st_size)
        self._arena = mmap.mmap(arena_fd, self.budget)
        head = np.ndarray((2,), np.uint64, buffer=self._index_map)
        self._head = head
        self._slots = np.ndarray(
            (int(head[1]), 4), np.uint64, buffer=self._index_map, offset=_HEADER
        )
        self._lock_fd = os.open(f"/proc/self/fd/{index_fd}", os.O_RDWR | os.O_CLOEXEC)
        self._thread_lock = threading.Lock()

    @classmethod
    def create(cls, capacity: int) -> MemCache:
        """A new cache of ``capacity`` bytes (its memfds: ``fds``, for the workers)."""
        capacity = max(1 << 20, capacity)
        slots = max(1024, capacity // _ENTRY_GUESS)
        index_fd = sealed_memfd("dataserver-fetch-index", _HEADER + slots * _SLOT)
        arena_fd = sealed_memfd("dataserver-fetch", capacity)
        cache = cls(index_fd, arena_fd)
        cache._head[1] = slots
        cache._slots = np.ndarray((slots, 4), np.uint64, buffer=cache._index_map, offset=_HEADER)
        return cache

    @property
    def fds(self) -> tuple[int, int]:
        return self._fds

    @staticmethod
    def _key(key: str) -> tuple[int, int]:
        return int(key[:16], 16), int(key[16:32], 16)

    def _locked(self) -> _Flock:
        return _Flock(self._thread_lock, self._lock_fd)

    def _find(self, k0: int, k1: int) -> int:
        """The slot of a valid entry of the key (under the lock), or -1."""
        written = int(self._head[0])
        n = len(self._slots)
        for j in range(_PROBE):
            s = self._slots[(k0 + j) % n]
            same = int(s[0]) == k0 and int(s[1]) == k1
            if same and int(s[2]) + self.budget >= written and (int(s[3]) or int(s[2])):
                return (k0 + j) % n
        return -1

    def get(self, key: str) -> bytes | None:
        k0, k1 = self._key(key)
        with self._locked():
            slot = self._find(k0, k1)
            if slot < 0:
                return None
            pos, size = int(self._slots[slot, 2]), int(self._slots[slot, 3])
            start = pos % self.budget
            return bytes(self._arena[start : start + size])

    def holds(self, key: str) -> bool:
        k0, k1 = self._key(key)
        with self._locked():
            return self._find(k0, k1) >= 0

    def put(self, key: str, data: bytes) -> None:
        """Keep ``data`` (an entry over a quarter of the ring is not kept). Its room is
        taken under the lock (what was written moves past it, so no reader looks there),
        the bytes copied outside it, the entry made under it again, if the ring has not
        come round over it meanwhile."""
        size = len(data)
        if size > self.budget // 4:
            return
        k0, k1 = self._key(key)
        with self._locked():
            if self._find(k0, k1) >= 0:
                return
            pos = int(self._head[0])
            if pos % self.budget + size > self.budget:  # (not across the end: from the start)
                pos += self.budget - pos % self.budget
            self._head[0] = pos + size
        start = pos % self.budget
        self._arena[start : start + size] = data
        with self._locked():
            if pos + self.budget < int(self._head[0]):
                return  # (written over already)
            n = len(self._slots)
            best, oldest = -1, None
            for j in range(_PROBE):
                i = (k0 + j) % n
                s = self._slots[i]
                written = int(self._head[0])
                if int(s[2]) + self.budget < written or (not int(s[2]) and not int(s[3])):
                    best = i
                    break
                if oldest is None or int(s[2]) < int(self._slots[oldest, 2]):
                    oldest = i
            i = best if best >= 0 else (oldest if oldest is not None else k0 % n)
            self._slots[i] = (k0, k1, pos, size)

    def usage(self) -> CacheUsage:
        """What it holds now (every process's entries: a scan of the slots)."""
        with self._locked():
            written = int(self._head[0])
            slots = self._slots
            valid = (slots[:, 2].astype(np.int64) + self.budget >= written) & (
                (slots[:, 2] > 0) | (slots[:, 3] > 0)
            )
            total = int(slots[valid, 3].sum())
            return CacheUsage("memory", int(valid.sum()), total, self.budget)

    def close(self) -> None:
        os.close(self._lock_fd)


class _Flock:
    def __init__(self, lock: threading.Lock, fd: int) -> None:
        self._lock = lock
        self._fd = fd

    def __enter__(self) -> None:
        self._lock.acquire()
        fcntl.flock(self._fd, fcntl.LOCK_EX)

    def __exit__(self, *_: object) -> None:
        fcntl.flock(self._fd, fcntl.LOCK_UN)
        self._lock.release()

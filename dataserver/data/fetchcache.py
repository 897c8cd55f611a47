"""The fetch cache: encoded bytes fetched from an object store, kept as files in one
directory that every process of a server shares (``--fetch-cache DIR`` on local disk, or
a private directory in memory, ``/dev/shm``, that the front makes and removes).

Each process keeps its own share of the budget (``--fetch-cache-gb`` over the processes
that write): it evicts, oldest first, only the files it wrote (or, at start, the files
whose key falls in its share), so the directory never holds more than the budget and no
two processes fight over one file. Any process reads any file. A file is written whole
under a temporary name and renamed, so a reader sees a complete object or none; a file
gone between a lookup and its read is a miss, fetched again. Nothing here knows a URL's
credentials: the key is a hash of the URL and the byte range.
"""

from __future__ import annotations

import hashlib
import os
import tempfile
from collections import OrderedDict
from dataclasses import dataclass
from pathlib import Path

MEMORY_ROOT = "/dev/shm"  # where the in-memory cache lives when no --fetch-cache DIR is given


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
    """A new private directory for an in-memory cache (``/dev/shm`` where there is one, else
    the temporary directory: its pages then sit in the page cache)."""
    root = MEMORY_ROOT if os.path.isdir(MEMORY_ROOT) and os.access(MEMORY_ROOT, os.W_OK) else None
    return tempfile.mkdtemp(prefix="dataserver-fetch-", dir=root)


class ByteCache:
    """One process's view of the shared cache directory (see the module's docstring).

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

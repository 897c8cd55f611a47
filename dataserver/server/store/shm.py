"""The store's shared memory: two anonymous memfds (the index and the arena), sealed against
shrinking and growing once sized, that the front creates (``new_fds``) and every worker it
starts inherits and checks before use (``reopen_fds``, ``_reopen``: regular files of the
right sizes, sealed; ``StoreUnusable`` otherwise). One ``SharedMemory`` is one process's
mapping of them: the ``flock`` on the index that serialises every change (each handle opens
the index afresh, so its lock is its own), page reservation (``fallocate``), the one-off fault
of every committed page (``touch``), the mapping of the whole arena in a thread of its own
(``MADV_POPULATE_READ``), writes through the descriptor where pages are not mapped here
(``write_at``: ``pwritev``), and closing. It knows nothing of what the bytes mean."""

from __future__ import annotations

import fcntl
import mmap
import os
import stat
import threading

import numpy as np

from dataserver.memfd import SIZE_SEALS, sealed_memfd
from dataserver.server.store.layout import HEADER


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


def new_fds(capacity: int, index_bytes: int) -> tuple[int, int]:
    """The (index, arena) memfds of a new store, sealed at their sizes; the index's pages
    reserved now."""
    index_fd = sealed_memfd("dataserver-store-index", index_bytes)
    try:
        os.posix_fallocate(index_fd, 0, index_bytes)
        arena_fd = sealed_memfd("dataserver-store-arena", capacity)
    except BaseException:
        os.close(index_fd)
        raise
    return index_fd, arena_fd


def reopen_fds(index_fd: int, arena_fd: int, capacity: int, index_bytes: int) -> tuple[int, int]:
    """Descriptors of this process's own for the store's memfds ``index_fd``, ``arena_fd``
    (as inherited), checked first (``_reopen``); the given ones are left open."""
    index = _reopen(index_fd, index_bytes, "index")
    try:
        arena = _reopen(arena_fd, capacity, "arena")
    except BaseException:
        os.close(index)
        raise
    return index, arena


class SharedMemory:
    """One process's mapping of a store's two memfds (it owns and closes the descriptors)."""

    def __init__(
        self, index_fd: int, arena_fd: int, capacity: int, index_bytes: int, populate: bool
    ) -> None:
        """Map the index (``index_bytes``) and the arena (``capacity``). ``populate``: map
        every page of the arena here (``start_populating``) and write through the mapping,
        if the whole arena is committed (a read fault on a hole of a memfd allocates a page,
        which would commit memory the front could not have)."""
        self.capacity = capacity
        self._index_fd = index_fd
        self._arena_fd = arena_fd
        self._closing = threading.Event()
        self.populated = threading.Event()  # (``populate``) every page of it is mapped here
        try:
            self._index_map = mmap.mmap(index_fd, index_bytes)
            committed = int(np.frombuffer(self._index_map, HEADER, 1, 0)[0]["reserved"])
            # every page of the arena is mapped here: write through it
            self.mapped = populate and committed == capacity
            self._arena_map = mmap.mmap(arena_fd, capacity)
        except BaseException:
            os.close(index_fd)
            os.close(arena_fd)
            raise

    @property
    def fds(self) -> tuple[int, int]:
        return self._index_fd, self._arena_fd

    def index_buffer(self) -> memoryview:
        return memoryview(self._index_map)

    def arena_buffer(self) -> memoryview:
        return memoryview(self._arena_map)

    # ------------------------------------------------------------ locking

    def lock(self) -> None:
        fcntl.flock(self._index_fd, fcntl.LOCK_EX)

    def unlock(self) -> None:
        fcntl.flock(self._index_fd, fcntl.LOCK_UN)

    # ------------------------------------------------------------ pages

    def fallocate(self, offset: int, size: int) -> None:
        """Reserve the arena's pages in [offset, offset + size) (``OSError`` if memory
        refuses)."""
        os.posix_fallocate(self._arena_fd, offset, size)

    def touch(self, committed: int) -> None:
        """Fault the first ``committed`` bytes of the arena in once (a read fault of a memfd
        page that ``fallocate`` reserved clears it; on a VM it is also where the host first
        backs it: 0.5-3 s a GiB on the development VM, ~10x the reservation), so that no
        process of the server meets a fresh page later. The mapping made for it goes at
        once."""
        if committed <= 0 or not _MAP_POPULATE:
            return
        m = mmap.mmap(self._arena_fd, committed, flags=mmap.MAP_SHARED | _MAP_POPULATE)
        m.close()

    def start_populating(self) -> None:
        """With ``mapped``: map every page of the arena here, in a thread of its own
        (``MADV_POPULATE_READ``, 4 MiB at a time: ~70 ms a GiB, off the start of the worker
        and of a replacement); ``populated`` is set when done."""
        if self.mapped:
            threading.Thread(target=self._populate, name="store-populate", daemon=True).start()

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

    def write_at(self, parts: list[np.ndarray], offset: int, nbytes: int) -> bool:
        """Write ``parts`` (``nbytes`` in all) at ``offset`` of the arena with one
        ``pwritev``, not through this process's mapping, where its pages are not mapped
        here: mapping them would cost a minor fault a 4 KiB page (readers map what they
        read). A fresh store's put of a 590 KB source, one process: ~650 us through an
        unpopulated mapping, ~390 us this way. False after a short write."""
        return os.pwritev(self._arena_fd, [p.data for p in parts], offset) == nbytes

    def close(self) -> None:
        """Unmap (once no view of the maps is alive: until then, the maps stay, and go with
        the last view) and close the descriptors."""
        self._closing.set()
        for m in (self._index_map, self._arena_map):
            try:
                m.close()
            except BufferError:
                pass
        os.close(self._index_fd)
        os.close(self._arena_fd)


_MAP_POPULATE: int = getattr(mmap, "MAP_POPULATE", 0)  # (Linux; 0: mapped lazily)
_MADV_POPULATE_READ: int = getattr(mmap, "MADV_POPULATE_READ", 22)  # (Linux >= 5.14)

"""``Store``: one process's handle on a server's store, what the front, its workers, compose
and the tests use. It ties the shared memory (``shm.SharedMemory``) to the index and ring
(``index.Index``) and holds what is this process's alone: its counts, and the bytes it has
reserved for sources it is fitting straight into the store. Its reads and writes: ``get``
(one key: from the store, or made by ``make()`` and copied in), and the fetches of many keys
under one lock, one method for each way a miss is made: ``fetch`` (made, then copied in; the
admitted subset of a larger dataset), ``fetch_into`` (fitted straight into its place in the
store, ``pipeline.PlanesFor``; the admitted subset) and ``fetch_recent`` (fitted into place,
and every one kept: read again soon, a window mosaic's or the lookahead's twin batch)."""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from functools import partial
from typing import Any

import numpy as np

from dataserver.data.pipeline import PlanesFor, Source
from dataserver.server.store.index import Claim, Index, Placing, StoreStats, same_bytes
from dataserver.server.store.layout import layout
from dataserver.server.store.shm import SharedMemory, StoreUnusable, new_fds, reopen_fds

PENDING_WAIT_S = 30.0  # how long to wait for a source another live worker is making

Make = Callable[[int], Source]  # fetch: the i-th key's source, new memory
Fit = Callable[[int, "PlanesFor | None"], Source]  # fetch_into: fitted where told, if told


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
        self.entries, index_bytes = layout(capacity)
        self.stats = StoreStats()
        self.commit_s = 0.0  # how long committing the arena took (the creator's handle)
        self._mem = SharedMemory(index_fd, arena_fd, capacity, index_bytes, populate and not create)
        self.index = Index(self._mem, self.entries, self.stats)
        # Ring bytes reserved for a source this process is fitting straight into the store
        # (``_planes_for``): key -> (position, bytes reserved, the planes handed out).
        self._placing: dict[tuple[int, int], Placing] = {}
        if create:
            self.index.start()
        elif not self.index.is_store():
            self.close()
            raise StoreUnusable(f"not a store of {capacity} bytes (magic, capacity or size)")
        self._mem.start_populating()

    @classmethod
    def create(cls, capacity: int, commit: bool = True) -> Store:
        """A new, empty store of ``capacity`` bytes. The index's pages are reserved now,
        and with ``commit`` the arena's too (``commit_s`` says how long that took; what
        memory refuses is reserved later, as the ring first reaches it). Its descriptors
        (``fds``) are for the processes this one starts (``pass_fds``): keep this handle
        open while any may."""
        store = cls(*new_fds(capacity, layout(capacity)[1]), capacity, create=True)
        if commit:
            start = time.perf_counter()
            store.index.lock()
            try:
                store.index.reserve(capacity)
            finally:
                store.index.unlock()
            store._mem.touch(store.committed)
            store.commit_s = time.perf_counter() - start
        return store

    @classmethod
    def attach(cls, index_fd: int, arena_fd: int, capacity: int, populate: bool = False) -> Store:
        """Another handle on the store whose memfds are ``index_fd``, ``arena_fd`` (as
        inherited from the front, or the front's own), checked first: regular files of
        the store's sizes, sealed, with a store's header. The given descriptors are left
        open; the handle has its own. ``populate``: see ``Store``. Raises
        ``StoreUnusable`` naming what is wrong."""
        fds = reopen_fds(index_fd, arena_fd, capacity, layout(capacity)[1])
        return cls(*fds, capacity, populate=populate)

    @property
    def committed(self) -> int:
        """Arena bytes whose pages are reserved so far."""
        return int(self.index.header[0]["reserved"])

    @property
    def fds(self) -> tuple[int, int]:
        """The (index, arena) descriptors, for ``attach`` in this or a child process."""
        return self._mem.fds

    @property
    def populated(self) -> threading.Event:
        """(``populate``) set once every page of the arena is mapped here."""
        return self._mem.populated

    def close(self) -> None:
        """Unmap (once no view of a source read from it is alive: until then, the maps
        stay, and go with the last view) and close the descriptors."""
        self.index.release()
        self._mem.close()

    # ------------------------------------------------------------ reads and writes

    def get(
        self, key: tuple[int, int], make: Callable[[], Source], population: int = 0
    ) -> tuple[Source, int]:
        """The source for ``key``: from the store, or made by ``make()`` and stored. While
        another live worker makes the same source, wait for it (at most
        ``PENDING_WAIT_S``) instead of making it twice. Returns (source, position);
        position >= 0 means its arrays are views into the ring: check
        ``intact(position)`` after using them. ``population``: how many sources the key's
        family has (``Index.admit_fraction``; 0: unknown, all admitted)."""
        k0, k1 = key
        deadline = time.monotonic() + PENDING_WAIT_S
        waited = False
        while True:
            self.index.lock()
            try:
                fraction = self.index.admit_fraction(population)
                claim, pos = self.index.claim(k0, k1, time.monotonic() > deadline, fraction)
                if claim is Claim.HIT:
                    self.stats.count(waits=waited)
                    return self.index.view(k0, k1, pos), pos
            finally:
                self.index.unlock()
            if claim is Claim.FULL or claim is Claim.SKIP:
                self.stats.count(skipped=claim is Claim.SKIP)
                return make(), -1  # not kept: make it, do not keep it
            if claim is Claim.MINE:
                break
            waited = True
            time.sleep(0.0005)
        self.stats.count(misses=1)
        try:
            source = make()
        except BaseException:
            self.index.forget(k0, k1)
            raise
        self._put_many([(key, source)])
        return source, -1

    def fetch(
        self,
        keys: list[tuple[int, int]],
        make: Make,
        population: int = 0,
        misses: Callable[[list[int]], None] | None = None,
    ) -> tuple[list[Source | None], int]:
        """``get`` for many keys under one lock: the sources (``make(i)`` for the i-th key
        where the store lacks it, then copied in, or None where ``make`` raised: call
        ``make(i)`` again to see why), and the oldest ring position read (check ``intact``
        once after use). ``population``: as for ``get``. ``misses(ks)``: told the keys this
        call will make, before it makes any (a dataset in object storage starts fetching
        them all at once)."""
        return self._fetch(keys, lambda i, _planes: make(i), make, population, False, misses)

    def fetch_into(
        self,
        keys: list[tuple[int, int]],
        fit: Fit,
        population: int = 0,
        misses: Callable[[list[int]], None] | None = None,
    ) -> tuple[list[Source | None], int]:
        """``fetch``, a miss the store will keep made by ``fit(i, planes_for)``, where
        ``planes_for`` (``pipeline.PlanesFor``) hands the planes' place in the store itself:
        such a source is stored without a copy, and is read from the store like a hit (its
        position counts in the one returned). A miss not kept: ``fit(i, None)``."""
        return self._fetch(keys, fit, partial(_unplaced, fit), population, False, misses)

    def fetch_recent(
        self,
        keys: list[tuple[int, int]],
        fit: Fit,
        population: int = 0,
        misses: Callable[[list[int]], None] | None = None,
    ) -> tuple[list[Source | None], int]:
        """``fetch_into`` for sources read again soon (a window mosaic's: each is a partner
        of the next outputs of the epoch, ``mosaic_partners="window"``; a batch the client's
        lookahead composes in both modes: its twin, ``Task.recent``): every one is kept, as
        when the dataset fits, whatever subset a larger dataset has admitted: the ring keeps
        what is recent, and no source is decoded again for its window (with the subset
        alone, a store half the dataset decoded two sources per mosaic, not one)."""
        return self._fetch(keys, fit, partial(_unplaced, fit), population, True, misses)

    def _fetch(
        self,
        keys: list[tuple[int, int]],
        fit: Fit,
        make: Make,
        population: int,
        keep_all: bool,
        misses: Callable[[list[int]], None] | None,
    ) -> tuple[list[Source | None], int]:
        """The fetches' one read path: claim every key under one lock (the admitted subset
        of ``population``, or with ``keep_all`` every key), read the hits, make the misses
        (``_make_and_keep``: ``fit(i, planes_for or None)``), wait for those another worker
        makes (``get``, ``make(i)``)."""
        out: list[Source | None] = [None] * len(keys)
        views: list[int] = []  # positions of hits
        mine: list[int] = []  # keys this call makes
        later: list[int] = []  # keys another live worker is making (or with no slot)
        kept: list[bool] = [True] * len(keys)  # False: made and kept nowhere (not admitted)
        self.index.lock()
        try:
            fraction = self.index.admit_fraction(population)
            if keep_all:
                fraction = 1.0
            for i, (k0, k1) in enumerate(keys):
                claim, pos = self.index.claim(k0, k1, False, fraction)
                if claim is Claim.HIT:
                    views.append(pos)
                    out[i] = self.index.view(k0, k1, pos)
                elif claim is Claim.SKIP:
                    kept[i] = False
                    mine.append(i)
                else:
                    (mine if claim is Claim.MINE else later).append(i)
        finally:
            self.index.unlock()
        if misses is not None and mine + later:
            misses(mine + later)
        placed = self._make_and_keep(keys, mine, kept, fit, out)
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
        fit: Fit,
        out: list[Source | None],
    ) -> int:
        """The fetches' one write path: make each of ``mine`` into ``out`` (``fit(i,
        planes_for)`` for those ``kept``, ``fit(i, None)`` for the others), then store those
        ``kept`` (admitted) under one lock; a failed one's PENDING entry is dropped. Returns
        the oldest position of a source made in the store (-1: none)."""
        made: list[tuple[tuple[int, int], Source]] = []
        for i in mine:
            self.stats.count(misses=1, skipped=not kept[i])
            try:
                source = fit(i, self._planes_for(*keys[i]) if kept[i] else None)
            except Exception:
                if kept[i]:
                    self._placing.pop(keys[i], None)
                    self.index.forget(*keys[i])
                continue
            out[i] = source
            if kept[i]:
                made.append((keys[i], source))
        placed = [
            self._placing[key][0]
            for key, source in made
            if key in self._placing and same_bytes(self._placing[key][2], source.image)
        ]
        if made:
            self._put_many(made)
        return min(placed, default=-1)

    def _planes_for(self, k0: int, k1: int) -> PlanesFor:
        """``pipeline.PlanesFor`` for the source ``(k0, k1)`` this process is making (its
        entry PENDING, its own): the ring bytes for its planes, boxes, labels and file name
        reserved at the head, and its planes' place there handed out (None: no room, or the
        entry is no longer this process's: new memory, stored by a copy)."""

        def planes_for(h: int, w: int, boxes: int, name: int) -> np.ndarray | None:
            placing = self.index.place(k0, k1, h, w, 3 * h * w + 24 * boxes + name)
            if placing is None:
                return None
            self._placing[(k0, k1)] = placing
            return placing[2]

        return planes_for

    def _put_many(self, items: list[tuple[tuple[int, int], Source]]) -> None:
        """Store sources this process made (their entries PENDING, its own), one lock."""
        self.index.lock()
        try:
            for (k0, k1), source in items:
                placing = self._placing.pop((k0, k1), None)
                self.index.store_one(k0, k1, source, placing)
        finally:
            self.index.unlock()

    def intact(self, position: int) -> bool:
        """Whether the bytes read at ``position`` were not written over since."""
        if position < 0:
            return True
        self.index.lock()
        try:
            ok = self.index.intact_at(position)
        finally:
            self.index.unlock()
        if not ok:
            self.stats.count(torn=1)
        return ok

    def usage(self) -> dict[str, Any]:
        """Entries and bytes held, bytes committed, and the share of the largest dataset
        seen that it admits (for stats)."""
        self.index.lock()
        try:
            return self.index.usage()
        finally:
            self.index.unlock()


def _unplaced(fit: Fit, i: int) -> Source:
    """``fit(i)`` into new memory: a source made while another worker made it too."""
    return fit(i, None)

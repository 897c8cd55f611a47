"""The server's store of prepared sources: decoded and fitted (``pipeline.Source``), in
shared memory that every worker of the server maps, bounded in bytes (``--cache-gb``). It
serves epochs after the first (a hit skips the decode), several jobs with the same dataset
and image size (same key, same bytes), and zero-stall mode flips (the sources of the next
batch, decoded once, serve whichever mode is decided). The package is split by job:
``layout`` (the format of the index: header, hash table entries, journal), ``shm`` (the two
sealed memfds: created, checked and reopened, mapped, committed, locked, closed;
``StoreUnusable``), ``index`` (the hash table, the ring and its journal, the claim rule, the
keys ``store_key``/``index_keys``), ``admission`` (the fixed subset a store keeps of a
dataset larger than it) and ``handle`` (``Store``, the one facade the front, the workers and
the tests use: ``create``/``attach``, ``get``, ``fetch``/``fetch_into``/``fetch_recent``,
``intact``, ``usage``). What follows is how the pieces work together.

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
a GiB). A miss is fitted straight into its reserved bytes (``fetch_into``, ``fetch_recent``),
or else copied in through the maker's mapping: no page is allocated, cleared or faulted while
an epoch runs (lazily reserved pages cost a fresh server's first epoch ~0.5 ms an image:
docs/DESIGN-NOTES.md). If the memory cannot all be had, what could be is kept: the rest is
reserved 64 MiB at a time as the head first reaches it, and where a reservation fails the ring
stops growing there instead of the process dying on a write to a page that cannot be had.

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

from dataserver.server.store.admission import admitted
from dataserver.server.store.handle import PENDING_WAIT_S, Store
from dataserver.server.store.index import Claim, StoreStats, index_keys, store_key
from dataserver.server.store.shm import SEALS, StoreUnusable

__all__ = [
    "PENDING_WAIT_S",
    "SEALS",
    "Claim",
    "Store",
    "StoreStats",
    "StoreUnusable",
    "admitted",
    "index_keys",
    "store_key",
]

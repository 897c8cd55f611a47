"""The store's format in shared memory, which every process of a server maps alike: the
index's header (magic, capacity, head position, ring size, reserved bytes, journal ends, the
dirty flag, the puts that give the mean entry's size, the largest family seen), its open
addressing hash table of 64-byte entries (key, state, owner pid, position, shape, the
sample's original size, the file name's length) and its journal of (position, key) in ring
order, as numpy record types; the states an entry is in; and how many entries and index
bytes a store of a given capacity has (``layout``). Nothing here reads or writes memory."""

from __future__ import annotations

import numpy as np

MAGIC = 0x44535354_4F524533  # "DSSTORE3"
EMPTY, PENDING, READY = 0, 1, 2  # an index entry's states
ENTRY_BYTES = 8192  # hash table slots: one per this many bytes of ring
MIN_ENTRIES = 1024
CHUNK = 64 << 20  # arena pages are reserved this much at a time

HEADER = np.dtype(
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
ENTRY = np.dtype(
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
JOURNAL = np.dtype([("pos", "<u8"), ("k0", "<u8"), ("k1", "<u8")])


def layout(capacity: int) -> tuple[int, int]:
    """The hash table's entries and the index's bytes for a store of ``capacity`` bytes."""
    entries = max(MIN_ENTRIES, capacity // ENTRY_BYTES)
    index_bytes = HEADER.itemsize + entries * (ENTRY.itemsize + JOURNAL.itemsize)
    return entries, index_bytes

"""What a store keeps of a dataset larger than it: a fixed subset of each family of keys
(one dataset at one stored size), the same every epoch and in every worker (``admitted``: a
pure function of the key), sized from the mean entry so far (``fraction``), and the one line
STATS says about it (``reason``). A window mosaic's sources and the lookahead's twin batch are
read again soon and bypass the subset (``Store.fetch_recent``). Pure functions of numbers the
index holds: nothing here touches shared memory."""

from __future__ import annotations

# A dataset larger than the store: the share of the ring its admitted sources may fill (the
# rest is slack, so that sizes above the mean estimate do not push admitted entries out).
ADMIT_SHARE = 0.94
ADMIT_AFTER = 16  # puts before the mean entry size is trusted (until then, admit all)


def admitted(k1: int, fraction: float) -> bool:
    """Whether the source whose key's second half is ``k1`` is one of the ``fraction`` of
    sources a store keeps when the dataset is larger than it: the same subset every epoch
    and in every worker (a pure function of the key), so what is kept is read again, and no
    put is spent on a source that the ring would evict before it is read (a scan through a
    dataset larger than an LRU or FIFO cache hits nothing)."""
    return fraction >= 1.0 or (k1 >> 11) < fraction * (1 << 53)


def keepable_entries(entries: int) -> int:
    """Entries a table of ``entries`` slots keeps before it evicts (``Index.claim``: at
    three quarters full)."""
    return entries * 3 // 4 - 1


def fraction(population: int, puts: int, put_bytes: int, ring: int, entries: int) -> float:
    """The share of a family of ``population`` sources that a store keeps: all of them when
    they fit (or while fewer than ``ADMIT_AFTER`` puts say what an entry's size is), else
    ``ADMIT_SHARE`` of what it can hold (its ``ring`` bytes, or its table's keepable
    entries at the mean entry's size) over their estimated bytes (the mean entry's size so
    far, ``put_bytes / puts``, times ``population``)."""
    if population <= 0 or puts < ADMIT_AFTER:
        return 1.0
    mean = put_bytes / puts
    room = min(ring, keepable_entries(entries) * mean)
    need = population * mean
    return min(1.0, ADMIT_SHARE * room / need) if need > 0 else 1.0


def reason(population: int, puts: int, mean: int, share: float, ring: int, entries: int) -> str:
    """Why the store keeps what it keeps, in one line (STATS' ``admission``)."""
    if population <= 0 or puts < ADMIT_AFTER:
        return f"all (fewer than {ADMIT_AFTER} sources stored: entry size not known yet)"
    need = population * mean
    if share >= 1.0:
        return f"all: {population} sources x {mean} bytes fit in {ring}"
    return (
        f"a fixed subset ({share:.1%}): {population} sources x {mean} bytes "
        f"({need / 1e6:.0f} MB) exceed what it holds ({ring / 1e6:.0f}"
        f" MB, {keepable_entries(entries)} entries); the same sources every epoch, so none "
        "is evicted before it is read again"
    )

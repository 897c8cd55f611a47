"""Allocator settings for the server's own processes.

Results are large (a 512 x 512 image is 768 KiB) and short-lived. glibc serves blocks that
large with fresh ``mmap`` pages, so every result costs hundreds of page faults and a
kernel zeroing of its pages. Raising the mmap and trim thresholds keeps such blocks in the
heap for reuse (the front keeps less at the top: ``FRONT_TRIM_THRESHOLD``; in a thread's arena
that top is given back at a free past the threshold, never by ``malloc_trim``). Only the
server's own processes (front, workers) do this; the trainer's
process is left alone.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import logging

log = logging.getLogger("dataserver.memory")

M_TRIM_THRESHOLD = -1
M_MMAP_THRESHOLD = -3
FRONT_TRIM_THRESHOLD = 16 << 20  # the front's (``serve``): see there


def keep_large_blocks(mmap_threshold: int = 64 << 20, trim_threshold: int = 256 << 20) -> bool:
    """Ask glibc to reuse large freed blocks; False where there is no glibc mallopt."""
    name = ctypes.util.find_library("c")
    if name is None:
        return False
    try:
        libc = ctypes.CDLL(name)
        mallopt = libc.mallopt
    except (OSError, AttributeError):
        return False
    ok = bool(mallopt(M_MMAP_THRESHOLD, mmap_threshold)) and bool(
        mallopt(M_TRIM_THRESHOLD, trim_threshold)
    )
    if not ok:
        log.debug("mallopt refused the thresholds")
    return ok

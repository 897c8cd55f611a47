"""The host's memory as the server's own processes see it: how much there is free
(``memory_room``, what the front sizes the store by), and the allocator settings they run
with (``keep_large_blocks``).

Room: the least of ``MemAvailable`` and what each memory cgroup limit above this process
leaves free (v1 and v2), since a store's memfd pages count there, not against
``/dev/shm``'s size.

Allocator: results are large (a 512 x 512 image is 768 KiB) and short-lived. glibc serves
blocks that large with fresh ``mmap`` pages, so every result costs hundreds of page faults
and a kernel zeroing of its pages. Raising the mmap and trim thresholds keeps such blocks in
the heap for reuse (the front keeps less at the top: ``FRONT_TRIM_THRESHOLD``; in a thread's
arena that top is given back at a free past the threshold, never by ``malloc_trim``). Only
the server's own processes (front, workers) do this; the trainer's process is left alone.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import logging
from pathlib import Path

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


def _cgroup_rooms() -> list[int]:
    """What each memory cgroup limit above this process leaves free (v1 and v2)."""
    try:
        lines = Path("/proc/self/cgroup").read_text().splitlines()
    except OSError:
        return []
    rooms = []
    for line in lines:
        _, controllers, path = line.split(":", 2)
        if controllers == "":  # v2
            bases = [Path("/sys/fs/cgroup"), Path("/sys/fs/cgroup/unified")]
            limit_name, usage_name = "memory.max", "memory.current"
        elif "memory" in controllers.split(","):
            bases = [Path("/sys/fs/cgroup/memory")]
            limit_name, usage_name = "memory.limit_in_bytes", "memory.usage_in_bytes"
        else:
            continue
        for base in bases:
            d = base / path.lstrip("/")
            while True:  # the cgroup and every one above it
                try:
                    limit = (d / limit_name).read_text().strip()
                    usage = int((d / usage_name).read_text())
                    if limit != "max" and int(limit) < 1 << 60:
                        rooms.append(max(0, int(limit) - usage))
                except (OSError, ValueError):
                    pass
                if d == base:
                    break
                d = d.parent
    return rooms


def memory_room() -> int | None:
    """Bytes of memory this host and every memory cgroup this process is in have free (the
    least of ``MemAvailable`` and each limit's headroom), or None where none can be read.
    A store's pages count there, not against ``/dev/shm``'s size."""
    rooms = _cgroup_rooms()
    try:
        for line in Path("/proc/meminfo").read_text().splitlines():
            if line.startswith("MemAvailable:"):
                rooms.append(int(line.split()[1]) * 1024)
    except (OSError, ValueError, IndexError):
        pass
    return min(rooms, default=None)

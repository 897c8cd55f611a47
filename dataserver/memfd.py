"""Anonymous shared memory sealed at its size: what the server's store of decoded sources
(``server/store/``) and the fetch cache (``data/fetchcache.py``) are made of. A memfd has no
name on the host (nothing in ``/dev/shm`` to leave behind or for another user to open); the
processes that inherit or are handed its fd map it, and the seals keep its size fixed."""

from __future__ import annotations

import fcntl
import os

SIZE_SEALS = fcntl.F_SEAL_SHRINK | fcntl.F_SEAL_GROW | fcntl.F_SEAL_SEAL


def sealed_memfd(name: str, size: int) -> int:
    """A new anonymous shared memory file of ``size`` bytes (close-on-exec), sealed at that
    size; ``name`` is only what ``/proc/PID/fd`` shows."""
    fd = os.memfd_create(name, os.MFD_CLOEXEC | os.MFD_ALLOW_SEALING)
    try:
        os.ftruncate(fd, size)
        fcntl.fcntl(fd, fcntl.F_ADD_SEALS, SIZE_SEALS)
    except BaseException:
        os.close(fd)
        raise
    return fd

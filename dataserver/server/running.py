"""Which task a worker is running, readable by the front after the worker died.

One 16-byte file per worker slot in the server's private directory, mapped by both: the
worker writes the key of the task it starts, then the number of the image of it that it
composes (and zeros when done); the front reads it when it reaps the worker. So a death is
blamed on the task that was running, and within it on the image, and never on the task
queued behind it, nor on one already answered whose DONE the front had not yet read.
"""

from __future__ import annotations

import hashlib
import mmap
import os
import struct
from pathlib import Path

_LAYOUT = struct.Struct("<QII")  # (task key, 1 while running, the image it composes)
_IMAGE = struct.Struct("<I")  # the last field alone


def task_key(session: bytes, task_id: int) -> int:
    """A 64-bit key for (session, task_id); never 0."""
    digest = hashlib.blake2b(session + task_id.to_bytes(8, "little"), digest_size=8).digest()
    return int.from_bytes(digest, "little") or 1


class RunningSlot:
    """The shared 16 bytes of one worker slot."""

    def __init__(self, path: Path) -> None:
        self.path = path
        fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o600)
        try:
            if os.fstat(fd).st_size < _LAYOUT.size:
                os.ftruncate(fd, _LAYOUT.size)
            self._map = mmap.mmap(fd, _LAYOUT.size)
        finally:
            os.close(fd)

    @classmethod
    def open(cls, state_dir: str, slot: int) -> RunningSlot:
        return cls(Path(state_dir) / f"running-{slot}")

    def set(self, session: bytes, task_id: int) -> None:
        _LAYOUT.pack_into(self._map, 0, task_key(session, task_id), 1, 0)

    def image(self, n: int) -> None:
        """The running task is now composing its image ``n``."""
        _IMAGE.pack_into(self._map, 12, n)

    def clear(self) -> None:
        _LAYOUT.pack_into(self._map, 0, 0, 0, 0)

    def read(self) -> tuple[int, int]:
        """(key of the running task, the image it was composing), or (0, 0) when none ran."""
        key, running, image = _LAYOUT.unpack_from(self._map, 0)
        return (int(key), int(image)) if running else (0, 0)

    def close(self) -> None:
        self._map.close()

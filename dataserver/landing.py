"""Landing: results written by a server's workers straight into a client's batch buffers,
in shared memory, when both run on one host. No socket carries the pixels, and the client
copies nothing: its CPU per image goes from the cost of two copies to almost none.

The client makes a *landing file* in ``/dev/shm`` (``dataserver-land-<session>``, mode 0600)
holding a header page and ``regions`` batch buffers. The header holds a magic number, a
random token (a worker proves it may write by reading it back), the owner's pid, and one
generation number per region. A TASK that may land names the file, the token, the region,
its generation, and the byte offset of its first image.

Rules that make a late or duplicate writer harmless, by construction:

- a worker writes its task's bytes of a region only while holding a POSIX lock on those
  bytes, and only if the region's generation is still the one its task names (so workers
  writing different tasks of one batch do not wait for each other);
- the client bumps a region's generation while holding a lock on the whole region (which
  no writer can hold a part of meanwhile), the moment its batch is complete (before the
  trainer sees it), or dropped. A writer that comes after finds the generation changed
  and writes nothing (it sends the pixels over the socket instead, which the client then
  drops as unwanted).

A worker opens only files named ``dataserver-land-*`` directly in the landing directory,
without following links, regular files owned by its own user, with the magic and token
the task names; anything else, and the task's pixels travel over the socket as usual.
"""

from __future__ import annotations

import fcntl
import mmap
import os
import secrets
import stat
import struct
from collections import OrderedDict
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import numpy as np

MAGIC = 0x444E414C53445331  # "1SDSLAND"
PREFIX = "dataserver-land-"
HEADER = 4096
_HEAD = struct.Struct("<QQ32sQQ")  # magic, owner pid, token, regions, region bytes
GEN_AT = 64  # generation words (u64 each) start here
MAX_REGIONS = (HEADER - GEN_AT) // 8


def land_dir() -> Path | None:
    """Where landing files live: ``/dev/shm`` where it is a writable directory."""
    shm = Path("/dev/shm")
    return shm if shm.is_dir() and os.access(shm, os.W_OK) else None


def pid_alive(pid: int) -> bool:
    """Whether process ``pid`` exists (one of another user counts); never for pid <= 0,
    which ``kill`` would take for a process group."""
    if pid <= 0:
        return False
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def sweep(directory: Path) -> None:
    """Remove landing files whose client is gone (one killed before it could)."""
    for path in directory.glob(PREFIX + "*"):
        try:
            with open(path, "rb") as f:
                magic, pid, *_ = _HEAD.unpack(f.read(_HEAD.size))
        except (OSError, struct.error):
            continue
        if magic == MAGIC and not pid_alive(pid):
            path.unlink(missing_ok=True)


class LandingArea:
    """The client's side: a landing file of ``regions`` buffers of ``region_bytes``."""

    def __init__(self, directory: Path, name: str, regions: int, region_bytes: int) -> None:
        if not 1 <= regions <= MAX_REGIONS:
            raise ValueError(f"1..{MAX_REGIONS} regions, not {regions}")
        sweep(directory)
        self.path = str(directory / (PREFIX + name))
        self.token = secrets.token_hex(16)
        self.regions = regions
        self.region_bytes = region_bytes
        size = HEADER + regions * region_bytes
        self.fd = os.open(self.path, os.O_RDWR | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC, 0o600)
        try:
            os.ftruncate(self.fd, size)
            # The header's pages now; a region's when it is first used (``take``): reserving
            # every region up front cost tens of milliseconds before the first batch.
            os.posix_fallocate(self.fd, 0, HEADER)
            self.map = mmap.mmap(self.fd, size)
        except BaseException:
            os.close(self.fd)
            os.unlink(self.path)
            raise
        _HEAD.pack_into(self.map, 0, MAGIC, os.getpid(), self.token.encode(), regions, region_bytes)
        self._gens = np.frombuffer(self.map, np.uint64, regions, GEN_AT)
        self.free = list(range(regions))
        self._reserved: set[int] = set()
        self._written: set[int] = set()  # regions a batch has been composed in

    def take(self) -> int | None:
        """A free region, its pages reserved (so a write to it can never SIGBUS); None
        when none is free, or shared memory has no room for one (the socket it is)."""
        while self.free:
            region = self.free.pop()
            if region in self._reserved:
                return region
            try:
                os.posix_fallocate(self.fd, self.offset(region), self.region_bytes)
            except OSError:
                continue  # no room in /dev/shm: this region stays unused
            self._reserved.add(region)
            return region
        return None

    def buffer(self, region: int) -> np.ndarray:
        """Region ``region`` as a flat uint8 array over the shared memory."""
        start = HEADER + region * self.region_bytes
        return np.frombuffer(self.map, np.uint8, self.region_bytes, start)

    def offset(self, region: int) -> int:
        return HEADER + region * self.region_bytes

    def generation(self, region: int) -> int:
        return int(self._gens[region])

    def seal(self, region: int) -> bool:
        """Bump the region's generation, so that no writer can touch it any more; False
        (try again later) while a worker holds a lock on a part of it, writing."""
        start = self.offset(region)
        try:
            fcntl.lockf(self.fd, fcntl.LOCK_EX | fcntl.LOCK_NB, self.region_bytes, start)
        except OSError:
            return False
        try:
            self._gens[region] += 1
            self._written.add(region)
        finally:
            fcntl.lockf(self.fd, fcntl.LOCK_UN, self.region_bytes, start)
        return True

    def fresh(self, region: int) -> bool:
        """Whether no batch was composed in ``region`` yet (its bytes are all zero)."""
        return region not in self._written

    def close(self) -> None:
        del self._gens
        try:
            self.map.close()
        except BufferError:
            pass  # a batch the trainer keeps still views it: the mapping goes with it
        os.close(self.fd)
        try:
            os.unlink(self.path)
        except FileNotFoundError:
            pass


class Landings:
    """The worker's side: the landing files it was asked to write, open, checked."""

    def __init__(self, directory: Path | None = None, keep: int = 32) -> None:
        self.directory = directory if directory is not None else land_dir()
        self.keep = keep
        self._open: OrderedDict[tuple[str, str], tuple[int, mmap.mmap, int, int] | None] = (
            OrderedDict()
        )

    def _file(self, path: str, token: str) -> tuple[int, mmap.mmap, int, int] | None:
        key = (path, token)
        if key in self._open:
            self._open.move_to_end(key)
            return self._open[key]
        self.purge()  # a new client: let go of the files of clients that are gone
        opened = self._check(path, token)
        self._open[key] = opened
        if len(self._open) > self.keep:
            _, old = self._open.popitem(last=False)
            if old is not None:
                old[1].close()
                os.close(old[0])
        return opened

    def _check(self, path: str, token: str) -> tuple[int, mmap.mmap, int, int] | None:
        if self.directory is None:
            return None
        name = os.path.basename(path)
        if os.path.dirname(path) != str(self.directory) or not name.startswith(PREFIX):
            return None
        try:
            fd = os.open(path, os.O_RDWR | os.O_NOFOLLOW | os.O_CLOEXEC)
        except OSError:
            return None
        try:
            st = os.fstat(fd)
            if not stat.S_ISREG(st.st_mode) or st.st_uid != os.getuid() or st.st_size < HEADER:
                raise ValueError("not a landing file")
            m = mmap.mmap(fd, st.st_size)
            magic, _, stored, regions, region_bytes = _HEAD.unpack_from(m, 0)
            fits = 0 < regions <= MAX_REGIONS and HEADER + regions * region_bytes <= len(m)
            if magic != MAGIC or stored.decode(errors="replace") != token or not fits:
                m.close()
                raise ValueError("not this client's landing file")
        except (OSError, ValueError):
            os.close(fd)
            return None
        return fd, m, regions, region_bytes

    @contextmanager
    def target(
        self,
        path: str,
        token: str,
        region: int,
        generation: int,
        offset: int,
        shape: tuple[int, ...],
    ) -> Iterator[np.ndarray | None]:
        """The (N, 3, H, W) destination of a task, locked, if it may land there now (else
        None: send the pixels over the socket)."""
        opened = self._file(path, token) if path else None
        nbytes = int(np.prod(shape))
        if opened is None or region < 0:
            yield None
            return
        fd, m, regions, region_bytes = opened
        start = HEADER + region * region_bytes
        if region >= regions or offset < start or offset + nbytes > start + region_bytes:
            yield None  # not inside the region it names
            return
        fcntl.lockf(fd, fcntl.LOCK_EX, nbytes, offset)  # these bytes only: others write theirs
        try:
            current = struct.unpack_from("<Q", m, GEN_AT + 8 * region)[0]
            if current != generation:
                yield None  # sealed (complete, or dropped): nothing may be written there
                return
            yield np.frombuffer(m, np.uint8, nbytes, offset).reshape(shape)
        finally:
            fcntl.lockf(fd, fcntl.LOCK_UN, nbytes, offset)

    def purge(self) -> None:
        """Close the files their clients removed (their memory is freed only then)."""
        for key, opened in list(self._open.items()):
            if opened is None:
                continue
            try:
                gone = os.stat(key[0]).st_ino != os.fstat(opened[0]).st_ino
            except OSError:
                gone = True
            if gone:
                del self._open[key]
                try:
                    opened[1].close()
                except BufferError:
                    pass
                os.close(opened[0])

    def close(self) -> None:
        for opened in self._open.values():
            if opened is not None:
                try:
                    opened[1].close()
                except BufferError:
                    pass
                os.close(opened[0])
        self._open.clear()

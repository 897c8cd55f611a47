"""One columnar annotation index per server: built once, cached on disk, shared read-only.

A dataset source (a COCO file, a YOLO layout, a user's dataset) is turned once into named
numpy arrays (``Columns``); the front puts their bytes into a sealed anonymous memory file
(``SharedIndex``: a ``memfd`` nothing on the host can name, sealed against writes and
resizing) that its workers inherit and map read-only, as the store's memfds. Whatever
``--workers``, the index costs its arrays' bytes once per server, and no worker parses
annotations.

The same bytes are the cache file (``IndexCache``): ``--index-cache DIR``, keyed by the
source's identity (``SourceId``: kind, path, size, mtime and a digest of the file, or of a
directory layout's listing), versioned, and checked field by field on load; a stale or
damaged file is rebuilt, with one line saying why, never trusted.

File (and memfd) layout, every integer little-endian::

    MAGIC (8 bytes) | format version u32 | 0 u32 | header length u64 | header (JSON)
    | arrays, each at a 64-byte aligned offset the header gives

A new source kind plugs in with a builder (``() -> Columns``) and a ``SourceId``:
``IndexCache.load_or_build(source, build)``.

Over the house's ~500 lines (about 540): the index's on-disk format (written, mapped,
checked) and its cache, which change together with the format.
"""

from __future__ import annotations

import fcntl
import hashlib
import logging
import mmap
import os
import stat
import struct
from collections.abc import Callable, Mapping
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import msgspec
import numpy as np

from dataserver.data.remote import is_remote, object_identity

log = logging.getLogger("dataserver.index")

MAGIC = b"DSINDEX\0"
FORMAT_VERSION = 1
_PREFIX = struct.Struct("<8sIIQ")
ALIGN = 64
# The dtypes an index may hold (a file naming another is damaged, not trusted).
DTYPES = frozenset({"|u1", "<i4", "<i8", "<f4", "<f8"})
SEALS = fcntl.F_SEAL_SHRINK | fcntl.F_SEAL_GROW | fcntl.F_SEAL_SEAL | fcntl.F_SEAL_WRITE
# A file's digest reads this many evenly spaced chunks of this size (and its whole self
# when smaller): a changed file is told by its size, mtime or these bytes, at a cost that
# does not grow with the file (a cached start of a 1 GB file must take seconds).
DIGEST_CHUNKS = 64
DIGEST_CHUNK = 64 << 10


class IndexProblem(ValueError):
    """An index that cannot be built, loaded or mapped; the message says what and where."""


class IndexDamaged(IndexProblem):
    """A cache file that is not a whole index of the expected source (rebuilt, not used)."""


@dataclass(frozen=True)
class SourceId:
    """What an index was built from; a cache file is used only when every field is equal.

    ``kind``: the builder (``coco``, ``yolo``, ``plugin``, ...); ``path``: the source,
    absolute; ``size``/``mtime_ns``: the file's (a directory layout: its listing's total
    size and newest mtime); ``digest``: ``file_digest`` of the file, or of the listing;
    ``detail``: anything else the index depends on (a split, arguments)."""

    kind: str
    path: str
    size: int
    mtime_ns: int
    digest: str
    detail: str = ""

    def key(self) -> str:
        """The cache file's name: one per source (kind, path, detail); what the file holds
        is checked against the rest (size, mtime, digest) and the format when loaded."""
        text = msgspec.json.encode([self.kind, self.path, self.detail])
        return f"{self.kind}-{hashlib.blake2b(text, digest_size=16).hexdigest()}.idx"


def file_digest(path: str | os.PathLike[str]) -> str:
    """A blake2b digest of the file's size and ``DIGEST_CHUNKS`` chunks spread over it
    (the whole file when it is smaller than they are)."""
    h = hashlib.blake2b(digest_size=16)
    with open(path, "rb") as f:
        size = os.fstat(f.fileno()).st_size
        h.update(size.to_bytes(8, "little"))
        if size <= DIGEST_CHUNKS * DIGEST_CHUNK:
            h.update(f.read())
        else:
            step = (size - DIGEST_CHUNK) // (DIGEST_CHUNKS - 1)
            for i in range(DIGEST_CHUNKS):
                f.seek(i * step)
                h.update(f.read(DIGEST_CHUNK))
    return h.hexdigest()


def file_source(kind: str, path: str | os.PathLike[str], detail: str = "") -> SourceId:
    """The identity of an annotation file (``OSError`` when it cannot be read)."""
    p = Path(path).resolve()
    st = p.stat()
    return SourceId(kind, str(p), st.st_size, st.st_mtime_ns, file_digest(p), detail)


def source_of(kind: str, path: str | os.PathLike[str], detail: str = "") -> SourceId:
    """The identity of an annotation file or object: ``file_source`` for a local path; for
    a URL (``dataserver.data.remote``) its size and the store's ETag (a changed object has
    another), mtime 0. ``OSError`` when it cannot be read."""
    if not is_remote(path):
        return file_source(kind, path, detail)
    url = str(path)
    size, tag = object_identity(url)
    return SourceId(
        kind, url, size, 0, hashlib.blake2b(tag.encode(), digest_size=16).hexdigest(), detail
    )


@dataclass
class Columns:
    """An index being built: named arrays and a JSON-able ``meta`` (counts, notes)."""

    arrays: dict[str, np.ndarray]
    meta: dict[str, Any] = field(default_factory=dict)


class _Entry(msgspec.Struct, array_like=True, forbid_unknown_fields=True):
    name: str
    dtype: str
    shape: list[int]
    offset: int
    nbytes: int


class _Header(msgspec.Struct, forbid_unknown_fields=True):
    source: dict[str, Any]
    meta: dict[str, Any]
    arrays: list[_Entry]
    total: int


def _layout(columns: Columns, source: SourceId) -> tuple[bytes, list[tuple[int, np.ndarray]], int]:
    """The header bytes (with the prefix), each array's offset, and the total size."""
    arrays = {k: np.ascontiguousarray(v) for k, v in columns.arrays.items()}
    for name, a in arrays.items():
        if a.dtype.str not in DTYPES:
            raise IndexProblem(
                f"index array {name!r}: dtype {a.dtype} is not one of {sorted(DTYPES)}"
            )
    # The header's length depends on the offsets it holds: lay out twice, the second time
    # with room for the first's widest numbers.
    room = 0
    while True:
        start = _align(_PREFIX.size + room)
        entries, places, at = [], [], start
        for name, a in arrays.items():
            entries.append(_Entry(name, a.dtype.str, list(a.shape), at, a.nbytes))
            places.append((at, a))
            at = _align(at + a.nbytes)
        header = msgspec.json.encode(_Header(asdict(source), columns.meta, entries, at))
        if _PREFIX.size + len(header) <= start:
            prefix = _PREFIX.pack(MAGIC, FORMAT_VERSION, 0, len(header))
            return prefix + header, places, at
        room = len(header) + 64


def _align(n: int) -> int:
    return (n + ALIGN - 1) // ALIGN * ALIGN


def write_index(fd: int, columns: Columns, source: SourceId) -> int:
    """Write the index into the open file ``fd`` from offset 0; returns its size."""
    head, places, total = _layout(columns, source)
    os.ftruncate(fd, total)
    os.pwrite(fd, head, 0)
    for offset, a in places:
        view = a.reshape(-1).view(np.uint8).data
        done = 0
        while done < len(view):
            done += os.pwrite(fd, view[done : done + (256 << 20)], offset + done)
    return total


@dataclass(frozen=True)
class MappedIndex:
    """An index mapped read-only: ``arrays`` are views of the mapping (never copied),
    ``meta`` and ``source`` as written. Valid as long as this object lives."""

    arrays: Mapping[str, np.ndarray]
    meta: Mapping[str, Any]
    source: SourceId
    nbytes: int
    _map: mmap.mmap = field(repr=False)


def map_index(fd: int, size: int, what: str, expect: SourceId | None = None) -> MappedIndex:
    """Map ``size`` bytes of ``fd`` read-only and check them field by field: the magic,
    the format version, the header, every array's dtype, shape and bounds, the total size,
    and (``expect``) every field of the source identity. ``IndexDamaged`` names the first
    field that is wrong."""
    if size < _PREFIX.size:
        raise IndexDamaged(f"{what}: {size} bytes, shorter than an index's prefix")
    m = mmap.mmap(fd, size, flags=mmap.MAP_SHARED, prot=mmap.PROT_READ)
    arrays: dict[str, np.ndarray] = {}
    try:
        header, source, end = _header(m, size, what)
        if expect is not None:
            _same_source(source, expect, what)
        for e in header.arrays:
            arrays[e.name] = _array(m, e, end, size, what)
    except BaseException:
        arrays.clear()  # (their views of the mapping first)
        m.close()
        raise
    return MappedIndex(arrays, header.meta, source, size, m)


def _header(m: mmap.mmap, size: int, what: str) -> tuple[_Header, SourceId, int]:
    """The header, the source it names, and where it ends; checked."""
    magic, version, _, hlen = _PREFIX.unpack_from(m, 0)
    if magic != MAGIC:
        raise IndexDamaged(f"{what}: not an index file (magic {magic!r})")
    if version != FORMAT_VERSION:
        raise IndexDamaged(
            f"{what}: format version {version}, this dataserver reads {FORMAT_VERSION}"
        )
    end = _PREFIX.size + hlen
    if end > size:
        raise IndexDamaged(f"{what}: header of {hlen} bytes runs past the end ({size} bytes)")
    try:
        header = msgspec.json.decode(m[_PREFIX.size : end], type=_Header)
        source = msgspec.convert(header.source, SourceId)
    except msgspec.MsgspecError as exc:
        raise IndexDamaged(f"{what}: header unreadable: {exc}") from None
    if header.total != size:
        raise IndexDamaged(f"{what}: {size} bytes, the header says {header.total} (truncated?)")
    return header, source, end


def _array(m: mmap.mmap, e: _Entry, start: int, size: int, what: str) -> np.ndarray:
    """One array's view of the mapping, its dtype, shape and bounds checked."""
    if e.dtype not in DTYPES:
        raise IndexDamaged(f"{what}: array {e.name!r} has dtype {e.dtype!r}")
    dtype = np.dtype(e.dtype)
    count = int(np.prod(e.shape, dtype=np.int64)) if e.shape else 1
    if min(e.shape, default=0) < 0 or count * dtype.itemsize != e.nbytes:
        raise IndexDamaged(f"{what}: array {e.name!r}: shape {e.shape} is not {e.nbytes} bytes")
    if e.offset % ALIGN or e.offset < start or e.offset + e.nbytes > size:
        raise IndexDamaged(f"{what}: array {e.name!r} lies outside the file")
    return np.frombuffer(m, dtype, count, e.offset).reshape(e.shape)


def _same_source(have: SourceId, want: SourceId, what: str) -> None:
    """``IndexDamaged`` naming the first field of the source identity that differs."""
    for name, value in asdict(want).items():
        old = getattr(have, name)
        if old != value:
            raise IndexDamaged(f"{what}: source {name} is {old!r}, now {value!r}")


class SharedIndex:
    """An index in a sealed memfd (no name on the host; sealed against writes, growing
    and shrinking), created by the front (``from_file``/``from_columns``) and inherited by
    its workers (``attach``), each mapping it read-only: its pages exist once."""

    def __init__(self, fd: int, mapped: MappedIndex) -> None:
        self.fd = fd
        self.mapped = mapped

    @property
    def nbytes(self) -> int:
        return self.mapped.nbytes

    @classmethod
    def _new(cls, write: Callable[[int], int]) -> SharedIndex:
        fd = os.memfd_create("dataserver-index", os.MFD_CLOEXEC | os.MFD_ALLOW_SEALING)
        try:
            size = write(fd)
            fcntl.fcntl(fd, fcntl.F_ADD_SEALS, SEALS)
            return cls(fd, map_index(fd, size, "the shared index"))
        except BaseException:
            os.close(fd)
            raise

    @classmethod
    def from_columns(cls, columns: Columns, source: SourceId) -> SharedIndex:
        return cls._new(lambda fd: write_index(fd, columns, source))

    @classmethod
    def from_file(cls, path: Path, expect: SourceId | None = None) -> SharedIndex:
        """The cache file's bytes copied into a memfd (``sendfile``: no copy through this
        process), then checked as ``map_index`` does."""

        def copy(fd: int) -> int:
            with open(path, "rb") as src:
                size = os.fstat(src.fileno()).st_size
                os.ftruncate(fd, size)
                done = 0
                while done < size:
                    sent = os.sendfile(fd, src.fileno(), done, size - done)
                    if sent == 0:
                        raise IndexDamaged(f"{path}: shorter than it was ({done} of {size} bytes)")
                    done += sent
                return size

        shared = cls._new(copy)
        if expect is not None:
            try:
                check_source(shared.mapped, expect, str(path))
            except BaseException:
                shared.close()
                raise
        return shared

    @classmethod
    def attach(cls, fd: int, size: int) -> SharedIndex:
        """The index whose memfd ``fd`` the front passed down (this handle owns ``fd``):
        checked to be a sealed memfd of ``size`` bytes holding an index."""
        try:
            st = os.fstat(fd)
            seals = fcntl.fcntl(fd, fcntl.F_GET_SEALS)
        except OSError as exc:
            raise IndexProblem(f"shared index: fd {fd}: {exc.strerror}") from None
        if not stat.S_ISREG(st.st_mode) or st.st_size != size or seals & SEALS != SEALS:
            raise IndexProblem(f"shared index: fd {fd} is not a sealed memfd of {size} bytes")
        return cls(fd, map_index(fd, size, "the shared index"))

    def close(self) -> None:
        try:
            os.close(self.fd)
        except OSError:
            pass


def check_source(mapped: MappedIndex, expect: SourceId, what: str) -> None:
    """``IndexDamaged`` naming the first field of the source identity that differs."""
    _same_source(mapped.source, expect, what)


def default_cache_dir() -> Path:
    """``$XDG_CACHE_HOME/dataserver``, else ``~/.cache/dataserver``."""
    base = os.environ.get("XDG_CACHE_HOME") or str(Path.home() / ".cache")
    return Path(base) / "dataserver"


class IndexCache:
    """Index files in one directory of this user's (created 0700): one per source
    identity. A directory (or file) another user owns or can write is refused
    (``IndexProblem``): the index decides what every worker reads. The default directory
    (none given) that cannot be used is a warning: the index is built, not cached."""

    def __init__(self, directory: str | os.PathLike[str] | None = None) -> None:
        self.explicit = bool(directory)
        self.dir = Path(directory) if directory else default_cache_dir()

    def _check_dir(self) -> None:
        try:
            self.dir.mkdir(mode=0o700, parents=True, exist_ok=True)
            st = self.dir.stat()
        except OSError as exc:
            raise IndexProblem(f"--index-cache {self.dir}: {exc.strerror or exc}") from None
        _check_owned(st, f"--index-cache {self.dir}")

    def path_for(self, source: SourceId) -> Path:
        return self.dir / source.key()

    def usable(self) -> bool:
        """The directory can hold indexes (made if missing). False for an unusable default
        (warned); ``IndexProblem`` for an unusable directory that was given."""
        try:
            self._check_dir()
        except IndexProblem as exc:
            if self.explicit:
                raise
            log.warning("%s; indexes are built and not cached", exc)
            return False
        return True

    def load_or_build(
        self, source: SourceId, build: Callable[[], Columns] | None
    ) -> tuple[SharedIndex | None, str]:
        """The index of ``source``: its cache file when whole and of this very source,
        else built (``build()``) and written to the cache. Returns the shared index and
        what happened (``cached``, ``built``, or ``rebuilt: WHY``: logged as one line).
        ``build`` None: only a cached index, else (None, ``uncached``)."""
        if not self.usable():
            if build is None:
                return None, "uncached"
            return SharedIndex.from_columns(build(), source), "built (not cached)"
        path = self.path_for(source)
        why = ""
        if path.exists():
            try:
                _check_owned(path.stat(), str(path))
                return SharedIndex.from_file(path, expect=source), "cached"
            except IndexDamaged as exc:
                why = str(exc)
            except OSError as exc:
                why = f"{path}: {exc.strerror or exc}"
            if build is None:
                return None, "uncached"
            log.warning("index cache %s: rebuilding (%s)", path, why)
        if build is None:
            return None, "uncached"
        columns = build()
        shared = SharedIndex.from_columns(columns, source)
        self._write(path, shared)
        return shared, f"rebuilt: {why}" if why else "built"

    def _write(self, path: Path, shared: SharedIndex) -> None:
        """The memfd's bytes into ``path`` atomically (a temporary file renamed over it),
        0600. A cache that cannot be written is a warning: the server still serves."""
        tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
        try:
            fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
            try:
                done, size = 0, shared.nbytes
                while done < size:
                    done += os.sendfile(fd, shared.fd, done, size - done)
                os.fsync(fd)
            finally:
                os.close(fd)
            os.replace(tmp, path)
        except OSError as exc:
            log.warning("index cache %s not written: %s", path, exc.strerror or exc)
            tmp.unlink(missing_ok=True)


def _check_owned(st: os.stat_result, what: str) -> None:
    if st.st_uid != os.geteuid():
        raise IndexProblem(f"{what}: owned by uid {st.st_uid}, not this user's; refused")
    if st.st_mode & (stat.S_IWGRP | stat.S_IWOTH):
        raise IndexProblem(
            f"{what}: other users can write it (mode {stat.S_IMODE(st.st_mode):o}); refused "
            "(the index decides what every worker reads)"
        )


# ---------------------------------------------------------------------- detection indexes

# The arrays of a detection index (COCO, YOLO): what ``DetectionIndex`` reads.
DETECTION_ARRAYS = (
    "names",  # uint8: every image's file name (UTF-8), one after another
    "name_offsets",  # int64 (N + 1,): image i's name is names[o[i]:o[i + 1]]
    "hw",  # int32 (N, 2): (height, width), 0 where not known
    "boxes",  # float32 (M, 4): x1, y1, x2, y2 (pixels; normalized when meta says so)
    "labels",  # int32 (M,)
    "box_offsets",  # int64 (N + 1,): image i's boxes are boxes[o[i]:o[i + 1]]
    "category_ids",  # int32 (C,)
    "category_names",  # uint8: names, one after another
    "category_offsets",  # int64 (C + 1,)
)


def packed_strings(items: list[str]) -> tuple[np.ndarray, np.ndarray]:
    """Strings as one uint8 array of their UTF-8 bytes and int64 offsets (len + 1)."""
    encoded = [s.encode() for s in items]
    offsets = np.zeros(len(encoded) + 1, dtype=np.int64)
    np.cumsum(np.fromiter(map(len, encoded), np.int64, len(encoded)), out=offsets[1:])
    return np.frombuffer(b"".join(encoded), dtype=np.uint8).copy(), offsets


def detection_columns(
    files: list[str],
    hw: np.ndarray,
    boxes: np.ndarray,
    labels: np.ndarray,
    box_offsets: np.ndarray,
    categories: list[tuple[int, str]],
    meta: dict[str, Any],
) -> Columns:
    """A detection index's columns from its parts (``box_offsets``: int64, N + 1)."""
    names, name_offsets = packed_strings(files)
    cat_names, cat_offsets = packed_strings([n for _, n in categories])
    return Columns(
        {
            "names": names,
            "name_offsets": name_offsets,
            "hw": np.asarray(hw, dtype=np.int32).reshape(-1, 2),
            "boxes": np.asarray(boxes, dtype=np.float32).reshape(-1, 4),
            "labels": np.asarray(labels, dtype=np.int32).reshape(-1),
            "box_offsets": np.asarray(box_offsets, dtype=np.int64),
            "category_ids": np.array([c for c, _ in categories], dtype=np.int32),
            "category_names": cat_names,
            "category_offsets": cat_offsets,
        },
        {"detection": 1, **meta},
    )


class DetectionIndex:
    """A detection index read in place (no per-image Python objects): ``len``, each
    image's ``file(i)``, ``hw[i]``, ``boxes(i)``/``labels(i)`` (views), ``categories``."""

    def __init__(self, mapped: MappedIndex) -> None:
        a = mapped.arrays
        missing = [k for k in DETECTION_ARRAYS if k not in a]
        if missing or not mapped.meta.get("detection"):
            raise IndexProblem(
                f"not a detection index (no {', '.join(missing) or 'detection meta'})"
            )
        self.mapped = mapped
        self._names, self._name_off = a["names"], a["name_offsets"]
        self.hw = a["hw"]
        self.all_boxes, self.all_labels, self._box_off = a["boxes"], a["labels"], a["box_offsets"]
        n, m = len(self.hw), len(self.all_boxes)
        ok = (
            len(self._name_off) == n + 1
            and len(self._box_off) == n + 1
            and len(self.all_labels) == m
            and (n == 0 or (self._box_off[0] == 0 and self._box_off[-1] == m))
            and (n == 0 or (self._name_off[0] == 0 and self._name_off[-1] == len(self._names)))
            and bool((np.diff(self._box_off) >= 0).all())
            and bool((np.diff(self._name_off) >= 0).all())
        )
        if not ok:
            raise IndexDamaged("a detection index whose offsets do not match its arrays")
        ids, cn, co = a["category_ids"], a["category_names"], a["category_offsets"]
        self.categories = tuple(
            (int(ids[i]), bytes(cn[co[i] : co[i + 1]]).decode()) for i in range(len(ids))
        )
        self.normalized = bool(mapped.meta.get("normalized"))

    def __len__(self) -> int:
        return len(self.hw)

    def file(self, i: int) -> str:
        return bytes(self._names[self._name_off[i] : self._name_off[i + 1]]).decode()

    def boxes(self, i: int) -> np.ndarray:
        return self.all_boxes[self._box_off[i] : self._box_off[i + 1]]

    def labels(self, i: int) -> np.ndarray:
        return self.all_labels[self._box_off[i] : self._box_off[i + 1]]

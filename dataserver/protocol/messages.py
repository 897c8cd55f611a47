"""One small typed codec per message type.

Each message is a dataclass whose fields name their codec (``fields.py``). ``encode()``
gives frames; ``decode(frames)`` gives the message of the right class with every field
checked for type and range, cross-field rules checked by ``_check``, and RESULT arrays
checked by role. Absent optional fields read as None (or their default), and unknown
header keys are ignored, so a newer peer may add fields.

Who sends what (client = trainer, front = server's front process, worker = its workers)::

    HELLO       client -> front      open (or re-open) a session
    WELCOME     front  -> client     dataset, workers, credit, endpoints, limits
    TASK        client -> front -> worker
    RESULT      worker -> client (direct) or worker -> front -> client
    DONE        worker -> front      "I sent that RESULT straight to the client"
    ERROR       front | worker -> client, naming the task when there is one
    CANCELLED   front  -> client     queued tasks of an older plan, dropped
    CONTROL     client -> front      (control socket) new plan version / control values
    HEARTBEAT   both ways            liveness; the front's reply lists worker endpoints
    STATS       anyone <-> front     counters
    BYE         client -> front, front -> worker
    READY       worker -> front      a worker is up (and where clients reach it)
"""

from __future__ import annotations

import dataclasses
import hashlib
from collections.abc import Sequence
from typing import Any, ClassVar, TypeVar

import msgpack
import numpy as np

from dataserver.protocol.fields import (
    MISSING,
    SESSION,
    Blob,
    Blobs,
    Choice,
    Failures,
    Flag,
    Int,
    IntLists,
    Ints,
    Opt,
    Text,
    Texts,
    Tree,
    Values,
)
from dataserver.protocol.wire import MsgType, ProtocolError, pack, unpack

MAX_IMAGE_SIDE = 16384  # the protocol's own cap; a server's --max-image-side may be lower
MAX_TILES = 16  # grid 4 x 4
MAX_BOXES = 1 << 16  # per output image
MAX_WORKERS = 4096
MAX_TASK_IMAGES = 64  # output images one TASK may ask for
MAX_US = 1 << 40  # a timing in microseconds (12 days)
# A session's secret (16..32 random bytes): chosen by the client, bound by its HELLO, and
# named by every message that acts for the session (TASK, CONTROL, HEARTBEAT, BYE). The
# session id says which session; only the secret says who may act for it.
AUTH = Blob(16, 32)
MAX_SEQ = 1 << 53  # plan versions and control sequence numbers
TAG_BYTES = 16
MAX_TAGS = 1024  # servers one published CONTROL speaks to


def steer_tag(secret: bytes, msg: Control) -> bytes:
    """What proves a published CONTROL comes from the session's owner, to the one server
    whose secret for the session is ``secret`` (a keyed hash of what the message says). A
    client talks to many servers with a secret for each; what it publishes to all of them
    carries one tag per server, so no server learns a secret that works on another."""
    body = msgpack.packb(
        [msg.session, msg.plan_version, msg.control_seq, msg.control, msg.mode, list(msg.cancel)],
        use_bin_type=True,
    )
    return hashlib.blake2b(body, key=secret, digest_size=TAG_BYTES).digest()


DECODE_US = Opt(Ints(0, MAX_TASK_IMAGES * MAX_TILES, 0, MAX_US))  # one timing per source

M = TypeVar("M", bound="Message")


def f(codec: Any, default: Any = dataclasses.MISSING) -> Any:
    """A message field read with ``codec`` (required unless it has a default)."""
    if default is dataclasses.MISSING:
        return dataclasses.field(metadata={"codec": codec})
    return dataclasses.field(default=default, metadata={"codec": codec})


class Message:
    """Base of the typed messages."""

    __slots__ = ()
    TYPE: ClassVar[MsgType]
    _codecs: ClassVar[tuple[tuple[str, Any], ...]] = ()

    def header(self) -> dict[str, Any]:
        out = {}
        for name, _ in self._codecs:
            value = getattr(self, name)
            if value is not None:
                out[name] = value
        return out

    def arrays(self) -> list[np.ndarray]:
        return []

    def encode(self) -> list[Any]:
        """Frames for ``send_multipart(frames, copy=False)``."""
        return pack(self.TYPE, self.header(), self.arrays())

    @classmethod
    def read(cls: type[M], header: dict[str, Any], arrays: list[np.ndarray] | None) -> M:
        values = {name: codec.read(name, header.get(name, MISSING)) for name, codec in cls._codecs}
        msg = cls(**values)
        msg._check(arrays)
        return msg

    def _check(self, arrays: list[np.ndarray] | None) -> None:
        if arrays:
            raise ProtocolError(f"{self.TYPE.name} carries no arrays, {len(arrays)} came")


MESSAGES: dict[MsgType, type[Message]] = {}


def message(cls: type[M]) -> type[M]:
    """Register a message dataclass under its TYPE."""
    cls._codecs = tuple(
        (fld.name, fld.metadata["codec"])
        for fld in dataclasses.fields(cls)  # type: ignore[arg-type]
        if "codec" in fld.metadata
    )
    MESSAGES[cls.TYPE] = cls
    return cls


def decode(frames: Sequence[Any], with_arrays: bool = True) -> Message:
    """Decode and check one message; raises ``ProtocolError`` naming what is wrong, and
    nothing else (whatever a check missed is turned into one)."""
    mtype, header, arrays = unpack(frames, with_arrays)
    try:
        return MESSAGES[mtype].read(header, arrays if with_arrays else None)
    except ProtocolError as exc:
        raise ProtocolError(f"{mtype.name}: {exc}") from None
    except Exception as exc:
        raise ProtocolError(f"{mtype.name}: unreadable ({type(exc).__name__}: {exc})") from None


# ---------------------------------------------------------------------------- handshake


@message
@dataclasses.dataclass(slots=True, kw_only=True)
class Hello(Message):
    """Open a session (or re-open it after the server forgot it), binding its secret
    ``auth``; ``plan_version`` and ``control_seq`` are where the session stands now (a
    server met mid-job bounds the numbers it will take from there)."""

    TYPE: ClassVar[MsgType] = MsgType.HELLO
    session: bytes = f(SESSION)
    auth: bytes | None = f(Opt(AUTH), None)
    plan_version: int = f(Int(0, MAX_SEQ, default=0), 0)
    control_seq: int = f(Int(0, MAX_SEQ, default=0), 0)


@message
@dataclasses.dataclass(slots=True, kw_only=True)
class Welcome(Message):
    """The server's answer to HELLO: what it serves and where to reach its parts."""

    TYPE: ClassVar[MsgType] = MsgType.WELCOME
    session: bytes = f(SESSION)
    server_id: str = f(Text(64))
    dataset_len: int = f(Int(0, 1 << 48))
    fingerprint: str = f(Text(128))
    workers: int = f(Int(1, MAX_WORKERS))
    credit: int = f(Int(1, 1 << 16))
    control: str = f(Text(512))
    results: tuple[str, ...] = f(Texts(MAX_WORKERS, 512, default=()), ())
    max_image_side: int = f(Int(1, MAX_IMAGE_SIDE, default=MAX_IMAGE_SIDE), MAX_IMAGE_SIDE)
    # The same workers' ipc endpoints, for a client on this host (it proves it is by
    # finding ``local_token`` in the file beside them).
    local: tuple[str, ...] = f(Texts(MAX_WORKERS, 512, default=()), ())
    local_token: str = f(Text(64, default=""), "")
    # Bytes of its store of prepared sources (0: none; every task decodes its sources).
    store_bytes: int = f(Int(0, 1 << 50, default=0), 0)


# ---------------------------------------------------------------------------- work


@message
@dataclasses.dataclass(slots=True, kw_only=True)
class Task(Message):
    """Compose a run of output images of one batch: image i from the sources
    ``images[i]`` (grid x grid cells, row-major), each source first fitted into ``fit_hw``
    (the client's image size: what the server's store keeps), then into its cell.
    ``control_seq`` names the control values the dataset must hold (sent once, by CONTROL);
    ``priority`` 1 marks a speculative task (run when nothing else waits)."""

    TYPE: ClassVar[MsgType] = MsgType.TASK
    session: bytes = f(SESSION)
    auth: bytes | None = f(Opt(AUTH), None)
    task_id: int = f(Int())
    plan_version: int = f(Int(0, MAX_SEQ))
    epoch: int = f(Int())
    seed: int = f(Int())
    images: tuple[tuple[int, ...], ...] = f(IntLists(MAX_TASK_IMAGES, MAX_TILES))
    grid: int = f(Int(1, 4))
    out_hw: tuple[int, ...] = f(Ints(2, 2, 1, MAX_IMAGE_SIDE))
    fit_hw: tuple[int, ...] = f(Ints(2, 2, 1, MAX_IMAGE_SIDE))
    on_error: str = f(Choice(("raise", "skip")))
    control_seq: int = f(Int(0, MAX_SEQ))
    exclude: tuple[int, ...] = f(Ints(0, MAX_TILES, default=()), ())
    priority: int = f(Int(0, 1, default=0), 0)
    # Landing (same host): write the images into the client's shared-memory buffer
    # (``dataserver/landing.py``) instead of sending them, if the worker holds the buffer
    # registered under ``land_token`` for this session (handed over on its unix socket).
    land_token: str = f(Text(64, default=""), "")
    land_region: int = f(Int(0, 1 << 16, default=0), 0)
    land_gen: int = f(Int(default=0), 0)
    land_offset: int = f(Int(default=0), 0)
    # 1: the landing bytes were never written (fresh shared memory, all zero): the worker
    # need not clear them before composing (the letterbox padding is already zero).
    land_zero: int = f(Int(0, 1, default=0), 0)

    def _check(self, arrays: list[np.ndarray] | None) -> None:
        Message._check(self, arrays)
        for indices in self.images:
            if len(indices) > self.grid * self.grid:
                raise ProtocolError(
                    f"{len(indices)} indices do not fit a {self.grid}x{self.grid} grid"
                )
        if min(self.out_hw) < self.grid:
            raise ProtocolError(f"out_hw {self.out_hw} is smaller than the grid {self.grid}")

    @property
    def indices(self) -> tuple[int, ...]:
        """Every source index of the task, in order."""
        return tuple(i for image in self.images for i in image)

    def canvas_bytes(self) -> int:
        return len(self.images) * 3 * self.out_hw[0] * self.out_hw[1]


@message
@dataclasses.dataclass(slots=True, kw_only=True)
class Result(Message):
    """The images of one TASK, in its order: ``images[i]`` the indices image i holds (cell
    order; sources left out under on_error="skip" are in ``failed``; none when all of its
    sources were), ``box_counts[i]`` its boxes. Arrays: all the images as one
    (N, 3, H, W) uint8 array, then all boxes (sum M, 4) float32 xyxy and labels (sum M,)
    int64, image by image."""

    TYPE: ClassVar[MsgType] = MsgType.RESULT
    session: bytes = f(SESSION)
    task_id: int = f(Int())
    plan_version: int = f(Int())
    images: tuple[tuple[int, ...], ...] = f(IntLists(MAX_TASK_IMAGES, MAX_TILES, 0))
    box_counts: tuple[int, ...] = f(Ints(0, MAX_TASK_IMAGES, 0, MAX_BOXES))
    failed: tuple[tuple[int, str], ...] = f(Failures(MAX_TASK_IMAGES * MAX_TILES), ())
    decoded: int = f(Int(0, MAX_TASK_IMAGES * MAX_TILES, default=0), 0)
    landed: bool | None = f(Opt(Flag()), None)  # the images are in the client's buffer
    # For the server's metrics: microseconds the worker spent on the task, and on each
    # source it decoded and fitted (store misses). 0 / absent: a worker that does not say.
    task_us: int = f(Int(0, MAX_US, default=0), 0)
    decode_us: tuple[int, ...] | None = f(DECODE_US, None)
    pixels: np.ndarray | None = None
    boxes: np.ndarray | None = None
    labels: np.ndarray | None = None

    def arrays(self) -> list[np.ndarray]:
        if self.boxes is None or self.labels is None or (self.pixels is None) != bool(self.landed):
            raise ProtocolError("a RESULT needs its images (unless landed), boxes and labels")
        if self.landed:
            return [self.boxes, self.labels]
        assert self.pixels is not None
        return [self.pixels, self.boxes, self.labels]

    def _check(self, arrays: list[np.ndarray] | None) -> None:
        if len(self.box_counts) != len(self.images):
            raise ProtocolError(f"{len(self.box_counts)} box counts for {len(self.images)} images")
        if arrays is None:  # the front forwards it unread
            return
        want = 2 if self.landed else 3
        if len(arrays) != want:
            raise ProtocolError(f"RESULT carries {want} arrays, {len(arrays)} came")
        if self.landed:
            boxes, labels = arrays
        else:
            pixels, boxes, labels = arrays
            check_images_spec(pixels.dtype, pixels.shape, len(self.images))
            self.pixels = pixels
        check_boxes(boxes, labels, sum(self.box_counts))
        self.boxes, self.labels = boxes, labels


def check_images_spec(dtype: Any, shape: tuple[int, ...], n: int) -> None:
    """A RESULT's images: uint8 (n, 3, H, W), H and W within the protocol's cap."""
    ok = (
        np.dtype(dtype) == np.uint8
        and len(shape) == 4
        and shape[0] == n
        and shape[1] == 3
        and 1 <= shape[2] <= MAX_IMAGE_SIDE
        and 1 <= shape[3] <= MAX_IMAGE_SIDE
    )
    if not ok:
        raise ProtocolError(
            f"images must be uint8 ({n}, 3, H, W), H, W <= {MAX_IMAGE_SIDE}: got {dtype} {shape}"
        )


def check_boxes(boxes: np.ndarray, labels: np.ndarray, count: int) -> None:
    """Boxes float32 (M, 4) and labels int64 (M,), M = ``count``."""
    if not (boxes.dtype == np.float32 and boxes.ndim == 2 and boxes.shape == (count, 4)):
        raise ProtocolError(f"boxes must be float32 ({count}, 4): got {boxes.dtype} {boxes.shape}")
    if not (labels.dtype == np.int64 and labels.shape == (count,)):
        raise ProtocolError(f"labels must be int64 ({count},): got {labels.dtype} {labels.shape}")


@message
@dataclasses.dataclass(slots=True, kw_only=True)
class Done(Message):
    """A worker sent a RESULT straight to its client."""

    TYPE: ClassVar[MsgType] = MsgType.DONE
    session: bytes = f(SESSION)
    task_id: int = f(Int())
    plan_version: int = f(Int())
    decoded: int = f(Int(0, MAX_TASK_IMAGES * MAX_TILES, default=0), 0)
    samples: int = f(Int(0, MAX_TASK_IMAGES * MAX_TILES, default=0), 0)
    images: int = f(Int(0, MAX_TASK_IMAGES, default=0), 0)
    task_us: int = f(Int(0, MAX_US, default=0), 0)  # as in RESULT
    decode_us: tuple[int, ...] | None = f(DECODE_US, None)


@message
@dataclasses.dataclass(slots=True, kw_only=True)
class ErrorMsg(Message):
    """Something went wrong; ``task_id`` names the task when there is one, ``kind`` says
    what: sample, poison, request, control, internal, protocol, unknown_session, overload,
    limit, maybe_lost, dropped, session_limit, not_owner."""

    TYPE: ClassVar[MsgType] = MsgType.ERROR
    message: str = f(Text())
    kind: str = f(Text(32, default=""), "")
    session: bytes | None = f(Opt(SESSION), None)
    task_id: int | None = f(Opt(Int()), None)
    plan_version: int | None = f(Opt(Int()), None)
    index: int | None = f(Opt(Int()), None)
    file: str | None = f(Opt(Text()), None)
    indices: tuple[int, ...] | None = f(Opt(Ints(0, MAX_TASK_IMAGES * MAX_TILES)), None)
    retry: bool | None = f(Opt(Flag()), None)  # worker -> front: it may succeed if run again
    image: int | None = f(Opt(Int(0, MAX_TASK_IMAGES)), None)  # poison: which of the task's


@message
@dataclasses.dataclass(slots=True, kw_only=True)
class Cancelled(Message):
    """Queued tasks of an older plan, dropped unrun (their credit is free again)."""

    TYPE: ClassVar[MsgType] = MsgType.CANCELLED
    session: bytes = f(SESSION)
    task_ids: tuple[int, ...] = f(Ints(0, 1 << 16))
    plan_version: int = f(Int(default=0), 0)


# ---------------------------------------------------------------------------- steering, liveness


@message
@dataclasses.dataclass(slots=True, kw_only=True)
class Control(Message):
    """Client -> front (data socket, and published on the control socket): the session's
    control values as of ``control_seq``, its mode, and tasks it no longer wants (queued
    ones are dropped at once, answered CANCELLED). Front -> worker: the values a session's
    next task needs (``control`` and ``control_seq`` only)."""

    TYPE: ClassVar[MsgType] = MsgType.CONTROL
    session: bytes = f(SESSION)
    # Client -> front, on the data socket: the session's secret for this server. Published
    # on the control socket: ``tags`` instead, one ``steer_tag`` per server.
    auth: bytes | None = f(Opt(AUTH), None)
    tags: tuple[bytes, ...] | None = f(Opt(Blobs(MAX_TAGS, TAG_BYTES)), None)
    plan_version: int = f(Int(0, MAX_SEQ, default=0), 0)
    control_seq: int = f(Int(0, MAX_SEQ))
    control: dict[str, Any] = f(Values())
    mode: str | None = f(Opt(Choice(("regular", "stitch"))), None)
    cancel: tuple[int, ...] = f(Ints(0, 1 << 16, default=()), ())


@message
@dataclasses.dataclass(slots=True, kw_only=True)
class Heartbeat(Message):
    """Client -> front: ``session``. Front -> client: ``server_id`` and the live workers'
    result endpoints."""

    TYPE: ClassVar[MsgType] = MsgType.HEARTBEAT
    session: bytes | None = f(Opt(SESSION), None)
    auth: bytes | None = f(Opt(AUTH), None)
    server_id: str | None = f(Opt(Text(64)), None)
    results: tuple[str, ...] | None = f(Opt(Texts(MAX_WORKERS, 512)), None)
    local: tuple[str, ...] | None = f(Opt(Texts(MAX_WORKERS, 512)), None)


@message
@dataclasses.dataclass(slots=True, kw_only=True)
class Stats(Message):
    """A request (no ``stats``) or the reply (``stats``: the server's counters)."""

    TYPE: ClassVar[MsgType] = MsgType.STATS
    stats: dict[str, Any] | None = f(Opt(Tree()), None)


@message
@dataclasses.dataclass(slots=True, kw_only=True)
class Bye(Message):
    """End a session (client -> front), stop (front -> worker), or, front -> client: this
    server is draining (SIGTERM): send it nothing more; its queued tasks come back
    CANCELLED, its running ones are finished."""

    TYPE: ClassVar[MsgType] = MsgType.BYE
    session: bytes | None = f(Opt(SESSION), None)
    auth: bytes | None = f(Opt(AUTH), None)  # client -> front


@message
@dataclasses.dataclass(slots=True, kw_only=True)
class Ready(Message):
    """A worker is up; clients reach it at ``results`` (empty: only through the front)."""

    TYPE: ClassVar[MsgType] = MsgType.READY
    worker: int = f(Int(0, MAX_WORKERS))
    pid: int = f(Int(1, 1 << 31))
    results: str = f(Text(512, default=""), "")
    local: str = f(Text(512, default=""), "")  # its ipc endpoint, for clients on this host
    # Whether it maps the server's store: False when what it inherited was unusable (it
    # serves without); None when the server has none.
    store: bool | None = f(Opt(Flag()), None)


__all__ = [
    "MAX_BOXES",
    "MAX_IMAGE_SIDE",
    "MAX_TILES",
    "MESSAGES",
    "Blob",
    "Bye",
    "Cancelled",
    "Control",
    "Done",
    "ErrorMsg",
    "Heartbeat",
    "Hello",
    "Message",
    "Ready",
    "Result",
    "Stats",
    "Task",
    "Welcome",
    "decode",
    "steer_tag",
]

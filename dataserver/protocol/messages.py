"""One ``msgspec.Struct`` per message type.

Each message's fields carry their constraints (``fields.py``), checked by msgspec while it
decodes the header straight from its msgpack bytes; ``encode()`` gives frames;
``decode(frames)`` gives the message of the right class with every field checked for type
and range, cross-field rules checked by ``_check``, and RESULT arrays checked by role.
Absent optional fields read as None (or their default), and unknown header keys are skipped
(parsed, never built), so a newer peer may add fields. The numbers behind the choice of
msgspec are in docs/DESIGN-NOTES.md ("Codecs: msgspec or not").

Who sends what (client = trainer, front = server's front process, worker = its workers)::

    HELLO       client -> front      open (or re-open) a session
    WELCOME     front  -> client     dataset, workers, credit, endpoints, limits
    TASK        client -> front -> worker
    RESULT      worker -> client (direct) or worker -> front -> client
    DONE        worker -> front      "I sent that RESULT straight to the client"
    ERROR       front | worker -> client, naming the task when there is one
    CANCELLED   front  -> client     queued tasks of an older plan, dropped
    CONTROL     client -> front      new plan version / control values / cancels (on
                                     the session's data connection, like TASK)
    HEARTBEAT   both ways            liveness; the front's reply lists worker endpoints
    STATS       anyone <-> front     counters
    BYE         client -> front, front -> worker
    READY       worker -> front      a worker is up (and where clients reach it)
    SIZES       client <-> front     per-sample (h, w), a chunk at a time, on request

Per-sample sizes (aspect-grouped batches: Ultralytics' rect validation) are not in WELCOME:
a dataset of up to ``MAX_ANNOUNCED_SIZES`` (2^24) samples announces only their count
(``sizes_count``) and a digest of the whole table (``sizes_digest``,
``sizes_digest()``); a client that needs them asks SIZES ``start``/``count`` (at most
``SIZES_CHUNK`` a request), for its session, and each reply carries ``count`` (h, w) as one
int32 array and the table's digest. The front answers a session's requests at
``SIZES_RATE`` a second (``SIZES_BURST`` at once), within the outbox's bounds; the client
asks no faster, checks every chunk (its range, its digest) and the digest of the whole.

Over the house's ~500 lines (about 760): one ``Struct`` per message type, the protocol's one
definition; split by message, the wire format would be scattered.
"""

from __future__ import annotations

import hashlib
import re
from collections.abc import Sequence
from typing import Annotated, Any, ClassVar

import msgpack
import msgspec
import numpy as np
from msgspec import Meta, Struct

from dataserver.protocol.batchsizes import BatchSizes
from dataserver.protocol.fields import (
    MAX_LABEL,
    T32,
    T64,
    T128,
    T512,
    U63,
    In,
    Len,
    Session,
    Text,
    control_problem,
    tree_problem,
)
from dataserver.protocol.wire import (
    MAGIC,
    MAX_FRAMES,
    MsgType,
    ProtocolError,
    array,
    check_dtypes,
    head,
)

MAX_IMAGE_SIDE = 16384  # the protocol's own cap; a server's --max-image-side may be lower
MAX_TILES = 16  # grid 4 x 4
MAX_BOXES = 1 << 16  # per output image
MAX_WORKERS = 4096
MAX_TASK_IMAGES = 64  # output images one TASK may ask for
DEFAULT_TASK_BYTES = 64 << 20  # what a WELCOME without max_task_bytes means
MAX_US = 1 << 40  # a timing in microseconds (12 days)
MAX_SEQ = 1 << 53  # plan versions and control sequence numbers
MAX_SOURCES = MAX_TASK_IMAGES * MAX_TILES
MAX_CATEGORIES = 4096  # (label, name) pairs a WELCOME may announce
MAX_CATEGORY_NAME = 256  # characters of one category's name
MAX_FILE = 1024  # characters of a sample's file name in a RESULT
MAX_ORIG_SIDE = 1 << 20  # a sample's original side, as it says (0: unknown)
MAX_ANNOUNCED_SIZES = 1 << 24  # per-sample (h, w) a server may announce (SIZES, on request)
SIZES_CHUNK = 1 << 16  # (h, w) pairs one SIZES reply carries at most (512 KiB)
SIZES_RATE = 64.0  # SIZES requests a session may make a second, sustained (a 2^24 table: 4 s)
SIZES_BURST = 64.0  # ... and at once
DIGEST_BYTES = 16  # ``sizes_digest``
MAX_FETCH_TIMES = 4096  # GET latencies one TALLY may carry
MAX_AHEAD = 4096  # sample indices one TASK may name as its plan's next (``ahead``)
FETCH_ERROR_KINDS = 16  # kinds of fetch error one TALLY may count

# A session's secret (16..32 random bytes): chosen by the client, bound by its HELLO, and
# named by every message that acts for the session (TASK, CONTROL, HEARTBEAT, BYE). The
# session id says which session; only the secret says who may act for it.
Auth = Annotated[bytes, Len(16, 32)]
Seq = Annotated[int, In(0, MAX_SEQ)]
Us = Annotated[int, In(0, MAX_US)]
Count = Annotated[int, In(0, MAX_SOURCES)]
Side = Annotated[int, In(1, MAX_IMAGE_SIDE)]
Flag01 = Annotated[int, In(0, 1)]
Endpoints = Annotated[tuple[T512, ...], Len(0, MAX_WORKERS)]
Ids = Annotated[tuple[U63, ...], Len(0, 1 << 16)]
DecodeUs = Annotated[tuple[Us, ...], Len(0, MAX_SOURCES)]  # one timing per source
Tiles = Annotated[tuple[U63, ...], Len(1, MAX_TILES)]
Tiles0 = Annotated[tuple[U63, ...], Len(0, MAX_TILES)]
Category = tuple[Annotated[int, In(0, MAX_LABEL)], Annotated[str, Len(0, MAX_CATEGORY_NAME)]]
Categories = Annotated[tuple[Category, ...], Len(0, MAX_CATEGORIES)]
SizesCount = Annotated[int, In(0, MAX_ANNOUNCED_SIZES)]
Digest = Annotated[bytes, Len(0, DIGEST_BYTES)]
FileName = Annotated[str, Len(0, MAX_FILE)]
OrigSide = Annotated[int, In(0, MAX_ORIG_SIDE)]
Side0 = Annotated[int, In(0, MAX_IMAGE_SIDE)]
Box4 = tuple[Side0, Side0, Side0, Side0]  # (top, left, h, w) of a picture in its canvas
# How often the server asks a client to beat, in ms (0: it says nothing; the client keeps its
# own). The wire bounds it loosely: the client refuses what is beyond its own bounds
# (``dataserver_client.net.beats``), counted, and keeps beating as it did.
BeatMs = Annotated[int, In(0, 1 << 31)]


class Message(Struct, kw_only=True, omit_defaults=True):
    """Base of the typed messages. ``specs`` is the header's "arrays" entry (array
    descriptors, checked against their frames by ``wire.array``)."""

    TYPE: ClassVar[MsgType]
    specs: Annotated[tuple[Any, ...], Len(0, MAX_FRAMES)] = msgspec.field(default=(), name="arrays")

    def header(self) -> dict[str, Any]:
        """The header fields that are set (not None), by name."""
        out = {}
        for name in self.__struct_fields__:
            value = getattr(self, name)
            if value is not None and name not in _NOT_HEADER:
                out[name] = value
        return out

    def arrays(self) -> list[np.ndarray]:
        return []

    def encode(self) -> list[Any]:
        """Frames for ``send_multipart(frames, copy=False)``."""
        return [MAGIC, bytes((int(self.TYPE),)), _ENCODER.encode(self)]

    def _check(self, arrays: list[np.ndarray] | None) -> None:
        if arrays:
            raise ProtocolError(f"{self.TYPE.name} carries no arrays, {len(arrays)} came")


_NOT_HEADER = frozenset({"specs", "pixels", "boxes", "labels", "hw"})


def decode(frames: Sequence[Any], with_arrays: bool = True) -> Message:
    """Decode and check one message; raises ``ProtocolError`` naming what is wrong, and
    nothing else (whatever a check missed is turned into one). ``with_arrays=False`` leaves
    the array frames unread: for a front that forwards a result it does not look into."""
    mtype, raw = head(frames)
    try:
        msg = _DECODERS[mtype].decode(raw)
        buffers = frames[3:]
        if len(msg.specs) != len(buffers):
            raise ProtocolError(
                f"header names {len(msg.specs)} array(s) but {len(buffers)} buffer frame(s) came"
            )
        if not with_arrays:
            msg._check(None)
            return msg
        pairs = zip(msg.specs, buffers, strict=True)
        msg._check([array(i, spec, frame) for i, (spec, frame) in enumerate(pairs)])
        return msg
    except Exception as exc:
        raise ProtocolError(f"{mtype.name}: {_problem(exc)}") from None


def decode_head(frames: Sequence[Any]) -> Message:
    """The message of a message's first three frames, its fields checked and its array
    descriptors in ``specs``, unchecked: for a receiver that takes the array frames itself
    (straight into its buffers). Raises ``ProtocolError`` and nothing else."""
    mtype, raw = head(frames)
    try:
        msg = _DECODERS[mtype].decode(raw)
        msg._check(None)
        return msg
    except Exception as exc:
        raise ProtocolError(f"{mtype.name}: {_problem(exc)}") from None


_AT = re.compile(r" - at `\$\.(\w+)")
_MISSING = re.compile(r"Object missing required field `(\w+)`")


def _problem(exc: Exception) -> str:
    """What is wrong, naming the field as "field 'name'" where there is one."""
    text = str(exc)
    if isinstance(exc, ProtocolError):
        return text
    if isinstance(exc, msgspec.DecodeError) and not isinstance(exc, msgspec.ValidationError):
        return f"header is not valid msgpack: {text}"
    if not isinstance(exc, msgspec.ValidationError):
        return f"unreadable ({type(exc).__name__}: {text})"
    where = _AT.search(text) or _MISSING.search(text)
    if where:
        return f"field {where[1]!r}: {text}"
    if text.startswith("Expected `object`"):
        return f"header must be a map: {text}"
    return text


# ---------------------------------------------------------------------------- handshake


class Hello(Message, kw_only=True):
    """Open a session (or re-open it after the server forgot it), binding its secret
    ``auth``; ``plan_version`` and ``control_seq`` are where the session stands now (a
    server met mid-job bounds the numbers it will take from there)."""

    TYPE: ClassVar[MsgType] = MsgType.HELLO
    session: Session
    auth: Auth | None = None
    plan_version: Seq = 0
    control_seq: Seq = 0
    # Random bytes a server on the client's host proves its host token with, in WELCOME's
    # ``local_proof`` (``dataserver.security.host_proof``); the token never goes on the wire.
    nonce: Annotated[bytes, Meta(max_length=32)] = b""
    # On a worker's result port: the tag the session's WELCOME gave (``claim``), without
    # which a worker takes no claim (``dataserver.security.claim_tag``).
    claim: Annotated[bytes, Meta(max_length=32)] = b""


class Welcome(Message, kw_only=True):
    """The server's answer to HELLO: what it serves and where to reach its parts."""

    TYPE: ClassVar[MsgType] = MsgType.WELCOME
    session: Session
    server_id: T64
    dataset_len: Annotated[int, In(0, 1 << 48)]
    fingerprint: T128
    workers: Annotated[int, In(1, MAX_WORKERS)]
    credit: Annotated[int, In(1, 1 << 16)]
    results: Endpoints = ()
    max_image_side: Side = MAX_IMAGE_SIDE
    # The most output bytes one TASK may ask for (images x 3 x H x W; ``--max-task-mb``):
    # the client cuts its batches into tasks that fit. Absent (an older server): 64 MiB.
    max_task_bytes: Annotated[int, In(1, 1 << 50)] = DEFAULT_TASK_BYTES
    # The same workers' ipc endpoints, for a client on this host: it is when the host token
    # in the file beside them makes ``local_proof`` for its HELLO's nonce and the connection
    # the HELLO came by (``dataserver.security.host_proof``: a relay's is another one). The
    # token itself is never sent (``local_token`` stays empty: any HELLO read it once, and
    # a fake server replayed it).
    local: Endpoints = ()
    local_token: T64 = ""
    local_proof: Annotated[bytes, Meta(max_length=32)] = b""
    # What the session's claims on the workers' result ports carry (``Hello.claim``): it
    # proves the front admitted the session (absent, an older server: results come
    # through the front wherever a worker asks for it).
    claim: Annotated[bytes, Meta(max_length=32)] = b""
    # Bytes of its store of prepared sources (0: none; every task decodes its sources).
    store_bytes: Annotated[int, In(0, 1 << 50)] = 0
    # The dataset's categories, its (label, name) pairs (none: it announces none).
    categories: Categories = ()
    # How many per-sample (h, w) the server answers SIZES for (0: it announces none;
    # else the dataset's length), and the digest of the whole table (``sizes_digest``): a
    # trainer groups batches by aspect with them (Ultralytics' rect validation), asking for
    # them only then, in chunks; the digest ties the chunks to this dataset.
    sizes_count: SizesCount = 0
    sizes_digest: Digest = b""
    # How often to beat (the server's load sets it: ``dataserver.server.beats``; absent: an
    # older server, the client keeps its own interval).
    heartbeat_ms: BeatMs = 0
    # 1: it fetches its dataset's bytes from object storage ahead of its workers: tell it
    # the plan's next samples (``Task.ahead``); absent (0): the client sends none.
    fetch_ahead: Flag01 = 0

    def _check(self, arrays: list[np.ndarray] | None) -> None:
        Message._check(self, arrays)
        labels = {label for label, _ in self.categories}
        if len(labels) != len(self.categories):
            raise ProtocolError("field 'categories': a label is named twice")
        if self.sizes_count and self.sizes_count != self.dataset_len:
            raise ProtocolError(
                f"field 'sizes_count': {self.sizes_count} sizes for {self.dataset_len} samples"
            )
        if len(self.sizes_digest) != (DIGEST_BYTES if self.sizes_count else 0):
            raise ProtocolError(
                f"field 'sizes_digest': {len(self.sizes_digest)} bytes; {DIGEST_BYTES} with "
                "sizes_count, none without"
            )


def control_digest(values: dict[str, Any]) -> bytes:
    """The digest of a set of control values (BLAKE2b, 16 bytes, of their msgpack), as a
    worker reads them off the wire: what a TASK says its values are (``Task.control_digest``)
    and a RESULT says its worker composed with (``Result.control_digest``), and, in hex,
    what keys a worker's dataset object and its store entries for them (``controls.py``)."""
    packed = msgpack.packb(values, use_bin_type=True)
    return hashlib.blake2b(packed, digest_size=DIGEST_BYTES).digest()


def wire_control_digest(values: dict[str, Any]) -> bytes:
    """``control_digest`` of ``values`` as a worker gets them: sent and read back (a tuple
    is a list there, a bytearray bytes), so the sender's digest is the worker's."""
    read = msgspec.msgpack.decode(msgspec.msgpack.encode(values), type=dict[str, Any])
    return control_digest(read)


def sizes_digest(table: np.ndarray) -> bytes:
    """The digest of a whole table of per-sample (h, w) (int32 (N, 2)) that WELCOME and
    every SIZES reply carry: BLAKE2b of its little-endian bytes, so the table's length is in
    it too."""
    data = np.ascontiguousarray(table, dtype="<i4")
    return hashlib.blake2b(data.data, digest_size=DIGEST_BYTES).digest()


# ---------------------------------------------------------------------------- work


class Task(Message, kw_only=True):
    """Compose a run of output images of one batch: image i from the sources
    ``images[i]`` at ``out_hw``, each source fitted into ``source_hw`` (what the server's
    store keeps; none: ``fit_hw``), then into ``fit_hw`` (the batch's image size) when that
    is smaller (the three as one value: ``sizes``, ``batchsizes.BatchSizes``),
    then given to the dataset's ``augment`` (never stored), then composed: ``layout``
    "grid" puts them in grid x grid cells (row-major), "mosaic" around a random centre
    (``dataserver/data/mosaic.py``). ``step`` and ``mode`` are the batch's (``augment``
    is told them). ``control_seq`` names the control values the dataset must hold (sent
    once, by CONTROL); ``control``, when set, are values for this task alone (a rebuilt
    batch: ``client.rebuild``), in place of the session's.
    ``priority`` 1: queued ahead of the session's other queued tasks (the client's hedge
    of a task a slow server holds: the trainer waits on it first); other sessions' tasks
    are not passed (the fair queue is between sessions). A server before it ignores it."""

    TYPE: ClassVar[MsgType] = MsgType.TASK
    session: Session
    auth: Auth | None = None
    task_id: U63
    plan_version: Seq
    epoch: U63
    seed: U63
    images: Annotated[tuple[Tiles, ...], Len(1, MAX_TASK_IMAGES)]
    grid: Annotated[int, In(1, 4)]
    out_hw: tuple[Side, Side]
    fit_hw: tuple[Side, Side]
    on_error: Annotated[str, Meta(pattern=r"\A(raise|skip)\Z")]
    control_seq: Seq
    exclude: Annotated[tuple[U63, ...], Len(0, MAX_TILES)] = ()
    priority: Flag01 = 0
    step: U63 = 0
    mode: Annotated[str, Meta(pattern=r"\A(regular|stitch)\Z")] = "regular"
    layout: Annotated[str, Meta(pattern=r"\A(grid|mosaic)\Z")] = "grid"
    # 1 (layout "mosaic" only): window mosaics (``mosaic_partners="window"``): images[i][0]
    # is an anchor and the rest its partners, each partner's flip and ``augment`` drawn
    # for its (anchor, cell) instead of its own index; an image of one index is a regular
    # image (the anchor alone, letterboxed as in regular mode).
    partners: Flag01 = 0
    # 1: its sources are read again within a few tasks (the client's lookahead composes the
    # batch in both modes, ``client/dataserver_client/session/lookahead.py``): the server's store
    # keeps what the task decodes whatever subset of a larger dataset it admits, so the twin
    # decodes nothing again (a window mosaic's partners are kept the same way).
    recent: Flag01 = 0
    source_hw: tuple[Side, Side] | None = None
    control: dict[str, Any] | None = None
    # Landing (same host): write the images into the client's shared-memory buffer
    # (``dataserver/landing.py``) instead of sending them, if the worker holds the buffer
    # registered under ``land_token`` for this session (handed over on its unix socket).
    land_token: T64 = ""
    land_region: Annotated[int, In(0, 1 << 16)] = 0
    land_gen: U63 = 0
    land_offset: U63 = 0
    # HMAC-SHA256 (16 bytes) of the task (every field but ``auth`` and this one) under the key
    # the client handed the worker with its buffer, on the unix socket only
    # (``dataserver.landing.land_mac``): a server that relays tasks (a fake one that
    # replayed a local server's WELCOME) cannot make a worker write other images, or into
    # other slots, than the client asked.
    land_mac: Annotated[bytes, Meta(max_length=32)] = b""
    # The value of every pixel no source covers (letterbox padding, mosaic gaps, empty
    # cells), and where a source smaller than its cell sits in it.
    pad_value: Annotated[int, In(0, 255)] = 0
    letterbox: Annotated[str, Meta(pattern=r"\A(top-left|center)\Z")] = "top-left"
    # How a source is fitted into its cell: "letterbox" (aspect kept, the rest padded) or
    # "stretch" (resized to the whole cell, aspect not kept). Its sources are stored apart.
    fit: Annotated[str, Meta(pattern=r"\A(letterbox|stretch)\Z")] = "letterbox"
    # 0: no augmentation at all (neither the built-in flip nor the dataset's ``augment`` or
    # ``augment_composed``): what a validation client asks.
    augment: Flag01 = 1
    # The sample indices the session's plan asks next, after the tasks sent so far, in its
    # order (the client knows its epoch's order exactly): a server with a dataset in object
    # storage fetches their bytes ahead (``dataserver/server/front/prefetch.py``). Sent when the
    # plan moved on since the last the server was told (each list replaces the last);
    # empty: nothing new. An older server skips the field; an older client never sends it.
    ahead: Annotated[tuple[U63, ...], Len(0, MAX_AHEAD)] = ()
    # The digest of the control values it is to be composed with (``control_digest``: the
    # session's at ``control_seq``, or ``control``), under ``land_mac`` with the rest: a
    # worker holding other values for it refuses it (``control_mismatch``), and its RESULT
    # says the digest it composed with, so that values changed on the way (a relay that
    # rewrote a CONTROL, issue 40 item 6) never pass for the ones asked. Empty: unsaid
    # (an older client).
    control_digest: Digest = b""

    def _check(self, arrays: list[np.ndarray] | None) -> None:
        Message._check(self, arrays)
        for indices in self.images:
            if len(indices) > self.grid * self.grid:
                raise ProtocolError(
                    f"{len(indices)} indices do not fit a {self.grid}x{self.grid} grid"
                )
        if min(self.out_hw) < self.grid:
            raise ProtocolError(f"out_hw {self.out_hw} is smaller than the grid {self.grid}")
        if self.layout == "mosaic" and self.grid != 2:
            raise ProtocolError(f"a mosaic has 4 cells (grid 2), not grid {self.grid}")
        if self.partners and self.layout != "mosaic":
            raise ProtocolError("field 'partners': only with layout 'mosaic'")
        if self.control is not None:
            problem = control_problem(self.control)
            if problem:
                raise ProtocolError(f"field 'control': {problem}")

    @property
    def sizes(self) -> BatchSizes:
        """The output, fit and stored sizes its fields ``out_hw``, ``fit_hw`` and
        ``source_hw`` say (``batchsizes.py``)."""
        return BatchSizes.of(self.out_hw, self.fit_hw, self.source_hw)

    @property
    def indices(self) -> tuple[int, ...]:
        """Every source index of the task, in order."""
        return tuple(i for image in self.images for i in image)

    def canvas_bytes(self) -> int:
        return len(self.images) * 3 * self.out_hw[0] * self.out_hw[1]


class Result(Message, kw_only=True):
    """The images of one TASK, in its order: ``images[i]`` the indices image i holds (cell
    order; sources left out under on_error="skip" are in ``failed``; none when all of its
    sources were), ``box_counts[i]`` its boxes. Arrays: all the images as one
    (N, 3, H, W) uint8 array, then all boxes (sum M, 4) float32 xyxy and labels (sum M,)
    int64, image by image. ``pixels``, ``boxes`` and ``labels`` never travel in the header:
    ``decode`` sets them from the array frames, whatever the header says."""

    TYPE: ClassVar[MsgType] = MsgType.RESULT
    session: Session
    task_id: U63
    plan_version: U63
    images: Annotated[tuple[Tiles0, ...], Len(1, MAX_TASK_IMAGES)]
    box_counts: Annotated[tuple[Annotated[int, In(0, MAX_BOXES)], ...], Len(0, MAX_TASK_IMAGES)]
    failed: Annotated[tuple[tuple[U63, Text], ...], Len(0, MAX_SOURCES)] = ()
    decoded: Count = 0
    landed: bool | None = None  # the images are in the client's buffer
    # For the server's metrics: microseconds the worker spent on the task, and on each
    # source it decoded and fitted (store misses). 0 / absent: a worker that does not say.
    task_us: Us = 0
    decode_us: DecodeUs | None = None
    # Per image: its anchor's (first source's) file name ("" unknown) and original (h, w)
    # as read, before any resize ((0, 0) unknown). Absent: a worker that does not say.
    files: Annotated[tuple[FileName, ...], Len(0, MAX_TASK_IMAGES)] | None = None
    orig_sizes: Annotated[tuple[tuple[OrigSide, OrigSide], ...], Len(0, MAX_TASK_IMAGES)] | None = (
        None
    )
    # Per image: (top, left, h, w) of the picture in its canvas (the whole canvas for a
    # stitched or mosaic image, or one through ``augment_composed``). Absent: a worker that
    # does not say.
    content: Annotated[tuple[Box4, ...], Len(0, MAX_TASK_IMAGES)] | None = None
    # The digest of the control values its images were composed with (``control_digest``);
    # empty: none were consulted (a dataset with neither ``set_control`` nor ``augment``),
    # or a worker that does not say. The client refuses one that is not its task's.
    control_digest: Digest = b""
    pixels: Any = None  # np.ndarray | None (msgspec cannot type an array field)
    boxes: Any = None
    labels: Any = None

    def encode(self) -> list[Any]:
        """Frames: the header, then the arrays, not copied (those that are not C-contiguous
        are made so)."""
        arrays = [np.ascontiguousarray(a) for a in self.arrays()]
        check_dtypes(arrays)
        specs = tuple((a.dtype.str, a.shape) for a in arrays)
        header = msgspec.structs.replace(self, specs=specs, pixels=None, boxes=None, labels=None)
        return [MAGIC, bytes((int(self.TYPE),)), _ENCODER.encode(header), *arrays]

    def arrays(self) -> list[np.ndarray]:
        if self.boxes is None or self.labels is None or (self.pixels is None) != bool(self.landed):
            raise ProtocolError("a RESULT needs its images (unless landed), boxes and labels")
        if self.landed:
            return [self.boxes, self.labels]
        return [self.pixels, self.boxes, self.labels]

    def _check(self, arrays: list[np.ndarray] | None) -> None:
        self.pixels = self.boxes = self.labels = None
        if len(self.box_counts) != len(self.images):
            raise ProtocolError(f"{len(self.box_counts)} box counts for {len(self.images)} images")
        for name in ("files", "orig_sizes", "content"):
            each = getattr(self, name)
            if each is not None and len(each) != len(self.images):
                raise ProtocolError(f"{len(each)} {name} for {len(self.images)} images")
        if arrays is None:  # the front forwards it unread
            return
        want = 2 if self.landed else 3
        if len(arrays) != want:
            raise ProtocolError(f"RESULT carries {want} arrays, {len(arrays)} came")
        if not self.landed:
            check_images_spec(arrays[0].dtype, arrays[0].shape, len(self.images))
        check_boxes(arrays[-2], arrays[-1], sum(self.box_counts))
        self.pixels = None if self.landed else arrays[0]
        self.boxes, self.labels = arrays[-2:]


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


class Done(Message, kw_only=True):
    """A worker sent a RESULT straight to its client."""

    TYPE: ClassVar[MsgType] = MsgType.DONE
    session: Session
    task_id: U63
    plan_version: U63
    decoded: Count = 0
    samples: Count = 0
    images: Annotated[int, In(0, MAX_TASK_IMAGES)] = 0
    task_us: Us = 0  # as in RESULT
    decode_us: DecodeUs | None = None


class ErrorMsg(Message, kw_only=True):
    """Something went wrong; ``task_id`` names the task when there is one, ``kind`` says
    what: sample, poison, request, control, internal, protocol, unknown_session, overload,
    limit, maybe_lost, dropped, session_limit, not_owner."""

    TYPE: ClassVar[MsgType] = MsgType.ERROR
    message: Text
    kind: T32 = ""
    session: Session | None = None
    task_id: U63 | None = None
    plan_version: U63 | None = None
    index: U63 | None = None
    file: Text | None = None
    indices: Annotated[tuple[U63, ...], Len(0, MAX_SOURCES)] | None = None
    retry: bool | None = None  # worker -> front: it may succeed if run again
    image: Annotated[int, In(0, MAX_TASK_IMAGES)] | None = None  # poison: which of the task's


class Cancelled(Message, kw_only=True):
    """Queued tasks of an older plan, dropped unrun (their credit is free again)."""

    TYPE: ClassVar[MsgType] = MsgType.CANCELLED
    session: Session
    task_ids: Ids
    plan_version: U63 = 0


# ---------------------------------------------------------------------------- steering, liveness


class Control(Message, kw_only=True):
    """Client -> front (on the session's data connection): the session's control values as
    of ``control_seq``, its mode, and tasks it no longer wants (queued ones are dropped at
    once, answered CANCELLED). Front -> worker: the values a session's next task needs
    (``control`` and ``control_seq`` only)."""

    TYPE: ClassVar[MsgType] = MsgType.CONTROL
    session: Session
    # Client -> front: the session's secret for this server.
    auth: Auth | None = None
    plan_version: Seq = 0
    control_seq: Seq
    control: dict[str, Any]
    mode: Annotated[str, Meta(pattern=r"\A(regular|stitch)\Z")] | None = None
    cancel: Ids = ()

    def _check(self, arrays: list[np.ndarray] | None) -> None:
        Message._check(self, arrays)
        problem = control_problem(self.control)
        if problem:
            raise ProtocolError(f"field 'control': {problem}")


class Heartbeat(Message, kw_only=True):
    """Client -> front: ``session``. Front -> client: ``server_id``, the live workers'
    result endpoints and how often to beat now (``heartbeat_ms``, as in WELCOME)."""

    TYPE: ClassVar[MsgType] = MsgType.HEARTBEAT
    session: Session | None = None
    auth: Auth | None = None
    server_id: T64 | None = None
    results: Endpoints | None = None
    local: Endpoints | None = None
    heartbeat_ms: BeatMs = 0
    # The reply: why the server's object store gives it nothing now (its root URL, the
    # failure's kind, for how long: ``Fetcher.stall``); empty while it answers. The
    # client's ``timeout`` error names it as the cause.
    store_stall: T512 = ""


class Stats(Message, kw_only=True):
    """A request (no ``stats``) or the reply (``stats``: the server's counters)."""

    TYPE: ClassVar[MsgType] = MsgType.STATS
    stats: dict[str, Any] | None = None

    def _check(self, arrays: list[np.ndarray] | None) -> None:
        Message._check(self, arrays)
        problem = None if self.stats is None else tree_problem(self.stats, 8)
        if problem:
            raise ProtocolError(f"field 'stats': {problem}")


class Bye(Message, kw_only=True):
    """End a session (client -> front), stop (front -> worker), or, front -> client: this
    server is draining (SIGTERM): send it nothing more; its queued tasks come back
    CANCELLED, its running ones are finished."""

    TYPE: ClassVar[MsgType] = MsgType.BYE
    session: Session | None = None
    auth: Auth | None = None  # client -> front


class SampleSizes(Message, kw_only=True):
    """Client -> front: the per-sample (h, w) of samples ``start`` .. ``start + count``
    (``session``, ``auth``: asked for a session, charged to it). Front -> client: those
    sizes, as one int32 (count, 2) array (``hw``, set by ``decode`` from its frame, never
    from the header), each side 1..``MAX_ORIG_SIDE``, and ``digest``, the whole table's
    (WELCOME's ``sizes_digest``). A request carries no array, a reply exactly one."""

    TYPE: ClassVar[MsgType] = MsgType.SIZES
    session: Session
    auth: Auth | None = None  # a request's
    start: Annotated[int, In(0, MAX_ANNOUNCED_SIZES - 1)]
    count: Annotated[int, In(1, SIZES_CHUNK)]
    digest: Digest = b""  # a reply's
    hw: Any = None  # np.ndarray | None: a reply's (count, 2) int32

    def encode(self) -> list[Any]:
        """Frames: the header, then (a reply) the sizes array, not copied."""
        if self.hw is None:
            return Message.encode(msgspec.structs.replace(self, specs=()))
        hw = np.ascontiguousarray(self.hw, dtype="<i4")
        header = msgspec.structs.replace(self, specs=((hw.dtype.str, hw.shape),), hw=None)
        return [MAGIC, bytes((int(self.TYPE),)), _ENCODER.encode(header), hw]

    def _check(self, arrays: list[np.ndarray] | None) -> None:
        self.hw = None
        if self.start + self.count > MAX_ANNOUNCED_SIZES:
            raise ProtocolError(
                f"samples {self.start}..{self.start + self.count} exceed the "
                f"{MAX_ANNOUNCED_SIZES} a server may announce"
            )
        if not arrays:  # a request (or a reply's head, its array unread)
            return
        if len(arrays) != 1:
            raise ProtocolError(f"SIZES carries one array, {len(arrays)} came")
        hw = arrays[0]
        if hw.dtype != np.int32 or hw.shape != (self.count, 2):
            raise ProtocolError(f"sizes must be int32 ({self.count}, 2): got {hw.dtype} {hw.shape}")
        if len(self.digest) != DIGEST_BYTES:
            raise ProtocolError(f"field 'digest': {len(self.digest)} bytes, not {DIGEST_BYTES}")
        if int(hw.min()) < 1 or int(hw.max()) > MAX_ORIG_SIDE:
            raise ProtocolError(f"sizes: a side is not 1..{MAX_ORIG_SIDE}")
        self.hw = hw


class Ready(Message, kw_only=True):
    """A worker is up; clients reach it at ``results`` (empty: only through the front)."""

    TYPE: ClassVar[MsgType] = MsgType.READY
    worker: Annotated[int, In(0, MAX_WORKERS)]
    pid: Annotated[int, In(1, 1 << 31)]
    results: T512 = ""
    local: T512 = ""  # its ipc endpoint, for clients on this host
    # Whether it maps the server's store: False when what it inherited was unusable (it
    # serves without); None when the server has none.
    store: bool | None = None
    # Whether its dataset has ``set_control`` (each control state in use is then a copy of
    # the dataset object in the worker: the front paces how often a session changes it).
    steerable: bool = False


class Tally(Message, kw_only=True):
    """A worker's result connections shut down since its last TALLY, by reason (its
    ``results_budget``, ``--idle-timeout``, a message never finished): the front adds them
    to its ``rejected`` counters as ``results_<reason>``. Also what it fetched from object
    stores since (``fetches``...: the front's counters of those names) and each GET's
    latency in microseconds (at most ``MAX_FETCH_TIMES``: the metric
    ``dataserver_fetch_seconds``)."""

    TYPE: ClassVar[MsgType] = MsgType.TALLY
    worker: Annotated[int, In(0, MAX_WORKERS)]
    idle_dropped: U63 = 0
    over_limit_dropped: U63 = 0
    unfinished_dropped: U63 = 0
    frames_dropped: U63 = 0  # a message of too many frames (issue 40)
    barred_dropped: U63 = 0  # ... its peer's next connections
    claim_dropped: U63 = 0  # a claim no admitted session's (no tag from the front)
    unclaimed_dropped: U63 = 0  # never claimed in time, or beyond the unclaimed budget
    fetches: U63 = 0
    fetch_bytes: U63 = 0
    fetch_retries: U63 = 0
    fetch_errors: U63 = 0
    fetch_us: Annotated[
        tuple[Annotated[int, In(0, MAX_US)], ...], Meta(max_length=MAX_FETCH_TIMES)
    ] = ()
    # ``fetch_errors`` by kind (``dataserver.data.remote.FetchError.kind``)
    fetch_error_kinds: Annotated[dict[T32, U63], Meta(max_length=FETCH_ERROR_KINDS)] = {}


MESSAGES: dict[MsgType, type[Message]] = {c.TYPE: c for c in Message.__subclasses__()}
_DECODERS = {t: msgspec.msgpack.Decoder(c) for t, c in MESSAGES.items()}
_ENCODER = msgspec.msgpack.Encoder()

__all__ = [
    "MAX_BOXES",
    "MAX_IMAGE_SIDE",
    "MAX_TILES",
    "MESSAGES",
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
    "SampleSizes",
    "Stats",
    "Tally",
    "Task",
    "Welcome",
    "control_digest",
    "decode",
    "decode_head",
    "sizes_digest",
    "wire_control_digest",
]

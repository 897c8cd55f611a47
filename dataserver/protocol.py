"""The dataserver wire protocol, shared by the client, the server front and its workers.

No socket code lives here: only constants, the message type, ``encode`` and ``decode``.
Nothing is ever pickled. A message is a list of ZeroMQ frames (after any routing frames
that a ROUTER socket adds or strips)::

    frame 0    b"DS1"                 magic + protocol version (one ASCII digit)
    frame 1    one byte               MsgType
    frame 2    msgpack map            the header; header["arrays"] = [[dtype, [d0, d1, ...]], ...]
    frame 3..  raw bytes, one frame   per array named in header["arrays"], C order, no padding

Arrays are sent without copies (numpy buffers handed to ``send_multipart(copy=False)``)
and received without copies (``numpy.frombuffer`` over the received frame; read-only).

``decode`` trusts nothing: it checks the magic and version, the type byte, the header size
and msgpack limits, the header's schema for its type, the dtype of every array against an
allow-list, and that shape x itemsize equals the buffer length. Anything else raises
``ProtocolError``, which the receiver counts and drops; it never crashes a server.
"""

from __future__ import annotations

import enum
import math
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from typing import Any

import msgpack
import numpy as np

PROTOCOL_VERSION = 1
MAGIC = b"DS" + str(PROTOCOL_VERSION).encode()

MAX_FRAMES = 16
MAX_HEADER_BYTES = 1 << 20  # task headers carry the session's control values
MAX_ARRAY_BYTES = 1 << 30
MAX_NDIM = 4
MAX_SESSION_BYTES = 64
MAX_INT = (1 << 63) - 1
MAX_CONTROL_DEPTH = 8
MAX_IMAGE_SIDE = 16384
MAX_TILES = 16  # grid 4 x 4

# The only dtypes that may travel. Byte order is explicit so both ends agree.
ALLOWED_DTYPES = frozenset({"|u1", "<i8", "<i4", "<f4", "<f8"})


class ProtocolError(ValueError):
    """A message that is not a well-formed dataserver message of this version."""


class MsgType(enum.IntEnum):
    """One-byte message types.

    Client <-> server:  HELLO -> WELCOME (handshake); TASK -> RESULT | ERROR | CANCELLED;
    CONTROL (on the control socket); HEARTBEAT both ways; STATS request -> STATS reply;
    BYE ends a session. Front <-> worker: READY announces a worker (and its result
    endpoint), then TASK, answered by RESULT or ERROR through the front, or by DONE when the
    worker sent the RESULT straight to the client.
    """

    HELLO = 1
    WELCOME = 2
    TASK = 3
    RESULT = 4
    ERROR = 5
    CANCELLED = 6
    CONTROL = 7
    HEARTBEAT = 8
    STATS = 9
    BYE = 10
    READY = 11
    DONE = 12


@dataclass(slots=True)
class Message:
    """One decoded message: its type, its header map and its arrays (read-only views)."""

    type: MsgType
    header: dict[str, Any]
    arrays: list[np.ndarray] = field(default_factory=list)


# ---------------------------------------------------------------------------- schemas

_INT = "int"
_STR = "str"
_BYTES = "bytes"
_LIST = "list"
_DICT = "dict"
_BOOL = "bool"

# Required header keys per type. Extra keys are allowed (newer minor revisions).
_SCHEMAS: dict[MsgType, dict[str, str]] = {
    MsgType.HELLO: {"session": _BYTES},
    MsgType.WELCOME: {
        "session": _BYTES,
        "server_id": _STR,
        "dataset_len": _INT,
        "fingerprint": _STR,
        "workers": _INT,
        "credit": _INT,
        "control": _STR,
    },
    MsgType.TASK: {
        "session": _BYTES,
        "task_id": _INT,
        "plan_version": _INT,
        "epoch": _INT,
        "seed": _INT,
        "indices": _LIST,
        "grid": _INT,
        "out_hw": _LIST,
        "on_error": _STR,
        "control_seq": _INT,
        "control": _DICT,
    },
    MsgType.RESULT: {
        "session": _BYTES,
        "task_id": _INT,
        "plan_version": _INT,
        "indices": _LIST,
        "failed": _LIST,
    },
    MsgType.ERROR: {"message": _STR},
    MsgType.CANCELLED: {"session": _BYTES, "task_ids": _LIST},
    MsgType.CONTROL: {
        "session": _BYTES,
        "plan_version": _INT,
        "control_seq": _INT,
        "control": _DICT,
    },
    MsgType.HEARTBEAT: {},
    MsgType.STATS: {},
    MsgType.BYE: {"session": _BYTES},
    MsgType.READY: {"worker": _INT, "pid": _INT},
    MsgType.DONE: {"session": _BYTES, "task_id": _INT, "plan_version": _INT},
}

# How many arrays each type carries: RESULT = image (3, H, W) uint8, boxes (M, 4) float32,
# labels (M,) int64. Every other type carries none.
_ARRAY_COUNTS: dict[MsgType, int] = {MsgType.RESULT: 3}


def _is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and 0 <= value <= MAX_INT


_CHECKS: dict[str, Any] = {
    _INT: _is_int,
    _STR: lambda v: isinstance(v, str),
    _BYTES: lambda v: isinstance(v, bytes) and 0 < len(v) <= MAX_SESSION_BYTES,
    _LIST: lambda v: isinstance(v, list),
    _DICT: lambda v: isinstance(v, dict),
    _BOOL: lambda v: isinstance(v, bool),
}


def _check_type(key: str, value: Any, kind: str) -> None:
    if not _CHECKS[kind](value):
        raise ProtocolError(f"header field {key!r}: expected {kind}, got {type(value).__name__}")


def _depth(value: Any, limit: int) -> None:
    if limit < 0:
        raise ProtocolError(f"control values nested deeper than {MAX_CONTROL_DEPTH}")
    if isinstance(value, dict):
        for k, v in value.items():
            _depth(k, limit - 1)
            _depth(v, limit - 1)
    elif isinstance(value, list):
        for v in value:
            _depth(v, limit - 1)


def _check_int_list(key: str, values: list[Any], lo: int, hi: int) -> None:
    if not (lo <= len(values) <= hi) or not all(_is_int(v) for v in values):
        raise ProtocolError(f"header field {key!r}: expected {lo}..{hi} non-negative integers")


def _check_semantics(mtype: MsgType, header: dict[str, Any]) -> None:
    """Checks beyond types: ranges that a worker relies on before touching data."""
    if mtype is MsgType.TASK:
        grid = header["grid"]
        if not 1 <= grid <= 4:
            raise ProtocolError(f"task grid {grid} out of range 1..4")
        _check_int_list("indices", header["indices"], 1, grid * grid)
        _check_int_list("out_hw", header["out_hw"], 2, 2)
        h, w = header["out_hw"]
        if not (grid <= h <= MAX_IMAGE_SIDE and grid <= w <= MAX_IMAGE_SIDE):
            raise ProtocolError(f"task out_hw {h}x{w} out of range")
        if header["on_error"] not in ("raise", "skip"):
            raise ProtocolError(f"task on_error {header['on_error']!r} is not raise|skip")
        exclude = header.get("exclude", [])
        if not isinstance(exclude, list):
            raise ProtocolError("task exclude must be a list")
        _check_int_list("exclude", exclude, 0, MAX_TILES)
        if not all(isinstance(k, str) for k in header["control"]):
            raise ProtocolError("control keys must be strings")
        _depth(header["control"], MAX_CONTROL_DEPTH)
    elif mtype is MsgType.CONTROL:
        if not all(isinstance(k, str) for k in header["control"]):
            raise ProtocolError("control keys must be strings")
        _depth(header["control"], MAX_CONTROL_DEPTH)
        if header.get("mode") not in (None, "regular", "stitch"):
            raise ProtocolError(f"control mode {header.get('mode')!r} is not regular|stitch")
    elif mtype is MsgType.RESULT:
        _check_int_list("indices", header["indices"], 0, MAX_TILES)
    elif mtype is MsgType.CANCELLED:
        _check_int_list("task_ids", header["task_ids"], 0, 1 << 16)


# ---------------------------------------------------------------------------- encode


def encode(msg: Message) -> list[Any]:
    """Frames for ``send_multipart(frames, copy=False)``; arrays are not copied.

    Arrays that are not C-contiguous are made so (that one copy is the caller's cost).
    """
    arrays = [np.ascontiguousarray(a) for a in msg.arrays]
    header = dict(msg.header)
    if arrays:
        header["arrays"] = [[a.dtype.str, list(a.shape)] for a in arrays]
    for a in arrays:
        if a.dtype.str not in ALLOWED_DTYPES:
            raise ProtocolError(f"dtype {a.dtype.str} may not travel")
    packed = msgpack.packb(header, use_bin_type=True)
    return [MAGIC, bytes((int(msg.type),)), packed, *arrays]


def make(mtype: MsgType, header: dict[str, Any], arrays: Iterable[np.ndarray] = ()) -> list[Any]:
    """Shorthand for ``encode(Message(mtype, header, list(arrays)))``."""
    return encode(Message(mtype, header, list(arrays)))


# ---------------------------------------------------------------------------- decode


def _view(frame: Any) -> memoryview:
    # zmq.Frame exposes .buffer; bytes and memoryviews are buffers themselves.
    buf = getattr(frame, "buffer", frame)
    view = memoryview(buf)
    return view.cast("B") if view.format != "B" or view.ndim != 1 else view


def _small(frame: Any, limit: int) -> bytes:
    """The bytes of a small frame (magic, type, header): copying them is cheaper than a view."""
    data: bytes
    if isinstance(frame, bytes):
        data = frame
    elif isinstance(getattr(frame, "bytes", None), bytes):
        data = frame.bytes
    else:
        data = bytes(_view(frame))
    if len(data) > limit:
        raise ProtocolError(f"frame of {len(data)} bytes exceeds {limit}")
    return data


def decode(frames: Sequence[Any]) -> Message:
    """Decode and validate one message; raise ``ProtocolError`` naming what is wrong."""
    if len(frames) < 3:
        raise ProtocolError(f"truncated message: {len(frames)} frame(s), need at least 3")
    if len(frames) > MAX_FRAMES:
        raise ProtocolError(f"too many frames: {len(frames)} > {MAX_FRAMES}")
    head = frames[0]
    magic = _small(head, MAX_HEADER_BYTES) if len(_view(head)) <= 8 else b"?"
    if magic != MAGIC:
        if len(magic) == 3 and magic.startswith(b"DS"):
            raise ProtocolError(
                f"protocol version {magic[2:].decode(errors='replace')!r} not supported "
                f"(this side speaks {PROTOCOL_VERSION})"
            )
        raise ProtocolError("not a dataserver message (bad magic frame)")
    type_frame = _small(frames[1], MAX_HEADER_BYTES) if len(_view(frames[1])) <= 8 else b""
    if len(type_frame) != 1:
        raise ProtocolError("message type frame must be exactly one byte")
    try:
        mtype = MsgType(type_frame[0])
    except ValueError:
        raise ProtocolError(f"unknown message type {type_frame[0]}") from None
    size = len(_view(frames[2]))
    if size > MAX_HEADER_BYTES:
        raise ProtocolError(f"header of {size} bytes exceeds {MAX_HEADER_BYTES}")
    raw_header = _small(frames[2], MAX_HEADER_BYTES)
    try:
        header = msgpack.unpackb(
            raw_header,
            raw=False,
            strict_map_key=True,
            max_str_len=MAX_HEADER_BYTES,
            max_bin_len=MAX_HEADER_BYTES,
            max_array_len=1 << 16,
            max_map_len=1 << 12,
            max_ext_len=0,
        )
    except Exception as exc:  # msgpack raises several types for hostile input
        raise ProtocolError(f"header is not valid msgpack: {exc}") from None
    if not isinstance(header, dict):
        raise ProtocolError(f"header must be a map, got {type(header).__name__}")
    for key, kind in _SCHEMAS[mtype].items():
        if key not in header:
            raise ProtocolError(f"{mtype.name} header lacks {key!r}")
        _check_type(key, header[key], kind)
    _check_semantics(mtype, header)
    arrays = _decode_arrays(mtype, header, frames[3:])
    return Message(mtype, header, arrays)


def peek(frames: Sequence[Any]) -> tuple[MsgType, dict[str, Any]]:
    """Type and header of a message from a trusted peer (a server's own worker), without
    the schema and array checks of ``decode``: for forwarding what is not read here."""
    if len(frames) < 3 or _small(frames[0], 8) != MAGIC:
        raise ProtocolError("not a dataserver message")
    type_frame = _small(frames[1], 8)
    try:
        mtype = MsgType(type_frame[0])
        header = msgpack.unpackb(_small(frames[2], MAX_HEADER_BYTES), raw=False)
    except Exception as exc:
        raise ProtocolError(f"unreadable message: {exc}") from None
    if not isinstance(header, dict):
        raise ProtocolError("header must be a map")
    return mtype, header


def _decode_arrays(mtype: MsgType, header: dict[str, Any], frames: Sequence[Any]) -> list[Any]:
    specs = header.pop("arrays", [])
    if not isinstance(specs, list):
        raise ProtocolError("header field 'arrays' must be a list")
    expected = _ARRAY_COUNTS.get(mtype, 0)
    if len(specs) != expected or len(frames) != expected:
        raise ProtocolError(
            f"{mtype.name} carries {expected} array(s); header names {len(specs)}, "
            f"{len(frames)} buffer frame(s) came"
        )
    arrays = []
    for i, (spec, frame) in enumerate(zip(specs, frames, strict=True)):
        if not (isinstance(spec, list) and len(spec) == 2):
            raise ProtocolError(f"array {i}: descriptor must be [dtype, shape]")
        dtype_str, shape = spec
        if not isinstance(dtype_str, str) or dtype_str not in ALLOWED_DTYPES:
            raise ProtocolError(f"array {i}: dtype {dtype_str!r} is not allowed")
        if not (isinstance(shape, list) and len(shape) <= MAX_NDIM and all(map(_is_int, shape))):
            raise ProtocolError(f"array {i}: shape {shape!r} is not a list of <= 4 sizes")
        dtype = np.dtype(dtype_str)
        nbytes = math.prod(shape) * dtype.itemsize
        if nbytes > MAX_ARRAY_BYTES:
            raise ProtocolError(f"array {i}: {nbytes} bytes exceeds {MAX_ARRAY_BYTES}")
        buf = _view(frame)
        if len(buf) != nbytes:
            raise ProtocolError(
                f"array {i}: shape {shape} x {dtype.itemsize} = {nbytes} bytes, "
                f"but its frame holds {len(buf)}"
            )
        arrays.append(np.frombuffer(buf, dtype=dtype).reshape(shape))
    return arrays

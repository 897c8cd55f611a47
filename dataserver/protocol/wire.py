"""The envelope: frames in, (type, header map, array views) out, and back.

Byte layout of one message (after any routing frames a ROUTER adds or strips)::

    frame 0    b"DS2"                 magic + protocol version (one ASCII digit)
    frame 1    one byte               MsgType
    frame 2    msgpack map            the header; header["arrays"] = [[dtype, [d0, d1, ...]], ...]
    frame 3..  raw bytes, one frame   per array named in header["arrays"], C order, no padding

This module checks everything that does not depend on the message type: the magic and
version, the type byte, frame counts and sizes, the dtype of every array against an
allow-list, every dimension of every shape, and that shape x itemsize equals the buffer
length. ``messages.py`` decodes the header (msgspec, straight into the message's type, its
fields checked as they are read). Whatever is wrong raises ``ProtocolError``, and nothing
else, so a receiver that catches ``ProtocolError`` cannot be crashed by input.
"""

from __future__ import annotations

import enum
import math
from collections.abc import Sequence
from typing import Any

import msgpack
import numpy as np

# 4: session secrets (auth, tags); 5: per-task sizes, augment, mosaic; 6: pad_value and
# letterbox in TASK, categories in WELCOME, files and orig_sizes in RESULT; partners in TASK;
# 7: per-sample sizes on request (SIZES, in chunks), WELCOME's sizes_count and sizes_digest;
# fit and augment in TASK, content in RESULT (an older server would ignore them);
# 8: no control socket: WELCOME without ``control``, CONTROL without ``tags``
PROTOCOL_VERSION = 9
MAGIC = b"DS" + str(PROTOCOL_VERSION).encode()

MAX_FRAMES = 16
MAX_HEADER_BYTES = 1 << 20
MAX_ARRAY_BYTES = 1 << 30
MAX_NDIM = 4

# The only dtypes that may travel. Byte order is explicit so both ends agree.
ALLOWED_DTYPES = frozenset({"|u1", "<i8", "<i4", "<f4", "<f8"})


class ProtocolError(ValueError):
    """A message that is not a well-formed dataserver message of this version."""


class MsgType(enum.IntEnum):
    """One-byte message types.

    Client <-> server:  HELLO -> WELCOME (handshake); TASK -> RESULT | ERROR | CANCELLED;
    CONTROL (on the data connection); HEARTBEAT both ways; STATS request -> STATS reply;
    BYE ends a session; SIZES request -> SIZES reply (a chunk of the per-sample sizes).
    Front <-> worker: READY announces a worker (and its result
    endpoint), then TASK, answered by RESULT or ERROR through the front, or by DONE when the
    worker sent the RESULT straight to the client; TALLY, now and then, what a worker's
    result socket refused (connections it shut down).
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
    TALLY = 13
    SIZES = 14


def pack(mtype: MsgType, header: dict[str, Any], arrays: Sequence[np.ndarray] = ()) -> list[Any]:
    """Frames for ``send_multipart(frames, copy=False)``; arrays are not copied.

    Arrays that are not C-contiguous are made so (that one copy is the caller's cost).
    The header is not checked here: ``messages.py`` builds only valid ones, and tests use
    this directly to build invalid ones.
    """
    if arrays:
        arrays = [np.ascontiguousarray(a) for a in arrays]
        check_dtypes(arrays)
        header = {**header, "arrays": [[a.dtype.str, list(a.shape)] for a in arrays]}
    packed = msgpack.packb(header, use_bin_type=True)
    return [MAGIC, bytes((int(mtype),)), packed, *arrays]


def check_dtypes(arrays: Sequence[np.ndarray]) -> None:
    """Refuse to send an array whose dtype may not travel."""
    for a in arrays:
        if a.dtype.str not in ALLOWED_DTYPES:
            raise ProtocolError(f"dtype {a.dtype.str} may not travel")


def view(frame: Any) -> memoryview:
    """A flat byte view of a frame (``zmq.Frame``, bytes or any buffer)."""
    buf = getattr(frame, "buffer", frame)
    mv = memoryview(buf)
    return mv.cast("B") if mv.format != "B" or mv.ndim != 1 else mv


def _small(frame: Any, limit: int, what: str) -> bytes:
    """The bytes of a small frame (magic, type, header): copying them is cheaper than a view."""
    data = frame if isinstance(frame, bytes) else getattr(frame, "bytes", None)
    if not isinstance(data, bytes):
        mv = view(frame)
        if len(mv) > limit:
            raise ProtocolError(f"{what} frame of {len(mv)} bytes exceeds {limit}")
        data = bytes(mv)
    if len(data) > limit:
        raise ProtocolError(f"{what} frame of {len(data)} bytes exceeds {limit}")
    return data


def head(frames: Sequence[Any]) -> tuple[MsgType, bytes]:
    """Type and header bytes of a message, from its first three frames, the envelope
    checked; raises ``ProtocolError`` and nothing else."""
    try:
        return _head(frames)
    except ProtocolError:
        raise
    except Exception as exc:  # a check missed something: still only a bad message
        raise ProtocolError(f"unreadable message ({type(exc).__name__}: {exc})") from None


def _head(frames: Sequence[Any]) -> tuple[MsgType, bytes]:
    if len(frames) < 3:
        raise ProtocolError(f"truncated message: {len(frames)} frame(s), need at least 3")
    if len(frames) > MAX_FRAMES:
        raise ProtocolError(f"too many frames: {len(frames)} > {MAX_FRAMES}")
    magic = _small(frames[0], 8, "magic") if len(view(frames[0])) <= 8 else b"?"
    if magic != MAGIC:
        if len(magic) == 3 and magic.startswith(b"DS"):
            raise ProtocolError(
                f"protocol version {magic[2:].decode(errors='replace')!r} not supported "
                f"(this side speaks {PROTOCOL_VERSION})"
            )
        raise ProtocolError("not a dataserver message (bad magic frame)")
    type_frame = _small(frames[1], 8, "type") if len(view(frames[1])) <= 8 else b""
    if len(type_frame) != 1:
        raise ProtocolError("message type frame must be exactly one byte")
    try:
        mtype = MsgType(type_frame[0])
    except ValueError:
        raise ProtocolError(f"unknown message type {type_frame[0]}") from None
    return mtype, _small(frames[2], MAX_HEADER_BYTES, "header")


def check_spec(i: int, spec: Any) -> tuple[str, tuple[int, ...], int]:
    """(dtype, shape, nbytes) of array descriptor ``i``, checked: an allowed dtype, at most
    MAX_NDIM sizes, and a zero may not hide huge dimensions from the byte count."""
    if not (isinstance(spec, list) and len(spec) == 2):
        raise ProtocolError(f"array {i}: descriptor must be [dtype, shape]")
    dtype_str, shape = spec
    if not isinstance(dtype_str, str) or dtype_str not in ALLOWED_DTYPES:
        raise ProtocolError(f"array {i}: dtype {dtype_str!r} is not allowed")
    if not (isinstance(shape, list) and len(shape) <= MAX_NDIM):
        raise ProtocolError(f"array {i}: shape must be a list of at most {MAX_NDIM} sizes")
    for d in shape:
        if not (isinstance(d, int) and not isinstance(d, bool) and 0 <= d <= MAX_ARRAY_BYTES):
            raise ProtocolError(f"array {i}: shape {shape!r} holds an invalid size")
    itemsize = np.dtype(dtype_str).itemsize
    if math.prod(d for d in shape if d) * itemsize > MAX_ARRAY_BYTES:
        raise ProtocolError(f"array {i}: shape {shape} exceeds {MAX_ARRAY_BYTES} bytes")
    return dtype_str, tuple(shape), math.prod(shape) * itemsize


def array(i: int, spec: Any, frame: Any) -> np.ndarray:
    """Array ``i`` of a message: its descriptor checked (``check_spec``) against its frame,
    a view of the frame (no copy)."""
    dtype_str, shape, nbytes = check_spec(i, spec)
    buf = view(frame)
    if len(buf) != nbytes:
        raise ProtocolError(
            f"array {i}: shape {list(shape)} x {np.dtype(dtype_str).itemsize} = {nbytes} bytes, "
            f"but its frame holds {len(buf)}"
        )
    return np.frombuffer(buf, dtype=dtype_str).reshape(shape)

"""Hypothesis strategies that know the protocol: each message type built field by field,
every field either valid, an edge value of its own type, a value of another type, or
missing; arrays with edge dtypes and shapes and buffers that match them or lie.

Used by ``test_protocol.py`` (decode alone), ``test_fuzz.py`` (live server and client
sockets) and ``fuzz_long.py`` (the long run).
"""

from __future__ import annotations

from typing import Any

import msgpack
from hypothesis import strategies as st

from dataserver.protocol import MAGIC, MsgType

SID = b"0123456789abcdef"
AUTH = b"fuzzer-secret-16"  # the fuzzer's own session secret

# A valid header of every type: the starting point each field is varied from.
VALID: dict[MsgType, dict[str, Any]] = {
    MsgType.HELLO: {"session": SID, "auth": AUTH},
    MsgType.WELCOME: {
        "session": SID,
        "server_id": "abc",
        "dataset_len": 10,
        "fingerprint": "synthetic-10-0",
        "workers": 2,
        "credit": 4,
        "results": ["tcp://127.0.0.1:6000"],
        "max_image_side": 4096,
    },
    MsgType.TASK: {
        "session": SID,
        "auth": AUTH,
        "task_id": 7,
        "plan_version": 2,
        "epoch": 1,
        "seed": 0,
        "images": [[4, 5, 6, 7], [8, 9]],
        "grid": 2,
        "out_hw": [64, 48],
        "fit_hw": [64, 48],
        "on_error": "raise",
        "control_seq": 1,
        "exclude": [],
        "priority": 0,
    },
    MsgType.RESULT: {
        "session": SID,
        "task_id": 7,
        "plan_version": 2,
        "images": [[4, 5], [8]],
        "box_counts": [1, 0],
        "failed": [[6, "bad"]],
        "decoded": 2,
    },
    MsgType.ERROR: {
        "message": "sample 3 (a.jpg): corrupt",
        "kind": "sample",
        "index": 3,
        "file": "a.jpg",
        "task_id": 7,
        "plan_version": 2,
        "session": SID,
    },
    MsgType.CANCELLED: {"session": SID, "task_ids": [1, 2, 3], "plan_version": 3},
    MsgType.CONTROL: {
        "session": SID,
        "auth": AUTH,
        "plan_version": 3,
        "control_seq": 2,
        "control": {"x": 1, "nested": {"a": [1, 2]}},
        "mode": "stitch",
        "cancel": [5, 6],
    },
    MsgType.HEARTBEAT: {"session": SID, "auth": AUTH},
    MsgType.STATS: {},
    MsgType.BYE: {"session": SID, "auth": AUTH},
    MsgType.READY: {"worker": 0, "pid": 123, "results": "tcp://127.0.0.1:4000"},
    MsgType.DONE: {"session": SID, "task_id": 7, "plan_version": 2, "decoded": 1, "samples": 1},
    MsgType.TALLY: {"worker": 1, "idle_dropped": 3, "over_limit_dropped": 2},
    MsgType.SIZES: {"session": SID, "auth": AUTH, "start": 65536, "count": 100},
}

# RESULT's arrays: two images (2, 3, 4, 5) uint8, boxes (1, 4) float32, labels (1,) int64.
VALID_ARRAYS: list[tuple[str, list[int]]] = [("|u1", [2, 3, 4, 5]), ("<f4", [1, 4]), ("<i8", [1])]


def task_header(
    session: bytes,
    task_id: int = 1,
    plan_version: int = 1,
    images: list[list[int]] | None = None,
    side: int = 32,
    auth: bytes = AUTH,
) -> dict[str, Any]:
    """A valid TASK header (for tests that send tasks by hand), acting for ``session`` with
    the secret ``auth``."""
    return {
        "session": session,
        "auth": auth,
        "task_id": task_id,
        "plan_version": plan_version,
        "epoch": 0,
        "seed": 0,
        "images": images or [[1]],
        "grid": 1,
        "out_hw": [side, side],
        "fit_hw": [side, side],
        "on_error": "raise",
        "control_seq": 0,
    }


EDGE_INTS = [
    0,
    1,
    -1,
    2,
    3,
    4,
    5,
    16,
    17,
    2**31,
    2**31 - 1,
    2**32,
    2**63 - 1,
    2**63,
    2**64 - 1,
    -(2**63),
]
MAX_PACKABLE = 2**64 - 1


def deep(depth: int) -> Any:
    value: Any = 1
    for i in range(depth):
        value = {"k": value} if i % 2 else [value]
    return value


# Strategies are built once, here: building them per draw costs far more than drawing.
_EDGE_INTS = st.sampled_from(EDGE_INTS) | st.integers(-(2**63), MAX_PACKABLE)
_EDGE_TEXT = st.sampled_from(
    ["", "a", "raise", "skip", "stitch", "regular", "tcp://x:1", "x" * 4097, "é" * 300]
) | st.text(max_size=20)
_EDGE_BYTES = st.sampled_from([b"", b"\x00", SID, b"s" * 64, b"s" * 65, b"\xff" * 16]) | st.binary(
    max_size=80
)
_SCALARS = (
    _EDGE_INTS
    | st.booleans()
    | st.none()
    | st.floats(allow_nan=True, allow_infinity=True)
    | _EDGE_TEXT
    | _EDGE_BYTES
)
_KEYS = st.text(max_size=4) | st.binary(max_size=4) | st.integers(-5, 5)
_NESTED = st.recursive(
    _SCALARS,
    lambda children: st.lists(children, max_size=5) | st.dictionaries(_KEYS, children, max_size=4),
    max_leaves=20,
)
_OTHERS = st.one_of(
    _SCALARS,
    _NESTED,
    st.lists(_EDGE_INTS, max_size=20),
    st.sampled_from([[], [0], [2**63 - 1], [-1], [1] * 17, [0, 0], [16385, 10], [1, 1]]),
    st.sampled_from(
        [{}, {1: 2}, {b"k": 1}, {"a": deep(12)}, {"a": [1] * 3}, {"x" * 100: "y" * 70000}]
    ),
    st.just(deep(20)),
)
_HOW = st.sampled_from(["keep", "keep", "vary", "edge", "drop"])
_EXTRA = st.dictionaries(st.text(max_size=8), _SCALARS, max_size=3)


def edge_ints() -> st.SearchStrategy[int]:
    return _EDGE_INTS


def scalars() -> st.SearchStrategy[Any]:
    return _SCALARS


def nested() -> st.SearchStrategy[Any]:
    """Lists and maps of scalars, nested, with string, bytes and integer keys."""
    return _NESTED


def _edge_of(valid: Any) -> st.SearchStrategy[Any]:
    """Edge values of the field's own kind."""
    if isinstance(valid, bool):
        return _SCALARS
    if isinstance(valid, int):
        return _EDGE_INTS
    if isinstance(valid, str):
        return _EDGE_TEXT
    if isinstance(valid, bytes):
        return _EDGE_BYTES
    return _OTHERS


@st.composite
def headers(draw: st.DrawFn, mtype: MsgType) -> dict[str, Any]:
    return draw_header(draw, mtype)


def draw_header(draw: st.DrawFn, mtype: MsgType) -> dict[str, Any]:
    """A header of ``mtype``, field by field: each kept, varied to any other kind of value,
    varied to an edge value of its own kind, or dropped; sometimes with extra keys."""
    header: dict[str, Any] = {}
    for key, valid in VALID[mtype].items():
        how = draw(_HOW)
        if how == "keep":
            header[key] = valid
        elif how == "vary":
            header[key] = draw(_OTHERS)
        elif how == "edge":
            header[key] = draw(_edge_of(valid))
    if draw(_BOOL):
        header.update(draw(_EXTRA))
    return header


DTYPES = ["|u1", "<f4", "<i8", "<i4", "<f8", "|O", ">f4", "<U4", "", "|b1"]


_COUNTS = st.sampled_from([3, 3, 3, 0, 1, 2, 4])
_DTYPES = st.sampled_from(DTYPES)
_SHAPES = st.sampled_from(
    [
        [],
        [0],
        [0, 2**62, 2**62],
        [3, 0, 2**40],
        [2**31, 2**31],
        [3, 16385, 1],
        [2, 3, 16385, 1],
        [3, 1, 1],
        [2, 3, 1, 1],
        [-1, 4],
        [1, 1, 1, 1, 1],
        [70000, 4],
        [1, 5],
    ]
) | st.lists(_EDGE_INTS, max_size=5)
_BOOL = st.booleans()
_LIE = st.integers(0, 4)
_FORM = st.integers(0, 4)
_TENTH = st.integers(0, 9)
_ENVELOPE = st.sampled_from(["ok"] * 8 + ["magic", "type", "cut", "extra"])
_MAGICS = st.sampled_from([b"DS1", b"DS9", b"", b"DS2\x00", b"XXXX"])
_TYPE_BYTES = st.sampled_from([b"", b"\x00", b"\xff", b"\x01\x02", bytes([13])])
_CUT = st.integers(0, 64)


def draw_arrays(draw: st.DrawFn) -> tuple[list[Any], list[bytes]]:
    """Descriptors and buffers: valid, or with edge dtypes, shapes and lying lengths."""
    specs: list[Any] = []
    buffers: list[bytes] = []
    count = draw(_COUNTS)
    for i in range(count):
        dtype, shape = VALID_ARRAYS[i] if i < len(VALID_ARRAYS) else VALID_ARRAYS[0]
        if draw(_BOOL):
            dtype = draw(_DTYPES)
        if draw(_BOOL):
            shape = draw(_SHAPES)
        item = {"|u1": 1, "<f4": 4, "<i8": 8, "<i4": 4, "<f8": 8}.get(dtype, 1)
        size = 1
        for d in shape:
            size *= d if isinstance(d, int) and 0 <= d < 2**20 else 1
        honest = size * item if size * item < 1 << 20 else 16
        length = [honest, honest, 0, max(0, honest - 1), honest + 1][draw(_LIE)]
        specs.append([[dtype, shape], [dtype, shape], [dtype], "x", [shape, dtype]][draw(_FORM)])
        buffers.append(bytes(length))
    return specs, buffers


def messages(types: list[MsgType] | None = None) -> st.SearchStrategy[list[bytes]]:
    """The frames of one message of a type in ``types`` (any type by default)."""
    pick = st.sampled_from(types or list(MsgType))

    @st.composite
    def one(draw: st.DrawFn) -> list[bytes]:
        mtype = draw(pick)
        header = draw_header(draw, mtype)
        buffers: list[bytes] = []
        if mtype is MsgType.RESULT or draw(_TENTH) == 0:
            specs, buffers = draw_arrays(draw)
            header["arrays"] = specs
        try:
            packed = msgpack.packb(header, use_bin_type=True)
        except (OverflowError, TypeError, ValueError):
            packed = msgpack.packb({"session": SID}, use_bin_type=True)
        frames = [MAGIC, bytes([int(mtype)]), packed, *buffers]
        envelope = draw(_ENVELOPE)
        if envelope == "magic":
            frames[0] = draw(_MAGICS)
        elif envelope == "type":
            frames[1] = draw(_TYPE_BYTES)
        elif envelope == "cut":
            frames = frames[: draw(_CUT) % len(frames)]
        elif envelope == "extra":
            frames.append(b"\x00" * draw(_CUT))
        return frames

    return one()

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

# A valid header of every type: the starting point each field is varied from.
VALID: dict[MsgType, dict[str, Any]] = {
    MsgType.HELLO: {"session": SID},
    MsgType.WELCOME: {
        "session": SID,
        "server_id": "abc",
        "dataset_len": 10,
        "fingerprint": "synthetic-10-0",
        "workers": 2,
        "credit": 4,
        "control": "tcp://127.0.0.1:5556",
        "results": ["tcp://127.0.0.1:6000"],
        "max_image_side": 4096,
    },
    MsgType.TASK: {
        "session": SID,
        "task_id": 7,
        "plan_version": 2,
        "epoch": 1,
        "seed": 0,
        "indices": [4, 5, 6, 7],
        "grid": 2,
        "out_hw": [64, 48],
        "on_error": "raise",
        "control_seq": 1,
        "control": {"active": 1, "nested": {"a": [1, 2]}},
        "exclude": [],
    },
    MsgType.RESULT: {
        "session": SID,
        "task_id": 7,
        "plan_version": 2,
        "indices": [4, 5],
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
        "plan_version": 3,
        "control_seq": 2,
        "control": {"x": 1},
        "mode": "stitch",
    },
    MsgType.HEARTBEAT: {"session": SID},
    MsgType.STATS: {},
    MsgType.BYE: {"session": SID},
    MsgType.READY: {"worker": 0, "pid": 123, "results": "tcp://127.0.0.1:4000"},
    MsgType.DONE: {"session": SID, "task_id": 7, "plan_version": 2, "decoded": 1, "samples": 1},
}

# RESULT's arrays: image (3, 4, 5) uint8, boxes (1, 4) float32, labels (1,) int64.
VALID_ARRAYS: list[tuple[str, list[int]]] = [("|u1", [3, 4, 5]), ("<f4", [1, 4]), ("<i8", [1])]

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


def edge_ints() -> st.SearchStrategy[int]:
    return st.sampled_from(EDGE_INTS) | st.integers(-(2**63), MAX_PACKABLE)


def edge_text() -> st.SearchStrategy[str]:
    return st.sampled_from(
        ["", "a", "raise", "skip", "stitch", "regular", "tcp://x:1", "x" * 4097, "é" * 300]
    ) | st.text(max_size=20)


def edge_bytes() -> st.SearchStrategy[bytes]:
    return st.sampled_from([b"", b"\x00", SID, b"s" * 64, b"s" * 65, b"\xff" * 16]) | st.binary(
        max_size=80
    )


def scalars() -> st.SearchStrategy[Any]:
    return (
        edge_ints()
        | st.booleans()
        | st.none()
        | st.floats(allow_nan=True, allow_infinity=True)
        | edge_text()
        | edge_bytes()
    )


def nested() -> st.SearchStrategy[Any]:
    """Lists and maps of scalars, nested, with string, bytes and integer keys."""
    keys = st.text(max_size=4) | st.binary(max_size=4) | st.integers(-5, 5)
    return st.recursive(
        scalars(),
        lambda children: (
            st.lists(children, max_size=5) | st.dictionaries(keys, children, max_size=4)
        ),
        max_leaves=20,
    )


def deep(depth: int) -> Any:
    value: Any = 1
    for i in range(depth):
        value = {"k": value} if i % 2 else [value]
    return value


def variant(valid: Any) -> st.SearchStrategy[Any]:
    """A field's value: its valid one, an edge value, another type, or a nested thing."""
    return st.one_of(
        st.just(valid),
        scalars(),
        nested(),
        st.lists(edge_ints(), max_size=20),
        st.sampled_from([[], [0], [2**63 - 1], [-1], [1] * 17, [0, 0], [16385, 10], [1, 1]]),
        st.sampled_from(
            [{}, {1: 2}, {b"k": 1}, {"a": deep(12)}, {"a": [1] * 3}, {"x" * 100: "y" * 70000}]
        ),
        st.just(deep(20)),
    )


@st.composite
def headers(draw: st.DrawFn, mtype: MsgType) -> dict[str, Any]:
    header: dict[str, Any] = {}
    for key, valid in VALID[mtype].items():
        how = draw(st.sampled_from(["keep", "keep", "vary", "drop"]))
        if how == "keep":
            header[key] = valid
        elif how == "vary":
            header[key] = draw(variant(valid))
    if draw(st.booleans()):
        header.update(draw(st.dictionaries(st.text(max_size=8), scalars(), max_size=3)))
    return header


DTYPES = ["|u1", "<f4", "<i8", "<i4", "<f8", "|O", ">f4", "<U4", "", "|b1"]


@st.composite
def array_specs(draw: st.DrawFn) -> tuple[list[Any], list[bytes]]:
    """Descriptors and buffers: valid, or with edge dtypes, shapes and lying lengths."""
    specs: list[Any] = []
    buffers: list[bytes] = []
    count = draw(st.sampled_from([3, 3, 3, 0, 1, 2, 4]))
    for i in range(count):
        dtype, shape = VALID_ARRAYS[i] if i < 3 else VALID_ARRAYS[0]
        if draw(st.booleans()):
            dtype = draw(st.sampled_from(DTYPES))
        if draw(st.booleans()):
            shape = draw(
                st.sampled_from(
                    [
                        [],
                        [0],
                        [0, 2**62, 2**62],
                        [3, 0, 2**40],
                        [2**31, 2**31],
                        [3, 16385, 1],
                        [3, 1, 1],
                        [-1, 4],
                        [1, 1, 1, 1, 1],
                        [70000, 4],
                        [1, 5],
                    ]
                )
                | st.lists(edge_ints(), max_size=5)
            )
        item = {"|u1": 1, "<f4": 4, "<i8": 8, "<i4": 4, "<f8": 8}.get(dtype, 1)
        size = 1
        for d in shape:
            size *= d if isinstance(d, int) and 0 <= d < 2**20 else 1
        honest = size * item if size * item < 1 << 20 else 16
        length = draw(st.sampled_from([honest, honest, 0, max(0, honest - 1), honest + 1]))
        specs.append(
            draw(st.sampled_from([[dtype, shape], [dtype, shape], [dtype], "x", [shape, dtype]]))
        )
        buffers.append(bytes(length))
    return specs, buffers


@st.composite
def messages(draw: st.DrawFn, types: list[MsgType] | None = None) -> list[bytes]:
    """The frames of one message of a type in ``types`` (any type by default)."""
    mtype = draw(st.sampled_from(types or list(MsgType)))
    header = draw(headers(mtype))
    buffers: list[bytes] = []
    if mtype is MsgType.RESULT or draw(st.integers(0, 9)) == 0:
        specs, buffers = draw(array_specs())
        header["arrays"] = specs
    try:
        packed = msgpack.packb(header, use_bin_type=True)
    except (OverflowError, TypeError, ValueError):
        packed = msgpack.packb({"session": SID}, use_bin_type=True)
    frames = [MAGIC, bytes([int(mtype)]), packed, *buffers]
    envelope = draw(st.sampled_from(["ok"] * 8 + ["magic", "type", "cut", "extra"]))
    if envelope == "magic":
        frames[0] = draw(st.sampled_from([b"DS1", b"DS9", b"", b"DS2\x00", b"XXXX"]))
    elif envelope == "type":
        frames[1] = draw(st.sampled_from([b"", b"\x00", b"\xff", b"\x01\x02", bytes([13])]))
    elif envelope == "cut":
        frames = frames[: draw(st.integers(0, len(frames) - 1))]
    elif envelope == "extra":
        frames.append(b"\x00" * draw(st.integers(0, 64)))
    return frames

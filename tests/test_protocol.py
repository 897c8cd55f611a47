"""The wire protocol: every message type round-trips; bad messages raise ProtocolError."""

from __future__ import annotations

from typing import Any

import msgpack
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from dataserver import protocol
from dataserver.protocol import MAGIC, Message, MsgType, ProtocolError, decode, encode

SID = b"0123456789abcdef"

TASK = {
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
}

EXAMPLES: dict[MsgType, tuple[dict[str, Any], list[np.ndarray]]] = {
    MsgType.HELLO: ({"session": SID}, []),
    MsgType.WELCOME: (
        {
            "session": SID,
            "server_id": "abc",
            "dataset_len": 10,
            "fingerprint": "synthetic-10-0",
            "workers": 2,
            "credit": 4,
            "control": "tcp://127.0.0.1:5556",
        },
        [],
    ),
    MsgType.TASK: (TASK, []),
    MsgType.RESULT: (
        {
            "session": SID,
            "task_id": 7,
            "plan_version": 2,
            "indices": [4, 5],
            "failed": [[6, "bad"]],
        },
        [
            np.arange(3 * 4 * 5, dtype=np.uint8).reshape(3, 4, 5),
            np.array([[1, 2, 3, 4]], dtype=np.float32),
            np.array([9], dtype=np.int64),
        ],
    ),
    MsgType.ERROR: ({"message": "sample 3 (a.jpg): corrupt", "index": 3, "file": "a.jpg"}, []),
    MsgType.CANCELLED: ({"session": SID, "task_ids": [1, 2, 3]}, []),
    MsgType.CONTROL: (
        {
            "session": SID,
            "plan_version": 3,
            "control_seq": 2,
            "control": {"x": 1},
            "mode": "stitch",
        },
        [],
    ),
    MsgType.HEARTBEAT: ({}, []),
    MsgType.STATS: ({"stats": {"workers": 2}}, []),
    MsgType.BYE: ({"session": SID}, []),
    MsgType.READY: ({"worker": 0, "pid": 123, "results": "tcp://127.0.0.1:4000"}, []),
    MsgType.DONE: ({"session": SID, "task_id": 7, "plan_version": 2, "decoded": 1}, []),
}


def frames_of(mtype: MsgType) -> list[bytes]:
    header, arrays = EXAMPLES[mtype]
    return [bytes(memoryview(f)) for f in encode(Message(mtype, header, arrays))]


@pytest.mark.parametrize("mtype", list(MsgType))
def test_round_trip_every_type(mtype: MsgType) -> None:
    header, arrays = EXAMPLES[mtype]
    msg = decode(frames_of(mtype))
    assert msg.type is mtype
    assert msg.header == header
    assert len(msg.arrays) == len(arrays)
    for got, want in zip(msg.arrays, arrays, strict=True):
        assert got.dtype == want.dtype and got.shape == want.shape
        assert np.array_equal(got, want)


def test_arrays_are_received_without_copy() -> None:
    frames = frames_of(MsgType.RESULT)
    buf = bytearray(frames[3])
    frames[3] = buf  # type: ignore[call-overload]
    msg = decode(frames)
    buf[0] = 200
    assert msg.arrays[0].flat[0] == 200  # a view over the frame, not a copy


def test_frame_layout_is_as_documented() -> None:
    frames = frames_of(MsgType.RESULT)
    assert frames[0] == b"DS1" == MAGIC
    assert frames[1] == bytes([MsgType.RESULT])
    header = msgpack.unpackb(frames[2])
    assert header["arrays"] == [["|u1", [3, 4, 5]], ["<f4", [1, 4]], ["<i8", [1]]]
    assert len(frames) == 6


def _with_header(
    mtype: MsgType, header: dict[str, Any], arrays: list[bytes] | None = None
) -> list[bytes]:
    return [MAGIC, bytes([mtype]), msgpack.packb(header, use_bin_type=True), *(arrays or [])]


@pytest.mark.parametrize(
    ("frames", "match"),
    [
        ([], "truncated"),
        ([MAGIC, bytes([MsgType.HELLO])], "truncated"),
        ([b"DS2", bytes([MsgType.HELLO]), msgpack.packb({"session": SID})], "version '2'"),
        ([b"XYZ", bytes([MsgType.HELLO]), msgpack.packb({"session": SID})], "bad magic"),
        ([b"\x00" * 100, b"\x01", b"\x80"], "bad magic"),
        ([MAGIC, bytes([99]), msgpack.packb({})], "unknown message type"),
        ([MAGIC, b"\x01\x02", msgpack.packb({})], "exactly one byte"),
        ([MAGIC, bytes([MsgType.HELLO]), b"\xc1garbage"], "not valid msgpack"),
        ([MAGIC, bytes([MsgType.HELLO]), msgpack.packb([1, 2])], "must be a map"),
        ([MAGIC, bytes([MsgType.HELLO]), msgpack.packb({})], "lacks 'session'"),
        ([MAGIC, bytes([MsgType.HELLO]), msgpack.packb({"session": "str"})], "expected bytes"),
        ([MAGIC, bytes([MsgType.HELLO]), b"\x81" + b"\x00" * (2 << 20)], "exceeds"),
        ([MAGIC] * 17, "too many frames"),
    ],
)
def test_rejects_malformed(frames: list[bytes], match: str) -> None:
    with pytest.raises(ProtocolError, match=match):
        decode(frames)


def _result_header(spec: list[Any]) -> dict[str, Any]:
    header, _ = EXAMPLES[MsgType.RESULT]
    return {**header, "arrays": spec}


def test_rejects_wrong_dtype() -> None:
    spec = [["|O", [1]], ["<f4", [0, 4]], ["<i8", [0]]]
    frames = _with_header(MsgType.RESULT, _result_header(spec), [b"\x00" * 8, b"", b""])
    with pytest.raises(ProtocolError, match="dtype '\\|O' is not allowed"):
        decode(frames)


def test_rejects_buffer_length_that_does_not_match_shape() -> None:
    spec = [["|u1", [3, 4, 5]], ["<f4", [1, 4]], ["<i8", [1]]]
    frames = _with_header(
        MsgType.RESULT, _result_header(spec), [b"\x00" * 59, b"\x00" * 16, b"\x00" * 8]
    )
    with pytest.raises(ProtocolError, match="60 bytes, but its frame holds 59"):
        decode(frames)


def test_rejects_oversized_array_declaration() -> None:
    spec = [["|u1", [1 << 20, 1 << 20, 3]], ["<f4", [0, 4]], ["<i8", [0]]]
    frames = _with_header(MsgType.RESULT, _result_header(spec), [b"", b"", b""])
    with pytest.raises(ProtocolError, match="exceeds"):
        decode(frames)


def test_rejects_missing_and_extra_buffers() -> None:
    spec = [["|u1", [1]], ["<f4", [0, 4]], ["<i8", [0]]]
    with pytest.raises(ProtocolError, match="carries 3 array"):
        decode(_with_header(MsgType.RESULT, _result_header(spec), [b"\x00", b""]))
    with pytest.raises(ProtocolError, match="carries 0 array"):
        decode(_with_header(MsgType.HELLO, {"session": SID}, [b"\x00"]))


@pytest.mark.parametrize(
    ("change", "match"),
    [
        ({"grid": 9}, "grid 9 out of range"),
        ({"indices": []}, "indices"),
        ({"indices": [1, 2, 3, 4, 5]}, "indices"),
        ({"indices": [-1]}, "indices"),
        ({"out_hw": [0, 10]}, "out_hw"),
        ({"out_hw": [10**6, 10]}, "out_hw"),
        ({"on_error": "ignore"}, "on_error"),
        ({"task_id": -5}, "task_id"),
        ({"task_id": True}, "task_id"),
        ({"task_id": 2**64 - 1}, "task_id"),
        ({"control": {1: 2}}, "not valid msgpack|control keys"),
        ({"exclude": [-1]}, "exclude"),
        ({"exclude": "all"}, "exclude"),
    ],
)
def test_rejects_bad_task_fields(change: dict[str, Any], match: str) -> None:
    with pytest.raises(ProtocolError, match=match):
        decode(_with_header(MsgType.TASK, {**TASK, **change}))


def test_rejects_deeply_nested_control() -> None:
    nested: Any = 1
    for _ in range(50):
        nested = [nested]
    with pytest.raises(ProtocolError, match="nested deeper"):
        decode(_with_header(MsgType.TASK, {**TASK, "control": {"x": nested}}))


def test_rejects_msgpack_bomb_declaring_huge_lengths() -> None:
    bomb = b"\x81\xa1a\xdd\xff\xff\xff\xff"  # {"a": array32 of 4 billion elements}, no data
    with pytest.raises(ProtocolError, match="not valid msgpack"):
        decode([MAGIC, bytes([MsgType.HELLO]), bomb])
    bomb_str = b"\x81\xa1a\xdb\x7f\xff\xff\xff"  # a 2 GiB string that is not there
    with pytest.raises(ProtocolError, match="not valid msgpack"):
        decode([MAGIC, bytes([MsgType.HELLO]), bomb_str])


def test_encode_refuses_unsafe_dtypes() -> None:
    with pytest.raises(ProtocolError, match="may not travel"):
        protocol.make(MsgType.RESULT, {}, [np.array([object()])])


@settings(max_examples=400, deadline=None)
@given(st.lists(st.binary(max_size=64), max_size=8))
def test_fuzz_random_frames_never_crash(frames: list[bytes]) -> None:
    try:
        decode(frames)
    except ProtocolError:
        pass


@settings(max_examples=300, deadline=None)
@given(
    st.sampled_from(list(MsgType)),
    st.dictionaries(
        st.text(max_size=12),
        st.recursive(
            st.none()
            | st.booleans()
            | st.integers(-(2**63), 2**64 - 1)
            | st.text(max_size=8)
            | st.binary(max_size=8),
            lambda children: (
                st.lists(children, max_size=4)
                | st.dictionaries(st.text(max_size=4), children, max_size=4)
            ),
            max_leaves=12,
        ),
        max_size=8,
    ),
    st.lists(st.binary(max_size=32), max_size=4),
)
def test_fuzz_valid_envelopes_with_arbitrary_headers(
    mtype: MsgType, header: dict[str, Any], tail: list[bytes]
) -> None:
    try:
        msg = decode(_with_header(mtype, header, tail))
    except ProtocolError:
        return
    # Anything accepted satisfies its schema.
    for key in protocol._SCHEMAS[mtype]:
        assert key in msg.header


@settings(max_examples=200, deadline=None)
@given(st.data())
def test_fuzz_mutated_real_messages(data: st.DataObject) -> None:
    mtype = data.draw(st.sampled_from(list(MsgType)))
    frames = frames_of(mtype)
    i = data.draw(st.integers(0, len(frames) - 1))
    raw = bytearray(frames[i])
    for _ in range(data.draw(st.integers(1, 4))):
        if raw and data.draw(st.booleans()):
            raw[data.draw(st.integers(0, len(raw) - 1))] = data.draw(st.integers(0, 255))
        else:
            raw = raw[: data.draw(st.integers(0, len(raw)))]
    frames[i] = bytes(raw)
    try:
        decode(frames)
    except ProtocolError:
        pass

"""The wire protocol: every message type round-trips; bad messages raise ProtocolError, and
nothing else, whatever their fields hold."""

from __future__ import annotations

from typing import Any

import msgpack
import numpy as np
import pytest
from fuzzing import SID, VALID, messages
from hypothesis import given, settings
from hypothesis import strategies as st

from dataserver import protocol
from dataserver.protocol import (
    MAGIC,
    MESSAGES,
    BatchSizes,
    Cancelled,
    Control,
    ErrorMsg,
    Message,
    MsgType,
    ProtocolError,
    Result,
    Task,
    Welcome,
    control_problem,
    decode,
    pack,
)


def result_arrays() -> list[np.ndarray]:
    return [
        np.arange(2 * 3 * 4 * 5, dtype=np.uint8).reshape(2, 3, 4, 5),
        np.array([[1, 2, 3, 4]], dtype=np.float32),
        np.array([9], dtype=np.int64),
    ]


def frames_of(mtype: MsgType) -> list[bytes]:
    arrays = result_arrays() if mtype is MsgType.RESULT else []
    return [bytes(memoryview(f)) for f in pack(mtype, VALID[mtype], arrays)]


def plain(value: Any) -> Any:
    """Tuples as lists, all the way down (as msgpack sends them)."""
    if isinstance(value, (tuple, list)):
        return [plain(v) for v in value]
    return value


def same(a: Message, b: Message) -> bool:
    if type(a) is not type(b) or a.header() != b.header():
        return False
    return all(np.array_equal(x, y) for x, y in zip(a.arrays(), b.arrays(), strict=True))


@pytest.mark.parametrize("mtype", list(MsgType))
def test_round_trip_every_type(mtype: MsgType) -> None:
    msg = decode(frames_of(mtype))
    assert type(msg) is MESSAGES[mtype] and msg.TYPE is mtype
    again = decode([bytes(memoryview(f)) for f in msg.encode()])
    assert same(msg, again)
    for key, value in VALID[mtype].items():  # every field read back as sent
        assert plain(getattr(msg, key)) == value


def test_typed_fields_are_normalised() -> None:
    msg = decode(frames_of(MsgType.TASK))
    assert isinstance(msg, Task)
    assert msg.images == ((4, 5, 6, 7), (8, 9)) and msg.indices == (4, 5, 6, 7, 8, 9)
    assert msg.out_hw == (64, 48) and msg.exclude == ()
    res = decode(frames_of(MsgType.RESULT))
    assert isinstance(res, Result) and res.failed == ((6, "bad"),)
    assert res.pixels is not None and res.pixels.shape == (2, 3, 4, 5)


@pytest.mark.parametrize("stored", [None, (96, 80)])
def test_batch_sizes_travel_as_the_task_fields(stored: tuple[int, int] | None) -> None:
    """``BatchSizes.wire`` gives the fields every client sent (no ``source_hw`` when the
    stored size is the fit size: the same bytes), and ``Task.sizes`` reads them back."""
    base = {k: v for k, v in VALID[MsgType.TASK].items() if k not in ("out_hw", "fit_hw")}
    sizes = BatchSizes.of((32, 24), (64, 48), stored)
    task = Task(**base, **sizes.wire())
    by_hand = Task(**base, out_hw=(32, 24), fit_hw=(64, 48), source_hw=stored)
    assert task.encode() == by_hand.encode()
    again = decode([bytes(memoryview(f)) for f in task.encode()])
    assert isinstance(again, Task) and again.sizes == sizes
    assert sizes.stored == (stored or (64, 48)) and sizes.image_bytes == 3 * 32 * 24


def test_arrays_are_received_without_copy() -> None:
    frames: list[Any] = frames_of(MsgType.RESULT)
    buf = bytearray(frames[3])
    frames[3] = buf
    msg = decode(frames)
    assert isinstance(msg, Result) and msg.pixels is not None
    buf[0] = 200
    assert msg.pixels.flat[0] == 200  # a view over the frame, not a copy


def test_frame_layout_is_as_documented() -> None:
    frames = frames_of(MsgType.RESULT)
    assert frames[0] == b"DS9" == MAGIC
    assert frames[1] == bytes([MsgType.RESULT])
    header = msgpack.unpackb(frames[2])
    assert header["arrays"] == [["|u1", [2, 3, 4, 5]], ["<f4", [1, 4]], ["<i8", [1]]]
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
        ([MAGIC, bytes([MsgType.HELLO]), msgpack.packb({})], "field 'session'"),
        ([MAGIC, bytes([MsgType.HELLO]), msgpack.packb({"session": "str"})], "bytes"),
        ([MAGIC, bytes([MsgType.HELLO]), b"\x81" + b"\x00" * (2 << 20)], "exceeds"),
        ([MAGIC] * 17, "too many frames"),
    ],
)
def test_rejects_malformed(frames: list[bytes], match: str) -> None:
    with pytest.raises(ProtocolError, match=match):
        decode(frames)


def _result(spec: list[Any], buffers: list[bytes]) -> list[bytes]:
    return _with_header(MsgType.RESULT, {**VALID[MsgType.RESULT], "arrays": spec}, buffers)


IMG = ["|u1", [2, 3, 4, 5]]
BOXES = ["<f4", [1, 4]]
LABELS = ["<i8", [1]]


def test_rejects_wrong_dtype() -> None:
    spec = [["|O", [1]], BOXES, LABELS]
    frames = _result(spec, [b"\x00" * 8, b"\x00" * 16, b"\x00" * 8])
    with pytest.raises(ProtocolError, match="dtype '\\|O' is not allowed"):
        decode(frames)


def test_rejects_buffer_length_that_does_not_match_shape() -> None:
    spec = [IMG, BOXES, LABELS]
    with pytest.raises(ProtocolError, match="120 bytes, but its frame holds 119"):
        decode(_result(spec, [b"\x00" * 119, b"\x00" * 16, b"\x00" * 8]))


@pytest.mark.parametrize(
    "shape",
    [[1 << 20, 1 << 20, 3], [0, 2**62, 2**62], [3, 0, 2**40], [2**31, 0], [-1, 3], [1, 1, 1, 1, 1]],
)
def test_rejects_shapes_that_are_huge_or_hide_a_huge_dimension_behind_a_zero(
    shape: list[int],
) -> None:
    with pytest.raises(ProtocolError, match="array 0"):
        decode(_result([["|u1", shape], BOXES, LABELS], [b""] * 3))


@pytest.mark.parametrize(
    ("arrays", "match"),
    [
        ([["|u1", [2, 4, 4, 5]], BOXES, LABELS], r"images must be uint8 \(2, 3, H, W\)"),
        ([["|u1", [1, 3, 4, 5]], BOXES, LABELS], r"images must be uint8 \(2, 3, H, W\)"),
        ([["|u1", [2, 3, 16385, 1]], BOXES, LABELS], "images must be"),
        ([["|u1", [2, 3, 0, 5]], BOXES, LABELS], "images must be"),
        ([["|u1", [3, 4, 5]], BOXES, LABELS], "images must be"),
        ([["<f4", [2, 3, 4, 5]], BOXES, LABELS], "images must be uint8"),
        ([IMG, ["<f4", [1, 5]], LABELS], r"boxes must be float32 \(1, 4\)"),
        ([IMG, ["<f8", [1, 4]], LABELS], "boxes must be float32"),
        ([IMG, ["<f4", [2, 4]], ["<i8", [2]]], r"boxes must be float32 \(1, 4\)"),
        ([IMG, BOXES, ["<i4", [1]]], "labels must be int64"),
        ([IMG, BOXES], "carries 3 arrays"),
    ],
)
def test_result_arrays_are_checked_by_role(arrays: list[Any], match: str) -> None:
    buffers = []
    for dtype, shape in arrays:
        n = int(np.prod(shape)) * np.dtype(dtype).itemsize
        buffers.append(bytes(n))
    with pytest.raises(ProtocolError, match=match):
        decode(_result(arrays, buffers))


def test_result_box_counts_must_match_its_images() -> None:
    header = {**VALID[MsgType.RESULT], "box_counts": [1]}
    with pytest.raises(ProtocolError, match="1 box counts for 2 images"):
        decode(_with_header(MsgType.RESULT, header))


def test_rejects_missing_and_extra_buffers() -> None:
    spec = [IMG, BOXES, LABELS]
    with pytest.raises(ProtocolError, match="names 3 array"):
        decode(_result(spec, [b"\x00" * 120, b"\x00" * 16]))
    with pytest.raises(ProtocolError, match="carries no arrays"):
        decode(_with_header(MsgType.HELLO, {"session": SID, "arrays": [["|u1", [1]]]}, [b"\x00"]))


@pytest.mark.parametrize(
    ("change", "match"),
    [
        ({"grid": 9}, "grid"),
        ({"grid": True}, "grid"),
        ({"images": []}, "images"),
        ({"images": [[]]}, "images"),
        ({"images": [[1]] * 65}, "images"),
        ({"images": [[1, 2, 3, 4, 5]]}, "do not fit a 2x2 grid"),
        ({"images": [[-1]]}, "images"),
        ({"images": [[1.5]]}, "images"),
        ({"images": [1, 2]}, "images"),
        ({"fit_hw": [0, 10]}, "fit_hw"),
        ({"priority": 2}, "priority"),
        ({"out_hw": [0, 10]}, "out_hw"),
        ({"out_hw": [1, 10]}, "smaller than the grid"),
        ({"out_hw": [10**6, 10]}, "out_hw"),
        ({"out_hw": [10, 10, 10]}, "out_hw"),
        ({"on_error": "ignore"}, "on_error"),
        ({"on_error": b"raise"}, "on_error"),
        ({"task_id": -5}, "task_id"),
        ({"task_id": True}, "task_id"),
        ({"task_id": 2.0}, "task_id"),
        ({"task_id": 2**64 - 1}, "task_id"),
        ({"session": b""}, "session"),
        ({"session": b"s" * 65}, "session"),
        ({"session": "s" * 16}, "session"),
        ({"control_seq": -1}, "control_seq"),
        ({"exclude": [-1]}, "exclude"),
        ({"exclude": "all"}, "exclude"),
        ({"partners": 2}, "partners"),
        ({"partners": 1}, "field 'partners': only with layout 'mosaic'"),
    ],
)
def test_rejects_bad_task_fields(change: dict[str, Any], match: str) -> None:
    with pytest.raises(ProtocolError, match=match):
        decode(_with_header(MsgType.TASK, {**VALID[MsgType.TASK], **change}))


def test_rejects_deeply_nested_and_oversized_control() -> None:
    nested: Any = 1
    for _ in range(50):
        nested = [nested]
    with pytest.raises(ProtocolError, match="nested deeper"):
        decode(_with_header(MsgType.CONTROL, {**VALID[MsgType.CONTROL], "control": {"x": nested}}))
    for bad in ({1: 2}, {"a": {b"k": 1}}, [1]):
        with pytest.raises(ProtocolError, match=r"not valid msgpack|control"):
            decode(_with_header(MsgType.CONTROL, {**VALID[MsgType.CONTROL], "control": bad}))
    with pytest.raises(ProtocolError, match="bytes packed"):
        decode(
            _with_header(MsgType.CONTROL, {**VALID[MsgType.CONTROL], "control": {"x": "y" * 70000}})
        )


def test_control_problem_is_what_decode_refuses() -> None:
    assert control_problem({"a": 1, "b": {"c": [1, 2.5, "x", b"y", None]}}) is None
    for bad in ({1: 0.5}, {"a": {2: 1}}, {"a": [{b"k": 1}]}, {"a": object()}, {"a": 2**64}):
        problem = control_problem(bad)
        assert problem is not None
        try:
            frames = _with_header(MsgType.CONTROL, {**VALID[MsgType.CONTROL], "control": bad})
        except (TypeError, OverflowError):
            continue  # not even packable
        with pytest.raises(ProtocolError):
            decode(frames)


def test_rejects_msgpack_bomb_declaring_huge_lengths() -> None:
    bomb = b"\x81\xa1a\xdd\xff\xff\xff\xff"  # {"a": array32 of 4 billion elements}, no data
    with pytest.raises(ProtocolError, match="not valid msgpack"):
        decode([MAGIC, bytes([MsgType.HELLO]), bomb])
    bomb_str = b"\x81\xa1a\xdb\x7f\xff\xff\xff"  # a 2 GiB string that is not there
    with pytest.raises(ProtocolError, match="not valid msgpack"):
        decode([MAGIC, bytes([MsgType.HELLO]), bomb_str])


def test_pack_refuses_unsafe_dtypes() -> None:
    with pytest.raises(ProtocolError, match="may not travel"):
        pack(MsgType.RESULT, {}, [np.array([object()])])


def test_optional_fields_read_as_none_or_default() -> None:
    err = decode(_with_header(MsgType.ERROR, {"message": "x"}))
    assert isinstance(err, ErrorMsg) and err.task_id is None and err.kind == ""
    c = decode(_with_header(MsgType.CANCELLED, {"session": SID, "task_ids": [1]}))
    assert isinstance(c, Cancelled) and c.plan_version == 0
    ctl = decode(_with_header(MsgType.CONTROL, {**VALID[MsgType.CONTROL], "mode": None}))
    assert isinstance(ctl, Control) and ctl.mode is None


# ------------------------------------------------------------------ fuzz: decode alone


def check_decode(frames: list[bytes]) -> None:
    """decode raises ProtocolError or returns a message that survives a round trip."""
    try:
        msg = decode(frames)
    except ProtocolError:
        return
    again = decode([bytes(memoryview(f)) for f in msg.encode()])
    assert same(msg, again), (msg, again)


@settings(max_examples=1500, deadline=None)
@given(messages())
def test_fuzz_field_by_field_raises_only_protocol_error(frames: list[bytes]) -> None:
    check_decode(frames)


@settings(max_examples=300, deadline=None)
@given(st.lists(st.binary(max_size=64), max_size=8))
def test_fuzz_random_frames_raise_only_protocol_error(frames: list[bytes]) -> None:
    check_decode(frames)


@settings(max_examples=300, deadline=None)
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
    check_decode(frames)


def test_every_type_has_a_codec_and_an_example() -> None:
    assert set(MESSAGES) == set(MsgType) == set(VALID)
    assert protocol.PROTOCOL_VERSION == 9


@pytest.mark.parametrize(
    ("mtype", "change", "match"),
    [
        (MsgType.TASK, {"pad_value": 256}, "pad_value"),
        (MsgType.TASK, {"pad_value": -1}, "pad_value"),
        (MsgType.TASK, {"pad_value": True}, "pad_value"),
        (MsgType.TASK, {"letterbox": "middle"}, "letterbox"),
        (MsgType.WELCOME, {"categories": [[1, "a"], [1, "b"]]}, "a label is named twice"),
        (MsgType.WELCOME, {"categories": [[-1, "a"]]}, "categories"),
        (MsgType.WELCOME, {"categories": [[1, "a" * 257]]}, "categories"),
        (MsgType.WELCOME, {"categories": [[1, "a"]] * 4097}, "categories"),
        (MsgType.WELCOME, {"categories": [[1]]}, "categories"),
        (MsgType.RESULT, {"files": ["a.jpg"]}, "1 files for 2 images"),
        (MsgType.RESULT, {"files": ["a" * 1025, ""]}, "files"),
        (MsgType.RESULT, {"orig_sizes": [[1, 2]]}, "1 orig_sizes for 2 images"),
        (MsgType.RESULT, {"orig_sizes": [[1, 2], [-1, 2]]}, "orig_sizes"),
        (MsgType.RESULT, {"orig_sizes": [[1, 2], [1, 2, 3]]}, "orig_sizes"),
    ],
)
def test_rejects_bad_composition_fields(mtype: MsgType, change: dict[str, Any], match: str) -> None:
    """Issue 24's fields: padding and letterbox of a TASK, a WELCOME's categories, a
    RESULT's files and original sizes (one per image)."""
    arrays = result_arrays() if mtype is MsgType.RESULT else []
    with pytest.raises(ProtocolError, match=match):
        decode([bytes(memoryview(f)) for f in pack(mtype, {**VALID[mtype], **change}, arrays)])


def test_composition_fields_round_trip() -> None:
    task = decode(_with_header(MsgType.TASK, {**VALID[MsgType.TASK], "pad_value": 114}))
    assert isinstance(task, Task) and (task.pad_value, task.letterbox) == (114, "top-left")
    welcome = {**VALID[MsgType.WELCOME], "categories": [[0, "bg"], [7, "cat"]]}
    got = decode(_with_header(MsgType.WELCOME, welcome))
    assert isinstance(got, Welcome) and got.categories == ((0, "bg"), (7, "cat"))
    header = {**VALID[MsgType.RESULT], "files": ["a.jpg", ""], "orig_sizes": [[480, 640], [0, 0]]}
    res = decode([bytes(memoryview(f)) for f in pack(MsgType.RESULT, header, result_arrays())])
    assert isinstance(res, Result)
    assert res.files == ("a.jpg", "") and res.orig_sizes == ((480, 640), (0, 0))

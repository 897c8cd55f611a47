"""Field types: what one header field may hold, as ``msgspec`` constraints checked while
the header is decoded (integer ranges, lengths of strings, bytes and lists, at every level of
nesting). Integers are never booleans and booleans never integers; lists read as tuples.

What a constraint cannot say is checked after: ``control_problem`` for control values
(string keys at every level, bounded depth and packed size), shared with the client, which
refuses at the call what the wire would refuse; ``tree_problem`` for a stats reply.
"""

from __future__ import annotations

from typing import Annotated, Any

import msgpack
from msgspec import Meta

MAX_INT = (1 << 63) - 1
MAX_SESSION_BYTES = 64
MAX_CONTROL_DEPTH = 8
MAX_CONTROL_BYTES = 64 << 10
MAX_TEXT = 4096
# Object labels are class ids: 0..MAX_LABEL (int32 for every framework's loss). Workers
# refuse others as sample errors; a client refuses them from a server as a protocol error.
MAX_LABEL = (1 << 31) - 1


def In(lo: int, hi: int = MAX_INT) -> Meta:
    """An integer in [lo, hi]."""
    return Meta(ge=lo, le=hi)


def Len(lo: int, hi: int) -> Meta:
    """A string (in characters), bytes or list of lo..hi."""
    return Meta(min_length=lo, max_length=hi)


U63 = Annotated[int, In(0)]
Session = Annotated[bytes, Len(1, MAX_SESSION_BYTES)]
Text = Annotated[str, Len(0, MAX_TEXT)]
T32 = Annotated[str, Len(0, 32)]
T64 = Annotated[str, Len(0, 64)]
T128 = Annotated[str, Len(0, 128)]
T512 = Annotated[str, Len(0, 512)]


def _depth(value: Any, limit: int) -> str | None:
    """None if ``value`` nests at most ``limit`` deep with string keys, else the problem."""
    stack = [(value, 0)]
    while stack:
        v, d = stack.pop()
        if d > limit:
            return f"nested deeper than {limit}"
        if isinstance(v, dict):
            for k, item in v.items():
                if not isinstance(k, str):
                    return f"key {k!r} is not a string"
                stack.append((item, d + 1))
        elif isinstance(v, (list, tuple)):
            stack.extend((item, d + 1) for item in v)
    return None


def tree_problem(value: Any, limit: int) -> str | None:
    """None if ``value`` is plain msgpack (no extension types) nesting at most ``limit``
    deep with string keys, else the problem."""
    problem = _depth(value, limit)
    if problem:
        return problem
    try:
        msgpack.packb(value, use_bin_type=True)
    except (TypeError, ValueError, OverflowError) as exc:
        return f"not plain msgpack: {exc}"
    return None


def control_problem(values: Any) -> str | None:
    """What is wrong with ``values`` as control values, or None. Used by the server when it
    reads them and by the client before it sends them, so both refuse the same values."""
    if not isinstance(values, dict):
        return f"control values must be a map, got {type(values).__name__}"
    problem = _depth(values, MAX_CONTROL_DEPTH)
    if problem:
        return f"control values: {problem}"
    try:
        packed = msgpack.packb(values, use_bin_type=True)
    except (TypeError, ValueError, OverflowError) as exc:
        return f"control values must be msgpack-able: {exc}"
    if len(packed) > MAX_CONTROL_BYTES:
        return f"control values take {len(packed)} bytes packed, more than {MAX_CONTROL_BYTES}"
    return None

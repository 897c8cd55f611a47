"""Field codecs: what one header field may hold, checked on the way in.

Each codec's ``read(name, value)`` returns the value (normalised: lists of integers become
tuples) or raises ``ProtocolError`` naming the field. ``MISSING`` is what a codec is given
for an absent field: only ``Opt`` and codecs with a default accept it. The checks are by
type and range only; what a field means is the receiver's business.

``check_control`` is shared with the client, which refuses at the call what the wire would
refuse (string keys at every level, bounded depth and size).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

import msgpack

from dataserver.protocol.wire import ProtocolError

MAX_INT = (1 << 63) - 1
MAX_SESSION_BYTES = 64
MAX_CONTROL_DEPTH = 8
MAX_CONTROL_BYTES = 64 << 10
MAX_TEXT = 4096
# Object labels are class ids: 0..MAX_LABEL (int32 for every framework's loss). Workers
# refuse others as sample errors; a client refuses them from a server as a protocol error.
MAX_LABEL = (1 << 31) - 1


class _Missing:
    def __repr__(self) -> str:
        return "MISSING"


MISSING: Any = _Missing()


def _bad(name: str, what: str, value: Any) -> ProtocolError:
    shown = repr(value)
    if len(shown) > 60:
        shown = shown[:57] + "..."
    return ProtocolError(f"field {name!r}: expected {what}, got {shown}")


def is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


@dataclass(frozen=True)
class Int:
    """An integer in [lo, hi] (bools are not integers here)."""

    lo: int = 0
    hi: int = MAX_INT
    default: Any = MISSING

    def read(self, name: str, value: Any) -> Any:
        if value is MISSING and self.default is not MISSING:
            return self.default
        if not (is_int(value) and self.lo <= value <= self.hi):
            raise _bad(name, f"an integer in {self.lo}..{self.hi}", value)
        return value


@dataclass(frozen=True)
class Flag:
    """A boolean."""

    def read(self, name: str, value: Any) -> Any:
        if not isinstance(value, bool):
            raise _bad(name, "true or false", value)
        return value


@dataclass(frozen=True)
class Float:
    """A finite number in [lo, hi]."""

    lo: float = -math.inf
    hi: float = math.inf

    def read(self, name: str, value: Any) -> Any:
        ok = (is_int(value) or isinstance(value, float)) and math.isfinite(value)
        if not (ok and self.lo <= value <= self.hi):
            raise _bad(name, f"a finite number in {self.lo}..{self.hi}", value)
        return float(value)


@dataclass(frozen=True)
class Text:
    """A string of at most ``max_len`` characters."""

    max_len: int = MAX_TEXT
    default: Any = MISSING

    def read(self, name: str, value: Any) -> Any:
        if value is MISSING and self.default is not MISSING:
            return self.default
        if not (isinstance(value, str) and len(value) <= self.max_len):
            raise _bad(name, f"a string of <= {self.max_len} characters", value)
        return value


@dataclass(frozen=True)
class Choice:
    """One of a few strings."""

    values: tuple[str, ...]
    default: Any = MISSING

    def read(self, name: str, value: Any) -> Any:
        if value is MISSING and self.default is not MISSING:
            return self.default
        if not (isinstance(value, str) and value in self.values):
            raise _bad(name, " | ".join(self.values), value)
        return value


@dataclass(frozen=True)
class Blob:
    """Bytes, ``lo`` to ``hi`` long."""

    lo: int = 1
    hi: int = MAX_SESSION_BYTES

    def read(self, name: str, value: Any) -> Any:
        if not (isinstance(value, bytes) and self.lo <= len(value) <= self.hi):
            raise _bad(name, f"{self.lo}..{self.hi} bytes", value)
        return value


SESSION = Blob(1, MAX_SESSION_BYTES)


@dataclass(frozen=True)
class Ints:
    """A list of ``lo_n``..``hi_n`` integers, each in [lo, hi]; read as a tuple."""

    lo_n: int = 0
    hi_n: int = 1 << 16
    lo: int = 0
    hi: int = MAX_INT
    default: Any = MISSING

    def read(self, name: str, value: Any) -> Any:
        if value is MISSING and self.default is not MISSING:
            return self.default
        if not (isinstance(value, list) and self.lo_n <= len(value) <= self.hi_n):
            raise _bad(name, f"a list of {self.lo_n}..{self.hi_n} integers", value)
        for v in value:
            if not (is_int(v) and self.lo <= v <= self.hi):
                raise _bad(name, f"integers in {self.lo}..{self.hi}", v)
        return tuple(value)


@dataclass(frozen=True)
class IntLists:
    """A list of 1..``hi_n`` lists, each of ``lo_each``..``hi_each`` integers in
    [0, MAX_INT]; read as a tuple of tuples."""

    hi_n: int
    hi_each: int
    lo_each: int = 1

    def read(self, name: str, value: Any) -> Any:
        if not (isinstance(value, list) and 1 <= len(value) <= self.hi_n):
            raise _bad(name, f"a list of 1..{self.hi_n} lists of integers", value)
        out = []
        for item in value:
            if not (isinstance(item, list) and self.lo_each <= len(item) <= self.hi_each):
                raise _bad(name, f"lists of {self.lo_each}..{self.hi_each} integers", item)
            for v in item:
                if not (is_int(v) and 0 <= v <= MAX_INT):
                    raise _bad(name, "non-negative integers", v)
            out.append(tuple(item))
        return tuple(out)


@dataclass(frozen=True)
class Texts:
    """A list of at most ``hi_n`` strings of at most ``max_len`` characters; a tuple."""

    hi_n: int = 1024
    max_len: int = 256
    default: Any = MISSING

    def read(self, name: str, value: Any) -> Any:
        if value is MISSING and self.default is not MISSING:
            return self.default
        if not (isinstance(value, list) and len(value) <= self.hi_n):
            raise _bad(name, f"a list of <= {self.hi_n} strings", value)
        for v in value:
            if not (isinstance(v, str) and len(v) <= self.max_len):
                raise _bad(name, f"strings of <= {self.max_len} characters", v)
        return tuple(value)


@dataclass(frozen=True)
class Blobs:
    """A list of at most ``hi_n`` byte strings, each ``size`` long; a tuple."""

    hi_n: int
    size: int

    def read(self, name: str, value: Any) -> Any:
        if not (isinstance(value, list) and len(value) <= self.hi_n):
            raise _bad(name, f"a list of <= {self.hi_n} byte strings", value)
        for v in value:
            if not (isinstance(v, bytes) and len(v) == self.size):
                raise _bad(name, f"byte strings of {self.size} bytes", v)
        return tuple(value)


@dataclass(frozen=True)
class Failures:
    """Samples left out of a result: a list of [index, reason] pairs; a tuple of tuples."""

    hi_n: int = 16

    def read(self, name: str, value: Any) -> Any:
        if value is MISSING:
            return ()
        if not (isinstance(value, list) and len(value) <= self.hi_n):
            raise _bad(name, f"a list of <= {self.hi_n} [index, reason] pairs", value)
        out = []
        for v in value:
            ok = isinstance(v, list) and len(v) == 2 and is_int(v[0]) and 0 <= v[0] <= MAX_INT
            if not (ok and isinstance(v[1], str) and len(v[1]) <= MAX_TEXT):
                raise _bad(name, "[index, reason] pairs", v)
            out.append((v[0], v[1]))
        return tuple(out)


@dataclass(frozen=True)
class Values:
    """Control values: a map with string keys at every level, nested at most
    ``MAX_CONTROL_DEPTH`` deep, at most ``MAX_CONTROL_BYTES`` packed."""

    default: Any = MISSING

    def read(self, name: str, value: Any) -> Any:
        if value is MISSING and self.default is not MISSING:
            return self.default
        if not isinstance(value, dict):
            raise _bad(name, "a map", value)
        problem = control_problem(value)
        if problem:
            raise ProtocolError(f"field {name!r}: {problem}")
        return value


@dataclass(frozen=True)
class Tree:
    """Any map of plain values (a stats reply), nested at most 8 deep."""

    def read(self, name: str, value: Any) -> Any:
        if not isinstance(value, dict) or _depth(value, 8) is not None:
            raise _bad(name, "a map nested at most 8 deep", value)
        return value


@dataclass(frozen=True)
class Opt:
    """``inner``, or None when the field is absent (or nil)."""

    inner: Any

    def read(self, name: str, value: Any) -> Any:
        if value is MISSING or value is None:
            return None
        return self.inner.read(name, value)


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

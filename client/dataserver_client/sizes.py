"""Image sizes per batch: one fixed size, or ``MultiScale``, a schedule known ahead.

A schedule is a pure function of (seed, epoch, step): every rank computes the same size for
the same step without a word between them, and the plan book plans each prefetched batch
at its own size, so a scheduled size change costs the trainer no wait (the batch was
prepared at that size already). ``set_image_size`` replaces the schedule from the next
batch on (an unscheduled change: the batches prefetched at the old size are planned again).

What the servers' stores keep: every source fitted once to the schedule's largest size
(``stored_hw``), then fitted into each batch's size as it is composed (never stored). One
copy of each source whatever the number of sizes, so a store that holds the dataset at the
largest size serves every size from the second epoch on; the price is one resize of a
fitted source per use (far less than a decode) and pixels that went through two
interpolations for the smaller sizes.
"""

from __future__ import annotations

import operator
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from dataserver.hashing import MASK64, mix64

SIZE_SALT = 0x51_2E5  # keeps the size draw apart from every other use of (seed, epoch, n)


def _integer(value: Any) -> int | None:
    """``value`` as an int when it is an integer (numpy's too), not a bool; else None."""
    if isinstance(value, bool | np.bool_):
        return None
    try:
        return operator.index(value)
    except TypeError:
        return None


def _pair(value: Any, what: str) -> tuple[int, int]:
    """(h, w) from an int (a square) or a pair of positive ints; ValueError naming ``what``."""
    single = _integer(value)
    if single is not None:
        pair: list[int | None] = [single, single]
    elif (
        isinstance(value, Sequence | np.ndarray) and not isinstance(value, str) and len(value) == 2
    ):
        pair = [_integer(v) for v in value]
    else:
        raise ValueError(f"{what} must be an int or (h, w), got {value!r}")
    if not all(v is not None and v >= 1 for v in pair):
        raise ValueError(f"{what} must be positive integers, got {value!r}")
    return int(pair[0] or 0), int(pair[1] or 0)


def _widest(a: tuple[int, int], b: tuple[int, int] | None) -> tuple[int, int]:
    return a if b is None else (max(a[0], b[0]), max(a[1], b[1]))


@dataclass(frozen=True)
class FixedSize:
    """One size for every batch. ``store_at``: a larger size its sources are stored at (a
    size set by ``set_image_size`` keeps the stored size of the client's schedule, so its
    first batches are composed from sources the stores hold already)."""

    hw: tuple[int, int]
    store_at: tuple[int, int] | None = None

    @property
    def sizes(self) -> tuple[tuple[int, int], ...]:
        return (self.hw,)

    @property
    def stored_hw(self) -> tuple[int, int]:
        return _widest(self.hw, self.store_at)

    def size_at(self, seed: int, epoch: int, step: int) -> tuple[int, int]:
        return self.hw

    def stored_at(self, hw: tuple[int, int]) -> FixedSize:
        return FixedSize(self.hw, _widest(hw, self.store_at))

    def to_state(self) -> list[int] | dict[str, Any]:
        if self.stored_hw == self.hw:
            return [self.hw[0], self.hw[1]]
        return {"size": list(self.hw), "stored": list(self.stored_hw)}


class MultiScale:
    """``image_size=MultiScale(sizes, every=1)``: batch ``step`` of an epoch has the size
    ``sizes[draw(seed, epoch, step // every)]``: the same on every rank, held for ``every``
    steps, known ahead (so the prefetch plans it and a change costs no stall). ``sizes``:
    ints (squares) or (h, w) pairs, as YOLOX's ``random_size`` or MMDetection's
    ``BatchSyncRandomResize`` ranges list them, e.g. ``MultiScale(range(320, 641, 32),
    every=10)``."""

    def __init__(self, sizes: Sequence[int | Sequence[int]], every: int = 1) -> None:
        if isinstance(sizes, (str, bytes)) or not isinstance(sizes, Sequence | np.ndarray):
            raise ValueError(f"MultiScale: sizes must be a sequence of sizes, got {sizes!r}")
        pairs = tuple(_pair(s, f"MultiScale: size {j}") for j, s in enumerate(sizes))
        if not pairs:
            raise ValueError("MultiScale: give at least one size")
        steps = _integer(every)
        if steps is None or steps < 1:
            raise ValueError(f"MultiScale: every must be an int >= 1, got {every!r}")
        self.sizes = pairs
        self.every = steps
        self.store_at: tuple[int, int] | None = None

    @property
    def stored_hw(self) -> tuple[int, int]:
        """The size sources are fitted to and stored at: the largest height and width."""
        widest = max(h for h, _ in self.sizes), max(w for _, w in self.sizes)
        return _widest(widest, self.store_at)

    def stored_at(self, hw: tuple[int, int]) -> MultiScale:
        """The same schedule, its sources stored at least at ``hw``."""
        out = MultiScale(self.sizes, self.every)
        out.store_at = _widest(hw, self.store_at)
        return out

    def size_at(self, seed: int, epoch: int, step: int) -> tuple[int, int]:
        """The size of batch ``step`` of ``epoch``."""
        if len(self.sizes) == 1:
            return self.sizes[0]
        block = step // self.every
        draw = mix64(mix64(mix64((seed ^ SIZE_SALT) & MASK64) ^ (epoch & MASK64)) ^ block)
        return self.sizes[draw % len(self.sizes)]

    def to_state(self) -> dict[str, Any]:
        state: dict[str, Any] = {"sizes": [[h, w] for h, w in self.sizes], "every": self.every}
        if self.store_at is not None:
            state["stored"] = list(self.stored_hw)
        return state

    def __eq__(self, other: object) -> bool:
        if not isinstance(other, MultiScale):
            return NotImplemented
        return (self.sizes, self.every, self.stored_hw) == (
            other.sizes,
            other.every,
            other.stored_hw,
        )

    def __hash__(self) -> int:
        return hash((self.sizes, self.every))

    def __repr__(self) -> str:
        return f"MultiScale({[list(s) for s in self.sizes]}, every={self.every})"


SizeSchedule = FixedSize | MultiScale


def schedule_of(value: Any, what: str = "image_size") -> SizeSchedule:
    """A size schedule from what a user gives: (h, w), a ``MultiScale``, or one of their
    ``to_state()`` forms (a loaded state); ValueError naming ``what`` otherwise."""
    if isinstance(value, FixedSize | MultiScale):
        return value
    if isinstance(value, dict):
        stored = value.get("stored")
        if set(value) - {"stored"} == {"sizes", "every"}:
            multi = MultiScale(value["sizes"], value["every"])
            return multi if stored is None else multi.stored_at(_pair(stored, what))
        if set(value) == {"size", "stored"}:
            return FixedSize(_pair(value["size"], what)).stored_at(_pair(stored, what))
        raise ValueError(f"{what} must be (h, w) or a MultiScale state, got {value!r}")
    if _integer(value) is not None:
        raise ValueError(f"{what} must be (h, w) or a MultiScale, got {value!r}")
    return FixedSize(_pair(value, what))

"""Image sizes per batch: one fixed size, or a schedule known ahead: ``MultiScale`` (sizes
drawn by (seed, epoch, step)) or ``StepSizes`` (a list: batch ``step`` of every epoch has
the list's ``step``-th size, e.g. the shapes of aspect-grouped rect validation batches).

A schedule is a pure function of (seed, epoch, step): every rank computes the same size for
the same step without a word between them, and the plan book plans each prefetched batch
at its own size, so a scheduled size change costs the trainer no wait (the batch was
prepared at that size already). ``set_image_size`` replaces the schedule from the next
batch on (an unscheduled change: the batches prefetched at the old size are planned again).

What the servers' stores keep: every source fitted once to the schedule's largest size
(``stored``), then fitted into each batch's size as it is composed (never stored). One
copy of each source whatever the number of sizes, so a store that holds the dataset at the
largest size serves every size from the second epoch on; the price is one resize of a
fitted source per use (far less than a decode) and pixels that went through two
interpolations for the smaller sizes.
"""

from __future__ import annotations

import bisect
import operator
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from dataserver.hashing import MASK64, mix64

SIZE_SALT = 0x51_2E5  # keeps the size draw apart from every other use of (seed, epoch, n)
MAX_STEPS = 1 << 20  # the most steps a StepSizes lists (far beyond an epoch's batches)


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
    def stored(self) -> tuple[int, int]:
        return _widest(self.hw, self.store_at)

    def size_at(self, seed: int, epoch: int, step: int) -> tuple[int, int]:
        return self.hw

    def stored_at(self, hw: tuple[int, int]) -> FixedSize:
        return FixedSize(self.hw, _widest(hw, self.store_at))

    def to_state(self) -> list[int] | dict[str, Any]:
        if self.stored == self.hw:
            return [self.hw[0], self.hw[1]]
        return {"size": list(self.hw), "stored": list(self.stored)}


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
    def stored(self) -> tuple[int, int]:
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
            state["stored"] = list(self.stored)
        return state

    def __eq__(self, other: object) -> bool:
        if not isinstance(other, MultiScale):
            return NotImplemented
        return (self.sizes, self.every, self.stored) == (
            other.sizes,
            other.every,
            other.stored,
        )

    def __hash__(self) -> int:
        return hash((self.sizes, self.every))

    def __repr__(self) -> str:
        return f"MultiScale({[list(s) for s in self.sizes]}, every={self.every})"


class StepSizes:
    """``image_size=StepSizes(sizes)``: batch ``step`` of every epoch has the size
    ``sizes[step]``; the steps past the list's end keep its last size. ``sizes``: ints
    (squares) or (h, w) pairs, at most ``MAX_STEPS`` (2**20) of them; a rank's own list
    (each rank may list its own sizes, e.g. the shapes of its own aspect-grouped batches,
    as Ultralytics' rect validation has them). Known ahead, as ``MultiScale``: the
    prefetch plans each batch at its size, so a change of size costs no batch planned
    again (``set_image_size`` before each batch would). Sources are stored at the largest
    height and width (``stored``).

    Held as runs of equal sizes (its state too: ``{"steps": [[h, w, count], ...]}``). A
    job-wide state (gathered or merged) carries rank 0's schedule for every rank: lists
    that differ by rank resume from each rank's own ``state_dict(gather=False)``."""

    def __init__(self, sizes: Sequence[int | Sequence[int]] | np.ndarray) -> None:
        if isinstance(sizes, (str, bytes)) or not isinstance(sizes, Sequence | np.ndarray):
            raise ValueError(f"StepSizes: sizes must be a sequence of sizes, got {sizes!r}")
        if len(sizes) == 0:
            raise ValueError("StepSizes: give at least one size")
        if len(sizes) > MAX_STEPS:
            raise ValueError(f"StepSizes: at most {MAX_STEPS} steps, got {len(sizes)}")
        runs: list[tuple[tuple[int, int], int]] = []
        for j, s in enumerate(sizes):
            hw = _pair(s, f"StepSizes: size {j}")
            if runs and runs[-1][0] == hw:
                runs[-1] = (hw, runs[-1][1] + 1)
            else:
                runs.append((hw, 1))
        self._set_runs(runs)

    def _set_runs(self, runs: Sequence[tuple[tuple[int, int], int]]) -> None:
        merged: list[tuple[tuple[int, int], int]] = []
        for hw, count in runs:
            if merged and merged[-1][0] == hw:
                merged[-1] = (hw, merged[-1][1] + count)
            else:
                merged.append((hw, count))
        self.runs = tuple(merged)
        ends, total = [], 0
        for _, count in merged:
            total += count
            ends.append(total)
        self._ends = tuple(ends)
        self.store_at: tuple[int, int] | None = None

    @classmethod
    def from_runs(cls, runs: Any, what: str = "StepSizes") -> StepSizes:
        """A schedule from its runs ``[[h, w, count], ...]`` (a state's ``steps``);
        ValueError naming ``what`` for anything else."""
        if isinstance(runs, (str, bytes)) or not isinstance(runs, Sequence) or not runs:
            raise ValueError(f"{what}: steps must be a non-empty list of [h, w, count]")
        if len(runs) > MAX_STEPS:
            raise ValueError(f"{what}: at most {MAX_STEPS} steps, got {len(runs)} runs")
        out: list[tuple[tuple[int, int], int]] = []
        total = 0
        for j, run in enumerate(runs):
            if isinstance(run, (str, bytes)) or not isinstance(run, Sequence) or len(run) != 3:
                raise ValueError(f"{what}: run {j} must be [h, w, count], got {run!r}")
            hw = _pair(run[:2], f"{what}: run {j}")
            count = _integer(run[2])
            if count is None or count < 1:
                raise ValueError(f"{what}: run {j} count must be an int >= 1, got {run[2]!r}")
            total += count
            if total > MAX_STEPS:
                raise ValueError(f"{what}: at most {MAX_STEPS} steps, got more")
            out.append((hw, count))
        schedule = cls.__new__(cls)
        schedule._set_runs(out)
        return schedule

    @property
    def steps(self) -> tuple[tuple[int, int], ...]:
        """The size of each listed step."""
        return tuple(hw for hw, count in self.runs for _ in range(count))

    def __len__(self) -> int:
        """The steps listed (those after them keep the last size)."""
        return self._ends[-1]

    @property
    def sizes(self) -> tuple[tuple[int, int], ...]:
        """Every distinct size, in the order the steps first have it."""
        return tuple(dict.fromkeys(hw for hw, _ in self.runs))

    @property
    def stored(self) -> tuple[int, int]:
        """The size sources are fitted to and stored at: the largest height and width."""
        widest = max(h for h, _ in self.sizes), max(w for _, w in self.sizes)
        return _widest(widest, self.store_at)

    def stored_at(self, hw: tuple[int, int]) -> StepSizes:
        """The same schedule, its sources stored at least at ``hw``."""
        out = StepSizes.__new__(StepSizes)
        out._set_runs(self.runs)
        out.store_at = _widest(hw, self.store_at)
        return out

    def size_at(self, seed: int, epoch: int, step: int) -> tuple[int, int]:
        """The size of batch ``step`` (of any epoch): the listed one, else the last."""
        at = bisect.bisect_right(self._ends, max(0, step))
        return self.runs[min(at, len(self.runs) - 1)][0]

    def to_state(self) -> dict[str, Any]:
        state: dict[str, Any] = {"steps": [[h, w, n] for (h, w), n in self.runs]}
        if self.store_at is not None:
            state["stored"] = list(self.stored)
        return state

    def __eq__(self, other: object) -> bool:
        if not isinstance(other, StepSizes):
            return NotImplemented
        return (self.runs, self.stored) == (other.runs, other.stored)

    def __hash__(self) -> int:
        return hash(self.runs)

    def __repr__(self) -> str:
        """A Python expression that builds it again (a run of sizes as a repeated list)."""
        parts = [f"[{[h, w]}]" + (f" * {n}" if n > 1 else "") for (h, w), n in self.runs]
        return f"StepSizes({' + '.join(parts)})"


SizeSchedule = FixedSize | MultiScale | StepSizes


def schedule_of(value: Any, what: str = "image_size") -> SizeSchedule:
    """A size schedule from what a user gives: (h, w), a ``MultiScale``, a ``StepSizes``,
    or one of their ``to_state()`` forms (a loaded state); ValueError naming ``what``
    otherwise."""
    if isinstance(value, FixedSize | MultiScale | StepSizes):
        return value
    if isinstance(value, dict):
        stored = value.get("stored")
        if set(value) - {"stored"} == {"sizes", "every"}:
            multi = MultiScale(value["sizes"], value["every"])
            return multi if stored is None else multi.stored_at(_pair(stored, what))
        if set(value) - {"stored"} == {"steps"}:
            steps = StepSizes.from_runs(value["steps"], what)
            return steps if stored is None else steps.stored_at(_pair(stored, what))
        if set(value) == {"size", "stored"}:
            return FixedSize(_pair(value["size"], what)).stored_at(_pair(stored, what))
        raise ValueError(f"{what} must be (h, w) or a MultiScale or StepSizes state, got {value!r}")
    if _integer(value) is not None:
        raise ValueError(f"{what} must be (h, w), a MultiScale or a StepSizes, got {value!r}")
    return FixedSize(_pair(value, what))

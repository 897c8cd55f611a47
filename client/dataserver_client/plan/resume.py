"""Resume states: where the trainer stands (``Position``, the plan book's snapshot), what a
``state_dict`` holds, the job-wide view of one, and elastic resume (loading a state saved by
a job of N ranks into a job of M ranks); and this rank's shard of an epoch (``epoch_shard``,
its share of a deal). Pure: no sockets, no threads, no torch.

**The global view of an epoch.** A job of N ranks reads the epoch's order padded or
trimmed as DistributedSampler does (``epoch.global_order``: N x shard_size positions);
rank r owns the global positions r, r + N, r + 2N, ... in that order. A rank whose first
untaken batch starts at shard position p has delivered its first p positions.

**What counts as delivered** when the ranks are not in lockstep (rank 0 had taken 5
batches, rank 1 only 4): a sample is delivered iff ``next()`` had returned its batch on
its rank before that rank's ``state_dict()`` call. Each rank's position is its own.

**A deal** is a set U of undelivered global positions (of the order of a job of
``plan_world`` ranks) shared round-robin by a job of M ranks: rank j takes U[j], U[j+M],
... in epoch order, each position once and nothing padded. A normal epoch is the implicit
deal "everything, M = N". A deal's epoch saved again describes its undelivered set the
same way (positions into each rank's share), so an elastic job can itself be resumed
elastically, or exactly at the same size. U is held as what made it, never as a list:
per saving, each rank's undelivered interval of its own share (``IntervalDeal``, its
``Level``s: O(world size), whatever N), the k-th position of U and of a rank's share
computed on demand. States of before issue 28 (``LEGACY_VERSIONS``: the table-shuffled
order, a bitmap deal) load and finish their epoch as they were saved.

**Equal batch counts.** With R positions over M ranks the first R mod M ranks hold one
sample more (the *spare*). A rank holding the spare cuts its batches as if it had not got
it and adds it to its last batch (``epoch.Cursor.plan_at``), so when the ranks take the
same modes (``feedback(sync=True)``) every rank ends the epoch on the same step, which DDP
and the feedback all-reduce need. Only when R < M do some ranks get no batch at all.

Over the house's ~500 lines (about 760): the resume state's format, its checks, merging
ranks' states and the elastic deals change together (a new state version touches each); pure
functions and records.
"""

from __future__ import annotations

import zlib
from abc import ABC, abstractmethod
from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import msgpack
import numpy as np

from dataserver.protocol import MAX_INT, control_problem
from dataserver.protocol.messages import MAX_SEQ
from dataserver_client.plan.epoch import MODES, epoch_order, legacy_order, shard_of, shard_size
from dataserver_client.plan.order import IndexSeq, Shard, Strided, TableOrder
from dataserver_client.plan.sizes import schedule_of

if TYPE_CHECKING:
    from dataserver_client.config import ClientConfig

# States saved before issue 28: their epoch in ``epoch.legacy_order`` (a table shuffle), a
# dealt one's deal a bitmap (``BitmapDeal``). Loaded and finished as they were saved.
LEGACY_STATE_VERSION = 1  # a normal epoch
LEGACY_DEALT_VERSION = 2  # a dealt epoch
LEGACY_VERSIONS = (LEGACY_STATE_VERSION, LEGACY_DEALT_VERSION)
# States of this client: the epoch order computed per position (``order.py``); older clients
# must refuse them (their order is another), not misread them.
STATE_VERSION = 3  # a normal epoch
DEALT_VERSION = 4  # a dealt epoch (``IntervalDeal``)
VERSIONS = (*LEGACY_VERSIONS, STATE_VERSION, DEALT_VERSION)
DEALT_VERSIONS = (LEGACY_DEALT_VERSION, DEALT_VERSION)

# Must be equal between the saving and the loading client (rank and world_size may differ).
CONFIG_KEYS = (
    "seed",
    "shuffle",
    "batch_size",
    "stitch_k",
    "stitch_layout",
    "drop_last",
    "pad_value",
    "letterbox",
    "fit",
    "augment",
    "mosaic_partners",
    "mosaic_p",
)
# What a state saved before a key of CONFIG_KEYS existed meant by its absence.
CONFIG_DEFAULTS: dict[str, Any] = {
    "pad_value": 0,
    "letterbox": "top-left",
    "fit": "letterbox",
    "augment": True,
    "mosaic_partners": "consume",
    "mosaic_p": 1.0,
}
# What each rank contributes to a job-wide state ("ranks": one of these per rank).
RANK_KEYS = ("position", "step", "mode", "control", "control_seq", "feedback_seq")
# The most an epoch number or a sequence number of a loaded state may be: far beyond any
# run, and as much room again to count on before the protocol's bound on sequence numbers.
MAX_COUNT = MAX_SEQ // 2
# The most ranks a loaded state may hold, and the most bytes its ranks' control values may
# take together (packed): a 10,000-rank job's state passes with room; a state of 100,000
# ranks is refused by its size before any entry is read.
MAX_STATE_RANKS = 1 << 16
MAX_STATE_CONTROL_BYTES = 64 << 20
# The most levels a deal may have (each an elastic resume of the same epoch, saved again):
# far beyond any job's; and the most ranks' positions all levels may hold together: a bound
# on what loading a state may cost.
MAX_DEAL_LEVELS = 64
MAX_DEAL_POSITIONS = 4 * MAX_STATE_RANKS


def version_of(dealt: bool, legacy: bool) -> int:
    """The version of a state of a normal or ``dealt`` epoch (``legacy``: an epoch resumed
    from a legacy state, in its order of then, is saved as such a state again)."""
    if legacy:
        return LEGACY_DEALT_VERSION if dealt else LEGACY_STATE_VERSION
    return DEALT_VERSION if dealt else STATE_VERSION


class Deal(ABC):
    """The undelivered global positions of an epoch (of the order of a job of
    ``plan_world`` ranks: ``total`` positions), ``count`` of them, dealt round-robin to the
    ranks (``share``). ``IntervalDeal``: what this client deals; ``BitmapDeal``: the deal of
    a state of version 2 (``LEGACY_VERSIONS``)."""

    plan_world: int
    legacy = False  # a deal of a legacy state (its epoch in ``epoch.legacy_order``)

    @property
    @abstractmethod
    def total(self) -> int:
        """The global positions of the epoch (of a job of ``plan_world`` ranks)."""

    @property
    @abstractmethod
    def count(self) -> int:
        """The undelivered ones."""

    @abstractmethod
    def positions(self) -> IndexSeq:
        """The undelivered global positions, in epoch order."""

    @abstractmethod
    def to_state(self) -> dict[str, Any]:
        """Plain data, as a state holds it."""

    def share(self, rank: int, world_size: int) -> IndexSeq:
        """Rank ``rank`` of ``world_size``'s positions: every ``world_size``-th undelivered
        one, from its own (computed per position, as the deal's ``positions``)."""
        return Shard(self.positions(), Strided(rank, world_size, self.share_len(rank, world_size)))

    def share_len(self, rank: int, world_size: int) -> int:
        """How many positions ``share`` holds."""
        return self.count // world_size + self.spare(rank, world_size)

    def spare(self, rank: int, world_size: int) -> int:
        """1 when this rank holds one sample more than the ranks without a spare."""
        return int(rank < self.count % world_size)


def deal_from_state(state: Any, dataset_len: int, drop_last: bool, legacy: bool = False) -> Deal:
    """Decode a state's ``deal`` (``legacy``: of a state of version 2, a bitmap), checking it
    against the dataset."""
    if legacy:
        return BitmapDeal.from_state(state, dataset_len, drop_last)
    return IntervalDeal.from_state(state, dataset_len, drop_last)


class Level:
    """One saving of an epoch by a job of ``world`` ranks that read a sequence of ``length``
    positions round-robin (rank r: its positions r, r + world, ...: ``length // world`` of
    them, one more for the first ``length % world`` ranks), rank r having delivered the first
    ``done[r]`` of its own. What it left undelivered is, per rank, one interval of its own
    positions (done[r] .. its end); ``at(k)`` is the k-th of their union in sequence order.

    In sequence order the union is read row by row (row i: positions i x world ..
    i x world + world - 1), row i holding the ranks whose ``done`` is at most i (in rank
    order; the last row only the ranks that reach it). Between two consecutive values of
    ``done`` the rows hold the same ranks: at most world + 2 segments, each a count of rows
    and a count of ranks, so ``at`` costs a binary search over the segments and, once per
    segment met, a pass over the ranks (``_ranks``, the last few kept). O(world) memory,
    whatever the length."""

    KEEP = 8  # segments' rank lists kept (a share is read forward: few are in use at once)

    def __init__(self, world: int, length: int, done: Sequence[int]) -> None:
        if len(done) != world:
            raise ValueError(f"a state of {world} ranks has {len(done)} positions")
        self.world, self.length = world, length
        self.done = np.array([int(p) for p in done], dtype=np.int64)
        rows, extra = divmod(length, world)
        self._rows, self._extra = rows, extra
        own = rows + (np.arange(world) < extra)  # each rank's positions
        bad = np.flatnonzero((self.done < 0) | (self.done > own))
        if bad.size:
            r = int(bad[0])
            raise ValueError(f"rank {r}'s position {int(self.done[r])} is not in 0..{int(own[r])}")
        self.count = int((own - self.done).sum())
        last = rows + (extra > 0)  # the rows there are
        bounds = np.unique(np.concatenate([[0, rows, last], self.done]))
        starts = bounds[:-1]
        full = np.searchsorted(np.sort(self.done), starts, side="right")
        part = np.searchsorted(np.sort(self.done[:extra]), starts, side="right")
        self._starts = starts
        self._active = np.where(starts < rows, full, part)  # ranks in each segment's rows
        counts = self._active * (bounds[1:] - starts)
        self._cum = np.concatenate([[0], np.cumsum(counts)])  # positions before each segment
        self._kept: dict[int, np.ndarray] = {}

    def _ranks(self, segment: int) -> np.ndarray:
        """The ranks in the rows of ``segment``, in rank order."""
        ranks = self._kept.get(segment)
        if ranks is None:
            row = int(self._starts[segment])
            mask = self.done <= row
            if row >= self._rows:
                mask[self._extra :] = False
            ranks = np.flatnonzero(mask)
            if len(self._kept) >= self.KEEP:
                del self._kept[next(iter(self._kept))]
            self._kept[segment] = ranks
        return ranks

    def at(self, k: np.ndarray) -> np.ndarray:
        """The sequence positions of the undelivered ones ``k`` (each in 0..count-1)."""
        k = np.asarray(k, dtype=np.int64)
        segment = np.searchsorted(self._cum, k, side="right") - 1
        offset = k - self._cum[segment]
        active = self._active[segment]
        row = self._starts[segment] + offset // active
        slot = offset % active
        rank = np.empty_like(k)
        for s in np.unique(segment).tolist():
            where = segment == s
            rank[where] = self._ranks(s)[slot[where]]
        return rank + row * self.world


class Undelivered(IndexSeq):
    """An ``IntervalDeal``'s undelivered global positions: the last level's k-th, mapped
    through every level before it down to a global position."""

    def __init__(self, levels: tuple[Level, ...]) -> None:
        self.levels = levels

    def __len__(self) -> int:
        return self.levels[-1].count

    def at(self, positions: np.ndarray) -> np.ndarray:
        out = np.asarray(positions, dtype=np.int64)
        for level in reversed(self.levels):
            out = level.at(out)
        return out


class IntervalDeal(Deal):
    """A deal as the savings that made it (``levels``): the first, a job of ``plan_world``
    ranks reading the epoch's ``total`` global positions; each later one, a job reading the
    undelivered positions of the one before (a dealt epoch saved again and dealt again).
    Each level is its ranks' positions: O(world size) per level, never O(N); a position's
    global position is computed through the levels (``Undelivered``)."""

    def __init__(self, plan_world: int, total: int, levels: Sequence[Level]) -> None:
        if not levels:
            raise ValueError("a deal needs a level")
        self.plan_world, self._total, self.levels = plan_world, total, tuple(levels)
        self._positions = Undelivered(self.levels)

    @property
    def total(self) -> int:
        return self._total

    @property
    def count(self) -> int:
        return self.levels[-1].count

    def positions(self) -> IndexSeq:
        return self._positions

    def to_state(self) -> dict[str, Any]:
        """Plain data: each level's world size and ranks' positions (lengths follow)."""
        return {
            "plan_world_size": self.plan_world,
            "count": self.count,
            "levels": [
                {"world_size": lv.world, "positions": lv.done.tolist()} for lv in self.levels
            ],
        }

    @classmethod
    def from_state(cls, state: Any, dataset_len: int, drop_last: bool) -> IntervalDeal:
        """Decode ``to_state``'s output, checking it against the dataset (a position beyond
        its rank's share, a count that does not match, too many levels are refused)."""
        if not isinstance(state, dict):
            raise ValueError("state 'deal' is not a dict")
        world, count, levels = (
            state.get("plan_world_size"),
            state.get("count"),
            state.get("levels"),
        )
        if not isinstance(world, int) or not 1 <= world <= MAX_STATE_RANKS:
            raise ValueError("state 'deal' has no valid plan_world_size")
        if not isinstance(levels, list) or not 1 <= len(levels) <= MAX_DEAL_LEVELS:
            raise ValueError(f"state 'deal' 'levels' must be a list of 1..{MAX_DEAL_LEVELS}")
        total = world * shard_size(dataset_len, world, drop_last)
        out: list[Level] = []
        length, held = total, 0
        for i, entry in enumerate(levels):
            level = level_of(f"state 'deal' level {i}", entry, length)
            held += level.world
            if held > MAX_DEAL_POSITIONS:
                raise ValueError(
                    f"state 'deal' levels hold more than {MAX_DEAL_POSITIONS} ranks' positions"
                )
            out.append(level)
            length = level.count
        if count != length:
            raise ValueError("state 'deal' does not match its count")
        return cls(world, total, out)


def level_of(where: str, entry: Any, length: int) -> Level:
    """A level of a state's deal (``IntervalDeal.to_state``), reading ``length`` positions."""
    ranks = entry.get("world_size") if isinstance(entry, dict) else None
    done = entry.get("positions") if isinstance(entry, dict) else None
    if not isinstance(ranks, int) or not 1 <= ranks <= MAX_STATE_RANKS:
        raise ValueError(f"{where} has no valid world_size")
    if not isinstance(done, list) or len(done) != ranks:
        raise ValueError(f"{where} is not one position per rank of {ranks}")
    for p in done:
        check_count(where, "positions", p, MAX_INT)
    try:
        return Level(ranks, length, done)
    except ValueError as exc:
        raise ValueError(f"{where} does not fit this dataset: {exc}") from None


@dataclass(frozen=True, eq=False)
class BitmapDeal(Deal):
    """The deal of a state of version 2 (before issue 28): a bool per global position
    (``mask``), O(N). Kept to finish such an epoch exactly as it was dealt (in its legacy
    order), and saved again as it was."""

    plan_world: int
    mask: np.ndarray
    legacy = True

    @property
    def total(self) -> int:
        return len(self.mask)

    @property
    def count(self) -> int:
        return int(self.mask.sum())

    def positions(self) -> IndexSeq:
        return TableOrder(np.flatnonzero(self.mask))

    def to_state(self) -> dict[str, Any]:
        """Plain data: a zlib-compressed bitmap (``np.packbits``, big-endian bit order)."""
        packed = np.packbits(self.mask).tobytes()
        return {
            "plan_world_size": self.plan_world,
            "count": self.count,
            "undelivered": zlib.compress(packed, 9),
        }

    @classmethod
    def from_state(cls, state: Any, dataset_len: int, drop_last: bool) -> BitmapDeal:
        """Decode ``to_state``'s output, checking it against the dataset (a bitmap of the
        wrong length, or a count that does not match, is refused)."""
        if not isinstance(state, dict):
            raise ValueError("state 'deal' is not a dict")
        world, count, data = (
            state.get("plan_world_size"),
            state.get("count"),
            state.get("undelivered"),
        )
        if not isinstance(world, int) or world < 1 or not isinstance(data, bytes):
            raise ValueError("state 'deal' is malformed")
        if world > MAX_STATE_RANKS:  # its bitmap would be sized by it: bounded first
            raise ValueError(
                f"state 'deal' 'plan_world_size' {world} is more than {MAX_STATE_RANKS} ranks"
            )
        total = world * shard_size(dataset_len, world, drop_last)
        nbytes = (total + 7) // 8
        try:
            inflate = zlib.decompressobj()
            packed = inflate.decompress(data, nbytes + 1)  # bounded: no zip bomb
        except zlib.error as exc:
            raise ValueError(f"state 'deal' bitmap is corrupt: {exc}") from None
        if len(packed) != nbytes or inflate.unconsumed_tail:
            raise ValueError("state 'deal' bitmap does not fit this dataset")
        mask = np.unpackbits(np.frombuffer(packed, np.uint8), count=total).astype(bool)
        if int(mask.sum()) != count:
            raise ValueError("state 'deal' bitmap does not match its count")
        return cls(world, mask)


def epoch_shard(
    config: ClientConfig,
    dataset_len: int,
    epoch: int,
    deal: Deal | None = None,
    legacy: bool = False,
) -> tuple[Shard, int]:
    """This rank's shard of ``epoch`` (its share of ``deal``, with one) and its spare (see
    ``epoch.Cursor``). Lazy: the order is computed per position as batches are planned
    (``order.py``), so this costs microseconds whatever the dataset's size. ``legacy`` (or
    a legacy deal): the epoch of a state of version 1 or 2, in its order of then
    (``epoch.legacy_order``: the whole permutation, O(N)); the client runs this in the
    trainer's thread, so the I/O thread never stops serving heartbeats for it."""
    if legacy or (deal is not None and deal.legacy):
        order: IndexSeq = TableOrder(legacy_order(dataset_len, config.seed, epoch, config.shuffle))
    else:
        order = epoch_order(dataset_len, config.seed, epoch, config.shuffle)
    if deal is None:
        return shard_of(order, config.rank, config.world_size, config.drop_last), 0
    return Shard(order, deal.share(config.rank, config.world_size)), deal.spare(
        config.rank, config.world_size
    )


@dataclass(frozen=True)
class Position:
    """Where the trainer stands (the plan book's ``position``, what a state is made of):
    the first batch it has not taken (its position in this rank's share of the epoch's
    deal, when the epoch has one), and the plan's values."""

    epoch: int
    position: int
    step: int
    mode: str
    control: dict[str, Any]
    control_seq: int
    deal: dict[str, Any] | None
    share: int | None  # samples in this rank's share of the epoch (None: no epoch yet)
    image_size: list[int] | dict[str, Any]  # the size schedule, as a state holds it


def undelivered(
    dataset_len: int,
    drop_last: bool,
    world_size: int,
    positions: Sequence[int],
    deal: Deal | None,
    legacy: bool = False,
) -> Deal:
    """What a job of ``world_size`` ranks, rank r at shard position ``positions[r]`` of its
    share (of ``deal``, or of a normal epoch), has not yet delivered: an ``IntervalDeal``
    (``deal``'s levels and one more), O(world size); for an epoch of a legacy state
    (``legacy``, or a legacy deal), a ``BitmapDeal`` as such a state's client made it."""
    if len(positions) != world_size:
        raise ValueError(f"a state of {world_size} ranks has {len(positions)} positions")
    plan_world = deal.plan_world if deal is not None else world_size
    total = plan_world * shard_size(dataset_len, plan_world, drop_last)
    if legacy or (deal is not None and deal.legacy):
        mask = np.zeros(total, dtype=bool)
        for rank, position in enumerate(positions):
            own = (
                Strided(rank, world_size, total // world_size)
                if deal is None
                else deal.share(rank, world_size)
            )[:]
            if not 0 <= position <= len(own):
                raise ValueError(f"rank {rank}'s position {position} is not in 0..{len(own)}")
            mask[own[position:]] = True
        return BitmapDeal(plan_world, mask)
    if isinstance(deal, IntervalDeal):
        return IntervalDeal(
            plan_world, total, [*deal.levels, Level(world_size, deal.count, positions)]
        )
    return IntervalDeal(plan_world, total, [Level(world_size, total, positions)])


def check_state(state: Any, expected: dict[str, Any]) -> None:
    """Refuse a state that is not ours or was saved for other data, naming what differs
    (``expected``: the loading client's values of ``CONFIG_KEYS``, ``fingerprint`` and
    ``dataset_len``). The state's ``image_size`` (the size schedule it goes on with) must
    be one."""
    check_version(state)
    check_size(state)
    mismatched = [k for k in CONFIG_KEYS if config_value(state, k) != expected[k]]
    if state.get("fingerprint") != expected["fingerprint"]:
        mismatched.append("fingerprint (dataset)")
    if state.get("dataset_len") != expected["dataset_len"]:
        mismatched.append("dataset_len")
    if mismatched:
        raise ValueError(f"state does not match this client: {', '.join(mismatched)} differ")
    schedule_of(state.get("image_size"), "state 'image_size'")
    world, rank = state.get("world_size"), state.get("rank")
    if not isinstance(world, int) or not isinstance(rank, int) or not 0 <= rank < world:
        raise ValueError("state has no valid rank and world_size")
    ranks = state.get("ranks")
    if ranks is not None and (
        not isinstance(ranks, list)
        or len(ranks) != world
        or not all(isinstance(e, dict) and all(k in e for k in RANK_KEYS) for e in ranks)
    ):
        raise ValueError(f"state 'ranks' is not one entry per rank of {world}")
    check_count("state", "epoch", state.get("epoch"), MAX_COUNT)
    if ranks is None:
        check_entry("state", state)
    total = 0
    for r, entry in enumerate(ranks or ()):
        total += check_entry(f"state 'ranks'[{r}]", entry)
        if total > MAX_STATE_CONTROL_BYTES:
            raise ValueError(
                f"state 'ranks' hold more than {MAX_STATE_CONTROL_BYTES} bytes of control "
                f"values (at rank {r})"
            )
    check_parts(state)


# What a job-wide state's own fields must agree on with its entry in ``ranks`` (its rank's
# part, copied there by ``state_dict``); the control values are left out (a NaN is not
# equal to itself), the rest decide what is delivered.
OWN_KEYS = ("position", "step", "mode", "control_seq", "feedback_seq")


def check_parts(state: dict[str, Any]) -> None:
    """Refuse a state whose parts disagree, naming the field (its entries each checked by
    ``check_entry`` already, its dataset and configuration the loading client's): what
    ``state_dict`` writes always agrees, so a state that does not was altered, and loading
    it could deliver fewer samples than it says remain (issue 39: an empty epoch, silently).

    - its own fields and its entry in ``ranks`` (``OWN_KEYS``);
    - its deal (``check_deal``): the levels' world sizes and the job's, and an epoch with
      samples;
    - every rank's position within its share of the epoch (of the deal, when the epoch has
      one), and its step within the batches that position allows, not only the loading
      rank's: an elastic resume deals what every rank left.
    """
    world, rank = state["world_size"], state["rank"]
    ranks: list[dict[str, Any]] | None = state.get("ranks")
    if ranks is not None:
        own = ranks[rank]
        for key in OWN_KEYS:
            if key in state and state[key] != own[key]:
                raise ValueError(
                    f"state 'ranks'[{rank}] {key!r} is {own[key]!r} but the state's own {key!r} "
                    f"(rank {rank}'s) is {state[key]!r}"
                )
    dataset_len, drop_last = int(state["dataset_len"]), bool(state["drop_last"])
    legacy = state["version"] in LEGACY_VERSIONS
    deal_state = state.get("deal")
    deal = (
        None if deal_state is None else deal_from_state(deal_state, dataset_len, drop_last, legacy)
    )
    if isinstance(deal, IntervalDeal):
        check_deal(deal, world)
    own_only = ranks is None  # a one-rank state: its own fields are its rank's entry
    # (A legacy bitmap counts its deal in O(N): counted once, each rank's share from it.)
    count = None if deal is None else deal.count
    for r, entry in [(rank, state)] if ranks is None else enumerate(ranks):
        where = "state" if own_only else f"state 'ranks'[{r}]"
        if count is None:
            share = shard_size(dataset_len, world, drop_last)
        else:  # as Deal.share_len
            share = count // world + int(r < count % world)
        position, step = int(entry["position"]), int(entry["step"])
        if position > share:
            raise ValueError(
                f"{where} 'position' {position} is not in 0..{share} (rank {r}'s share of the "
                f"epoch, of {world} ranks)"
            )
        most = position if deal is None else deal.total
        if step > most:
            raise ValueError(
                f"{where} 'step' {step} is not in 0..{most} (batches rank {r} can have taken)"
            )


def check_deal(deal: IntervalDeal, world: int) -> None:
    """A deal as ``undelivered`` makes them: its first level is the job of ``plan_world``
    ranks that saved a normal epoch with samples in it, something of it delivered (else the
    resume starts a normal epoch, not a deal); each later level, and the job of ``world``
    ranks that holds the deal, is of another world size than the level before (a deal is
    made only by a resume on another number of ranks)."""
    first = deal.levels[0]
    if first.world != deal.plan_world:
        raise ValueError(
            f"state 'deal' 'levels'[0] 'world_size' {first.world} is not its "
            f"'plan_world_size' {deal.plan_world}"
        )
    if deal.total == 0:
        raise ValueError(
            f"state 'deal' 'plan_world_size' {deal.plan_world} leaves the epoch no sample "
            "(a deal of an empty epoch is never made)"
        )
    if not first.done.any():
        raise ValueError(
            "state 'deal' 'levels'[0] 'positions' are all 0: nothing was delivered, and a "
            "deal is made only once something was"
        )
    for i in range(1, len(deal.levels)):
        if deal.levels[i].world == deal.levels[i - 1].world:
            raise ValueError(
                f"state 'deal' 'levels'[{i}] 'world_size' {deal.levels[i].world} is that of "
                f"the level before (a deal is made only by a resume on another world size)"
            )
    if deal.levels[-1].world == world:
        raise ValueError(
            f"state 'world_size' {world} is that of its deal's last level (a deal is made "
            "only by a resume on another world size)"
        )


def check_version(state: Any) -> None:
    """A state of one of ``VERSIONS``, with a deal iff its version is of a dealt epoch."""
    if not isinstance(state, dict) or state.get("version") not in VERSIONS:
        raise ValueError(
            f"not a DataServerClient state of version {' or '.join(map(str, VERSIONS))}"
        )
    if (state.get("deal") is not None) != (state["version"] in DEALT_VERSIONS):
        raise ValueError(f"state 'deal' does not match its version {state['version']}")


def check_size(state: dict[str, Any]) -> None:
    """Refuse a state larger than any job's (``MAX_STATE_RANKS``) before reading its
    entries: its ``world_size`` and its number of ``ranks`` entries."""
    world, ranks = state.get("world_size"), state.get("ranks")
    if isinstance(world, int) and not isinstance(world, bool) and world > MAX_STATE_RANKS:
        raise ValueError(f"state 'world_size' {world} is more than {MAX_STATE_RANKS} ranks")
    if isinstance(ranks, list) and len(ranks) > MAX_STATE_RANKS:
        raise ValueError(f"state 'ranks' has {len(ranks)} entries, more than {MAX_STATE_RANKS}")


def config_value(state: dict[str, Any], key: str) -> Any:
    """The value of ``key`` (of ``CONFIG_KEYS``) a state was saved with: its own, or, for a
    state saved before the key existed, what its absence meant (``CONFIG_DEFAULTS``)."""
    return state.get(key, CONFIG_DEFAULTS.get(key))


def check_count(where: str, key: str, value: Any, hi: int) -> None:
    """``value`` (field ``key`` of ``where``) must be an integer in 0..``hi``."""
    if isinstance(value, bool) or not isinstance(value, int | np.integer) or not 0 <= value <= hi:
        shown = repr(value) if len(repr(value)) <= 40 else repr(value)[:37] + "..."
        raise ValueError(f"{where} {key!r} must be an integer in 0..{hi}, got {shown}")


def check_entry(where: str, entry: dict[str, Any]) -> int:
    """One rank's part of a state (``RANK_KEYS``), each field by type and range (position and
    step against the epoch: ``plan_resume``); the bytes of its control values, packed."""
    for key in RANK_KEYS:
        if key not in entry:
            raise ValueError(f"{where} has no {key!r}")
    for key in ("position", "step"):
        check_count(where, key, entry[key], MAX_INT)
    for key in ("control_seq", "feedback_seq"):
        check_count(where, key, entry[key], MAX_COUNT)
    if entry["mode"] not in MODES:
        raise ValueError(f"{where} 'mode' must be one of {MODES}, got {entry['mode']!r}")
    control = entry["control"]
    problem = "not a dict" if not isinstance(control, dict) else control_problem(control)
    if problem is not None:
        raise ValueError(f"{where} 'control' is not valid control values: {problem}")
    return len(msgpack.packb(control, use_bin_type=True))


def merge_states(states: Sequence[dict[str, Any]]) -> dict[str, Any]:
    """One job-wide state from the states of every rank of a job (any order): rank 0's
    state with ``"ranks"``, each rank's position, step, mode, control values and
    feedback_seq. They must be of one epoch, one configuration and one deal."""
    if not states:
        raise ValueError("merge_states needs the state of every rank")
    by_rank: dict[int, dict[str, Any]] = {}
    first = states[0]
    world = first.get("world_size") if isinstance(first, dict) else None
    for state in states:
        if not isinstance(state, dict):
            raise ValueError("merge_states takes DataServerClient states (dicts)")
        rank = state.get("rank")
        if state.get("world_size") != world or not isinstance(rank, int):
            raise ValueError("states of different world sizes cannot be merged")
        if rank in by_rank:
            raise ValueError(f"two states of rank {rank}")
        for key in ("version", "epoch", "fingerprint", "deal", "dataset_len", *CONFIG_KEYS):
            if config_value(state, key) != config_value(first, key):
                raise ValueError(f"states differ in {key!r}: not one job's")
        by_rank[rank] = state
    if not isinstance(world, int) or sorted(by_rank) != list(range(world)):
        raise ValueError(
            f"merge_states needs one state per rank 0..{world}-1, got {sorted(by_rank)}"
        )
    ranks = [{k: by_rank[r][k] for k in RANK_KEYS} for r in range(world)]
    return {**by_rank[0], "ranks": ranks}


def plan_resume(state: dict[str, Any], rank: int, world_size: int) -> dict[str, Any]:
    """Where rank ``rank`` of a job of ``world_size`` ranks goes on from a checked state:
    ``{epoch, position, step, deal, legacy, mode, control, control_seq, feedback_seq,
    image_size}`` (the size schedule: the state's own, job-wide; ``legacy``: a state of
    ``LEGACY_VERSIONS``, whose epoch goes on in ``epoch.legacy_order``).

    Same world size: each rank goes on from its own entry, exactly as an unbroken run
    would. Another world size: the job's undelivered positions are dealt to the new ranks,
    which go on in the mode, control values, step and feedback_seq of rank 0; a state in
    which nothing was delivered yet starts a normal epoch of the new world size.
    """
    saved_world, saved_rank = state["world_size"], state["rank"]
    ranks: list[dict[str, Any]] | None = state.get("ranks")
    if ranks is None and saved_world == 1:
        ranks = [{k: state[k] for k in RANK_KEYS}]  # one rank's state is the job's
    dataset_len, drop_last = int(state["dataset_len"]), bool(state["drop_last"])
    deal_state = state.get("deal")
    legacy = state["version"] in LEGACY_VERSIONS  # its epoch goes on in its order of then
    deal = (
        None if deal_state is None else deal_from_state(deal_state, dataset_len, drop_last, legacy)
    )
    if saved_world == world_size:
        if ranks is not None:
            entry = ranks[rank]
        elif saved_rank == rank:
            entry = state
        else:
            raise ValueError(
                f"state does not match this client: rank differs (it is rank {saved_rank}'s "
                "state of one rank; load that rank's state, or a job-wide one: see merge_states)"
            )
        start, dealt = int(entry["position"]), deal
        if deal is not None:
            share = len(deal.share(rank, world_size))
        else:
            share = shard_size(dataset_len, world_size, drop_last)
        if not 0 <= start <= share:
            raise ValueError(
                f"state 'position' {start} is not in 0..{share} (this rank's share of the epoch)"
            )
    else:
        if ranks is None:
            raise ValueError(
                f"a state of one rank of {saved_world} cannot be resumed by {world_size} ranks: "
                "it lacks the other ranks' positions. Take state_dict() on every rank with "
                "torch.distributed initialised (it then gathers them), or combine the ranks' "
                "states with DataServerClient.merge_states([...])"
            )
        entry = ranks[0]
        positions = [int(e["position"]) for e in ranks]
        left = undelivered(dataset_len, drop_last, saved_world, positions, deal, legacy)
        nothing_taken = deal is None and not any(positions)
        start, dealt = 0, None if nothing_taken else left
    if entry["mode"] not in MODES:
        raise ValueError(f"state mode {entry['mode']!r} is not one of {MODES}")
    # Every batch holds a sample at least: a normal epoch has taken at most as many batches
    # as its position; a dealt one, at most as many as its epoch has samples (the steps
    # before the deal included).
    step = int(entry["step"])
    most = start if dealt is None else dealt.total
    if not 0 <= step <= most:
        raise ValueError(
            f"state 'step' {step} is not in 0..{most} (batches this rank can have taken)"
        )
    return {
        "epoch": int(state["epoch"]),
        "step": step,
        "mode": entry["mode"],
        "control": dict(entry["control"]),
        "control_seq": int(entry["control_seq"]),
        "feedback_seq": int(entry["feedback_seq"]),
        "position": start,
        "deal": dealt,
        "legacy": legacy,
        "image_size": schedule_of(state["image_size"], "state 'image_size'"),
    }

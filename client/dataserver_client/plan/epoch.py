"""The epoch plan: order, shard, and batches cut from it. Pure: no sockets, no threads.

The client owns the epoch. For (seed, epoch) it fixes one permutation of the dataset,
computed per position (``order.py``: nothing that grows with the dataset), takes this
rank's shard of it (DistributedSampler semantics, a lazy ``order.Shard``) and keeps a
cursor into it. A batch is a contiguous run of the shard: B samples in regular mode, k x B
when stitched (B anchors in a window mosaic, ``mosaic_partners="window"``: each position
anchors an output whose partners are drawn from the positions before it,
``partners.py``). Planning ahead is speculative: when the mode changes, every batch not
yet handed to the trainer is dropped and the cursor rewinds to the first of them, so the
same samples are planned again, in the same order, under the new mode. That is what makes
exactly-once and zero stale batches hold together.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np

from dataserver.protocol.batchsizes import BatchSizes
from dataserver_client.plan.order import EpochOrder, IndexSeq, Shard, Strided, as_seq
from dataserver_client.plan.partners import WINDOW, is_mosaic, partner_positions, window_size
from dataserver_client.plan.sizes import SizeSchedule, schedule_of

REGULAR = "regular"
STITCH = "stitch"
MODES = (REGULAR, STITCH)
LAYOUTS = ("spatial", "batch", "mosaic")
LETTERBOXES = ("top-left", "center")
FITS = ("letterbox", "stretch")  # how a source is fitted into its cell


ShardLike = IndexSeq | np.ndarray  # a shard: lazy (``order.Shard``) or, in tests, an array


def epoch_order(n: int, seed: int, epoch: int, shuffle: bool) -> EpochOrder:
    """The dataset order of an epoch: a permutation of [0, n) fixed by (seed, epoch), or
    0..n-1; computed per position (``order.EpochOrder``), never held as a whole."""
    return EpochOrder(n, seed, epoch, shuffle)


def index_dtype(n: int) -> type[np.signedinteger]:
    """The narrowest index type for a dataset of ``n`` samples: int32 up to 2**31 (4 bytes a
    sample for a legacy order, not 8), int64 beyond."""
    return np.int32 if n <= 1 << 31 else np.int64


def legacy_order(n: int, seed: int, epoch: int, shuffle: bool) -> np.ndarray:
    """The epoch order before issue 28 (states of version 1 and 2 were saved in it): a whole
    array of ``n``, shuffled in place (``rng.shuffle``: the same order as
    ``rng.permutation(n)``). O(n) time and memory (8 s and 256 MiB for 2**26 samples): used
    only to finish an epoch resumed from such a state (``resume.epoch_shard``)."""
    order = np.arange(n, dtype=index_dtype(n))
    if shuffle:
        rng = np.random.default_rng(np.random.SeedSequence([seed, epoch, 0xE90C]))
        rng.shuffle(order)
    return order


def shard_size(n: int, world_size: int, drop_last: bool) -> int:
    """Samples per rank, as ``torch.utils.data.DistributedSampler`` counts them."""
    if drop_last and n % world_size:
        return n // world_size
    return math.ceil(n / world_size)


def shard_of(order: ShardLike, rank: int, world_size: int, drop_last: bool) -> Shard:
    """This rank's part of ``order``, with DistributedSampler's semantics, as a lazy
    ``order.Shard`` (its samples computed for the positions asked).

    Ranks take every ``world_size``-th sample starting at ``rank``: disjoint, and together
    they cover the dataset. When ``len(order)`` is not a multiple of ``world_size``, all
    ranks must still see equally many samples (or distributed training deadlocks), so like
    DistributedSampler: ``drop_last`` drops the tail, otherwise the order is padded with
    its own first samples (which are then seen twice in the epoch, once each on two ranks).
    """
    seq = as_seq(order)
    return Shard(seq, Strided(rank, world_size, shard_size(len(seq), world_size, drop_last)))


def global_order(order: ShardLike, world_size: int, drop_last: bool) -> Shard:
    """``order`` padded or trimmed to ``world_size`` x shard_size, as DistributedSampler
    does (global position g holds ``order[g mod n]``): the epoch as a job of ``world_size``
    ranks reads it, rank r taking positions r, r + world_size, ... (the global positions
    that elastic resume counts in). Lazy, as ``shard_of``."""
    seq = as_seq(order)
    total = shard_size(len(seq), world_size, drop_last) * world_size
    return Shard(seq, Strided(0, 1, total))


@dataclass(frozen=True)
class Layout:
    """How a batch is cut and composed. ``image_size``: the size schedule the client was
    built with ((h, w) or a ``sizes`` schedule); the plan book may replace it
    (``set_image_size``): planning takes the size of each step from the cursor's."""

    batch_size: int
    image_size: SizeSchedule | tuple[int, int]
    stitch_k: int
    stitch_layout: str
    drop_last: bool
    mosaic_partners: str = "consume"  # "window": YOLO's mosaic (``partners.py``)
    mosaic_p: float = 1.0  # a window mosaic's probability, per output
    pad_value: int = 0  # what the servers pad with
    letterbox: str = "top-left"  # where a regular image sits: or "center"
    fit: str = "letterbox"  # how a source is fitted into its cell: or "stretch"
    augment: bool = True  # False: no flip, no dataset augment (validation)

    @property
    def grid(self) -> int:
        return math.isqrt(self.stitch_k)

    @property
    def k_per_image(self) -> bool:
        """Whether a stitched image holds k samples (spatial, mosaic), not one (batch)."""
        return self.stitch_layout != "batch"

    @property
    def window(self) -> bool:
        """Whether a stitched image is a window mosaic: one anchor consumed, its partners
        drawn from the positions before it (not consumed)."""
        return self.stitch_layout == "mosaic" and self.mosaic_partners == WINDOW

    def samples_per_image(self, mode: str) -> int:
        """Shard positions one output image of ``mode`` consumes (k for a stitched image of
        a "consume" layout, else 1)."""
        return self.stitch_k if mode == STITCH and self.k_per_image and not self.window else 1

    def samples_per_batch(self, mode: str) -> int:
        if mode == REGULAR or self.window:
            return self.batch_size
        return self.batch_size * self.stitch_k


@dataclass(frozen=True)
class ImagePlan:
    """One output image: its source indices (cell order) and grid side (its size is its
    batch's: ``BatchPlan.sizes.out``)."""

    indices: tuple[int, ...]
    grid: int


@dataclass(frozen=True)
class BatchPlan:
    """Batch ``step`` of the epoch under ``plan_version``: shard positions [start, stop).
    ``sizes``: its output size, its image size (what sources are fitted into) and the size
    the servers' stores keep sources at (``BatchSizes``: carried to the tasks as they are);
    ``layout``: "grid" or "mosaic" (how the servers compose an image of several);
    ``partners``: a window mosaic (each image's first index its anchor, the one shard
    position it consumes; the rest its partners; an image of one index a regular image)."""

    step: int
    plan_version: int
    mode: str
    start: int
    stop: int
    images: tuple[ImagePlan, ...]
    sizes: BatchSizes
    epoch: int = 0
    seed: int = 0
    layout: str = "grid"
    partners: bool = False  # a window mosaic: each image's indices[0] its anchor (consumed)
    pad_value: int = 0  # (the layout's; a rebuilt batch: its manifest's)
    letterbox: str = "top-left"
    fit: str = "letterbox"
    augment: bool = True


def split_runs(n: int, parts: int) -> list[range]:
    """``range(n)`` cut into ``parts`` contiguous runs as even as can be (larger first)."""
    parts = max(1, min(parts, n))
    base, extra = divmod(n, parts)
    out, start = [], 0
    for p in range(parts):
        size = base + (p < extra)
        out.append(range(start, start + size))
        start += size
    return out


def cut_images(
    indices: np.ndarray, layout: Layout, mode: str, image_size: tuple[int, int]
) -> tuple[tuple[ImagePlan, ...], tuple[int, int]]:
    """The output images that compose ``indices`` into one batch in ``mode`` at
    ``image_size``, and their size."""
    h, w = image_size
    if mode == REGULAR:
        return tuple(ImagePlan((int(i),), 1) for i in indices), (h, w)
    g = layout.grid
    if layout.stitch_layout == "batch":
        small = (h // g, w // g)
        return tuple(ImagePlan((int(i),), 1) for i in indices), small
    k = layout.stitch_k
    groups = [tuple(int(i) for i in indices[j : j + k]) for j in range(0, len(indices), k)]
    return tuple(ImagePlan(grp, g) for grp in groups), (h, w)


def window_images(
    shard: ShardLike,
    start: int,
    stop: int,
    layout: Layout,
    seed: int,
    epoch: int,
) -> tuple[ImagePlan, ...]:
    """The window mosaics anchored at shard positions [start, stop): each the anchor and 3
    partners drawn from the positions before it (``partners.partner_positions``), or, where
    the ``mosaic_p`` draw says no mosaic, the anchor alone (a regular image). The samples of
    every position they name are looked up in one go (one pass of the order's arithmetic)."""
    n = len(shard)
    window = window_size(n, layout.batch_size)
    spans: list[tuple[int, ...]] = []
    for position in range(start, stop):
        if not is_mosaic(seed, epoch, position, layout.mosaic_p):
            spans.append((position,))
        else:
            spans.append((position, *partner_positions(seed, epoch, position, n, window)))
    flat = np.fromiter((q for span in spans for q in span), dtype=np.int64)
    samples = iter(shard[flat].tolist())
    return tuple(ImagePlan(tuple(next(samples) for _ in span), layout.grid) for span in spans)


class Cursor:
    """Cuts one rank's shard of one epoch into batches, ahead of the trainer.

    ``spare``: 1 when this rank's shard holds one sample more than the other ranks' (an
    elastic resume deals the undelivered samples without padding: see ``resume.py``). It
    rides in the last batch: batches are cut as if the shard were one sample shorter, and
    a batch that would leave just the spare behind takes it too, so every rank ends the
    epoch on the same step when the ranks take the same modes.
    """

    def __init__(
        self,
        shard: ShardLike,
        layout: Layout,
        mode: str,
        plan_version: int,
        spare: int = 0,
        *,
        epoch: int = 0,
        seed: int = 0,
        sizes: SizeSchedule | None = None,
    ) -> None:
        self.shard = shard
        self.layout = layout
        self.mode = mode
        self.plan_version = plan_version
        self.spare = spare
        self.epoch = epoch
        self.seed = seed
        self.sizes = sizes if sizes is not None else schedule_of(layout.image_size)
        self.position = 0  # shard position of the next batch to plan
        self.step = 0  # its step number

    @property
    def remaining(self) -> int:
        return len(self.shard) - self.position

    def plan_at(self, step: int, start: int, mode: str) -> BatchPlan | None:
        """Batch ``step`` cut from shard position ``start`` in ``mode`` (None when the shard
        has too few samples left). Pure: the cursor does not move."""
        want = self.layout.samples_per_batch(mode)
        left = len(self.shard) - start
        short = left - self.spare  # what a rank without the spare has left at this step
        if left <= 0 or (self.layout.drop_last and short < want):
            return None
        stop = start + (left if self.spare and short == want else min(want, left))
        size = self.sizes.size_at(self.seed, self.epoch, step)
        mosaic = mode == STITCH and self.layout.stitch_layout == "mosaic"
        partners = mosaic and self.layout.window
        if partners:
            images = window_images(self.shard, start, stop, self.layout, self.seed, self.epoch)
            out = size
        else:
            images, out = cut_images(self.shard[start:stop], self.layout, mode, size)
        return BatchPlan(
            step,
            self.plan_version,
            mode,
            start,
            stop,
            images,
            BatchSizes.of(out, size, self.sizes.stored),
            epoch=self.epoch,
            seed=self.seed,
            layout="mosaic" if mosaic else "grid",
            partners=partners,
            pad_value=self.layout.pad_value,
            letterbox=self.layout.letterbox,
            fit=self.layout.fit,
            augment=self.layout.augment,
        )

    def next_plan(self) -> BatchPlan | None:
        """Plan the next batch, or None when the epoch has no more."""
        plan = self.plan_at(self.step, self.position, self.mode)
        if plan is not None:
            self.position, self.step = plan.stop, plan.step + 1
        return plan

    def rewind(
        self,
        step: int,
        position: int,
        mode: str,
        plan_version: int,
        sizes: SizeSchedule | None = None,
    ) -> None:
        """Forget every plan from ``step`` on; plan again from ``position`` in ``mode``
        (at ``sizes``, when given)."""
        if plan_version <= self.plan_version:
            raise ValueError("a rewind must raise plan_version")
        self.step, self.position = step, position
        self.mode, self.plan_version = mode, plan_version
        if sizes is not None:
            self.sizes = sizes

    def jump(self, step: int, position: int, mode: str) -> None:
        """Go on from batch ``step`` at ``position`` in ``mode``, under the same plan: the
        batches before ``step`` were planned already (a lookahead batch promoted on a mode
        flip), and every plan after them is dropped by the caller."""
        self.step, self.position, self.mode = step, position, mode

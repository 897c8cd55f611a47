"""YOLO's mosaic partners (``mosaic_partners="window"``): every shard position anchors one
output, and its partners are drawn from the positions just before it. Pure: no sockets,
no threads, no tables (each position's draws are a hash of (seed, epoch, position)).

Ultralytics' ``Mosaic`` takes each image as an anchor and draws its 3 partners from a buffer
of the images its dataset loaded last (``max_buffer_length = min(n, batch * 8, 1000)``,
``random.choices``: with replacement, the anchor itself included). Here the buffer is the
rank's epoch order: the partners of position p are drawn from positions p - 1, ..., p - W
(``window_size``: W = min(N, 8 x batch_size, 1000), N the rank's shard length), wrapping to
the epoch's end at its start, so they are mostly sources the servers have just prepared (or
are preparing for the batches around it). With W = N the window is the whole shard, the
anchor's own position included, as Ultralytics' buffer holds the anchor.

The draws depend on (seed, epoch, position) only: the same on any number of workers or
servers, whatever the prefetch or the mode switches (a batch planned again after a flip
draws the same partners for the same positions), and after a resume.
"""

from __future__ import annotations

from dataserver.hashing import MASK64, mix64

CONSUME = "consume"
WINDOW = "window"
PARTNER_MODES = (CONSUME, WINDOW)
PARTNERS = 3  # a mosaic of 4: the anchor and 3 partners
MAX_WINDOW = 1000  # Ultralytics' max_buffer_length cap
_TAG = 0x9A27  # separates these draws from any other seeded by (seed, epoch, position)
_MOSAIC = 1 << 62  # the slot of the "mosaic or not" draw (no partner slot is this large)


def window_size(shard_len: int, batch_size: int) -> int:
    """W = min(N, 8 x batch_size, 1000), at least 1."""
    return max(1, min(shard_len, 8 * batch_size, MAX_WINDOW))


def _draw(seed: int, epoch: int, position: int, slot: int) -> int:
    base = mix64(mix64(mix64(seed & MASK64) ^ (epoch & MASK64)) ^ _TAG)
    return mix64(mix64(base ^ (position & MASK64)) ^ slot)


def partner_positions(
    seed: int, epoch: int, position: int, shard_len: int, window: int
) -> tuple[int, ...]:
    """The shard positions of position ``position``'s 3 partners: each (position - d) mod
    ``shard_len`` for d drawn uniformly from 1..``window`` (with replacement)."""
    return tuple(
        (position - 1 - _draw(seed, epoch, position, slot) % window) % shard_len
        for slot in range(1, PARTNERS + 1)
    )


def is_mosaic(seed: int, epoch: int, position: int, p: float) -> bool:
    """Whether position ``position``'s output is a mosaic (``mosaic_p`` = ``p``): a uniform
    draw in [0, 1) from (seed, epoch, position) below ``p`` (always for 1.0, never for 0.0)."""
    if p >= 1.0:
        return True
    return (_draw(seed, epoch, position, _MOSAIC) >> 11) < p * (1 << 53)

"""Composition of output images from prepared sources: regular letterbox and stitching.

A task names up to grid x grid source indices and an output size. ``compose`` places
source t in cell (t // grid, t % grid), row-major, each letterboxed into its cell
(aspect kept, top-left of the cell), boxes scaled and offset into the cell. grid 1 is the
regular letterbox. The spatial stitch of Stitcher (Chen et al. 2020) is grid 2 (k = 4) or
3 (k = 9) at the full output size; the batch stitch is grid 1 at (H / sqrt(k), W / sqrt(k)),
one task per source. Empty cells (a short group at the end of an epoch, or a tile left out
with on_error="skip") stay zero.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import numpy as np

from dataserver.data.sample import Sample
from dataserver.data.transforms import letterbox_into


def grid_side(k: int) -> int:
    """sqrt(k) for a square k (1, 4, 9, 16); ValueError otherwise."""
    side = math.isqrt(k)
    if k < 1 or side * side != k:
        raise ValueError(f"stitch_k must be a square (1, 4, 9, 16), got {k}")
    return side


def cell_size(out_h: int, out_w: int, grid: int) -> tuple[int, int]:
    """The (h, w) of one cell of a grid x grid mosaic of an (out_h, out_w) image."""
    return out_h // grid, out_w // grid


def compose(
    sources: Sequence[Sample | None], grid: int, out_h: int, out_w: int, chw: bool = False
) -> Sample:
    """Build one output image and its boxes from ``sources`` (None = empty cell). The image is
    uint8 HWC, or CHW (the wire layout) when ``chw``; the pixels are the same either way."""
    if len(sources) > grid * grid:
        raise ValueError(f"{len(sources)} sources do not fit a {grid}x{grid} grid")
    shape = (3, out_h, out_w) if chw else (out_h, out_w, 3)
    canvas = np.zeros(shape, dtype=np.uint8)
    cell_h, cell_w = cell_size(out_h, out_w, grid)
    all_boxes = [np.zeros((0, 4), dtype=np.float32)]
    all_labels = [np.zeros((0,), dtype=np.int64)]
    for t, source in enumerate(sources):
        if source is None:
            continue
        row, col = divmod(t, grid)
        boxes, labels = letterbox_into(
            canvas, row * cell_h, col * cell_w, cell_h, cell_w, source, chw
        )
        all_boxes.append(boxes)
        all_labels.append(labels)
    return Sample(canvas, np.concatenate(all_boxes), np.concatenate(all_labels))

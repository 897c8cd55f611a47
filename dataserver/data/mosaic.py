"""YOLO-style mosaic: four sources around a random centre, cropped to the output. Pure.

The geometry is Ultralytics' ``Mosaic._mosaic4`` (``ultralytics/data/augment.py``) followed
by the crop its ``RandomPerspective`` makes at ``border = -s/2`` when rotation, shear,
perspective and translate are 0: ``_mosaic4`` draws the centre ``int(random.uniform(s/2,
3s/2))`` on a 2s x 2s canvas and puts the four images around it (top-left, top-right,
bottom-left, bottom-right, touching the centre with their bottom-right, bottom-left,
top-right and top-left corners); the perspective step then keeps the central s x s window.
So in output pixels the centre is uniform over the output, and this module works there
directly: no 2H x 2W canvas is ever allocated, each scaled source is written only where it
overlaps the output. YOLOX's ``MosaicDetection`` (``yolox/data/datasets/mosaicdetection.py``)
uses the same centre range (``random.uniform(0.5 * input_h, 1.5 * input_h)``) and
``mosaic_scale=(0.5, 1.5)``, which is also Ultralytics' default (``scale=0.5``, a factor in
[1 - 0.5, 1 + 0.5]). Two differences, on purpose: the scale is drawn per source instead of
once for the whole mosaic, and the padding stays 0 (the caller's zeroed canvas; not 114).

Boxes are scaled by the exact per-axis factors of the rounded sizes, mirrored with their
source, offset, clipped to the output, and filtered with Ultralytics' ``box_candidates`` rule
(box1 before clipping, box2 after; ``wh_thr=2, ar_thr=100, area_thr=0.1, eps=1e-16``).

Randomness comes only from the ``np.random.Generator`` passed in, made by ``mosaic_rng`` from
(seed, epoch, indices), so that a task rerun anywhere gives the same bytes.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

import cv2
import numpy as np

from dataserver.hashing import MASK64

if TYPE_CHECKING:  # only for annotations: pipeline.py may import this module
    from dataserver.data.pipeline import Source

MOSAIC_SCALE = (0.5, 1.5)
CELLS = 4
_TAG = 0x4D05  # separates the mosaic's stream from any other seeded by (seed, epoch, ...)

# Ultralytics' box_candidates thresholds (RandomPerspective's defaults).
_WH_THR = 2.0
_AR_THR = 100.0
_AREA_THR = 0.1
_EPS = 1e-16


def mosaic_rng(seed: int, epoch: int, indices: Sequence[int]) -> np.random.Generator:
    """The mosaic's randomness: a function of (seed, epoch, the image's source indices) only.

    Each integer is taken modulo 2^64 (``SeedSequence`` wants them non-negative; values
    already in [0, 2^64) are used as they are)."""
    entropy = [seed & MASK64, epoch & MASK64, _TAG, *(int(i) & MASK64 for i in indices)]
    return np.random.default_rng(np.random.SeedSequence(entropy))


@dataclass(frozen=True, slots=True)
class MosaicGeometry:
    """``centre`` (cy, cx) in output pixels; ``sizes[t]`` the (h, w) source t is scaled to,
    (0, 0) for a missing source."""

    centre: tuple[int, int]
    sizes: tuple[tuple[int, int], ...]


def _scaled_size(hw: tuple[int, int] | None, ratio: float) -> tuple[int, int]:
    if hw is None:
        return (0, 0)
    return (max(1, round(hw[0] * ratio)), max(1, round(hw[1] * ratio)))


def mosaic_geometry(
    rng: np.random.Generator, out_hw: tuple[int, int], source_hws: Sequence[tuple[int, int] | None]
) -> MosaicGeometry:
    """Draws, in this fixed order whatever sources are missing: cy ~ U[0, H), cx ~ U[0, W)
    (integers), then 4 scales r_t ~ U[MOSAIC_SCALE) (``rng.uniform(lo, hi, size=4)``); cell
    t's size is (max(1, round(h_t * r_t)), max(1, round(w_t * r_t))), (0, 0) for a missing
    source (None). The draws never depend on which sources are missing, so leaving one out
    changes nothing for the others. At most 4 sources; H, W >= 1."""
    if len(source_hws) > CELLS:
        raise ValueError(f"a mosaic has at most {CELLS} sources, got {len(source_hws)}")
    out_h, out_w = int(out_hw[0]), int(out_hw[1])
    if out_h < 1 or out_w < 1:
        raise ValueError(f"mosaic output size must be positive, got {out_hw}")
    cy = int(rng.integers(out_h))
    cx = int(rng.integers(out_w))
    ratios = rng.uniform(MOSAIC_SCALE[0], MOSAIC_SCALE[1], size=CELLS)
    sizes = tuple(_scaled_size(hw, float(ratios[t])) for t, hw in enumerate(source_hws))
    return MosaicGeometry((cy, cx), sizes)


def cell_origin(centre: tuple[int, int], t: int, size: tuple[int, int]) -> tuple[int, int]:
    """(y0, x0) of cell t's scaled source in output pixels (may be negative): cell 0 has its
    bottom-right corner at the centre, cell 1 its bottom-left, cell 2 its top-right, cell 3
    its top-left."""
    cy, cx = centre
    h, w = size
    return (cy - h if t < 2 else cy, cx - w if t % 2 == 0 else cx)


def box_candidates(before: np.ndarray, after: np.ndarray) -> np.ndarray:
    """Ultralytics' ``box_candidates`` on (N, 4) xyxy rows: keep a box whose ``after`` is
    wider and taller than 2 px, keeps more than 10% of its ``before`` area and has an aspect
    ratio under 100. NaN boxes are never kept."""
    w1, h1 = before[:, 2] - before[:, 0], before[:, 3] - before[:, 1]
    w2, h2 = after[:, 2] - after[:, 0], after[:, 3] - after[:, 1]
    ratio = np.maximum(w2 / (h2 + _EPS), h2 / (w2 + _EPS))
    keep: np.ndarray = (
        (w2 > _WH_THR) & (h2 > _WH_THR) & (w2 * h2 / (w1 * h1 + _EPS) > _AREA_THR)
    ) & (ratio < _AR_THR)
    return keep


def _draw_cropped(
    canvas: np.ndarray,
    origin: tuple[int, int],
    size: tuple[int, int],
    image: np.ndarray,
    flip: bool,
) -> None:
    """Write the CHW ``image`` resized to ``size`` (h, w), mirrored when ``flip``, with its
    top-left at ``origin`` of ``canvas``: only the part inside the canvas."""
    (y0, x0), (h, w) = origin, size
    _, out_h, out_w = canvas.shape
    ya, yb = max(y0, 0), min(y0 + h, out_h)
    xa, xb = max(x0, 0), min(x0 + w, out_w)
    if ya >= yb or xa >= xb:
        return
    resize = size != image.shape[1:]
    for c in range(3):
        plane = image[c]
        if resize:
            plane = cv2.resize(plane, (w, h), interpolation=cv2.INTER_LINEAR)
        if flip:  # mirror then place: the view reads the mirrored columns, no copy
            plane = plane[:, ::-1]
        canvas[c, ya:yb, xa:xb] = plane[ya - y0 : yb - y0, xa - x0 : xb - x0]


def _cell_boxes(
    source: Source,
    origin: tuple[int, int],
    size: tuple[int, int],
    flip: bool,
    out_hw: tuple[int, int],
) -> tuple[np.ndarray, np.ndarray]:
    """``source``'s boxes in output pixels (scaled, mirrored, offset, clipped, filtered)."""
    if not len(source.boxes):
        return np.zeros((0, 4), np.float32), np.zeros((0,), np.int64)
    (y0, x0), (new_h, new_w) = origin, size
    height, width = source.image.shape[1:]
    sx, sy = new_w / width, new_h / height
    boxes = np.asarray(source.boxes, np.float32) * np.array([sx, sy, sx, sy], dtype=np.float32)
    if flip:  # mirrored within the scaled width, before the offset
        x1 = new_w - boxes[:, 2]
        boxes[:, 2] = new_w - boxes[:, 0]
        boxes[:, 0] = x1
    boxes += np.array([x0, y0, x0, y0], dtype=np.float32)
    out_h, out_w = out_hw
    clipped = np.clip(boxes, 0.0, np.array([out_w, out_h, out_w, out_h], dtype=np.float32))
    keep = box_candidates(boxes, clipped)
    return clipped[keep], np.asarray(source.labels, np.int64)[keep]


def compose_mosaic(
    canvas: np.ndarray,
    sources: Sequence[Source | None],
    flips: Sequence[bool],
    rng: np.random.Generator,
) -> tuple[np.ndarray, np.ndarray]:
    """Compose a mosaic of up to 4 ``sources`` (cell order; None: left out, its quadrant
    stays as the canvas was) into the zeroed uint8 (3, H, W) ``canvas``, in place, source t
    mirrored left-right when ``flips[t]``. Draws its geometry from ``rng`` with
    ``mosaic_geometry``. Returns boxes float32 (M, 4) xyxy in canvas pixels, all finite and
    within [0, W] x [0, H], wider and taller than 2 px, and their labels int64 (M,)."""
    if len(flips) != len(sources):
        raise ValueError(f"{len(sources)} sources but {len(flips)} flips")
    _, out_h, out_w = canvas.shape
    hws = [None if s is None else (int(s.image.shape[1]), int(s.image.shape[2])) for s in sources]
    geometry = mosaic_geometry(rng, (out_h, out_w), hws)
    all_boxes = [np.zeros((0, 4), dtype=np.float32)]
    all_labels = [np.zeros((0,), dtype=np.int64)]
    for t, source in enumerate(sources):
        if source is None:
            continue
        size = geometry.sizes[t]
        origin = cell_origin(geometry.centre, t, size)
        _draw_cropped(canvas, origin, size, source.image, bool(flips[t]))
        boxes, labels = _cell_boxes(source, origin, size, bool(flips[t]), (out_h, out_w))
        all_boxes.append(boxes)
        all_labels.append(labels)
    return np.concatenate(all_boxes), np.concatenate(all_labels)


def _quadrant(
    t: int, xc: int, yc: int, h: int, w: int, big_h: int, big_w: int
) -> tuple[int, int, int, int, int, int]:
    """``_mosaic4``'s placement of an h x w source in cell ``t`` around (yc, xc): its canvas
    rectangle (x1a, y1a, x2a, y2a) and the source pixel (x1b, y1b) at its top-left."""
    if t == 0:  # top left
        x1a, y1a, x2a, y2a = max(xc - w, 0), max(yc - h, 0), xc, yc
        return x1a, y1a, x2a, y2a, w - (x2a - x1a), h - (y2a - y1a)
    if t == 1:  # top right
        x1a, y1a, x2a, y2a = xc, max(yc - h, 0), min(xc + w, big_w), yc
        return x1a, y1a, x2a, y2a, 0, h - (y2a - y1a)
    if t == 2:  # bottom left
        x1a, y1a, x2a, y2a = max(xc - w, 0), yc, xc, min(big_h, yc + h)
        return x1a, y1a, x2a, y2a, w - (x2a - x1a), 0
    x1a, y1a, x2a, y2a = xc, yc, min(xc + w, big_w), min(big_h, yc + h)  # bottom right
    return x1a, y1a, x2a, y2a, 0, 0


def _place(
    canvas: np.ndarray,
    source: Source,
    cell: tuple[int, int, int, int],
    origin: tuple[int, int],
    region: tuple[int, int, int, int],
) -> None:
    """``source``'s image into the HWC ``canvas`` at ``cell`` (y1, x1, y2, x2), the source
    pixel ``origin`` (y, x) at its top-left, only inside ``region`` (top, left, bottom,
    right); in place (an HWC source by a copy, CHW planes by cv2.merge into the view)."""
    top, left = max(cell[0], region[0]), max(cell[1], region[1])
    bottom, right = min(cell[2], region[2]), min(cell[3], region[3])
    if bottom <= top or right <= left:
        return
    sy, sx = origin[0] + top - cell[0], origin[1] + left - cell[1]
    view = canvas[top:bottom, left:right]
    if source.hwc:
        np.copyto(view, source.image[sy : sy + bottom - top, sx : sx + right - left])
        return
    planes = source.image
    parts = [planes[c, sy : sy + bottom - top, sx : sx + right - left] for c in range(3)]
    merged = cv2.merge(parts, dst=view)
    if merged is not view and not np.shares_memory(merged, canvas):
        view[...] = merged  # (OpenCV wrote a new array: not expected, kept right)


def _pad_around(
    canvas: np.ndarray,
    quadrant: tuple[int, int, int, int],
    cell: tuple[int, int, int, int] | None,
    region: tuple[int, int, int, int],
    value: int,
) -> None:
    """Fill with ``value`` the part of ``quadrant`` (y1, x1, y2, x2) that ``cell`` (inside
    it; None: nothing) does not cover, within ``region``: the bands above, below, left
    and right of the cell."""
    qt, ql, qb, qr = quadrant
    if cell is None:
        bands = [(qt, ql, qb, qr)]
    else:
        ct, cl, cb, cr = cell
        bands = [(qt, ql, ct, qr), (cb, ql, qb, qr), (ct, ql, cb, cl), (ct, cr, cb, qr)]
    for band in bands:
        top, left = max(band[0], region[0]), max(band[1], region[1])
        bottom, right = min(band[2], region[2]), min(band[3], region[3])
        if bottom > top and right > left:
            canvas[top:bottom, left:right] = value


def mosaic4_canvas(
    sources: Sequence[Source | None],
    out_hw: tuple[int, int],
    pad_value: int,
    rng: np.random.Generator,
    region: tuple[int, int, int, int] | None = None,
) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """The mosaic as Ultralytics' ``Mosaic._mosaic4`` leaves it for its ``RandomPerspective``
    (what a dataset's ``augment_composed`` is given): a (2H, 2W, 3) uint8 canvas filled with
    ``pad_value``, the centre (yc, xc) drawn as ``int(uniform(-b, 2s + b))`` with border
    ``b = (-H // 2, -W // 2)`` (yc first; ``uniform(a, c) = a + (c - a) * rng.random()``,
    Python's formula), the up to 4 ``sources`` (cell order; None: left out, its quadrant
    padding) at their own size, no scaling and no mirroring, touching the centre with their
    bottom-right, bottom-left, top-right and top-left corners and cut at the canvas' edge;
    their boxes offset, clipped to the canvas and those without area dropped (``_cat_labels``).
    Returns (canvas, boxes float32 (M, 4) xyxy, labels int64 (M,)). ``region`` (top, left,
    bottom, right): only that part of the canvas is written (padding and tiles), the rest
    left as allocated, for a reader that reads nothing else (``composed.region_of``); the
    boxes are the same."""
    if len(sources) > CELLS:
        raise ValueError(f"a mosaic has at most {CELLS} sources, got {len(sources)}")
    out_h, out_w = int(out_hw[0]), int(out_hw[1])
    big_h, big_w = 2 * out_h, 2 * out_w
    by, bx = -out_h // 2, -out_w // 2
    yc = int(-by + (big_h + by - -by) * rng.random())
    xc = int(-bx + (big_w + bx - -bx) * rng.random())
    rt, rl, rb, rr = (0, 0, big_h, big_w) if region is None else region
    # Only what is read is written: each quadrant's tile, and padding where no tile is.
    canvas = np.empty((big_h, big_w, 3), dtype=np.uint8)
    quadrants = ((0, 0, yc, xc), (0, xc, yc, big_w), (yc, 0, big_h, xc), (yc, xc, big_h, big_w))
    all_boxes = [np.zeros((0, 4), dtype=np.float32)]
    all_labels = [np.zeros((0,), dtype=np.int64)]
    for t in range(CELLS):
        source = sources[t] if t < len(sources) else None
        if source is None:
            _pad_around(canvas, quadrants[t], None, (rt, rl, rb, rr), pad_value)
            continue
        h, w = source.hw
        x1a, y1a, x2a, y2a, x1b, y1b = _quadrant(t, xc, yc, h, w, big_h, big_w)
        _place(canvas, source, (y1a, x1a, y2a, x2a), (y1b, x1b), (rt, rl, rb, rr))
        _pad_around(canvas, quadrants[t], (y1a, x1a, y2a, x2a), (rt, rl, rb, rr), pad_value)
        if len(source.boxes):
            padw, padh = x1a - x1b, y1a - y1b
            boxes = np.asarray(source.boxes, np.float32) + np.array(
                [padw, padh, padw, padh], dtype=np.float32
            )
            all_boxes.append(boxes)
            all_labels.append(np.asarray(source.labels, np.int64))
    boxes = np.concatenate(all_boxes)
    labels = np.concatenate(all_labels)
    np.clip(boxes, 0.0, np.array([big_w, big_h, big_w, big_h], dtype=np.float32), out=boxes)
    keep = (boxes[:, 2] - boxes[:, 0]) * (boxes[:, 3] - boxes[:, 1]) > 0
    return canvas, boxes[keep], labels[keep]

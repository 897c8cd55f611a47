"""From a task's parameters to output images: read, fit, flip, compose. Pure functions.

The steps, and why they are split where they are:

1. ``read``: the dataset's sample, checked (``SampleError`` names the index).
2. ``fit``: resized to fit the client's image size, keeping its aspect ratio, stored as
   CHW planes (``Source``). This is the expensive, mode-independent part, and what a
   server's store keeps: the same fitted source serves a regular image, a cell of a
   stitched one, every epoch and every job asking for that size.
3. ``flips``: the augmentation, a function of (seed, epoch, index) only.
4. ``compose_into``: each source placed at the top-left of its cell (fitted into the cell
   when the cell is smaller), mirrored when its flip says so, written plane by plane
   straight into the output canvas (the wire layout; no whole-image transpose).

Used unchanged by the server's workers and by the DataLoader baseline of ``dataserver
bench``, so both sides of every comparison run the same image code, and by the tests.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import cv2
import numpy as np

from dataserver.data.sample import Sample, SampleError, as_sample
from dataserver.data.transforms import fit_size, keep_valid
from dataserver.hashing import MASK64, mix64


@dataclass(slots=True)
class Source:
    """A source fitted to an image size: ``image`` uint8 (3, h, w); ``boxes`` float32
    (M, 4) xyxy in its pixels; ``labels`` int64 (M,)."""

    image: np.ndarray
    boxes: np.ndarray
    labels: np.ndarray

    @property
    def nbytes(self) -> int:
        return int(self.image.nbytes + self.boxes.nbytes + self.labels.nbytes)


def read(dataset: Any, index: int) -> Sample:
    """Sample ``index`` of ``dataset``, checked; ``SampleError`` names the index (and file,
    when the dataset names one)."""
    try:
        raw = dataset[index]
    except SampleError:
        raise
    except Exception as exc:
        raise SampleError(index, f"{type(exc).__name__}: {exc}") from None
    return as_sample(index, raw)


def fit(sample: Sample, fit_hw: Sequence[int]) -> Source:
    """``sample`` resized to fit (H, W) keeping its aspect ratio, as CHW planes; boxes
    scaled by the exact per-axis factors, clipped, degenerate ones dropped."""
    height, width = sample.image.shape[:2]
    new_h, new_w = fit_size(height, width, int(fit_hw[0]), int(fit_hw[1]))
    image = sample.image
    if (new_h, new_w) != (height, width):
        image = cv2.resize(image, (new_w, new_h), interpolation=cv2.INTER_LINEAR)
    planes = np.empty((3, new_h, new_w), dtype=np.uint8)
    cv2.split(image, [planes[0], planes[1], planes[2]])
    boxes, labels = _scaled(
        sample.boxes, sample.labels, new_w / width, new_h / height, new_h, new_w
    )
    return Source(planes, boxes, labels)


def _scaled(
    boxes: np.ndarray, labels: np.ndarray, sx: float, sy: float, h: int, w: int
) -> tuple[np.ndarray, np.ndarray]:
    if not len(boxes):
        return np.zeros((0, 4), np.float32), np.zeros((0,), np.int64)
    out = boxes * np.array([sx, sy, sx, sy], dtype=np.float32)
    np.clip(out, 0.0, np.array([w, h, w, h], dtype=np.float32), out=out)
    return keep_valid(out, labels)


def prepare(dataset: Any, index: int, fit_hw: Sequence[int]) -> Source:
    """``read`` then ``fit``: what a worker does on a store miss."""
    return fit(read(dataset, index), fit_hw)


def flip_of(seed: int, epoch: int, index: int) -> bool:
    """The augmentation: mirror left-right or not, a function of (seed, epoch, index) only
    (so a task rerun anywhere gives the same bytes), true for about half of the indices."""
    return bool(mix64(mix64(mix64(seed & MASK64) ^ (epoch & MASK64)) ^ (index & MASK64)) >> 63)


def _mirror(boxes: np.ndarray, width: float) -> None:
    """Mirror xyxy ``boxes`` left-right in place, within an image ``width`` wide."""
    x1 = width - boxes[:, 2]
    boxes[:, 2] = width - boxes[:, 0]
    boxes[:, 0] = x1


def _draw(
    canvas: np.ndarray, y0: int, x0: int, size: tuple[int, int], image: np.ndarray, flip: bool
) -> None:
    """Write the CHW ``image`` at (y0, x0) of ``canvas``, resized to ``size`` (h, w) when
    it differs, mirrored when ``flip``."""
    new_h, new_w = size
    same = size == image.shape[1:]
    if same and not flip:
        np.copyto(canvas[:, y0 : y0 + new_h, x0 : x0 + new_w], image)
        return
    for c in range(3):
        dst = canvas[c, y0 : y0 + new_h, x0 : x0 + new_w]
        if same:
            cv2.flip(image[c], 1, dst=dst)
        else:
            cv2.resize(image[c], (new_w, new_h), dst=dst, interpolation=cv2.INTER_LINEAR)
            if flip:
                cv2.flip(dst, 1, dst=dst)


def place(
    canvas: np.ndarray, y0: int, x0: int, cell_h: int, cell_w: int, source: Source, flip: bool
) -> tuple[np.ndarray, np.ndarray]:
    """Write ``source`` at the top-left of the cell (y0, x0, cell_h, cell_w) of a CHW
    ``canvas``, fitted into the cell when it is larger, mirrored when ``flip``. Returns its
    boxes in canvas pixels and their labels (clipped; degenerate ones dropped)."""
    _, height, width = source.image.shape
    new_h, new_w = fit_size(height, width, cell_h, cell_w)
    _draw(canvas, y0, x0, (new_h, new_w), source.image, flip)
    if not len(source.boxes):
        return source.boxes, source.labels
    if (new_h, new_w) == (height, width):  # already clipped to the source, none degenerate
        boxes = source.boxes.copy()
        if flip:
            _mirror(boxes, width)
        if x0 or y0:
            boxes += np.array([x0, y0, x0, y0], dtype=np.float32)
        return boxes, source.labels.copy()
    sx, sy = new_w / width, new_h / height
    boxes = source.boxes * np.array([sx, sy, sx, sy], dtype=np.float32)
    if flip:
        _mirror(boxes, new_w)
    np.clip(boxes, 0.0, np.array([new_w, new_h, new_w, new_h], dtype=np.float32), out=boxes)
    boxes, labels = keep_valid(boxes, source.labels)
    boxes += np.array([x0, y0, x0, y0], dtype=np.float32)
    return boxes, labels


@dataclass(slots=True)
class Composed:
    """One output image's boxes, labels, the indices it holds (cell order) and the
    sources left out as (index, reason)."""

    boxes: np.ndarray
    labels: np.ndarray
    indices: list[int]
    failed: list[tuple[int, str]]


def compose_into(
    canvas: np.ndarray,
    get_source: Callable[[int], Source],
    indices: Sequence[int],
    grid: int,
    flips: Sequence[bool],
    skip_errors: bool,
) -> Composed:
    """Compose one output image into the zeroed CHW ``canvas`` from ``indices`` (cell t
    = (t // grid, t % grid)). With ``skip_errors`` a failing source leaves its cell empty
    and is reported; without, its ``SampleError`` propagates."""
    _, out_h, out_w = canvas.shape
    cell_h, cell_w = out_h // grid, out_w // grid
    all_boxes = [np.zeros((0, 4), dtype=np.float32)]
    all_labels = [np.zeros((0,), dtype=np.int64)]
    kept: list[int] = []
    failed: list[tuple[int, str]] = []
    for t, index in enumerate(indices):
        try:
            source = get_source(index)
        except SampleError as exc:
            if not skip_errors:
                raise
            failed.append((index, str(exc)))
            continue
        row, col = divmod(t, grid)
        boxes, labels = place(canvas, row * cell_h, col * cell_w, cell_h, cell_w, source, flips[t])
        all_boxes.append(boxes)
        all_labels.append(labels)
        kept.append(index)
    if len(all_boxes) == 2:  # one source: no need to join
        return Composed(all_boxes[1], all_labels[1], kept, failed)
    return Composed(np.concatenate(all_boxes), np.concatenate(all_labels), kept, failed)


def compose_one(
    dataset: Any,
    indices: Sequence[int],
    grid: int,
    out_hw: Sequence[int],
    fit_hw: Sequence[int],
    seed: int,
    epoch: int,
) -> tuple[np.ndarray, Composed]:
    """One output image straight from the dataset (no store): what the DataLoader baseline
    and the tests run. Bit-identical to what a worker sends for the same task."""
    canvas = np.zeros((3, int(out_hw[0]), int(out_hw[1])), dtype=np.uint8)
    flips = [flip_of(seed, epoch, i) for i in indices]
    composed = compose_into(
        canvas, lambda i: prepare(dataset, i, fit_hw), indices, grid, flips, False
    )
    return canvas, composed

"""From a task's parameters to output images: read, fit, augment, flip, compose. Pure
functions.

Two stages. The *source* (steps 1-2) is deterministic: what a server's store may keep, and
keeps only for a dataset that says its ``__getitem__`` is a pure function of the index
(``deterministic = True``). The *augment* (steps 3-5) is random, a function of (seed,
epoch, index) and the batch's parameters, and never stored.

1. ``read``: the dataset's sample, checked (``SampleError`` names the index).
2. ``fit``: resized to fit the stored size (the task's ``source_hw``: the largest size of a
   multi-scale schedule, else the image size), keeping its aspect ratio, as CHW planes
   (``Source``). The expensive, mode-independent part: the same fitted source serves a
   regular image, a cell of a stitched one or a mosaic, every epoch, every size of the
   schedule and every job asking for that size.
3. ``refit``: fitted again into the batch's image size, when that is smaller.
4. ``augmented``: the dataset's own ``augment(sample, rng, params)``, if it has one, with
   ``rng`` from (seed, epoch, index) only (``augment_rng``); its answer checked.
5. ``flip_of`` and composition: ``compose_into`` places each source at the top-left of its
   cell, or centred in it (the task's ``letterbox``), on the task's ``pad_value`` (fitted
   into the cell when the cell is smaller), mirrored when its flip says so,
   written plane by plane straight into the output canvas (the wire layout; no
   whole-image transpose); ``dataserver.data.mosaic`` composes a mosaic.

Used unchanged by the server's workers and by the DataLoader baseline of ``dataserver
bench``, so both sides of every comparison run the same image code, and by the tests.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from types import MappingProxyType
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


def refit(source: Source, fit_hw: Sequence[int]) -> Source:
    """``source`` (fitted to the stored size) fitted into ``fit_hw``, keeping its aspect
    ratio; itself when it fits exactly already."""
    _, height, width = source.image.shape
    new_h, new_w = fit_size(height, width, int(fit_hw[0]), int(fit_hw[1]))
    if (new_h, new_w) == (height, width):
        return source
    planes = np.empty((3, new_h, new_w), dtype=np.uint8)
    for c in range(3):
        cv2.resize(source.image[c], (new_w, new_h), dst=planes[c], interpolation=cv2.INTER_LINEAR)
    boxes, labels = _scaled(
        source.boxes, source.labels, new_w / width, new_h / height, new_h, new_w
    )
    return Source(planes, boxes, labels)


def augment_rng(seed: int, epoch: int, index: int) -> np.random.Generator:
    """The generator ``augment`` is given for sample ``index``: a function of (seed, epoch,
    index) only, so a task rerun on any worker of any server draws the same numbers."""
    return np.random.Generator(np.random.PCG64(np.random.SeedSequence([seed, epoch, index, 0xA6])))


@dataclass(frozen=True, slots=True)
class Recipe:
    """What a task says about how its images are made, besides their indices."""

    seed: int
    epoch: int
    step: int
    mode: str
    fit_hw: tuple[int, int]  # the batch's image size
    stored_hw: tuple[int, int]  # the size sources are fitted to first (what the store keeps)
    control: dict[str, Any]  # the session's control values (``augment``'s params)
    pad_value: int = 0  # every pixel no source covers
    letterbox: str = "top-left"  # where a source smaller than its cell sits: or "center"

    def params(self, index: int) -> dict[str, Any]:
        """``augment``'s ``params`` for sample ``index`` (a fresh dict: it may keep it)."""
        return {
            "epoch": self.epoch,
            "step": self.step,
            "mode": self.mode,
            "image_size": self.fit_hw,
            "control": MappingProxyType(self.control),  # (the worker's own: read-only)
            "index": index,
            "seed": self.seed,
        }


def augmented(dataset: Any, index: int, source: Source, recipe: Recipe) -> Source:
    """``source`` through the dataset's ``augment`` (HWC in and out, as ``__getitem__``
    returns), checked: an image at most the batch's size, boxes clipped to it (degenerate
    ones dropped); anything else is a ``SampleError`` naming the index. Without
    ``augment``: ``source`` itself."""
    augment = getattr(dataset, "augment", None)
    if augment is None:
        return source
    sample = {
        "image": cv2.merge([source.image[0], source.image[1], source.image[2]]),
        "boxes": source.boxes.copy(),
        "labels": source.labels.copy(),
    }
    rng = augment_rng(recipe.seed, recipe.epoch, index)
    try:
        raw = augment(sample, rng, recipe.params(index))
    except SampleError:
        raise
    except Exception as exc:
        raise SampleError(index, f"augment raised {type(exc).__name__}: {exc}") from None
    out = as_sample(index, raw, "augment")
    height, width = out.image.shape[:2]
    if height > recipe.fit_hw[0] or width > recipe.fit_hw[1]:
        raise SampleError(
            index,
            f"augment returned a {height}x{width} image, larger than the image size "
            f"{recipe.fit_hw[0]}x{recipe.fit_hw[1]}",
        )
    planes = np.empty((3, height, width), dtype=np.uint8)
    cv2.split(out.image, [planes[0], planes[1], planes[2]])
    boxes, labels = _scaled(out.boxes, out.labels, 1.0, 1.0, height, width)
    return Source(planes, boxes, labels)


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


def letterbox_offset(cell_h: int, cell_w: int, new_h: int, new_w: int) -> tuple[int, int]:
    """(top, left) of an image of (new_h, new_w) centred in a cell of (cell_h, cell_w), as
    Ultralytics' ``LetterBox(center=True)`` rounds it: ``round(d / 2 - 0.1)``."""
    dh, dw = (cell_h - new_h) / 2, (cell_w - new_w) / 2
    return round(dh - 0.1), round(dw - 0.1)


def place(
    canvas: np.ndarray,
    y0: int,
    x0: int,
    cell_h: int,
    cell_w: int,
    source: Source,
    flip: bool,
    center: bool = False,
) -> tuple[np.ndarray, np.ndarray]:
    """Write ``source`` at the top-left of the cell (y0, x0, cell_h, cell_w) of a CHW
    ``canvas`` (``center``: centred in it, ``letterbox_offset``), fitted into the cell when
    it is larger, mirrored when ``flip``. Returns its boxes in canvas pixels and their
    labels (clipped; degenerate ones dropped)."""
    _, height, width = source.image.shape
    new_h, new_w = fit_size(height, width, cell_h, cell_w)
    if center:
        top, left = letterbox_offset(cell_h, cell_w, new_h, new_w)
        y0, x0 = y0 + top, x0 + left
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
    center: bool = False,
) -> Composed:
    """Compose one output image into the CHW ``canvas`` (filled with the padding value)
    from ``indices`` (cell t = (t // grid, t % grid); ``center``: each source centred in
    its cell). With ``skip_errors`` a failing source leaves its cell empty and is reported;
    without, its ``SampleError`` propagates."""
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
        boxes, labels = place(
            canvas, row * cell_h, col * cell_w, cell_h, cell_w, source, flips[t], center
        )
        all_boxes.append(boxes)
        all_labels.append(labels)
        kept.append(index)
    if len(all_boxes) == 2:  # one source: no need to join
        return Composed(all_boxes[1], all_labels[1], kept, failed)
    return Composed(np.concatenate(all_boxes), np.concatenate(all_labels), kept, failed)


def finished(dataset: Any, index: int, stored: Source, recipe: Recipe) -> Source:
    """A source as stored (fitted to ``recipe.stored_hw``) made ready to compose: fitted
    into the batch's size, then augmented. Never stored."""
    source = stored if recipe.stored_hw == recipe.fit_hw else refit(stored, recipe.fit_hw)
    return augmented(dataset, index, source, recipe)


def compose_image(
    canvas: np.ndarray,
    get_source: Callable[[int], Source],
    indices: Sequence[int],
    grid: int,
    layout: str,
    recipe: Recipe,
    skip_errors: bool,
) -> Composed:
    """One output image into the CHW ``canvas``, filled with ``recipe.pad_value``:
    ``layout`` "grid" (``compose_into``, each source placed as ``recipe.letterbox`` says)
    or "mosaic" (``dataserver.data.mosaic``, its randomness from (seed, epoch, indices)).
    ``get_source`` gives a ``finished`` source."""
    flips = [flip_of(recipe.seed, recipe.epoch, i) for i in indices]
    if layout != "mosaic":
        center = recipe.letterbox == "center"
        return compose_into(canvas, get_source, indices, grid, flips, skip_errors, center)
    from dataserver.data.mosaic import compose_mosaic, mosaic_rng

    sources: list[Source | None] = []
    kept: list[int] = []
    failed: list[tuple[int, str]] = []
    for index in indices:
        try:
            sources.append(get_source(index))
            kept.append(index)
        except SampleError as exc:
            if not skip_errors:
                raise
            sources.append(None)
            failed.append((index, str(exc)))
    rng = mosaic_rng(recipe.seed, recipe.epoch, indices)
    boxes, labels = compose_mosaic(canvas, sources, flips, rng)
    return Composed(boxes, labels, kept, failed)


def compose_one(
    dataset: Any,
    indices: Sequence[int],
    grid: int,
    out_hw: Sequence[int],
    fit_hw: Sequence[int],
    seed: int,
    epoch: int,
    *,
    step: int = 0,
    mode: str = "regular",
    layout: str = "grid",
    stored_hw: Sequence[int] | None = None,
    control: dict[str, Any] | None = None,
    pad_value: int = 0,
    letterbox: str = "top-left",
) -> tuple[np.ndarray, Composed]:
    """One output image straight from the dataset (no store): what the DataLoader baseline
    and the tests run. Bit-identical to what a worker sends for the same task."""
    canvas = np.full((3, int(out_hw[0]), int(out_hw[1])), pad_value, dtype=np.uint8)
    fit_size_hw = (int(fit_hw[0]), int(fit_hw[1]))
    stored = fit_size_hw if stored_hw is None else (int(stored_hw[0]), int(stored_hw[1]))
    recipe = Recipe(
        seed,
        epoch,
        step,
        mode,
        fit_size_hw,
        stored,
        dict(control or {}),
        pad_value,
        letterbox,
    )

    def source(i: int) -> Source:
        return finished(dataset, i, prepare(dataset, i, stored), recipe)

    composed = compose_image(canvas, source, indices, grid, layout, recipe, False)
    return canvas, composed

"""From a task's parameters to output images: read, fit, augment, flip, compose. Pure
functions.

Two stages. The *source* (steps 1-2) is deterministic: what a server's store may keep, and
keeps only for a dataset that says its ``__getitem__`` is a pure function of the index
(``deterministic = True``). The *augment* (steps 3-5) is random, a function of (seed,
epoch, index) and the batch's parameters, and never stored.

1. ``read``: the dataset's sample, checked (``SampleError`` names the index).
2. ``fit``: resized to fit the stored size (``BatchSizes.stored``: the largest size of a
   multi-scale schedule, else the image size), keeping its aspect ratio (the task's ``fit``
   "letterbox"; "stretch": resized to the whole size, aspect not kept), as CHW planes
   (``Source``). The expensive, mode-independent part: the same fitted source serves a
   regular image, a cell of a stitched one or a mosaic, every epoch, every size of the
   schedule and every job asking for that size.
3. ``refit``: fitted again into the batch's image size, when that is smaller.
4. ``augmented``: the dataset's own ``augment(sample, rng, params)``, if it has one, with
   ``rng`` from (seed, epoch, index) only (``augment_rng``); its answer checked. A window
   mosaic's partner (``Task.partners``) is drawn for its (anchor, cell) instead
   (``partner_rng``, ``partner_flip``): the same source partnering two anchors differs.
   Not run for a task with ``augment`` 0 (validation), nor the flip, nor
   ``augment_composed``.
5. ``flip_of`` and composition: ``compose_into`` places each source at the top-left of its
   cell, or centred in it (the task's ``letterbox``), on the task's ``pad_value`` (fitted
   into the cell when the cell is smaller), mirrored when its flip says so,
   written plane by plane straight into the output canvas (the wire layout; no
   whole-image transpose); ``dataserver.data.mosaic`` composes a mosaic.

Used unchanged by the server's workers and by the DataLoader baseline of ``dataserver
bench``, so both sides of every comparison run the same image code, and by the tests.

Over the house's ~500 lines (about 715): the per-task image math is one chain of pure
functions (read, fit, augment, flip, compose), each step's output the next one's input; kept
in one module so the chain reads top to bottom.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from types import MappingProxyType
from typing import Any, Protocol

import cv2
import numpy as np

from dataserver.data.composed import Hook, after_composition, composed_rng, hook_of
from dataserver.data.sample import Sample, SampleError, as_sample
from dataserver.data.transforms import fit_size, keep_valid
from dataserver.hashing import MASK64, mix64
from dataserver.protocol.batchsizes import BatchSizes


@dataclass(slots=True)
class Source:
    """A source fitted to an image size: ``image`` uint8 (3, h, w), or (h, w, 3) when
    ``hwc``; ``boxes`` float32 (M, 4) xyxy in its pixels; ``labels`` int64 (M,); ``file``:
    the file its sample names ("" none); ``orig_hw``: the (h, w) its sample says it had as
    read, else the decoded image's ((0, 0): unknown).

    The layout is the dataset's (``layout_of``): planes (CHW, what a batch holds) unless
    it has ``augment_composed``, whose outputs are composed and augmented as HWC images
    (Ultralytics' layout), so that its sources are kept HWC and placed by a plain copy.
    Either way the same bytes come out of a task."""

    image: np.ndarray
    boxes: np.ndarray
    labels: np.ndarray
    file: str = ""
    orig_hw: tuple[int, int] = (0, 0)
    hwc: bool = False

    @property
    def nbytes(self) -> int:
        return int(self.image.nbytes + self.boxes.nbytes + self.labels.nbytes)

    @property
    def hw(self) -> tuple[int, int]:
        """(h, w) of its image, whatever its layout."""
        shape = self.image.shape
        return (int(shape[0]), int(shape[1])) if self.hwc else (int(shape[1]), int(shape[2]))

    def as_hwc(self) -> Source:
        """The same source over the same bytes read as (h, w, 3): for a source the store
        gives back (``Store`` keeps bytes; its views are (3, h, w)) of a dataset whose
        sources are HWC."""
        if self.hwc:
            return self
        _, h, w = self.image.shape
        return Source(
            self.image.reshape(h, w, 3), self.boxes, self.labels, self.file, self.orig_hw, True
        )


def layout_of(dataset: Any) -> str:
    """How ``dataset``'s sources are kept: "hwc" when it has ``augment_composed`` (its
    outputs are composed and augmented HWC), else "chw" (placed plane by plane straight
    into the batch's layout)."""
    return "hwc" if hook_of(dataset) is not None else "chw"


# (anchor, slot) of a window mosaic's partner, whose augmentation is drawn for it; None:
# a source drawn for its own index.
Draw = tuple[int, int] | None


class SourceOf(Protocol):
    """What composition asks for a source: ``finished`` source ``index``, augmented for
    ``draw`` (see ``augmented``)."""

    def __call__(self, index: int, draw: Draw = None, /) -> Source: ...


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


def scales_up(dataset: Any) -> bool:
    """Whether sources of ``dataset`` may be enlarged to fit: unless it says ``scaleup =
    False`` (Ultralytics' ``LetterBox(scaleup=False)``: a dataset that serves its images at
    their final size, e.g. ``yolo_set`` in mode "val"; they are only shrunk when they do
    not fit, and otherwise placed unscaled in a larger canvas)."""
    return getattr(dataset, "scaleup", True) is not False


# Where a fitted source's pixels go: given (h, w, the sample's box count, its file name's
# UTF-8 bytes), a writable uint8 (3, h, w) array (3 * h * w contiguous bytes, read as
# (h, w, 3) for an HWC source), or None for new memory (``Store.fetch`` hands one that lies
# in the store itself, so a source is stored without a copy).
PlanesFor = Callable[[int, int, int, int], "np.ndarray | None"]


def sized(
    height: int, width: int, out_h: int, out_w: int, scaleup: bool, stretch: bool
) -> tuple[int, int]:
    """The size an image of (height, width) takes in (out_h, out_w): all of it when
    ``stretch`` (the aspect ratio not kept, ``scaleup`` ignored), else ``fit_size``'s."""
    if stretch:
        return out_h, out_w
    return fit_size(height, width, out_h, out_w, scaleup)


def fit(
    sample: Sample,
    hw: Sequence[int],
    scaleup: bool = True,
    planes_for: PlanesFor | None = None,
    hwc: bool = False,
    stretch: bool = False,
) -> Source:
    """``sample`` resized to fit (H, W) keeping its aspect ratio (``scaleup=False``: only
    shrunk; ``stretch``: resized to (H, W) exactly), as CHW planes (``hwc``: an (h, w, 3)
    image), in ``planes_for``'s array where it gives one; boxes scaled by the exact
    per-axis factors, clipped, degenerate ones dropped."""
    height, width = sample.image.shape[:2]
    new_h, new_w = sized(height, width, int(hw[0]), int(hw[1]), scaleup, stretch)
    resize = (new_h, new_w) != (height, width)
    place = None
    if planes_for is not None:
        place = planes_for(new_h, new_w, len(sample.boxes), len((sample.file or "").encode()))
    if hwc:
        if place is not None:
            image = place.reshape(new_h, new_w, 3)
            if resize:
                cv2.resize(sample.image, (new_w, new_h), dst=image, interpolation=cv2.INTER_LINEAR)
            else:
                np.copyto(image, sample.image)
        elif resize:
            image = cv2.resize(sample.image, (new_w, new_h), interpolation=cv2.INTER_LINEAR)
        else:
            image = np.ascontiguousarray(sample.image)
    else:
        image = sample.image
        if resize:
            image = cv2.resize(image, (new_w, new_h), interpolation=cv2.INTER_LINEAR)
        planes = place if place is not None else np.empty((3, new_h, new_w), dtype=np.uint8)
        cv2.split(image, [planes[0], planes[1], planes[2]])
        image = planes
    boxes, labels = _scaled(
        sample.boxes, sample.labels, new_w / width, new_h / height, new_h, new_w
    )
    orig = sample.orig_size if sample.orig_size is not None else (height, width)
    return Source(image, boxes, labels, sample.file or "", orig, hwc)


def _scaled(
    boxes: np.ndarray, labels: np.ndarray, sx: float, sy: float, h: int, w: int
) -> tuple[np.ndarray, np.ndarray]:
    if not len(boxes):
        return np.zeros((0, 4), np.float32), np.zeros((0,), np.int64)
    out = boxes * np.array([sx, sy, sx, sy], dtype=np.float32)
    np.clip(out, 0.0, np.array([w, h, w, h], dtype=np.float32), out=out)
    return keep_valid(out, labels)


def prepare(
    dataset: Any,
    index: int,
    hw: Sequence[int],
    planes_for: PlanesFor | None = None,
    stretch: bool = False,
) -> Source:
    """``read`` then ``fit`` into ``hw`` (the stored size) in the dataset's layout
    (``layout_of``; ``stretch``: to all of ``hw``): what a worker does on a store miss."""
    hwc = layout_of(dataset) == "hwc"
    return fit(read(dataset, index), hw, scales_up(dataset), planes_for, hwc, stretch)


def refit(source: Source, hw: Sequence[int], scaleup: bool = True, stretch: bool = False) -> Source:
    """``source`` (fitted to the stored size) fitted into ``hw``, keeping its aspect
    ratio (``scaleup=False``: only shrunk; ``stretch``: resized to ``hw`` exactly), in its
    layout; itself when it fits exactly already."""
    height, width = source.hw
    new_h, new_w = sized(height, width, int(hw[0]), int(hw[1]), scaleup, stretch)
    if (new_h, new_w) == (height, width):
        return source
    if source.hwc:
        image = cv2.resize(source.image, (new_w, new_h), interpolation=cv2.INTER_LINEAR)
    else:
        image = np.empty((3, new_h, new_w), dtype=np.uint8)
        for c in range(3):
            cv2.resize(
                source.image[c], (new_w, new_h), dst=image[c], interpolation=cv2.INTER_LINEAR
            )
    boxes, labels = _scaled(
        source.boxes, source.labels, new_w / width, new_h / height, new_h, new_w
    )
    return Source(image, boxes, labels, source.file, source.orig_hw, source.hwc)


def augment_rng(seed: int, epoch: int, index: int) -> np.random.Generator:
    """The generator ``augment`` is given for sample ``index``: a function of (seed, epoch,
    index) only, so a task rerun on any worker of any server draws the same numbers."""
    return np.random.Generator(np.random.PCG64(np.random.SeedSequence([seed, epoch, index, 0xA6])))


def partner_rng(seed: int, epoch: int, anchor: int, slot: int) -> np.random.Generator:
    """The generator ``augment`` is given for the partner in cell ``slot`` (1..3) of the
    window mosaic anchored at ``anchor`` (``Task.partners``): a function of (seed, epoch,
    anchor, slot) only, so a source that partners several anchors is augmented anew in
    each, and a task rerun anywhere draws the same numbers."""
    entropy = [seed, epoch, anchor, slot, 0xA7]
    return np.random.Generator(np.random.PCG64(np.random.SeedSequence(entropy)))


@dataclass(frozen=True, slots=True)
class Recipe:
    """What a task says about how its images are made, besides their indices."""

    seed: int
    epoch: int
    step: int
    mode: str
    sizes: BatchSizes  # the batch's output, fit (its image size) and stored sizes
    control: dict[str, Any]  # the session's control values (``augment``'s params)
    pad_value: int = 0  # every pixel no source covers
    letterbox: str = "top-left"  # where a source smaller than its cell sits: or "center"
    partners: bool = False  # window mosaics: images[i][0] an anchor, the rest its partners
    fit: str = "letterbox"  # how a source is fitted into its cell: or "stretch"
    augment: bool = True  # False: no flip, no ``augment``, no ``augment_composed``

    @property
    def stretch(self) -> bool:
        return self.fit == "stretch"

    def params(self, index: int) -> dict[str, Any]:
        """``augment``'s ``params`` for sample ``index`` (a fresh dict: it may keep it)."""
        return {
            "epoch": self.epoch,
            "step": self.step,
            "mode": self.mode,
            "image_size": self.sizes.fit,
            "control": MappingProxyType(self.control),  # (the worker's own: read-only)
            "index": index,
            "seed": self.seed,
        }


def augmented(
    dataset: Any, index: int, source: Source, recipe: Recipe, draw: Draw = None
) -> Source:
    """``source`` through the dataset's ``augment`` (HWC in and out, as ``__getitem__``
    returns), checked: an image at most the batch's size, boxes clipped to it (degenerate
    ones dropped); anything else is a ``SampleError`` naming the index. Without
    ``augment``: ``source`` itself. ``draw``: (anchor, slot) for a window mosaic's partner
    (its ``rng`` is ``partner_rng``'s), else None (``augment_rng``'s, of ``index``)."""
    augment = getattr(dataset, "augment", None)
    if augment is None:
        return source
    if source.hwc:  # (a copy: the hook may write into it, and the store's bytes are shared)
        image = source.image.copy()
    else:
        image = cv2.merge([source.image[0], source.image[1], source.image[2]])
    sample = {
        "image": image,
        "boxes": source.boxes.copy(),
        "labels": source.labels.copy(),
    }
    if draw is None:
        rng = augment_rng(recipe.seed, recipe.epoch, index)
    else:
        rng = partner_rng(recipe.seed, recipe.epoch, draw[0], draw[1])
    try:
        raw = augment(sample, rng, recipe.params(index))
    except SampleError:
        raise
    except Exception as exc:
        raise SampleError(index, f"augment raised {type(exc).__name__}: {exc}") from None
    out = as_sample(index, raw, "augment")
    height, width = out.image.shape[:2]
    fit_h, fit_w = recipe.sizes.fit
    if height > fit_h or width > fit_w:
        raise SampleError(
            index,
            f"augment returned a {height}x{width} image, larger than the image size "
            f"{fit_h}x{fit_w}",
        )
    if source.hwc:
        planes = np.ascontiguousarray(out.image)
    else:
        planes = np.empty((3, height, width), dtype=np.uint8)
        cv2.split(out.image, [planes[0], planes[1], planes[2]])
    boxes, labels = _scaled(out.boxes, out.labels, 1.0, 1.0, height, width)
    return Source(planes, boxes, labels, source.file, source.orig_hw, source.hwc)


def flip_of(seed: int, epoch: int, index: int) -> bool:
    """The augmentation: mirror left-right or not, a function of (seed, epoch, index) only
    (so a task rerun anywhere gives the same bytes), true for about half of the indices."""
    return bool(mix64(mix64(mix64(seed & MASK64) ^ (epoch & MASK64)) ^ (index & MASK64)) >> 63)


def partner_flip(seed: int, epoch: int, anchor: int, slot: int) -> bool:
    """``flip_of`` for the partner in cell ``slot`` of the window mosaic anchored at
    ``anchor``: a function of (seed, epoch, anchor, slot) only."""
    base = mix64(mix64(mix64(seed & MASK64) ^ (epoch & MASK64)) ^ (anchor & MASK64))
    return bool(mix64(base ^ (0xF1E9 << 8 | slot)) >> 63)


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


def _draw_hwc(
    canvas: np.ndarray, y0: int, x0: int, size: tuple[int, int], image: np.ndarray, flip: bool
) -> None:
    """``_draw`` for an HWC ``image`` on an HWC ``canvas``."""
    new_h, new_w = size
    dst = canvas[y0 : y0 + new_h, x0 : x0 + new_w]
    if size == image.shape[:2]:
        if flip:
            cv2.flip(image, 1, dst=dst)
        else:
            np.copyto(dst, image)
        return
    cv2.resize(image, (new_w, new_h), dst=dst, interpolation=cv2.INTER_LINEAR)
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
    scaleup: bool = True,
    stretch: bool = False,
) -> tuple[np.ndarray, np.ndarray]:
    """Write ``source`` at the top-left of the cell (y0, x0, cell_h, cell_w) of a
    ``canvas`` in its layout (CHW, or (H, W, 3) for an HWC source) (``center``: centred in
    it, ``letterbox_offset``), fitted into the cell (``scaleup=False``: only when it is
    larger; ``stretch``: resized to the whole cell), mirrored when ``flip``. Returns its
    boxes in canvas pixels and their labels (clipped; degenerate ones dropped)."""
    height, width = source.hw
    new_h, new_w = sized(height, width, cell_h, cell_w, scaleup, stretch)
    if center:
        top, left = letterbox_offset(cell_h, cell_w, new_h, new_w)
        y0, x0 = y0 + top, x0 + left
    draw = _draw_hwc if source.hwc else _draw
    draw(canvas, y0, x0, (new_h, new_w), source.image, flip)
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
    sources left out as (index, reason); ``content``: for an image of one cell, the (top,
    left, h, w) its picture covers (None: the whole canvas, ``content_of``)."""

    boxes: np.ndarray
    labels: np.ndarray
    indices: list[int]
    failed: list[tuple[int, str]]
    content: tuple[int, int, int, int] | None = None


def compose_into(
    canvas: np.ndarray,
    get_source: Callable[[int], Source],
    indices: Sequence[int],
    grid: int,
    flips: Sequence[bool],
    skip_errors: bool,
    center: bool = False,
    scaleup: bool = True,
    hwc: bool = False,
    stretch: bool = False,
) -> Composed:
    """Compose one output image into the CHW ``canvas`` (``hwc``: an (H, W, 3) one, for
    HWC sources), filled with the padding value, from ``indices`` (cell t = (t // grid,
    t % grid); ``center``: each source centred in its cell; ``stretch``: resized to the whole
    cell). With ``skip_errors`` a
    failing source leaves its cell empty and is reported; without, its ``SampleError``
    propagates."""
    out_h, out_w = canvas.shape[:2] if hwc else canvas.shape[1:]
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
        if source.hwc != hwc:
            source = in_layout(source, hwc)
        row, col = divmod(t, grid)
        boxes, labels = place(
            canvas,
            row * cell_h,
            col * cell_w,
            cell_h,
            cell_w,
            source,
            flips[t],
            center,
            scaleup,
            stretch,
        )
        all_boxes.append(boxes)
        all_labels.append(labels)
        kept.append(index)
    if len(all_boxes) == 2:  # one source: no need to join
        content = None
        if grid == 1:
            height, width = source.hw
            new_h, new_w = sized(height, width, out_h, out_w, scaleup, stretch)
            top, left = letterbox_offset(out_h, out_w, new_h, new_w) if center else (0, 0)
            content = (top, left, new_h, new_w)
        return Composed(all_boxes[1], all_labels[1], kept, failed, content)
    return Composed(np.concatenate(all_boxes), np.concatenate(all_labels), kept, failed)


def content_of(composed: Composed, out_hw: Sequence[int]) -> tuple[int, int, int, int]:
    """(top, left, h, w) of the picture of one output image in its canvas of ``out_hw``:
    where its one source lies (a regular image), else the whole canvas (a stitched or mosaic
    image, or one through ``augment_composed``, which may move its picture anywhere)."""
    if composed.content is not None:
        return composed.content
    return 0, 0, int(out_hw[0]), int(out_hw[1])


def in_layout(source: Source, hwc: bool) -> Source:
    """``source`` with its image in the layout asked for (a copy when it is not already)."""
    if source.hwc == hwc:
        return source
    if hwc:
        image = cv2.merge([source.image[0], source.image[1], source.image[2]])
    else:
        height, width = source.hw
        image = np.empty((3, height, width), np.uint8)
        cv2.split(source.image, [image[0], image[1], image[2]])
    return Source(image, source.boxes, source.labels, source.file, source.orig_hw, hwc)


def finished(dataset: Any, index: int, stored: Source, recipe: Recipe, draw: Draw = None) -> Source:
    """A source as stored (fitted to ``recipe.sizes.stored``) made ready to compose: fitted
    into the batch's size, then augmented (``draw``: see ``augmented``; not with
    ``recipe.augment`` False). Never stored."""
    sizes, grow = recipe.sizes, scales_up(dataset)
    if sizes.stored != sizes.fit:
        stored = refit(stored, sizes.fit, grow, recipe.stretch)
    if not recipe.augment:
        return stored
    return augmented(dataset, index, stored, recipe, draw)


def compose_image(
    canvas: np.ndarray,
    get_source: SourceOf,
    indices: Sequence[int],
    grid: int,
    layout: str,
    recipe: Recipe,
    skip_errors: bool,
    dataset: Any = None,
) -> Composed:
    """One output image into the CHW ``canvas``, filled here with ``recipe.pad_value`` (unless
    every pixel is written anyway, as through ``augment_composed``), then,
    when ``dataset`` has ``augment_composed``, through it (``dataserver.data.composed``):
    ``layout`` "grid" (``compose_into``, each source placed as ``recipe.letterbox`` says)
    or "mosaic" (``dataserver.data.mosaic``, its randomness from (seed, epoch, indices)).
    ``get_source`` gives a ``finished`` source. With ``recipe.partners`` (window mosaics),
    ``indices[0]`` is the anchor and the source in cell t >= 1 is drawn for (anchor, t)
    (``partner_flip``, ``partner_rng``); the anchor alone is a regular image."""
    window = recipe.partners and layout == "mosaic"
    if window and len(indices) == 1:  # no mosaic drawn for this anchor: a regular image
        layout, grid = "grid", 1
    hook = hook_of(dataset) if recipe.augment else None
    if hook is None:
        canvas.fill(recipe.pad_value)
    if layout != "mosaic":
        grow = scales_up(dataset)
        return _compose_grid(canvas, get_source, indices, grid, recipe, skip_errors, hook, grow)
    flips = [recipe.augment and flip_of(recipe.seed, recipe.epoch, i) for i in indices]
    from dataserver.data.mosaic import compose_mosaic, mosaic_rng

    sources: list[Source | None] = []
    kept: list[int] = []
    failed: list[tuple[int, str]] = []
    if window and recipe.augment:
        anchor = indices[0]
        for t in range(1, len(indices)):
            flips[t] = partner_flip(recipe.seed, recipe.epoch, anchor, t)
    for t, index in enumerate(indices):
        try:
            sources.append(get_source(index, (indices[0], t) if window and t else None))
            kept.append(index)
        except SampleError as exc:
            if not skip_errors:
                raise
            sources.append(None)
            failed.append((index, str(exc)))
    rng = mosaic_rng(recipe.seed, recipe.epoch, indices)
    if hook is None:  # (HWC sources of a dataset whose augment_composed is off: as planes)
        planes = [None if s is None else in_layout(s, False) for s in sources]
        boxes, labels = compose_mosaic(canvas, planes, flips, rng)
        return Composed(boxes, labels, kept, failed)
    done = Composed(np.zeros((0, 4), np.float32), np.zeros((0,), np.int64), kept, failed)
    return _after(hook, canvas, sources, done, indices[0], recipe, skip_errors, rng)


def _compose_grid(
    canvas: np.ndarray,
    get_source: SourceOf,
    indices: Sequence[int],
    grid: int,
    recipe: Recipe,
    skip_errors: bool,
    hook: Hook | None,
    scaleup: bool = True,
) -> Composed:
    """``compose_into`` as ``recipe`` says, then ``hook`` (which flips the whole image, as
    Ultralytics does: its sources are not mirrored), the image composed HWC for it."""
    center, stretch = recipe.letterbox == "center", recipe.stretch
    if hook is None:
        flips = [recipe.augment and flip_of(recipe.seed, recipe.epoch, i) for i in indices]
        return compose_into(
            canvas, get_source, indices, grid, flips, skip_errors, center, scaleup, False, stretch
        )
    flat = [False] * len(indices)
    _, out_h, out_w = canvas.shape
    image = np.full((out_h, out_w, 3), recipe.pad_value, np.uint8)
    done = compose_into(
        image, get_source, indices, grid, flat, skip_errors, center, scaleup, True, stretch
    )
    return _after(hook, canvas, None, done, indices[0], recipe, skip_errors, image=image)


def _after(
    hook: Hook,
    canvas: np.ndarray,
    sources: Sequence[Source | None] | None,
    done: Composed,
    anchor: int,
    recipe: Recipe,
    skip_errors: bool,
    rng: np.random.Generator | None = None,
    image: np.ndarray | None = None,
) -> Composed:
    """``done`` (``image``: composed HWC, for ``sources`` None) through the dataset's
    ``augment_composed`` (``composed.after_composition``), its answer written into the CHW
    ``canvas`` (every pixel): a mosaic (``sources``, its geometry from ``rng``) built on
    Ultralytics' 2H x 2W canvas first. With ``skip_errors`` a hook that fails leaves the
    image out (its samples reported failed; ``canvas`` padding); without, its
    ``SampleError`` (naming the anchor) propagates."""
    if not done.indices:
        canvas.fill(recipe.pad_value)
        return done
    params = recipe.params(anchor)
    try:
        boxes, labels = after_composition(
            hook,
            canvas,
            sources,
            done.boxes,
            done.labels,
            composed_rng(recipe.seed, recipe.epoch, anchor),
            params,
            recipe.pad_value,
            rng,
            done.content,
            image,
        )
    except SampleError as exc:
        if not skip_errors:
            raise
        canvas.fill(recipe.pad_value)
        failed = [*done.failed, *((i, str(exc)) for i in done.indices)]
        return Composed(np.zeros((0, 4), np.float32), np.zeros((0,), np.int64), [], failed)
    return Composed(boxes, labels, done.indices, done.failed)


def compose_one(
    dataset: Any,
    indices: Sequence[int],
    grid: int,
    sizes: BatchSizes,
    seed: int,
    epoch: int,
    *,
    step: int = 0,
    mode: str = "regular",
    layout: str = "grid",
    control: dict[str, Any] | None = None,
    pad_value: int = 0,
    letterbox: str = "top-left",
    partners: bool = False,
    fit: str = "letterbox",
    augment: bool = True,
) -> tuple[np.ndarray, Composed]:
    """One output image straight from the dataset (no store): what the DataLoader baseline
    and the tests run. Bit-identical to what a worker sends for the same task
    (``partners``: the task's flag, a window mosaic)."""
    canvas = np.empty((3, *sizes.out), dtype=np.uint8)  # (compose_image fills it)
    recipe = Recipe(
        seed,
        epoch,
        step,
        mode,
        sizes,
        dict(control or {}),
        pad_value,
        letterbox,
        partners,
        fit,
        augment,
    )

    def source(i: int, draw: Draw = None) -> Source:
        stored = prepare(dataset, i, sizes.stored, None, recipe.stretch)
        return finished(dataset, i, stored, recipe, draw)

    composed = compose_image(canvas, source, indices, grid, layout, recipe, False, dataset)
    return canvas, composed

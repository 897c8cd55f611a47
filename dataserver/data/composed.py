"""After composition: a dataset's ``augment_composed(sample, rng, params)`` on each finished
output image (regular, grid or mosaic), before it lands. Pure functions.

The hook gets ``{"image": uint8 (H, W, 3), "boxes": float32 (M, 4) xyxy, "labels": int64
(M,)}``, a generator from (seed, epoch, anchor) only (``composed_rng``: its own tag, so it
never repeats ``augment``'s draws for the same index) and ``augment``'s params plus
``"border"`` (bh, bw) and ``"mosaic"``: a mosaic is handed over as Ultralytics'
``Mosaic._mosaic4`` leaves it (the 2H x 2W canvas, ``border = (-H // 2, -W // 2)``,
``dataserver.data.mosaic.mosaic4_canvas``), anything else as composed (H x W, border
(0, 0); a regular image also with ``"content"``, the (top, left, h, w) its picture covers).
Its answer must be exactly the output's (H, W); its boxes are clipped to it and degenerate
ones dropped; anything else is a ``SampleError`` naming the anchor. A hook that reads only
part of a mosaic's canvas says which with ``mosaic_region(rng, params)`` (``region_of``: on
the hook or on the dataset it is a method of; given a copy of the generator the hook gets
and the params it gets): only that part is built (padding and tiles), the rest of the
canvas it is handed is left unwritten.
"""

from __future__ import annotations

import copy
from collections.abc import Callable, Mapping, Sequence
from typing import TYPE_CHECKING, Any

import cv2
import numpy as np

from dataserver.data.mosaic import mosaic4_canvas
from dataserver.data.sample import SampleError, as_sample
from dataserver.data.transforms import keep_valid

if TYPE_CHECKING:  # only for annotations: pipeline.py imports this module
    from dataserver.data.pipeline import Source

COMPOSED_TAG = 0xC0  # (augment_rng's is 0xA6)

Hook = Callable[[dict[str, Any], np.random.Generator, Mapping[str, Any]], Any]


def composed_rng(seed: int, epoch: int, anchor: int) -> np.random.Generator:
    """The generator ``augment_composed`` is given for the output anchored at ``anchor``
    (its first index): a function of (seed, epoch, anchor) only, so a task rerun on any
    worker of any server draws the same numbers."""
    entropy = [seed, epoch, anchor, COMPOSED_TAG]
    return np.random.Generator(np.random.PCG64(np.random.SeedSequence(entropy)))


def hook_of(dataset: Any) -> Hook | None:
    """The dataset's ``augment_composed``, or None."""
    hook = getattr(dataset, "augment_composed", None)
    return hook if callable(hook) else None


def region_of(hook: Hook) -> Callable[..., Any] | None:
    """The ``mosaic_region(rng, params)`` of ``hook`` (or of the dataset it is a method of),
    or None: a hook that says which part of a mosaic's 2H x 2W canvas it reads (the rest is
    then never built; ``YoloAugment``'s warp reads about a third of it)."""
    for owner in (hook, getattr(hook, "__self__", None)):
        found = getattr(owner, "mosaic_region", None)
        if callable(found):
            return found
    return None


def _region(
    finder: Callable[..., Any],
    anchor: int,
    rng: np.random.Generator,
    params: Mapping[str, Any],
    big_hw: tuple[int, int],
) -> tuple[int, int, int, int] | None:
    """``finder``'s (top, left, bottom, right) of the canvas, checked (a SampleError naming
    the anchor otherwise); None: the whole canvas."""
    try:
        region = finder(rng, params)
    except Exception as exc:
        raise SampleError(anchor, f"mosaic_region raised {type(exc).__name__}: {exc}") from None
    if region is None:
        return None
    top, left, bottom, right = (int(v) for v in region)
    if not (0 <= top <= bottom <= big_hw[0] and 0 <= left <= right <= big_hw[1]):
        raise SampleError(anchor, f"mosaic_region {region} is not inside the {big_hw} canvas")
    return top, left, bottom, right


def run_hook(
    hook: Hook,
    anchor: int,
    image: np.ndarray,
    boxes: np.ndarray,
    labels: np.ndarray,
    rng: np.random.Generator,
    params: dict[str, Any],
    out_hw: tuple[int, int],
) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """``hook`` on one composed image (HWC); its answer checked: (image (H, W, 3) uint8 of
    exactly ``out_hw``, boxes clipped to it, their labels)."""
    sample = {"image": image, "boxes": boxes, "labels": labels}
    try:
        raw = hook(sample, rng, params)
    except SampleError:
        raise
    except Exception as exc:
        raise SampleError(anchor, f"augment_composed raised {type(exc).__name__}: {exc}") from None
    out = as_sample(anchor, raw, "augment_composed")
    height, width = out.image.shape[:2]
    if (height, width) != tuple(out_hw):
        raise SampleError(
            anchor,
            f"augment_composed returned a {height}x{width} image, not the output size "
            f"{out_hw[0]}x{out_hw[1]}",
        )
    if not len(out.boxes):
        return out.image, np.zeros((0, 4), np.float32), np.zeros((0,), np.int64)
    clipped = np.clip(out.boxes, 0.0, np.array([width, height, width, height], np.float32))
    kept, kept_labels = keep_valid(clipped, out.labels)
    return out.image, kept, kept_labels


def after_composition(
    hook: Hook,
    canvas: np.ndarray,
    sources: Sequence[Source | None] | None,
    boxes: np.ndarray,
    labels: np.ndarray,
    rng: np.random.Generator,
    params: dict[str, Any],
    pad_value: int,
    mosaic_rng: np.random.Generator | None = None,
    content: tuple[int, int, int, int] | None = None,
    image: np.ndarray | None = None,
) -> tuple[np.ndarray, np.ndarray]:
    """One output through ``hook``, written into its CHW ``canvas`` (every pixel); returns
    its boxes and labels. ``sources`` None: the image composed HWC in ``image`` (else in
    ``canvas``; with ``boxes`` and ``labels``; ``content``: where a regular image's
    picture lies), border (0, 0).
    Otherwise a mosaic of ``sources``, laid out by ``mosaic4_canvas`` from ``mosaic_rng``
    with ``pad_value``, border (-H // 2, -W // 2). ``params`` (``augment``'s, of the
    anchor: ``params["index"]``) gains ``border`` and ``mosaic``."""
    _, out_h, out_w = canvas.shape
    if sources is None:
        if image is None:
            image = cv2.merge([canvas[0], canvas[1], canvas[2]])
        params.update(border=(0, 0), mosaic=False)
        if content is not None:
            params["content"] = content
    else:
        if mosaic_rng is None:
            raise ValueError("a mosaic needs its generator")
        params.update(border=(-out_h // 2, -out_w // 2), mosaic=True)
        finder = region_of(hook)
        region = None
        if finder is not None:  # its draws from a copy of the hook's own generator
            big = (2 * out_h, 2 * out_w)
            region = _region(finder, int(params["index"]), copy.deepcopy(rng), params, big)
        image, boxes, labels = mosaic4_canvas(
            sources, (out_h, out_w), pad_value, mosaic_rng, region
        )
    anchor = int(params["index"])
    out, boxes, labels = run_hook(hook, anchor, image, boxes, labels, rng, params, (out_h, out_w))
    cv2.split(out, [canvas[0], canvas[1], canvas[2]])
    return boxes, labels

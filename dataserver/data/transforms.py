"""Pure image and box functions: decode, flip, letterbox, clip.

Every function here is deterministic and free of global state so that a task rerun on
another worker or another server gives identical bytes. Randomness comes only from
``augment_rng(seed, epoch, index)``. Workers call ``cv2.setNumThreads(1)``.
"""

from __future__ import annotations

import cv2
import numpy as np

from dataserver.data.sample import Sample


def augment_rng(seed: int, epoch: int, index: int) -> np.random.Generator:
    """The only source of augmentation randomness: a function of (seed, epoch, index)."""
    return np.random.default_rng(np.random.SeedSequence([seed, epoch, index]))


def decode_image(data: bytes | np.ndarray) -> np.ndarray | None:
    """Decode encoded image bytes (JPEG, PNG, ...) to uint8 (H, W, 3) RGB, or None."""
    buf = np.frombuffer(data, dtype=np.uint8) if isinstance(data, bytes) else data
    if buf.size == 0:
        return None
    bgr = cv2.imdecode(buf, cv2.IMREAD_COLOR)
    if bgr is None or bgr.ndim != 3:
        return None
    return cv2.cvtColor(bgr, cv2.COLOR_BGR2RGB)


def hflip(sample: Sample) -> Sample:
    """Mirror left-right; a box [x1, y1, x2, y2] becomes [W - x2, y1, W - x1, y2]."""
    width = sample.image.shape[1]
    image = cv2.flip(sample.image, 1)  # 50x faster than numpy's negative-stride copy
    boxes = sample.boxes.copy()
    boxes[:, 0] = width - sample.boxes[:, 2]
    boxes[:, 2] = width - sample.boxes[:, 0]
    return Sample(image, boxes, sample.labels)


def augment(sample: Sample, rng: np.random.Generator) -> Sample:
    """The mode-independent augmentation: horizontal flip with probability 0.5."""
    return hflip(sample) if rng.random() < 0.5 else sample


def clip_boxes(boxes: np.ndarray, height: float, width: float) -> np.ndarray:
    """Clip xyxy boxes to [0, width] x [0, height]."""
    out = boxes.copy()
    np.clip(out[:, 0::2], 0.0, width, out=out[:, 0::2])
    np.clip(out[:, 1::2], 0.0, height, out=out[:, 1::2])
    return out


def keep_valid(boxes: np.ndarray, labels: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Drop degenerate boxes: those without positive width and height."""
    keep = (boxes[:, 2] > boxes[:, 0]) & (boxes[:, 3] > boxes[:, 1])
    return boxes[keep], labels[keep]


def fit_size(height: int, width: int, out_h: int, out_w: int) -> tuple[int, int]:
    """Size (h, w) of an image scaled to fit (out_h, out_w) keeping its aspect ratio."""
    scale = min(out_h / height, out_w / width)
    new_h = min(out_h, max(1, round(height * scale)))
    new_w = min(out_w, max(1, round(width * scale)))
    return new_h, new_w


def letterbox_into(
    canvas: np.ndarray,
    y0: int,
    x0: int,
    cell_h: int,
    cell_w: int,
    sample: Sample,
    chw: bool = False,
) -> tuple[np.ndarray, np.ndarray]:
    """Resize ``sample`` to fit the cell at (y0, x0) of ``canvas`` (HWC, or CHW when ``chw``),
    keeping its aspect ratio, and paste it at the cell's top-left; the rest of the cell is
    left as it is. Writing a CHW canvas plane by plane spares a whole-image transpose.

    Returns the sample's boxes in canvas pixels (scaled by the exact per-axis factors
    new_w / w and new_h / h, offset by the cell origin, clipped to the pasted image) and their
    labels, degenerate boxes dropped.
    """
    height, width = sample.image.shape[:2]
    new_h, new_w = fit_size(height, width, cell_h, cell_w)
    if (new_h, new_w) == (height, width):
        resized = sample.image
    else:
        resized = cv2.resize(sample.image, (new_w, new_h), interpolation=cv2.INTER_LINEAR)
    if chw:
        cv2.split(resized, [canvas[c, y0 : y0 + new_h, x0 : x0 + new_w] for c in range(3)])
    else:
        canvas[y0 : y0 + new_h, x0 : x0 + new_w] = resized
    boxes = sample.boxes * np.array(
        [new_w / width, new_h / height, new_w / width, new_h / height], dtype=np.float32
    )
    boxes = clip_boxes(boxes, new_h, new_w)
    boxes, labels = keep_valid(boxes, sample.labels)
    boxes += np.array([x0, y0, x0, y0], dtype=np.float32)
    return boxes, labels


def letterbox(sample: Sample, out_h: int, out_w: int) -> Sample:
    """The regular-mode output: ``sample`` fitted into a zero (out_h, out_w) canvas,
    top-left, aspect ratio kept, boxes moved with the pixels."""
    canvas = np.zeros((out_h, out_w, 3), dtype=np.uint8)
    boxes, labels = letterbox_into(canvas, 0, 0, out_h, out_w, sample)
    return Sample(canvas, boxes, labels)

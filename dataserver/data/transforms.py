"""Pure image and box helpers: decode, fit sizes, box clipping.

Deterministic and free of global state, so that a task rerun on another worker or another
server gives identical bytes. Workers call ``cv2.setNumThreads(1)``. The steps of the
per-task pipeline (fit, flip, compose) are in ``pipeline.py``.
"""

from __future__ import annotations

import math

import cv2
import numpy as np


def decode_image(data: bytes | np.ndarray) -> np.ndarray | None:
    """Decode encoded image bytes (JPEG, PNG, ...) to uint8 (H, W, 3) RGB, or None."""
    buf = np.frombuffer(data, dtype=np.uint8) if isinstance(data, bytes) else data
    if buf.size == 0:
        return None
    if _RGB is not None:  # the decoder writes RGB itself (the same bytes, no swap pass)
        rgb = cv2.imdecode(buf, _RGB)
        return None if rgb is None or rgb.ndim != 3 else rgb
    bgr = cv2.imdecode(buf, cv2.IMREAD_COLOR)
    if bgr is None or bgr.ndim != 3:
        return None
    return cv2.cvtColor(bgr, cv2.COLOR_BGR2RGB)


_RGB: int | None = getattr(cv2, "IMREAD_COLOR_RGB", None)  # OpenCV >= 4.10


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


def fit_size(
    height: int, width: int, out_h: int, out_w: int, scaleup: bool = True
) -> tuple[int, int]:
    """Size (h, w) of an image scaled to fit (out_h, out_w) keeping its aspect ratio
    (``scaleup=False``: never enlarged, only shrunk when it does not fit)."""
    scale = min(out_h / height, out_w / width)
    if not scaleup:
        scale = min(scale, 1.0)
    new_h = min(out_h, max(1, round(height * scale)))
    new_w = min(out_w, max(1, round(width * scale)))
    return new_h, new_w


def grid_side(k: int) -> int:
    """sqrt(k) for a square k (1, 4, 9, 16); ValueError otherwise."""
    side = math.isqrt(k)
    if k < 1 or side * side != k:
        raise ValueError(f"stitch_k must be a square (1, 4, 9, 16), got {k}")
    return side

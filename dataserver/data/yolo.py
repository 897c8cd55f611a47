"""Ultralytics' YOLO training augmentation after composition, as a dataset's
``augment_composed``: RandomPerspective, HSV, vertical and horizontal flips. numpy and cv2
only (it runs in the servers: no torch, no ultralytics).

    class MyDataset:
        augment_composed = YoloAugment(degrees=0.0, scale=0.5, fliplr=0.5)

Each step is Ultralytics 8.4's own (``ultralytics/data/augment.py``), on the same numbers:

- ``RandomPerspective``: ``M = T @ S @ R @ P @ C`` built in float32 exactly as
  ``_compute_affine_matrix`` builds it (C centres the input, P perspective, R
  ``cv2.getRotationMatrix2D(angle, (0, 0), s)``, S shear, T the translation as a fraction of
  the output size), ``cv2.warpAffine`` (``warpPerspective`` when ``perspective`` is set) with
  ``borderValue`` 114; boxes: the four corners through M (``apply_bboxes``), clipped to the
  output, kept by ``box_candidates`` against the input boxes scaled by s. The output is
  ``size`` (h, w): the composed output's ``image_size``. Ultralytics 8.4 passes
  ``size=(imgsz, imgsz)``; older versions gave ``border=(-imgsz // 2, -imgsz // 2)`` for a
  mosaic's 2s x 2s canvas and 0 otherwise and sized the output ``input + 2 x border``, which
  is the same output for even sizes; without ``size`` that rule is used here.
- ``RandomHSV``: the LUT method (hue shifted by ``r[0] * 180`` modulo 180, saturation and
  value scaled and clipped, ``lut_sat[0] = 0``). Ultralytics' images are BGR and ours RGB:
  ``COLOR_RGB2HSV``/``COLOR_HSV2RGB`` give the same HSV planes and bytes, channels reversed.
- ``RandomFlip``: ``flipud`` then ``fliplr``, boxes mirrored (``w - x2, w - x1``).

Draws: Ultralytics draws with Python's ``random.uniform(a, b)`` (``a + (b - a) *
random()``), ``np.random.uniform(-1, 1, 3)`` for HSV and ``random.random() < p`` per flip.
Here the same formulas draw from the ``numpy.random.Generator`` given, in Ultralytics' order
(``draw_perspective``, ``draw_hsv``, then one ``rng.random()`` per flip), so that anyone who
feeds Ultralytics those values gets our bytes (``tests/test_yolo_transforms.py`` does).
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import cv2
import numpy as np

from dataserver.data.mosaic import box_candidates

Arrays = tuple[np.ndarray, np.ndarray, np.ndarray]


@dataclass(frozen=True, slots=True)
class PerspectiveDraw:
    """The eight values ``RandomPerspective`` draws, in its order: perspective (x, y), the
    rotation in degrees, the scale factor, the shears in degrees (x, y) and the translation
    as fractions of the output size (x, y; 0.5 centres the input on the output)."""

    perspective_x: float = 0.0
    perspective_y: float = 0.0
    angle: float = 0.0
    scale: float = 1.0
    shear_x: float = 0.0
    shear_y: float = 0.0
    translate_x: float = 0.5
    translate_y: float = 0.5


def draw_perspective(
    rng: np.random.Generator,
    degrees: float = 0.0,
    translate: float = 0.1,
    scale: float | tuple[float, float] = 0.5,
    shear: float = 0.0,
    perspective: float = 0.0,
) -> PerspectiveDraw:
    """Eight ``rng.random()`` draws turned into a ``PerspectiveDraw`` with Python's
    ``random.uniform`` formula and Ultralytics' ranges; ``scale`` a float means
    [1 - scale, 1 + scale], a pair (min, max) the factors themselves."""

    def uniform(lo: float, hi: float) -> float:
        return lo + (hi - lo) * float(rng.random())

    px = uniform(-perspective, perspective)
    py = uniform(-perspective, perspective)
    angle = uniform(-degrees, degrees)
    if isinstance(scale, (tuple, list)):
        s = uniform(scale[0], scale[1])
    else:
        s = uniform(1 - scale, 1 + scale)
    sx = uniform(-shear, shear)
    sy = uniform(-shear, shear)
    tx = uniform(0.5 - translate, 0.5 + translate)
    ty = uniform(0.5 - translate, 0.5 + translate)
    return PerspectiveDraw(px, py, angle, s, sx, sy, tx, ty)


def perspective_matrix(
    draw: PerspectiveDraw, in_hw: tuple[int, int], out_hw: tuple[int, int]
) -> np.ndarray:
    """Ultralytics' 3 x 3 float32 ``M = T @ S @ R @ P @ C`` for an input of ``in_hw`` and an
    output of ``out_hw`` (both (h, w)), every factor built as ``_compute_affine_matrix``
    builds it, so that M is bit-identical to Ultralytics' for the same draws."""
    c = np.eye(3, dtype=np.float32)
    c[0, 2] = -in_hw[1] / 2
    c[1, 2] = -in_hw[0] / 2
    p = np.eye(3, dtype=np.float32)
    p[2, 0] = draw.perspective_x
    p[2, 1] = draw.perspective_y
    r = np.eye(3, dtype=np.float32)
    r[:2] = cv2.getRotationMatrix2D(angle=draw.angle, center=(0, 0), scale=draw.scale)
    s = np.eye(3, dtype=np.float32)
    s[0, 1] = math.tan(draw.shear_x * math.pi / 180)
    s[1, 0] = math.tan(draw.shear_y * math.pi / 180)
    t = np.eye(3, dtype=np.float32)
    t[0, 2] = draw.translate_x * out_hw[1]
    t[1, 2] = draw.translate_y * out_hw[0]
    m: np.ndarray = t @ s @ r @ p @ c  # right to left, as Ultralytics
    return m


def transform_boxes(boxes: np.ndarray, m: np.ndarray, projective: bool) -> np.ndarray:
    """``apply_bboxes``: each xyxy box's four corners through ``m`` (divided by w when
    ``projective``), the box their bounds; computed in ``boxes``' dtype."""
    n = len(boxes)
    if n == 0:
        return boxes
    xy = np.ones((n * 4, 3), dtype=boxes.dtype)
    xy[:, :2] = boxes[:, [0, 1, 2, 3, 0, 3, 2, 1]].reshape(n * 4, 2)
    xy = xy @ m.T
    xy = (xy[:, :2] / xy[:, 2:3] if projective else xy[:, :2]).reshape(n, 8)
    x = xy[:, [0, 2, 4, 6]]
    y = xy[:, [1, 3, 5, 7]]
    out: np.ndarray = np.concatenate(
        (x.min(1), y.min(1), x.max(1), y.max(1)), dtype=boxes.dtype
    ).reshape(4, n)
    return out.T


def output_size(
    in_hw: tuple[int, int], border: tuple[int, int], size: tuple[int, int] | None
) -> tuple[int, int]:
    """(h, w) of the warped output: ``size`` when given, else the input grown by twice
    ``border`` (Ultralytics' older rule); a ValueError when not positive."""
    if size is not None:
        out = (int(size[0]), int(size[1]))
    else:
        out = (int(in_hw[0]) + 2 * int(border[0]), int(in_hw[1]) + 2 * int(border[1]))
    if out[0] < 1 or out[1] < 1:
        raise ValueError(f"perspective output size must be positive, got {out} (h, w)")
    return out


def apply_perspective(
    image: np.ndarray,
    boxes: np.ndarray,
    labels: np.ndarray,
    draw: PerspectiveDraw,
    *,
    border: tuple[int, int] = (0, 0),
    size: tuple[int, int] | None = None,
    perspective: float = 0.0,
    pad_value: int = 114,
    content: tuple[int, int, int, int] | None = None,
) -> Arrays:
    """``RandomPerspective`` with the draws given: (image, boxes, labels) warped to the output
    size (``output_size``), boxes float32 xyxy clipped to it, the boxes and labels that
    ``box_candidates`` (and finiteness) reject dropped. ``perspective`` non-zero warps with
    ``warpPerspective``, as Ultralytics does when its ``perspective`` is set.

    ``content`` (top, left, h, w): where the picture lies in a letterboxed ``image`` padded
    with ``pad_value``. Ultralytics warps a regular training image from its resized picture,
    never letterboxed, so C centres the picture, not the canvas; given ``content``, the warp
    is from that picture (a view), bit-identical to Ultralytics'. Without it the canvas is
    centred: the same when the padding is even on both axes (up to float32 rounding of M),
    half a pixel off on an axis with odd padding."""
    boxes = np.asarray(boxes, dtype=np.float32).reshape(-1, 4)
    labels = np.asarray(labels).reshape(-1)
    out_h, out_w = output_size(image.shape[:2], border, size)
    if content is not None:
        top, left, ch, cw = (int(v) for v in content)
        inside = 0 <= top <= image.shape[0] - ch and 0 <= left <= image.shape[1] - cw
        if not inside or ch < 1 or cw < 1:
            raise ValueError(f"content {content} is not inside the image {image.shape[:2]}")
        image = image[top : top + ch, left : left + cw]
        boxes = boxes - np.array([left, top, left, top], np.float32)
    image = np.ascontiguousarray(image)
    m = perspective_matrix(draw, image.shape[:2], (out_h, out_w))
    fill = (pad_value,) * 4  # cv2 tiles borderValue in blocks of 4
    if perspective:
        warped = cv2.warpPerspective(image, m, dsize=(out_w, out_h), borderValue=fill)
    else:
        warped = cv2.warpAffine(image, m[:2], dsize=(out_w, out_h), borderValue=fill)
    new = transform_boxes(boxes, m, bool(perspective))
    new[:, [0, 2]] = new[:, [0, 2]].clip(0, out_w)
    new[:, [1, 3]] = new[:, [1, 3]].clip(0, out_h)
    keep = box_candidates(boxes * draw.scale, new) & np.isfinite(new).all(1)
    return np.asarray(warped), np.ascontiguousarray(new[keep]), labels[keep]


def random_perspective(
    image: np.ndarray,
    boxes: np.ndarray,
    labels: np.ndarray,
    rng: np.random.Generator,
    *,
    border: tuple[int, int] = (0, 0),
    size: tuple[int, int] | None = None,
    degrees: float = 0.0,
    translate: float = 0.1,
    scale: float | tuple[float, float] = 0.5,
    shear: float = 0.0,
    perspective: float = 0.0,
    pad_value: int = 114,
    content: tuple[int, int, int, int] | None = None,
) -> Arrays:
    """``draw_perspective`` from ``rng``, then ``apply_perspective``."""
    draw = draw_perspective(rng, degrees, translate, scale, shear, perspective)
    return apply_perspective(
        image,
        boxes,
        labels,
        draw,
        border=border,
        size=size,
        perspective=perspective,
        pad_value=pad_value,
        content=content,
    )


def draw_hsv(rng: np.random.Generator) -> np.ndarray:
    """The three HSV draws, ``rng.uniform(-1, 1, 3)`` (Ultralytics: ``np.random.uniform``)."""
    return rng.uniform(-1, 1, 3)


def random_hsv(
    image: np.ndarray, hgain: float, sgain: float, vgain: float, gains: np.ndarray
) -> np.ndarray:
    """``RandomHSV`` on an RGB uint8 image with the draws ``gains`` (three values in
    [-1, 1]): a new image equal to Ultralytics' on the same picture in BGR, channels
    reversed. All three gains 0: the image itself, as Ultralytics leaves it."""
    if not (hgain or sgain or vgain):
        return image
    r = np.asarray(gains, dtype=np.float64) * [hgain, sgain, vgain]
    x = np.arange(0, 256, dtype=r.dtype)
    lut_hue = ((x + r[0] * 180) % 180).astype(np.uint8)
    lut_sat = np.clip(x * (r[1] + 1), 0, 255).astype(np.uint8)
    lut_val = np.clip(x * (r[2] + 1), 0, 255).astype(np.uint8)
    lut_sat[0] = 0  # grey stays grey (Ultralytics 8.3.79)
    lut = np.stack((lut_hue, lut_sat, lut_val), -1).reshape(1, 256, 3)
    hsv = cv2.cvtColor(image, cv2.COLOR_RGB2HSV)
    return np.asarray(cv2.cvtColor(cv2.LUT(hsv, lut), cv2.COLOR_HSV2RGB))


def warped_extent(
    m: np.ndarray, in_hw: tuple[int, int], out_hw: tuple[int, int], margin: int = 2
) -> tuple[int, int, int, int]:
    """(top, left, bottom, right) of the output outside which an affine ``warpAffine`` of an
    ``in_hw`` image by ``m`` with a constant border is that border alone: the bounds of the
    input grown by one pixel (bilinear reads a neighbour) through ``m``, and ``margin``
    pixels more for OpenCV's fixed-point coordinates; clipped to the output."""
    h, w = in_hw
    corners = np.array([[-1, -1, 1], [w, -1, 1], [-1, h, 1], [w, h, 1]], np.float64)
    xy = corners @ np.asarray(m[:2], np.float64).T
    out_h, out_w = out_hw
    left = min(out_w, max(0, math.floor(xy[:, 0].min()) - margin))
    right = max(left, min(out_w, math.ceil(xy[:, 0].max()) + margin + 1))
    top = min(out_h, max(0, math.floor(xy[:, 1].min()) - margin))
    bottom = max(top, min(out_h, math.ceil(xy[:, 1].max()) + margin + 1))
    return top, left, bottom, right


def hsv_within(
    image: np.ndarray,
    rows: tuple[int, int],
    pad_value: int,
    gains: tuple[float, float, float],
    draws: np.ndarray,
) -> np.ndarray:
    """``random_hsv`` of an image whose rows outside ``rows`` (top, bottom) are all
    ``pad_value``: the same bytes, the conversion run on those rows only. HSV is a function
    of each pixel alone and OpenCV converts row by row (its vector and scalar code may round
    a pixel differently, by its column), so every padding row becomes what one padding row
    becomes, and the band converts as it does inside the whole image."""
    top, bottom = rows
    width = image.shape[1]
    out = np.empty_like(image)
    if top > 0 or bottom < image.shape[0]:
        pad_row = random_hsv(np.full((1, width, 3), pad_value, np.uint8), *gains, draws)
        out[:top] = pad_row
        out[bottom:] = pad_row
    if bottom > top:
        out[top:bottom] = random_hsv(image[top:bottom], *gains, draws)
    return out


def flip_vertical(image: np.ndarray, boxes: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """The image upside down (a new contiguous array) and its xyxy boxes mirrored."""
    h = image.shape[0]
    out = np.asarray(boxes, dtype=np.float32).reshape(-1, 4).copy()
    out[:, 1], out[:, 3] = h - out[:, 3], h - out[:, 1]
    return np.asarray(cv2.flip(image, 0)), out


def flip_horizontal(image: np.ndarray, boxes: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """The image mirrored left to right (a new contiguous array) and its xyxy boxes."""
    w = image.shape[1]
    out = np.asarray(boxes, dtype=np.float32).reshape(-1, 4).copy()
    out[:, 0], out[:, 2] = w - out[:, 2], w - out[:, 0]
    return np.asarray(cv2.flip(image, 1)), out


@dataclass(frozen=True, slots=True)
class YoloAugment:
    """Ultralytics' augmentation of a composed image, as ``augment_composed``:
    ``(sample, rng, params) -> sample``. Defaults are Ultralytics' ``default.yaml``.

    Order (``v8_transforms``): RandomPerspective to ``params["image_size"]`` (the mosaic's
    2H x 2W canvas with ``params["border"] = (-H // 2, -W // 2)``, or the letterboxed H x W
    image with border 0; ``params["content"]``, when present, the (top, left, h, w) of the
    picture in that image: see ``apply_perspective``), HSV, vertical flip, horizontal flip. Draws from ``rng``:
    ``draw_perspective``, ``draw_hsv`` (only when a gain is non-zero, as Ultralytics), one
    ``rng.random()`` per flip. The result is ``sample`` with ``image`` (uint8 RGB, exactly
    ``image_size``, contiguous), ``boxes`` (float32 xyxy within the image) and ``labels``
    replaced."""

    degrees: float = 0.0
    translate: float = 0.1
    scale: float | tuple[float, float] = 0.5
    shear: float = 0.0
    perspective: float = 0.0
    hsv_h: float = 0.015
    hsv_s: float = 0.7
    hsv_v: float = 0.4
    fliplr: float = 0.5
    flipud: float = 0.0
    pad_value: int = 114

    def __post_init__(self) -> None:
        for name in ("fliplr", "flipud"):
            p = getattr(self, name)
            if not 0.0 <= p <= 1.0:
                raise ValueError(f"{name} is a probability in [0, 1], got {p}")
        if not 0 <= self.pad_value <= 255:
            raise ValueError(f"pad_value must be in 0..255, got {self.pad_value}")
        if isinstance(self.scale, (tuple, list)) and len(self.scale) != 2:
            raise ValueError(f"scale is a float or a (min, max) pair, got {self.scale}")

    def __call__(
        self, sample: Mapping[str, Any], rng: np.random.Generator, params: Mapping[str, Any]
    ) -> dict[str, Any]:
        image = np.ascontiguousarray(sample["image"])
        boxes = np.asarray(sample.get("boxes", np.zeros((0, 4))), np.float32).reshape(-1, 4)
        labels = np.asarray(sample.get("labels", np.zeros(0)), np.int64).reshape(-1)
        bh, bw = params.get("border", (0, 0))
        h, w = params["image_size"]
        content = params.get("content")
        draw = draw_perspective(
            rng, self.degrees, self.translate, self.scale, self.shear, self.perspective
        )
        image, boxes, labels = apply_perspective(
            image,
            boxes,
            labels,
            draw,
            border=(int(bh), int(bw)),
            size=(int(h), int(w)),
            perspective=self.perspective,
            pad_value=self.pad_value,
            content=content,
        )
        if self.hsv_h or self.hsv_s or self.hsv_v:
            gains = (self.hsv_h, self.hsv_s, self.hsv_v)
            if content is not None and not self.perspective:
                # A regular image: above and below its warped picture the output is the
                # border (often a quarter of it): its HSV is one border row's.
                in_hw = (int(content[2]), int(content[3]))
                m = perspective_matrix(draw, in_hw, image.shape[:2])
                top, _, bottom, _ = warped_extent(m, in_hw, image.shape[:2])
                image = hsv_within(image, (top, bottom), self.pad_value, gains, draw_hsv(rng))
            else:
                image = random_hsv(image, *gains, draw_hsv(rng))
        if rng.random() < self.flipud:
            image, boxes = flip_vertical(image, boxes)
        if rng.random() < self.fliplr:
            image, boxes = flip_horizontal(image, boxes)
        return {**sample, "image": image, "boxes": boxes, "labels": labels}

    def mosaic_region(
        self, rng: np.random.Generator, params: Mapping[str, Any]
    ) -> tuple[int, int, int, int] | None:
        """The part (top, left, bottom, right) of a mosaic's 2H x 2W canvas that ``__call__``
        with this generator (a copy of the one it will get) and ``params`` reads: where the
        output's pixels come from through the inverse of M, grown by 3 pixels (a bilinear
        read's neighbour, and OpenCV's float coordinates); None (the whole canvas) for
        ``perspective``, or for an image that is not a mosaic. Pipelines build only that
        part (``dataserver.data.composed.region_of``); the output is the same bytes."""
        if self.perspective or not params.get("mosaic"):
            return None
        h, w = (int(v) for v in params["image_size"])
        big_h, big_w = 2 * h, 2 * w
        draw = draw_perspective(
            rng, self.degrees, self.translate, self.scale, self.shear, self.perspective
        )
        m = np.asarray(perspective_matrix(draw, (big_h, big_w), (h, w)), np.float64)
        try:
            inverse = np.linalg.inv(m)
        except np.linalg.LinAlgError:
            return None
        corners = np.array([[0, 0, 1], [w - 1, 0, 1], [0, h - 1, 1], [w - 1, h - 1, 1]], float)
        xy = corners @ inverse[:2].T
        if not np.isfinite(xy).all():
            return None
        top = min(big_h, max(0, math.floor(xy[:, 1].min()) - 3))
        left = min(big_w, max(0, math.floor(xy[:, 0].min()) - 3))
        bottom = max(top, min(big_h, math.ceil(xy[:, 1].max()) + 4))
        right = max(left, min(big_w, math.ceil(xy[:, 0].max()) + 4))
        return top, left, bottom, right


HYPERPARAMETERS = (
    "degrees",
    "translate",
    "scale",
    "shear",
    "perspective",
    "hsv_h",
    "hsv_s",
    "hsv_v",
    "fliplr",
    "flipud",
)


def yolo_hyp(args: Any, *, pad_value: int = 114) -> YoloAugment:
    """A ``YoloAugment`` from Ultralytics' arguments (a namespace such as a trainer's
    ``self.args``, or a mapping): its ``HYPERPARAMETERS`` where present and not None,
    Ultralytics' defaults otherwise."""
    values: dict[str, Any] = {}
    for name in HYPERPARAMETERS:
        value = args.get(name) if isinstance(args, Mapping) else getattr(args, name, None)
        if value is not None:
            values[name] = tuple(value) if isinstance(value, (list, tuple)) else float(value)
    return YoloAugment(**values, pad_value=pad_value)

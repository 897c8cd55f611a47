"""``dataserver.data.yolo`` against Ultralytics' own transforms (pure, no sockets).

Ultralytics draws with ``random.uniform``, ``random.random`` and ``np.random.uniform``; each
comparison replaces those three with functions drawing from a copy of the generator ours
draws from, with the same formulas, so both sides see the same numbers only if ours draws in
Ultralytics' order and ranges. Ultralytics' images are BGR: it gets our RGB picture reversed,
and its output is reversed back before comparing.
"""

from __future__ import annotations

import os
import subprocess
import sys
from collections.abc import Callable, Sequence
from types import ModuleType
from typing import Any

import cv2
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from dataserver.data.pipeline import compose_one
from dataserver.data.yolo import (
    PerspectiveDraw,
    YoloAugment,
    apply_perspective,
    draw_hsv,
    draw_perspective,
    flip_horizontal,
    flip_vertical,
    hsv_within,
    output_size,
    perspective_matrix,
    random_hsv,
    random_perspective,
    warped_extent,
    yolo_hyp,
)
from dataserver.protocol import BatchSizes

pytestmark = pytest.mark.timeout(120)

os.environ.setdefault("YOLO_OFFLINE", "1")  # Ultralytics never reaches out

HYPS: list[dict[str, Any]] = [
    {},  # default.yaml: translate 0.1, scale 0.5
    {"degrees": 10.0, "shear": 5.0, "translate": 0.2, "scale": 0.9},
    {"degrees": 180.0, "shear": 30.0, "translate": 0.4, "scale": (0.3, 1.7)},
    {"perspective": 0.0005, "degrees": 5.0, "scale": 0.5},
    {"perspective": 0.001, "shear": 10.0, "translate": 0.0, "scale": 0.0},
]

Result = tuple[np.ndarray, np.ndarray, np.ndarray]


@pytest.fixture(scope="module")
def ul() -> ModuleType:
    """``ultralytics.data.augment`` (the extra's environment only)."""
    return pytest.importorskip("ultralytics.data.augment")


def paint(rng: np.random.Generator, image: np.ndarray, y0: int, x0: int, y1: int, x1: int) -> None:
    """Noise over a smooth gradient in image[y0:y1, x0:x1]: edges and flat areas both."""
    h, w = y1 - y0, x1 - x0
    if h <= 0 or w <= 0:
        return
    yy, xx = np.mgrid[0:h, 0:w]
    base = (yy[..., None] * rng.uniform(0, 3, 3) + xx[..., None] * rng.uniform(0, 3, 3)) % 256
    noise = rng.integers(-40, 40, (h, w, 3))
    image[y0:y1, x0:x1] = np.clip(base + noise, 0, 255).astype(np.uint8)


def boxes_in(rng: np.random.Generator, n: int, y0: int, x0: int, y1: int, x1: int) -> np.ndarray:
    """n float32 xyxy boxes inside (x0, y0, x1, y1), some tiny, some large."""
    xs = np.sort(rng.uniform(x0, x1, (n, 2)), axis=1)
    ys = np.sort(rng.uniform(y0, y1, (n, 2)), axis=1)
    return np.stack([xs[:, 0], ys[:, 0], xs[:, 1], ys[:, 1]], axis=1).astype(np.float32)


def mosaic_canvas(rng: np.random.Generator, h: int, w: int) -> Result:
    """A 2h x 2w canvas as ``Mosaic._mosaic4`` leaves it: 114 padding, four pictures touching
    a centre in [h/2, 3h/2) x [w/2, 3w/2) with their bottom-right, bottom-left, top-right and
    top-left corners, boxes clipped to the canvas, zero-area ones out."""
    canvas = np.full((2 * h, 2 * w, 3), 114, np.uint8)
    yc, xc = int(rng.uniform(h / 2, 3 * h / 2)), int(rng.uniform(w / 2, 3 * w / 2))
    parts = []
    for cell in range(4):
        ph, pw = int(rng.integers(h // 3, h + 1)), int(rng.integers(w // 3, w + 1))
        y0 = yc - ph if cell < 2 else yc
        x0 = xc - pw if cell % 2 == 0 else xc
        y0, x0, y1, x1 = max(y0, 0), max(x0, 0), min(y0 + ph, 2 * h), min(x0 + pw, 2 * w)
        paint(rng, canvas, y0, x0, y1, x1)
        parts.append(boxes_in(rng, int(rng.integers(0, 6)), y0 - 5, x0 - 5, y1 + 5, x1 + 5))
    boxes = np.concatenate(parts).reshape(-1, 4)
    boxes[:, [0, 2]] = boxes[:, [0, 2]].clip(0, 2 * w)
    boxes[:, [1, 3]] = boxes[:, [1, 3]].clip(0, 2 * h)
    good = (boxes[:, 2] - boxes[:, 0]) * (boxes[:, 3] - boxes[:, 1]) > 0
    labels = rng.integers(0, 80, len(boxes)).astype(np.int64)
    return canvas, boxes[good], labels[good]


def letterboxed(rng: np.random.Generator, h: int, w: int, ih: int, iw: int) -> Result:
    """An ih x iw picture centred on an h x w 114 canvas, with boxes inside the picture."""
    image = np.full((h, w, 3), 114, np.uint8)
    top, left = (h - ih) // 2, (w - iw) // 2
    paint(rng, image, top, left, top + ih, left + iw)
    boxes = boxes_in(rng, int(rng.integers(0, 12)), top, left, top + ih, left + iw)
    return image, boxes, rng.integers(0, 80, len(boxes)).astype(np.int64)


def patch_draws(ul: ModuleType, monkeypatch: pytest.MonkeyPatch, seed: int) -> None:
    """Ultralytics' three random sources, drawing from ``default_rng(seed)`` as ours do."""
    stream = np.random.default_rng(seed)
    monkeypatch.setattr(ul.random, "uniform", lambda a, b: a + (b - a) * float(stream.random()))
    monkeypatch.setattr(ul.random, "random", lambda: float(stream.random()))
    monkeypatch.setattr(ul.np.random, "uniform", stream.uniform)


def run_ultralytics(transforms: Sequence[Callable[[dict], dict]], sample: Result) -> Result:
    """Ultralytics' transforms on (RGB image, xyxy boxes, labels), in its own types (BGR,
    ``Instances``, ``cls`` (N, 1)); back as (RGB image, xyxy pixel boxes, labels)."""
    from ultralytics.utils.instance import Instances

    image, boxes, labels = sample
    data: dict[str, Any] = {
        "img": np.ascontiguousarray(image[..., ::-1]),
        "cls": labels.reshape(-1, 1).copy(),
        "instances": Instances(boxes.copy(), bbox_format="xyxy", normalized=False),
    }
    for transform in transforms:
        data = transform(data)
    instances = data["instances"]
    instances.convert_bbox(format="xyxy")
    return data["img"][..., ::-1], instances.bboxes, data["cls"].reshape(-1)


def assert_same(ours: Result, theirs: Result) -> None:
    """Pixels exactly equal, boxes within 1e-3 px, the same labels kept."""
    assert ours[0].shape == theirs[0].shape
    assert ours[0].dtype == np.uint8
    np.testing.assert_array_equal(ours[0], theirs[0])
    np.testing.assert_array_equal(ours[2], theirs[2])
    assert ours[1].dtype == np.float32
    np.testing.assert_allclose(ours[1], theirs[1], rtol=0, atol=1e-3)


def perspective_of(ul: ModuleType, hyp: dict[str, Any], out_hw: tuple[int, int]) -> Any:
    return ul.RandomPerspective(
        degrees=hyp.get("degrees", 0.0),
        translate=hyp.get("translate", 0.1),
        scale=hyp.get("scale", 0.5),
        shear=hyp.get("shear", 0.0),
        perspective=hyp.get("perspective", 0.0),
        size=(out_hw[1], out_hw[0]),
    )


def ours_perspective(sample: Result, seed: int, hyp: dict[str, Any], **kw: Any) -> Result:
    draw = draw_perspective(np.random.default_rng(seed), **hyp)
    p = hyp.get("perspective", 0.0)
    return apply_perspective(*sample, draw, perspective=p, **kw)


@pytest.mark.parametrize("hw", [(64, 64), (96, 160), (320, 320)])
@pytest.mark.parametrize("hyp", HYPS)
def test_perspective_on_mosaic_canvas(
    ul: ModuleType, monkeypatch: pytest.MonkeyPatch, hw: tuple[int, int], hyp: dict[str, Any]
) -> None:
    """A 2H x 2W mosaic canvas with border (-H/2, -W/2) to H x W: Ultralytics'
    ``RandomPerspective(size=(W, H))``, byte for byte."""
    h, w = hw
    kept = 0
    for seed in range(12):
        sample = mosaic_canvas(np.random.default_rng(1000 + seed), h, w)
        patch_draws(ul, monkeypatch, seed)
        theirs = run_ultralytics([perspective_of(ul, hyp, hw)], sample)
        ours = ours_perspective(sample, seed, hyp, border=(-h // 2, -w // 2), size=hw)
        assert ours[0].shape == (h, w, 3)
        assert_same(ours, theirs)
        kept += len(ours[1])
    assert kept > 0  # boxes were compared, not only empty lists


@pytest.mark.parametrize("hyp", HYPS)
def test_perspective_on_letterboxed_image(
    ul: ModuleType, monkeypatch: pytest.MonkeyPatch, hyp: dict[str, Any]
) -> None:
    """A regular (letterboxed) image with border 0, byte for byte."""
    for seed in range(12):
        rng = np.random.default_rng(2000 + seed)
        h, w = int(rng.integers(32, 200)), int(rng.integers(32, 200))
        sample = letterboxed(rng, h, w, int(rng.integers(8, h + 1)), int(rng.integers(8, w + 1)))
        patch_draws(ul, monkeypatch, seed)
        theirs = run_ultralytics([perspective_of(ul, hyp, (h, w))], sample)
        assert_same(ours_perspective(sample, seed, hyp, border=(0, 0), size=(h, w)), theirs)


def test_regular_image_as_ultralytics_loads_it(
    ul: ModuleType, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Ultralytics warps a regular image from its resized picture, not letterboxed: given the
    picture's place (``content``), ours on the letterboxed canvas is the same bytes. Without
    it, measured: an even padding gives M up to float32 rounding (a few pixels one level
    off), an odd one centres the picture half a pixel off (boxes within half a pixel
    times the scale)."""
    even, odd = [], []
    for seed in range(24):
        rng = np.random.default_rng(3000 + seed)
        size = 128
        short = int(rng.integers(40, size))
        ih, iw = (size, short) if seed % 2 else (short, size)
        image, boxes, labels = letterboxed(rng, size, size, ih, iw)
        top, left = (size - ih) // 2, (size - iw) // 2
        picture = image[top : top + ih, left : left + iw].copy()
        shifted = boxes - np.array([left, top, left, top], np.float32)
        patch_draws(ul, monkeypatch, seed)
        theirs = run_ultralytics([perspective_of(ul, {}, (size, size))], (picture, shifted, labels))
        sample = (image, boxes, labels)
        placed = ours_perspective(sample, seed, {}, size=(size, size), content=(top, left, ih, iw))
        assert_same(placed, theirs)
        ours = ours_perspective(sample, seed, {}, size=(size, size))
        diff = np.abs(ours[0].astype(int) - theirs[0].astype(int))
        if (size - ih) % 2 == 0 and (size - iw) % 2 == 0:
            even.append((diff > 0).mean())
            assert diff.max() <= 1 and (diff > 0).mean() < 1e-3
        else:
            odd.append(diff.mean())
            assert diff.mean() < 12  # a half-pixel shift of +-40 noise
        if len(ours[1]) == len(theirs[1]):
            np.testing.assert_allclose(ours[1], theirs[1], rtol=0, atol=0.76)
    assert even and odd
    with pytest.raises(ValueError, match="inside"):
        ours_perspective(sample, 0, {}, size=(size, size), content=(0, 0, size + 1, size))


def test_border_rule_without_size() -> None:
    """Without ``size`` the output is the input grown by twice the border (Ultralytics'
    older ``border=mosaic_border``): for even sizes the same bytes as ``size=(H, W)``."""
    h, w = 96, 128
    sample = mosaic_canvas(np.random.default_rng(5), h, w)
    draw = draw_perspective(np.random.default_rng(6), degrees=5.0)
    by_border = apply_perspective(*sample, draw, border=(-h // 2, -w // 2))
    by_size = apply_perspective(*sample, draw, size=(h, w))
    for a, b in zip(by_border, by_size, strict=True):
        np.testing.assert_array_equal(a, b)
    assert output_size((2 * h, 2 * w), (-h // 2, -w // 2), None) == (h, w)
    with pytest.raises(ValueError, match="positive"):
        output_size((10, 10), (-5, -5), None)


def test_random_perspective_is_draw_then_apply() -> None:
    sample = mosaic_canvas(np.random.default_rng(8), 64, 64)
    hyp: dict[str, Any] = {"degrees": 20.0, "shear": 3.0, "perspective": 0.0007}
    a = random_perspective(*sample, np.random.default_rng(9), size=(64, 64), **hyp)
    b = ours_perspective(sample, 9, hyp, size=(64, 64))
    for x, y in zip(a, b, strict=True):
        np.testing.assert_array_equal(x, y)
    d = draw_perspective(np.random.default_rng(0), scale=0.0)
    assert d == PerspectiveDraw(translate_x=d.translate_x, translate_y=d.translate_y)
    assert 0.4 <= d.translate_x <= 0.6 and 0.4 <= d.translate_y <= 0.6
    identity = PerspectiveDraw()  # no draw: the input centred on the output, unchanged
    out = apply_perspective(*sample, identity, border=(-32, -32))
    np.testing.assert_array_equal(out[0], sample[0][32:96, 32:96])


@pytest.mark.parametrize(
    "gains", [(0.015, 0.7, 0.4), (0.5, 0.5, 0.5), (1.0, 1.0, 1.0), (0.0, 0.7, 0.0), (0.0, 0.0, 0.0)]
)
def test_hsv(
    ul: ModuleType, monkeypatch: pytest.MonkeyPatch, gains: tuple[float, float, float]
) -> None:
    """``RandomHSV``'s LUT method on the RGB picture: the bytes of Ultralytics' on BGR."""
    for seed in range(10):
        rng = np.random.default_rng(4000 + seed)
        image = rng.integers(0, 256, (int(rng.integers(1, 80)), int(rng.integers(1, 80)), 3))
        image = image.astype(np.uint8)
        image[: image.shape[0] // 3] = rng.integers(0, 256, (1, 1, 1))  # grey rows (S = 0)
        patch_draws(ul, monkeypatch, seed)
        theirs = run_ultralytics(
            [ul.RandomHSV(*gains)], (image, np.zeros((0, 4), np.float32), np.zeros(0))
        )
        ours = random_hsv(image, *gains, draw_hsv(np.random.default_rng(seed)))
        np.testing.assert_array_equal(ours, theirs[0])


@pytest.mark.parametrize("direction", ["vertical", "horizontal"])
def test_flips(ul: ModuleType, monkeypatch: pytest.MonkeyPatch, direction: str) -> None:
    flip = flip_vertical if direction == "vertical" else flip_horizontal
    for seed in range(10):
        rng = np.random.default_rng(5000 + seed)
        h, w = int(rng.integers(1, 90)), int(rng.integers(1, 90))
        image = rng.integers(0, 256, (h, w, 3)).astype(np.uint8)
        boxes = boxes_in(rng, int(rng.integers(0, 8)), 0, 0, h, w)
        labels = np.arange(len(boxes), dtype=np.int64)
        for p in (0.0, 1.0):
            patch_draws(ul, monkeypatch, seed)
            theirs = run_ultralytics(
                [ul.RandomFlip(p=p, direction=direction)], (image, boxes, labels)
            )
            ours = flip(image, boxes) if p else (image, boxes)
            assert_same((*ours, labels), theirs)
            assert ours[0].flags.c_contiguous


def pipeline_of(ul: ModuleType, aug: YoloAugment, out_hw: tuple[int, int]) -> list[Any]:
    """``v8_transforms``' steps after the mosaic, from the same hyperparameters."""
    hyp = {k: getattr(aug, k) for k in ("degrees", "translate", "scale", "shear", "perspective")}
    return [
        perspective_of(ul, hyp, out_hw),
        ul.RandomHSV(hgain=aug.hsv_h, sgain=aug.hsv_s, vgain=aug.hsv_v),
        ul.RandomFlip(direction="vertical", p=aug.flipud),
        ul.RandomFlip(direction="horizontal", p=aug.fliplr),
    ]


AUGMENTS = [
    YoloAugment(),
    YoloAugment(degrees=15.0, shear=4.0, translate=0.2, scale=0.9, flipud=0.5, hsv_h=0.2),
    YoloAugment(perspective=0.0008, fliplr=1.0, flipud=1.0, hsv_s=0.0, hsv_v=0.0, hsv_h=0.0),
]


@pytest.mark.parametrize("aug", AUGMENTS)
@pytest.mark.parametrize("kind", ["mosaic", "letterboxed", "picture"])
def test_yolo_augment_equals_ultralytics(
    ul: ModuleType, monkeypatch: pytest.MonkeyPatch, aug: YoloAugment, kind: str
) -> None:
    """The whole pipeline as ``augment_composed``, one generator for every draw, against
    Ultralytics' RandomPerspective, RandomHSV and two RandomFlips with the same draws: on a
    mosaic canvas, on a letterboxed image, and on a letterboxed image whose picture's place
    is given (Ultralytics then warps the bare picture, as its regular images)."""
    flips = 0
    for seed in range(16):
        rng = np.random.default_rng(6000 + seed)
        h, w = (64, 96) if seed % 2 else (80, 80)
        params: dict[str, Any] = {"image_size": (h, w), "border": (0, 0), "epoch": 0}
        if kind == "mosaic":
            sample = theirs_in = mosaic_canvas(rng, h, w)
            params.update(border=(-h // 2, -w // 2), mosaic=True)
        else:
            ih, iw = int(rng.integers(8, h + 1)), int(rng.integers(8, w + 1))
            sample = theirs_in = letterboxed(rng, h, w, ih, iw)
            params["mosaic"] = False
            if kind == "picture":
                top, left = (h - ih) // 2, (w - iw) // 2
                params["content"] = (top, left, ih, iw)
                offset = np.array([left, top, left, top], np.float32)
                picture = sample[0][top : top + ih, left : left + iw].copy()
                theirs_in = (picture, sample[1] - offset, sample[2])
        given_sample = {"image": sample[0], "boxes": sample[1], "labels": sample[2], "file": "x"}
        out = aug(given_sample, np.random.default_rng(seed), params)
        patch_draws(ul, monkeypatch, seed)
        theirs = run_ultralytics(pipeline_of(ul, aug, (h, w)), theirs_in)
        assert_same((out["image"], out["boxes"], out["labels"]), theirs)
        assert out["file"] == "x" and out["labels"].dtype == np.int64
        assert out["image"].flags.c_contiguous
        flips += not np.array_equal(
            out["image"], aug(given_sample, np.random.default_rng(seed + 99), params)["image"]
        )
    assert flips  # the draws matter


def test_defaults_are_ultralytics_default_yaml(ul: ModuleType) -> None:
    from ultralytics.cfg import DEFAULT_CFG

    assert yolo_hyp(DEFAULT_CFG) == YoloAugment()
    assert yolo_hyp(vars(DEFAULT_CFG)) == YoloAugment()


def test_yolo_hyp() -> None:
    aug = yolo_hyp({"degrees": 3, "fliplr": 0.0, "scale": [0.5, 1.5], "mixup": 0.1}, pad_value=0)
    assert aug == YoloAugment(degrees=3.0, fliplr=0.0, scale=(0.5, 1.5), pad_value=0)
    assert yolo_hyp({"hsv_h": None}) == YoloAugment()
    with pytest.raises(ValueError, match="fliplr"):
        YoloAugment(fliplr=1.5)
    with pytest.raises(ValueError, match="pad_value"):
        YoloAugment(pad_value=300)


class Dataset:
    augment_composed = YoloAugment(degrees=10.0)


def test_usable_as_a_dataset_member() -> None:
    """As a class attribute it is called with (sample, rng, params), no ``self``."""
    sample = mosaic_canvas(np.random.default_rng(1), 32, 32)
    params = {"image_size": (32, 32), "border": (-16, -16)}
    out = Dataset().augment_composed(
        {"image": sample[0], "boxes": sample[1], "labels": sample[2]},
        np.random.default_rng(2),
        params,
    )
    again = Dataset.augment_composed(
        {"image": sample[0], "boxes": sample[1], "labels": sample[2]},
        np.random.default_rng(2),
        params,
    )
    for key in ("image", "boxes", "labels"):
        np.testing.assert_array_equal(out[key], again[key])


@settings(max_examples=120, deadline=None)
@given(
    h=st.integers(1, 64),
    w=st.integers(1, 64),
    mosaic=st.booleans(),
    n=st.integers(0, 10),
    degrees=st.floats(0, 180),
    translate=st.floats(0, 0.9),
    scale=st.floats(0, 1.5),
    shear=st.floats(0, 45),
    perspective=st.sampled_from([0.0, 1e-4, 1e-3, 1e-2, 0.1]),
    seed=st.integers(0, 2**32 - 1),
)
def test_output_is_image_size_with_boxes_inside(
    h: int,
    w: int,
    mosaic: bool,
    n: int,
    degrees: float,
    translate: float,
    scale: float,
    shear: float,
    perspective: float,
    seed: int,
) -> None:
    rng = np.random.default_rng(seed)
    ih, iw = (2 * h, 2 * w) if mosaic else (h, w)
    image = rng.integers(0, 256, (ih, iw, 3)).astype(np.uint8)
    boxes = boxes_in(rng, n, -5, -5, ih + 5, iw + 5)
    labels = rng.integers(0, 80, n).astype(np.int64)
    aug = YoloAugment(degrees, translate, scale, shear, perspective, flipud=0.5)
    params = {"image_size": (h, w), "border": (-h // 2, -w // 2) if mosaic else (0, 0)}
    out = aug({"image": image, "boxes": boxes, "labels": labels}, rng, params)
    assert out["image"].shape == (h, w, 3) and out["image"].dtype == np.uint8
    b = out["boxes"]
    assert b.dtype == np.float32 and b.shape == (len(out["labels"]), 4)
    assert np.isfinite(b).all()
    assert (b >= 0).all() and (b[:, [0, 2]] <= w).all() and (b[:, [1, 3]] <= h).all()
    assert (b[:, 2] >= b[:, 0]).all() and (b[:, 3] >= b[:, 1]).all()
    assert set(out["labels"].tolist()) <= set(labels.tolist())


def test_import_does_not_load_torch() -> None:
    code = (
        "import sys, dataserver.data.yolo; "
        "bad = [m for m in ('torch', 'ultralytics') if m in sys.modules]; "
        "sys.exit(f'imported {bad}' if bad else 0)"
    )
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, done.stderr


@pytest.mark.parametrize("width", [640, 97])
def test_hsv_of_the_picture_rows_only_is_the_same_bytes(width: int) -> None:
    """A regular image's HSV run on the rows its warped picture reaches (``warped_extent``),
    the padding rows made from one padding row (``hsv_within``): byte for byte the HSV of
    the whole image, for the draws of many images, degrees and shears included; the rows
    left out are padding only, and some images leave rows out."""
    rng = np.random.default_rng(11)
    saved = 0
    for _ in range(24):
        out_h = int(rng.integers(64, 200))
        ih, iw = int(rng.integers(8, out_h)), int(rng.integers(8, width))
        picture = rng.integers(0, 256, (ih, iw, 3), dtype=np.uint8)
        hyp = HYPS[int(rng.integers(0, 3))]
        draw = draw_perspective(rng, **hyp)
        m = perspective_matrix(draw, (ih, iw), (out_h, width))
        warped = cv2.warpAffine(picture, m[:2], (width, out_h), borderValue=(114,) * 4)
        top, _, bottom, _ = warped_extent(m, (ih, iw), (out_h, width))
        assert (warped[:top] == 114).all() and (warped[bottom:] == 114).all()
        saved += out_h - (bottom - top)
        draws = draw_hsv(rng)
        for gains in ((0.015, 0.7, 0.4), (0.5, 0.0, 0.9)):
            whole = random_hsv(warped, *gains, draws)
            np.testing.assert_array_equal(
                hsv_within(warped, (top, bottom), 114, gains, draws), whole
            )
    assert saved > 0


class _Augmented:
    """The synthetic set with ``aug`` as its ``augment_composed`` (no ``mosaic_region``:
    every mosaic canvas built whole)."""

    deterministic = True

    def __init__(self, aug: YoloAugment) -> None:
        from dataserver.data.synthetic import SyntheticDataset

        self.base = SyntheticDataset(images=32, seed=4)
        self.aug = aug

    def __len__(self) -> int:
        return len(self.base)

    def __getitem__(self, index: int) -> Any:
        return self.base[index]

    def augment_composed(self, sample: Any, rng: np.random.Generator, params: Any) -> Any:
        return self.aug(sample, rng, params)


class _Regional(_Augmented):
    """The same, building only the part of each mosaic the warp reads."""

    def mosaic_region(self, rng: np.random.Generator, params: Any) -> Any:
        return self.aug.mosaic_region(rng, params)


@pytest.mark.parametrize("aug", [AUGMENTS[0], AUGMENTS[1], YoloAugment(scale=(0.3, 1.7))])
def test_a_mosaic_built_only_where_the_warp_reads_is_the_same_bytes(aug: YoloAugment) -> None:
    """``mosaic_region``: the pipeline builds only the part of the 2H x 2W canvas the warp
    reads, and every output (pixels, boxes, labels) is byte for byte the whole canvas's;
    the region is smaller than the canvas for most mosaics."""
    from dataserver.data.composed import composed_rng

    whole, regional = _Augmented(aug), _Regional(aug)
    smaller = 0
    for anchor in range(24):
        indices = [anchor, (anchor + 5) % 32, (anchor + 11) % 32, (anchor + 17) % 32]
        outs = [
            compose_one(ds, indices, 2, BatchSizes.of((96, 128)), 7, 1, mode="stitch",
                        layout="mosaic", pad_value=114, letterbox="center", partners=True)
            for ds in (whole, regional)
        ]  # fmt: skip
        (a, ca), (b, cb) = outs
        np.testing.assert_array_equal(a, b)
        np.testing.assert_array_equal(ca.boxes, cb.boxes)
        np.testing.assert_array_equal(ca.labels, cb.labels)
        region = aug.mosaic_region(
            composed_rng(7, 1, anchor), {"image_size": (96, 128), "mosaic": True}
        )
        assert region is not None
        top, left, bottom, right = region
        smaller += (bottom - top) * (right - left) < 192 * 256
    assert smaller >= 12
    assert aug.mosaic_region(np.random.default_rng(0), {"image_size": (96, 128)}) is None
    assert (
        YoloAugment(perspective=0.001).mosaic_region(
            np.random.default_rng(0), {"image_size": (96, 128), "mosaic": True}
        )
        is None
    )

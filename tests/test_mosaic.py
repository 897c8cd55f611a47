"""Mosaic composition (pure functions, no sockets): determinism, the geometry of the four
cells around the centre, cropping, flips, missing sources and the box filter, against a
reference that builds the whole padded canvas and crops it the way Ultralytics does."""

from __future__ import annotations

import cv2
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from dataserver.data.mosaic import (
    MOSAIC_SCALE,
    MosaicGeometry,
    box_candidates,
    cell_origin,
    compose_mosaic,
    mosaic_geometry,
    mosaic_rng,
)
from dataserver.data.pipeline import Source

pytestmark = pytest.mark.timeout(60)

SETTINGS = settings(max_examples=60, deadline=None)


def noise_source(h: int, w: int, boxes: list[list[float]], seed: int = 0) -> Source:
    image = np.random.default_rng(seed).integers(0, 256, (3, h, w), dtype=np.uint8)
    b = np.array(boxes, dtype=np.float32).reshape(-1, 4)
    return Source(image, b, np.arange(1, len(b) + 1, dtype=np.int64))


def flat_source(h: int, w: int, value: int, boxes: list[list[float]] | None = None) -> Source:
    b = np.array(boxes or [], dtype=np.float32).reshape(-1, 4)
    labels = np.full(len(b), value, dtype=np.int64)
    return Source(np.full((3, h, w), value, dtype=np.uint8), b, labels)


def hws(sources: list[Source | None]) -> list[tuple[int, int] | None]:
    return [None if s is None else (s.image.shape[1], s.image.shape[2]) for s in sources]


def run(
    out_hw: tuple[int, int], sources: list[Source | None], flips: list[bool], seed: int
) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    canvas = np.zeros((3, *out_hw), dtype=np.uint8)
    boxes, labels = compose_mosaic(canvas, sources, flips, mosaic_rng(seed, 0, [1, 2, 3, 4]))
    return canvas, boxes, labels


def geometry_of(out_hw: tuple[int, int], sources: list[Source | None], seed: int) -> MosaicGeometry:
    return mosaic_geometry(mosaic_rng(seed, 0, [1, 2, 3, 4]), out_hw, hws(sources))


def reference(
    out_hw: tuple[int, int], sources: list[Source | None], flips: list[bool], seed: int
) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Independent of the module's cropping: every scaled source pasted whole on a canvas
    padded by the largest source on each side, the output window cut out afterwards; the
    box filter written out in Ultralytics' column form."""
    geometry = geometry_of(out_hw, sources, seed)
    (cy, cx), (out_h, out_w) = geometry.centre, out_hw
    pad = max([1] + [max(size) for size in geometry.sizes])
    big = np.zeros((3, out_h + 2 * pad, out_w + 2 * pad), dtype=np.uint8)
    all_boxes, all_labels = [np.zeros((0, 4), np.float32)], [np.zeros((0,), np.int64)]
    for t, source in enumerate(sources):
        if source is None:
            continue
        h, w = geometry.sizes[t]
        y0 = cy - h if t in (0, 1) else cy
        x0 = cx - w if t in (0, 2) else cx
        img = np.stack(
            [cv2.resize(p, (w, h), interpolation=cv2.INTER_LINEAR) for p in source.image]
        )
        if flips[t]:
            img = img[:, :, ::-1]
        big[:, pad + y0 : pad + y0 + h, pad + x0 : pad + x0 + w] = img
        sh, sw = source.image.shape[1:]
        b = source.boxes * np.array([w / sw, h / sh, w / sw, h / sh], dtype=np.float32)
        if flips[t]:
            b = np.stack([w - b[:, 2], b[:, 1], w - b[:, 0], b[:, 3]], axis=1)
        b = b + np.array([x0, y0, x0, y0], dtype=np.float32)
        c = b.copy()
        c[:, [0, 2]] = c[:, [0, 2]].clip(0, out_w)
        c[:, [1, 3]] = c[:, [1, 3]].clip(0, out_h)
        box1, box2 = b.T, c.T
        w1, h1 = box1[2] - box1[0], box1[3] - box1[1]
        w2, h2 = box2[2] - box2[0], box2[3] - box2[1]
        ar = np.maximum(w2 / (h2 + 1e-16), h2 / (w2 + 1e-16))
        keep = (w2 > 2) & (h2 > 2) & (w2 * h2 / (w1 * h1 + 1e-16) > 0.1) & (ar < 100)
        all_boxes.append(c[keep])
        all_labels.append(source.labels[keep])
    canvas = big[:, pad : pad + out_h, pad : pad + out_w]
    return canvas, np.concatenate(all_boxes), np.concatenate(all_labels)


@st.composite
def mosaic_cases(draw: st.DrawFn) -> tuple:
    out_hw = (draw(st.integers(1, 96)), draw(st.integers(1, 96)))
    sources: list[Source | None] = []
    for t in range(draw(st.integers(0, 4))):
        if draw(st.booleans()) and draw(st.booleans()):  # a quarter of the cells left out
            sources.append(None)
            continue
        h, w = draw(st.integers(1, 80)), draw(st.integers(1, 80))
        boxes = []
        for _ in range(draw(st.integers(0, 4))):
            x1, x2 = sorted(draw(st.floats(0, w, width=32)) for _ in range(2))
            y1, y2 = sorted(draw(st.floats(0, h, width=32)) for _ in range(2))
            boxes.append([x1, y1, x2, y2])
        sources.append(noise_source(h, w, boxes, seed=t))
    flips = [draw(st.booleans()) for _ in sources]
    return out_hw, sources, flips, draw(st.integers(0, 2**32))


# --- randomness -----------------------------------------------------------------------


def test_mosaic_rng_is_the_documented_seed_sequence() -> None:
    ours = mosaic_rng(7, 3, [10, 20, 30, 40]).integers(0, 2**63, 8)
    want = np.random.default_rng(np.random.SeedSequence([7, 3, 0x4D05, 10, 20, 30, 40]))
    assert ours.tolist() == want.integers(0, 2**63, 8).tolist()


def test_mosaic_rng_accepts_negative_ints() -> None:
    a = mosaic_rng(-1, -2, [-3]).random(4)
    assert (a == mosaic_rng(-1, -2, [-3]).random(4)).all()


@SETTINGS
@given(mosaic_cases())
def test_same_seed_is_bit_identical(case: tuple) -> None:
    out_hw, sources, flips, seed = case
    canvas_a, boxes_a, labels_a = run(out_hw, sources, flips, seed)
    canvas_b, boxes_b, labels_b = run(out_hw, sources, flips, seed)
    assert canvas_a.tobytes() == canvas_b.tobytes()
    assert boxes_a.tobytes() == boxes_b.tobytes()
    assert labels_a.tobytes() == labels_b.tobytes()


def test_different_indices_give_different_geometry() -> None:
    hw = [(480, 640)] * 4
    seen = {
        mosaic_geometry(mosaic_rng(0, 0, [i, i + 1, i + 2, i + 3]), (640, 640), hw)
        for i in range(200)
    }
    assert len(seen) >= 195
    # and the epoch and the seed matter too
    base = mosaic_geometry(mosaic_rng(0, 0, [1, 2, 3, 4]), (640, 640), hw)
    assert mosaic_geometry(mosaic_rng(0, 1, [1, 2, 3, 4]), (640, 640), hw) != base
    assert mosaic_geometry(mosaic_rng(1, 0, [1, 2, 3, 4]), (640, 640), hw) != base


def test_geometry_draws_in_the_documented_order() -> None:
    hw = [(100, 200), (50, 60), None, (7, 3)]
    got = mosaic_geometry(np.random.default_rng(5), (300, 400), hw)
    rng = np.random.default_rng(5)
    cy, cx = int(rng.integers(0, 300)), int(rng.integers(0, 400))
    r = rng.uniform(*MOSAIC_SCALE, size=4)
    assert got.centre == (cy, cx)
    assert got.sizes == (
        (max(1, round(100 * r[0])), max(1, round(200 * r[0]))),
        (max(1, round(50 * r[1])), max(1, round(60 * r[1]))),
        (0, 0),
        (max(1, round(7 * r[3])), max(1, round(3 * r[3]))),
    )


def test_geometry_ranges() -> None:
    for seed in range(300):
        g = mosaic_geometry(np.random.default_rng(seed), (10, 20), [(100, 100)] * 4)
        assert 0 <= g.centre[0] < 10 and 0 <= g.centre[1] < 20
        assert all(50 <= h <= 150 and h == w for h, w in g.sizes)
    tiny = mosaic_geometry(np.random.default_rng(0), (1, 1), [(1, 1)] * 4)
    assert tiny.centre == (0, 0) and all(s == (1, 1) for s in tiny.sizes)


def test_geometry_rejects_bad_arguments() -> None:
    with pytest.raises(ValueError, match="at most 4"):
        mosaic_geometry(np.random.default_rng(0), (10, 10), [(1, 1)] * 5)
    with pytest.raises(ValueError, match="positive"):
        mosaic_geometry(np.random.default_rng(0), (0, 10), [(1, 1)])
    with pytest.raises(ValueError, match="flips"):
        compose_mosaic(
            np.zeros((3, 8, 8), np.uint8), [flat_source(4, 4, 1)], [], np.random.default_rng(0)
        )


# --- pixels and boxes against the reference --------------------------------------------


@SETTINGS
@given(mosaic_cases())
def test_matches_the_padded_canvas_reference(case: tuple) -> None:
    out_hw, sources, flips, seed = case
    canvas, boxes, labels = run(out_hw, sources, flips, seed)
    want_canvas, want_boxes, want_labels = reference(out_hw, sources, flips, seed)
    np.testing.assert_array_equal(canvas, want_canvas)
    np.testing.assert_array_equal(boxes, want_boxes)
    np.testing.assert_array_equal(labels, want_labels)


@SETTINGS
@given(mosaic_cases())
def test_boxes_lie_inside_the_image_and_are_not_degenerate(case: tuple) -> None:
    out_hw, sources, flips, seed = case
    _, boxes, labels = run(out_hw, sources, flips, seed)
    assert boxes.dtype == np.float32 and boxes.shape == (len(labels), 4)
    assert labels.dtype == np.int64
    assert np.isfinite(boxes).all()
    out_h, out_w = out_hw
    assert (boxes[:, 0] >= 0).all() and (boxes[:, 2] <= out_w).all()
    assert (boxes[:, 1] >= 0).all() and (boxes[:, 3] <= out_h).all()
    assert (boxes[:, 2] - boxes[:, 0] > 2).all() and (boxes[:, 3] - boxes[:, 1] > 2).all()


def test_each_colour_appears_only_in_its_quadrant() -> None:
    out_hw = (120, 160)
    sources: list[Source | None] = [flat_source(90, 70, 40 * (t + 1)) for t in range(4)]
    for seed in range(40):
        canvas, _, _ = run(out_hw, sources, [seed % 2 == 0] * 4, seed)
        g = geometry_of(out_hw, sources, seed)
        cy, cx = g.centre
        ys, xs = np.mgrid[: out_hw[0], : out_hw[1]]
        for t in range(4):
            h, w = g.sizes[t]
            top, left = t < 2, t % 2 == 0
            in_y = (cy - h <= ys) & (ys < cy) if top else (cy <= ys) & (ys < cy + h)
            in_x = (cx - w <= xs) & (xs < cx) if left else (cx <= xs) & (xs < cx + w)
            for c in range(3):  # exactly the cell's rectangle, cropped, has its colour
                np.testing.assert_array_equal(canvas[c] == 40 * (t + 1), in_y & in_x)
        covered = np.isin(canvas[0], [40, 80, 120, 160])
        assert (canvas[:, ~covered] == 0).all()  # padding stays 0


@pytest.mark.parametrize("missing", range(4))
def test_a_missing_source_leaves_its_quadrant_empty_and_the_rest_unchanged(
    missing: int,
) -> None:
    out_hw = (96, 128)
    full: list[Source | None] = [
        noise_source(60 + 5 * t, 80 - 5 * t, [[5, 5, 40, 40], [1, 1, 30, 20]], seed=t)
        for t in range(4)
    ]
    part = list(full)
    part[missing] = None
    flips = [True, False, False, True]
    for seed in range(30):
        g_full, g_part = geometry_of(out_hw, full, seed), geometry_of(out_hw, part, seed)
        assert g_part.centre == g_full.centre
        assert g_part.sizes[missing] == (0, 0)
        assert [s for t, s in enumerate(g_part.sizes) if t != missing] == [
            s for t, s in enumerate(g_full.sizes) if t != missing
        ]
        canvas_full, _, _ = run(out_hw, full, flips, seed)
        canvas_part, boxes, labels = run(out_hw, part, flips, seed)
        cy, cx = g_full.centre
        rows = slice(0, cy) if missing < 2 else slice(cy, None)
        cols = slice(0, cx) if missing % 2 == 0 else slice(cx, None)
        assert (canvas_part[:, rows, cols] == 0).all()
        canvas_full[:, rows, cols] = 0
        np.testing.assert_array_equal(canvas_part, canvas_full)
        # the boxes are those of the other cells, as the reference places them
        _, want_boxes, want_labels = reference(out_hw, part, flips, seed)
        np.testing.assert_array_equal(boxes, want_boxes)
        np.testing.assert_array_equal(labels, want_labels)


def test_flip_mirrors_pixels_and_boxes() -> None:
    # One source in cell 3 (top-left corner at the centre), small enough to be fully
    # visible for this seed: the flipped cell is the unflipped one mirrored.
    src = noise_source(30, 40, [[2, 3, 12, 20]], seed=9)
    sources: list[Source | None] = [None, None, None, src]
    out_hw = (200, 200)
    seed = next(
        s
        for s in range(1000)
        if (g := geometry_of(out_hw, sources, s)).centre[0] + g.sizes[3][0] <= 200
        and g.centre[1] + g.sizes[3][1] <= 200
    )
    g = geometry_of(out_hw, sources, seed)
    (cy, cx), (h, w) = g.centre, g.sizes[3]
    plain, plain_boxes, _ = run(out_hw, sources, [False] * 4, seed)
    flipped, flipped_boxes, labels = run(out_hw, sources, [False, False, False, True], seed)
    cell = (slice(None), slice(cy, cy + h), slice(cx, cx + w))
    np.testing.assert_array_equal(flipped[cell], plain[cell][:, :, ::-1])
    manual = np.stack([cv2.resize(p, (w, h), interpolation=cv2.INTER_LINEAR) for p in src.image])
    np.testing.assert_array_equal(flipped[cell], manual[:, :, ::-1])
    sx, sy = np.float32(w / 40), np.float32(h / 30)
    x1, y1, x2, y2 = 2 * sx, 3 * sy, 12 * sx, 20 * sy
    want = np.array([[w - x2 + cx, y1 + cy, w - x1 + cx, y2 + cy]], dtype=np.float32)
    np.testing.assert_allclose(flipped_boxes, want, rtol=1e-6)
    np.testing.assert_allclose(plain_boxes, [[x1 + cx, y1 + cy, x2 + cx, y2 + cy]], rtol=1e-6)
    assert labels.tolist() == [1]


@settings(max_examples=80, deadline=None)
@given(
    st.integers(0, 2**32),
    st.integers(0, 3),
    st.booleans(),
    st.tuples(st.integers(0, 10), st.integers(0, 10), st.integers(16, 30), st.integers(16, 30)),
)
def test_a_box_inside_the_visible_part_keeps_its_scaled_coordinates(
    seed: int, cell: int, flip: bool, box: tuple[int, int, int, int]
) -> None:
    src = noise_source(30, 30, [list(map(float, box))])
    sources: list[Source | None] = [None] * 4
    sources[cell] = src
    flips = [flip] * 4
    out_hw = (100, 120)
    g = geometry_of(out_hw, sources, seed)
    h, w = g.sizes[cell]
    y0, x0 = cell_origin(g.centre, cell, (h, w))
    f = np.array([w / 30, h / 30, w / 30, h / 30], dtype=np.float32)
    b = np.array(box, dtype=np.float32) * f
    if flip:
        b = np.array([w - b[2], b[1], w - b[0], b[3]], dtype=np.float32)
    want = b + np.array([x0, y0, x0, y0], dtype=np.float32)
    _, boxes, _ = run(out_hw, sources, flips, seed)
    inside = want[0] >= 0 and want[1] >= 0 and want[2] <= 120 and want[3] <= 100
    if inside:  # scaled sides are >= 6 * 0.5 = 3 > 2 px: always kept
        np.testing.assert_allclose(boxes, want[None], rtol=1e-6, atol=1e-5)


def test_cell_origin_corners_touch_the_centre() -> None:
    assert cell_origin((50, 60), 0, (10, 20)) == (40, 40)
    assert cell_origin((50, 60), 1, (10, 20)) == (40, 60)
    assert cell_origin((50, 60), 2, (10, 20)) == (50, 40)
    assert cell_origin((50, 60), 3, (10, 20)) == (50, 60)


# --- the box filter and empty inputs ---------------------------------------------------


def test_box_candidates_rule() -> None:
    before = np.array(
        [[0, 0, 10, 10], [0, 0, 10, 10], [0, 0, 100, 100], [0, 0, 500, 4], [0, 0, 10, 10]],
        dtype=np.float32,
    )
    after = np.array(
        [[0, 0, 10, 10], [0, 0, 2, 10], [0, 0, 30, 30], [0, 0, 500, 4], [0, 0, np.nan, 10]],
        dtype=np.float32,
    )
    # kept; too narrow; 9% of its area left; aspect ratio 125; NaN
    assert box_candidates(before, after).tolist() == [True, False, False, False, False]


def test_box_outside_the_output_or_mostly_cropped_is_dropped() -> None:
    # A box whose visible part is under 10% of its area is dropped, as in Ultralytics.
    src = flat_source(100, 100, 9, [[0, 0, 100, 100]])
    for seed in range(50):
        g = geometry_of((64, 64), [src], seed)
        h, w = g.sizes[0]
        cy, cx = g.centre
        visible = min(cy, h) * min(cx, w)
        _, boxes, labels = run((64, 64), [src], [False], seed)
        kept = min(cy, h) > 2 and min(cx, w) > 2 and visible / (h * w) > 0.1
        assert len(boxes) == int(kept) and labels.tolist() == [9] * int(kept)


def test_empty_inputs() -> None:
    canvas = np.zeros((3, 16, 16), np.uint8)
    for sources in ([], [None, None, None, None], [flat_source(8, 8, 5)] * 4):
        canvas[:] = 0
        boxes, labels = compose_mosaic(
            canvas, sources, [False] * len(sources), np.random.default_rng(0)
        )
        assert boxes.shape == (0, 4) and boxes.dtype == np.float32
        assert labels.shape == (0,) and labels.dtype == np.int64
        if not any(sources):
            assert not canvas.any()

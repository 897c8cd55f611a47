"""Image and box math against hand-computed cases (pure functions, no sockets)."""

from __future__ import annotations

import cv2
import numpy as np
import pytest

from dataserver.data.pipeline import build_output, prepare
from dataserver.data.sample import Sample, SampleError, as_sample
from dataserver.data.stitch import compose, grid_side
from dataserver.data.transforms import (
    augment,
    augment_rng,
    decode_image,
    fit_size,
    hflip,
    letterbox,
)


def sample(h: int, w: int, boxes: list[list[int]] | list[list[float]], value: int = 255) -> Sample:
    image = np.full((h, w, 3), value, dtype=np.uint8)
    b = np.array(boxes, dtype=np.float32).reshape(-1, 4)
    return Sample(image, b, np.arange(1, len(b) + 1, dtype=np.int64))


def test_letterbox_wide_image_scales_by_width_and_pads_bottom() -> None:
    # 100 x 200 into 64 x 64: scale min(64/100, 64/200) = 0.32 -> 32 x 64 at the top-left.
    out = letterbox(sample(100, 200, [[20, 10, 60, 50]]), 64, 64)
    assert out.image.shape == (64, 64, 3)
    assert (out.image[:32] == 255).all()
    assert (out.image[32:] == 0).all()
    np.testing.assert_allclose(out.boxes, [[6.4, 3.2, 19.2, 16.0]], rtol=1e-6)
    assert out.labels.tolist() == [1]


def test_letterbox_tall_image_pads_right_and_upscales() -> None:
    # 50 x 25 into 200 x 300: scale min(4, 12) = 4 -> 200 x 100, columns 100.. are padding.
    out = letterbox(sample(50, 25, [[5, 10, 15, 40]]), 200, 300)
    assert (out.image[:, :100] == 255).all()
    assert (out.image[:, 100:] == 0).all()
    np.testing.assert_allclose(out.boxes, [[20, 40, 60, 160]])


def test_letterbox_uses_exact_per_axis_factors_after_rounding() -> None:
    # 3 x 7 into 10 x 10: scale 10/7 -> (round(4.29) = 4, 10); x factor 10/7, y factor 4/3.
    assert fit_size(3, 7, 10, 10) == (4, 10)
    out = letterbox(sample(3, 7, [[0, 0, 7, 3]]), 10, 10)
    np.testing.assert_allclose(out.boxes, [[0, 0, 10, 4]], rtol=1e-6)


def test_letterbox_clips_and_drops_degenerate_boxes() -> None:
    boxes = [
        [-10, -5, 250, 120],  # larger than the image: clipped to it
        [210, 10, 220, 20],  # entirely right of the image: nothing left
        [50, 10, 50, 20],  # zero width
        [199, 10, 210, 20],  # partly outside: clipped, kept
    ]
    out = letterbox(sample(100, 200, boxes), 64, 64)
    expected = np.array([[0, 0, 64, 32], [63.68, 3.2, 64, 6.4]], dtype=np.float32)
    np.testing.assert_allclose(out.boxes, expected, rtol=1e-5)
    assert out.labels.tolist() == [1, 4]


def test_hflip_moves_pixels_and_boxes() -> None:
    s = sample(4, 200, [[20, 1, 60, 3]], value=0)
    s.image[:, 0] = 9
    f = hflip(s)
    assert (f.image[:, 199] == 9).all() and (f.image[:, 0] == 0).all()
    np.testing.assert_allclose(f.boxes, [[140, 1, 180, 3]])
    np.testing.assert_allclose(hflip(f).boxes, s.boxes)  # an involution


def test_flip_decision_is_a_function_of_seed_epoch_index() -> None:
    s = sample(8, 16, [[0, 0, 4, 4]])
    flips = [augment(s, augment_rng(0, 0, i)).boxes[0, 0] != 0 for i in range(200)]
    again = [augment(s, augment_rng(0, 0, i)).boxes[0, 0] != 0 for i in range(200)]
    other_epoch = [augment(s, augment_rng(0, 1, i)).boxes[0, 0] != 0 for i in range(200)]
    assert flips == again
    assert flips != other_epoch
    assert 60 < sum(flips) < 140  # about half


def test_spatial_stitch_places_tiles_row_major_with_boxes_in_their_cells() -> None:
    sources = [sample(16, 32, [[0, 0, 32, 16]], value=10 * (t + 1)) for t in range(4)]
    out = compose(sources, 2, 64, 64)
    cells = {(0, 0): 10, (0, 32): 20, (32, 0): 30, (32, 32): 40}
    for (y, x), value in cells.items():
        assert (out.image[y : y + 16, x : x + 32] == value).all()  # the tile
        assert (out.image[y + 16 : y + 32, x : x + 32] == 0).all()  # its cell's padding
    np.testing.assert_allclose(
        out.boxes, [[0, 0, 32, 16], [32, 0, 64, 16], [0, 32, 32, 48], [32, 32, 64, 48]]
    )


def test_stitch_k9_scales_into_thirds_and_leaves_missing_cells_empty() -> None:
    sources: list[Sample | None] = [
        sample(30, 30, [[3, 3, 27, 27]], value=100 + t) for t in range(7)
    ]
    out = compose(sources, 3, 90, 90)  # 7 of 9 cells: a short group at the end of an epoch
    assert out.image.shape == (90, 90, 3)
    assert (out.image[60:90, 30:90] == 0).all()  # cells 7 and 8 are empty
    assert (out.image[30:60, 60:90] == 105).all()  # cell 5 = row 1, col 2
    assert len(out.boxes) == 7
    np.testing.assert_allclose(out.boxes[5], [63, 33, 87, 57])


def test_grid_side_needs_a_square() -> None:
    assert [grid_side(k) for k in (1, 4, 9, 16)] == [1, 2, 3, 4]
    with pytest.raises(ValueError, match="square"):
        grid_side(6)


def test_build_output_is_chw_and_skips_failed_tiles() -> None:
    def source(i: int) -> Sample:
        if i == 2:
            raise SampleError(i, "broken", "x.jpg")
        return sample(10, 10, [[1, 1, 9, 9]], value=50 + i)

    out = build_output(source, [0, 1, 2, 3], 2, (20, 20), skip_errors=True)
    assert out.image.shape == (3, 20, 20)
    assert out.indices == [0, 1, 3]
    assert out.failed[0][0] == 2 and "x.jpg" in out.failed[0][1]
    assert (out.image[:, 10:, :10] == 0).all()  # the failed tile's cell stays empty
    with pytest.raises(SampleError, match=r"sample 2 \(x.jpg\): broken"):
        build_output(source, [0, 1, 2, 3], 2, (20, 20), skip_errors=False)


def test_decode_image_and_bad_bytes() -> None:
    rgb = np.zeros((8, 8, 3), np.uint8)
    rgb[..., 0] = 255  # red
    ok, jpeg = cv2.imencode(".png", cv2.cvtColor(rgb, cv2.COLOR_RGB2BGR))
    assert ok
    decoded = decode_image(jpeg.tobytes())
    assert decoded is not None and decoded[0, 0].tolist() == [255, 0, 0]
    assert decode_image(b"not an image") is None
    assert decode_image(b"") is None


def test_as_sample_names_what_is_wrong() -> None:
    with pytest.raises(SampleError, match="sample 3: image must be uint8"):
        as_sample(3, {"image": np.zeros((4, 4, 3), np.float32)})
    with pytest.raises(SampleError, match="2 boxes but 1 labels"):
        as_sample(
            3, {"image": np.zeros((4, 4, 3), np.uint8), "boxes": np.zeros((2, 4)), "labels": [1]}
        )
    with pytest.raises(SampleError, match="expected a dict"):
        as_sample(3, [1, 2])


def test_prepare_wraps_dataset_exceptions_with_the_index() -> None:
    class Broken:
        def __getitem__(self, i: int) -> dict[str, object]:
            raise KeyError("no such thing")

    with pytest.raises(SampleError, match="sample 4: KeyError"):
        prepare(Broken(), 4, 0, 0)


@pytest.mark.parametrize("grid", [1, 2, 3])
def test_compose_writes_the_same_pixels_in_chw_as_in_hwc(grid: int) -> None:
    rng = np.random.default_rng(0)
    sources: list[Sample | None] = [
        Sample(
            rng.integers(0, 256, (50 + 7 * t, 80 - 5 * t, 3), dtype=np.uint8),
            np.array([[1, 2, 30, 40]], np.float32),
            np.array([t], np.int64),
        )
        for t in range(grid * grid)
    ]
    sources[-1] = None  # an empty cell too
    hwc = compose(sources, grid, 97, 131)
    chw = compose(sources, grid, 97, 131, chw=True)
    assert np.array_equal(hwc.image.transpose(2, 0, 1), chw.image)
    assert np.array_equal(hwc.boxes, chw.boxes) and np.array_equal(hwc.labels, chw.labels)

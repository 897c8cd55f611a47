"""Image and box math against hand-computed cases (pure functions, no sockets): fit,
flip, place, compose, decode, sample checks."""

from __future__ import annotations

import cv2
import numpy as np
import pytest

from dataserver.data.pipeline import Source, compose_into, compose_one, fit, flip_of, place, read
from dataserver.data.sample import Sample, SampleError, as_sample
from dataserver.data.transforms import decode_image, fit_size, grid_side
from dataserver.protocol import BatchSizes


def sample(h: int, w: int, boxes: list[list[int]] | list[list[float]], value: int = 255) -> Sample:
    image = np.full((h, w, 3), value, dtype=np.uint8)
    b = np.array(boxes, dtype=np.float32).reshape(-1, 4)
    return Sample(image, b, np.arange(1, len(b) + 1, dtype=np.int64))


def canvas(h: int, w: int) -> np.ndarray:
    return np.zeros((3, h, w), np.uint8)


def test_fit_wide_image_scales_by_width_into_chw_planes() -> None:
    # 100 x 200 into 64 x 64: scale min(64/100, 64/200) = 0.32 -> 32 x 64.
    out = fit(sample(100, 200, [[20, 10, 60, 50]]), (64, 64))
    assert out.image.shape == (3, 32, 64) and (out.image == 255).all()
    np.testing.assert_allclose(out.boxes, [[6.4, 3.2, 19.2, 16.0]], rtol=1e-6)
    assert out.labels.tolist() == [1]


def test_fit_upscales_a_small_image() -> None:
    # 50 x 25 into 200 x 300: scale min(4, 12) = 4 -> 200 x 100.
    out = fit(sample(50, 25, [[5, 10, 15, 40]]), (200, 300))
    assert out.image.shape == (3, 200, 100)
    np.testing.assert_allclose(out.boxes, [[20, 40, 60, 160]])


def test_fit_uses_exact_per_axis_factors_after_rounding() -> None:
    # 3 x 7 into 10 x 10: scale 10/7 -> (round(4.29) = 4, 10); x factor 10/7, y factor 4/3.
    assert fit_size(3, 7, 10, 10) == (4, 10)
    out = fit(sample(3, 7, [[0, 0, 7, 3]]), (10, 10))
    np.testing.assert_allclose(out.boxes, [[0, 0, 10, 4]], rtol=1e-6)


def test_fit_clips_and_drops_degenerate_boxes() -> None:
    boxes = [
        [-10, -5, 250, 120],  # larger than the image: clipped to it
        [210, 10, 220, 20],  # entirely right of the image: nothing left
        [50, 10, 50, 20],  # zero width
        [199, 10, 210, 20],  # partly outside: clipped, kept
    ]
    out = fit(sample(100, 200, boxes), (64, 64))
    expected = np.array([[0, 0, 64, 32], [63.68, 3.2, 64, 6.4]], dtype=np.float32)
    np.testing.assert_allclose(out.boxes, expected, rtol=1e-5)
    assert out.labels.tolist() == [1, 4]


def gradient(h: int, w: int) -> Source:
    """Columns numbered 0..w-1 in every plane; one box [2, 1, 5, 3]."""
    image = np.broadcast_to(np.arange(w, dtype=np.uint8), (3, h, w)).copy()
    return Source(image, np.array([[2, 1, 5, 3]], np.float32), np.array([7], np.int64))


def test_place_at_the_top_left_of_its_cell_with_the_rest_left_alone() -> None:
    # A source already fitted to the image size (4 x 8 in 4 x 16) is copied as it is.
    out = canvas(6, 16)
    boxes, labels = place(out, 0, 0, 4, 16, gradient(4, 8), flip=False)
    assert (out[:, :4, :8] == np.arange(8)).all()
    assert (out[:, 4:, :] == 0).all() and (out[:, :, 8:] == 0).all()
    np.testing.assert_allclose(boxes, [[2, 1, 5, 3]])
    assert labels.tolist() == [7]


def test_place_mirrors_pixels_and_boxes_when_flipped() -> None:
    out = canvas(4, 8)
    boxes, _ = place(out, 0, 0, 4, 8, gradient(4, 8), flip=True)
    assert (out == np.arange(8)[::-1]).all()
    np.testing.assert_allclose(boxes, [[3, 1, 6, 3]])  # x -> 8 - x, ends swapped
    again = canvas(4, 8)
    src = Source(out.copy(), boxes, np.array([7]))
    back, _ = place(again, 0, 0, 4, 8, src, flip=True)
    np.testing.assert_allclose(back, [[2, 1, 5, 3]])  # an involution
    assert (again == np.arange(8)).all()


def test_place_fits_a_source_into_a_smaller_cell_and_offsets_its_boxes() -> None:
    out = canvas(64, 64)
    src = Source(
        np.full((3, 16, 32), 9, np.uint8), np.array([[0, 0, 32, 16]], np.float32), np.array([1])
    )
    boxes, _ = place(out, 32, 32, 32, 32, src, flip=False)  # the bottom-right cell of a 2x2
    assert (out[:, 32:48, 32:64] == 9).all()
    assert (out[:, 48:, 32:] == 0).all() and (out[:, :32] == 0).all()
    np.testing.assert_allclose(boxes, [[32, 32, 64, 48]])


def test_flip_decision_is_a_function_of_seed_epoch_index() -> None:
    flips = [flip_of(0, 0, i) for i in range(400)]
    assert flips == [flip_of(0, 0, i) for i in range(400)]
    assert flips != [flip_of(0, 1, i) for i in range(400)]
    assert flips != [flip_of(1, 0, i) for i in range(400)]
    assert 150 < sum(flips) < 250  # about half


def test_compose_places_sources_row_major_and_leaves_failed_cells_empty() -> None:
    def source(i: int) -> Source:
        if i == 2:
            raise SampleError(i, "broken", "x.jpg")
        return Source(
            np.full((3, 10, 10), 50 + i, np.uint8),
            np.array([[1, 1, 9, 9]], np.float32),
            np.array([i]),
        )

    out = canvas(20, 20)
    got = compose_into(out, source, [0, 1, 2, 3], 2, [False] * 4, skip_errors=True)
    assert got.indices == [0, 1, 3]
    assert got.failed[0][0] == 2 and "x.jpg" in got.failed[0][1]
    assert (out[:, :10, :10] == 50).all() and (out[:, :10, 10:] == 51).all()
    assert (out[:, 10:, :10] == 0).all()  # the failed source's cell stays empty
    assert (out[:, 10:, 10:] == 53).all()
    np.testing.assert_allclose(got.boxes, [[1, 1, 9, 9], [11, 1, 19, 9], [11, 11, 19, 19]])
    with pytest.raises(SampleError, match=r"sample 2 \(x.jpg\): broken"):
        compose_into(canvas(20, 20), source, [0, 1, 2, 3], 2, [False] * 4, skip_errors=False)


def test_stitch_k9_a_short_group_leaves_its_last_cells_empty() -> None:
    def source(i: int) -> Source:
        return fit(sample(30, 30, [[3, 3, 27, 27]], value=100 + i), (90, 90))

    out = canvas(90, 90)
    got = compose_into(out, source, list(range(7)), 3, [False] * 7, skip_errors=False)
    assert (out[:, 60:90, 30:90] == 0).all()  # cells 7 and 8 are empty
    assert (out[:, 30:60, 60:90] == 105).all()  # cell 5 = row 1, col 2
    assert len(got.boxes) == 7
    np.testing.assert_allclose(got.boxes[5], [63, 33, 87, 57])


def test_compose_one_fits_to_the_image_size_then_into_cells() -> None:
    class Three:
        def __getitem__(self, i: int) -> dict[str, object]:
            return {
                "image": np.full((40, 80, 3), 10 * (i + 1), np.uint8),
                "boxes": [[0, 0, 80, 40]],
                "labels": [i],
            }

    image, got = compose_one(Three(), [0, 1, 2], 2, BatchSizes.of((64, 64)), seed=0, epoch=0)
    # Each source is fitted to 64 x 64 first (32 x 64), then into its 32 x 32 cell (16 x 32).
    assert image.shape == (3, 64, 64)
    assert (image[:, :16, :32] == 10).all() and (image[:, :16, 32:] == 20).all()
    assert (image[:, 32:48, :32] == 30).all() and (image[:, 48:, :] == 0).all()
    np.testing.assert_allclose(got.boxes, [[0, 0, 32, 16], [32, 0, 64, 16], [0, 32, 32, 48]])


def test_grid_side_needs_a_square() -> None:
    assert [grid_side(k) for k in (1, 4, 9, 16)] == [1, 2, 3, 4]
    with pytest.raises(ValueError, match="square"):
        grid_side(6)


def test_decode_image_and_bad_bytes() -> None:
    rgb = np.zeros((8, 8, 3), np.uint8)
    rgb[..., 0] = 255  # red
    ok, jpeg = cv2.imencode(".png", cv2.cvtColor(rgb, cv2.COLOR_RGB2BGR))
    assert ok
    decoded = decode_image(jpeg.tobytes())
    assert decoded is not None and decoded[0, 0].tolist() == [255, 0, 0]
    assert decode_image(b"not an image") is None
    assert decode_image(b"") is None


def test_a_jpeg_decodes_to_the_bytes_of_a_bgr_decode_swapped() -> None:
    """The RGB decode (``IMREAD_COLOR_RGB`` where OpenCV has it) is OpenCV's BGR decode with
    its channels swapped, byte for byte (what Ultralytics reads, in RGB order)."""
    rng = np.random.default_rng(3)
    picture = cv2.GaussianBlur(rng.integers(0, 256, (48, 64, 3), dtype=np.uint8), (5, 5), 0)
    ok, jpeg = cv2.imencode(".jpg", picture, [cv2.IMWRITE_JPEG_QUALITY, 85])
    assert ok
    bgr = cv2.imdecode(jpeg, cv2.IMREAD_COLOR)
    assert bgr is not None
    want = cv2.cvtColor(bgr, cv2.COLOR_BGR2RGB)
    got = decode_image(jpeg.tobytes())
    assert got is not None
    np.testing.assert_array_equal(got, want)


def test_as_sample_names_what_is_wrong() -> None:
    with pytest.raises(SampleError, match="sample 3: image must be uint8"):
        as_sample(3, {"image": np.zeros((4, 4, 3), np.float32)})
    with pytest.raises(SampleError, match="2 boxes but 1 labels"):
        as_sample(
            3, {"image": np.zeros((4, 4, 3), np.uint8), "boxes": np.zeros((2, 4)), "labels": [1]}
        )
    with pytest.raises(SampleError, match="expected a dict"):
        as_sample(3, [1, 2])


def test_read_wraps_dataset_exceptions_with_the_index() -> None:
    class Broken:
        def __getitem__(self, i: int) -> dict[str, object]:
            raise KeyError("no such thing")

    with pytest.raises(SampleError, match="sample 4: KeyError"):
        read(Broken(), 4)

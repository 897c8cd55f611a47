"""Stitched batches checked on pixels and boxes: flat-coloured sources whose colour names
their index, so every cell and every box can be traced back to ``Batch.indices``."""

from __future__ import annotations

import json
from typing import Any

import pytest
import torch
from clients import make_client

from dataserver.data.transforms import fit_size

pytestmark = pytest.mark.timeout(120)

N = 50


@pytest.fixture(scope="module")
def flat_server() -> Any:
    from conftest import Server

    server = Server(
        "--dataset", "ds_plugins:flat", "--dataset-args", json.dumps({"n": N}), workers=2
    )
    yield server
    server.stop()


def source_hw(index: int) -> tuple[int, int]:
    """FlatDataset's image size for ``index`` (see tests/plugins/ds_plugins.py)."""
    return 60 + (index % 3) * 10, 80 + (index % 2) * 20


def colour(index: int) -> list[int]:
    return [index & 255, (index >> 8) & 255, 77]


def check_cell(
    image: torch.Tensor, y0: int, x0: int, ch: int, cw: int, index: int, full: tuple[int, int]
) -> tuple[int, int]:
    """The tile of ``index`` fills the top-left of its cell and nothing else of it. A source
    is fitted to the image size ``full`` first (what a server's store keeps), then into its
    cell."""
    h, w = fit_size(*fit_size(*source_hw(index), *full), ch, cw)
    tile = image[:, y0 : y0 + h, x0 : x0 + w]
    assert (tile == torch.tensor(colour(index), dtype=torch.uint8)[:, None, None]).all(), index
    rest = image[:, y0 : y0 + ch, x0 : x0 + cw].clone()
    rest[:, :h, :w] = 0
    assert (rest == 0).all(), f"cell of {index} has pixels outside its tile"
    return h, w


@pytest.mark.parametrize(("k", "grid"), [(4, 2), (9, 3)])
def test_spatial_stitch_cells_and_boxes_match_indices(flat_server: Any, k: int, grid: int) -> None:
    H, W = 180, 240
    with make_client(
        flat_server.address, batch_size=3, image_size=(H, W), stitch_k=k, prefetch=2
    ) as c:
        c.set_mode("stitch")
        c.set_epoch(0)
        batches = list(c)
    ch, cw = H // grid, W // grid
    seen = []
    for b in batches:
        assert b.mode == "stitch" and b.images.shape[1:] == (3, H, W)
        for image, target, idx in zip(b.images, b.targets, b.indices, strict=True):
            assert 1 <= len(idx) <= k
            seen.extend(idx)
            assert target["labels"].tolist() == [i + 1 for i in idx]  # one box per tile, in order
            for t, index in enumerate(idx):
                row, col = divmod(t, grid)
                h, w = check_cell(image, row * ch, col * cw, ch, cw, index, (H, W))
                box = target["boxes"][t].tolist()
                # The middle half of the tile, offset into its cell (flip keeps it in place).
                expected = [
                    col * cw + w / 4,
                    row * ch + h / 4,
                    col * cw + 3 * w / 4,
                    row * ch + 3 * h / 4,
                ]
                assert box == pytest.approx(expected, abs=1e-3)
            for t in range(len(idx), k):  # a short group at the end of the epoch
                row, col = divmod(t, grid)
                assert (image[:, row * ch : (row + 1) * ch, col * cw : (col + 1) * cw] == 0).all()
    assert sorted(seen) == list(range(N))


def test_batch_layout_gives_k_times_more_images_at_cell_size(flat_server: Any) -> None:
    with make_client(
        flat_server.address,
        batch_size=3,
        image_size=(128, 160),
        stitch_layout="batch",
    ) as c:
        c.set_mode("stitch")
        c.set_epoch(0)
        batches = list(c)
    first = batches[0]
    assert first.images.shape == (12, 3, 64, 80)
    assert all(len(i) == 1 for i in first.indices)
    for image, target, (index,) in zip(first.images, first.targets, first.indices, strict=True):
        h, w = check_cell(image, 0, 0, 64, 80, index, (128, 160))
        assert target["boxes"][0].tolist() == pytest.approx(
            [w / 4, h / 4, 3 * w / 4, 3 * h / 4], abs=1e-3
        )
    assert len(batches) == 5 and len(batches[-1]) == N - 48  # 50 = 4 x 12 + 2
    assert sorted(i for b in batches for (i,) in b.indices) == list(range(N))


def test_drop_last_drops_a_short_stitched_batch(flat_server: Any) -> None:
    with make_client(flat_server.address, batch_size=3, image_size=(64, 64), drop_last=True) as c:
        c.set_mode("stitch")
        c.set_epoch(0)
        batches = list(c)
    assert [len(b) for b in batches] == [3, 3, 3, 3]  # 50 // 12 = 4 full batches
    assert all(len(i) == 4 for b in batches for i in b.indices)

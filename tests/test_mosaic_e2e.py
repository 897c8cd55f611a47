"""``stitch_layout="mosaic"`` (issue 17, point 5) through the public API on real servers:
each stitched image is a mosaic of 4 samples (the epoch's last may hold fewer), bit-identical
to ``compose_one`` run here on the same dataset and on 1 or 2 workers; ``set_mode`` turns it
on and off with the next batch (close-mosaic is ``set_mode("regular")``), the lookahead
covering the flips, and every index of the epoch is delivered exactly once throughout."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import numpy as np
import pytest
from batches import flat_servers, snap
from clients import make_client
from conftest import Server
from ds_plugins import FlatDataset

from dataserver.data.pipeline import compose_one
from dataserver.protocol import BatchSizes
from dataserver_client import Batch
from dataserver_client.plan.epoch import epoch_order

pytestmark = pytest.mark.timeout(150)

N = 42  # 5 stitched batches of 2 x 4 samples, then one image of the 2 left
DATASET = FlatDataset(N)
KW: dict[str, Any] = {"timeout": 20.0, "stitch_layout": "mosaic", "stitch_k": 4}


@pytest.fixture(scope="module")
def servers() -> Iterator[dict[int, Server]]:
    """The same dataset behind a 1-worker and a 2-worker server (both keep a store)."""
    yield from flat_servers(N)


def check_batch(batch: Batch, size: tuple[int, int], seed: int, mode: str) -> None:
    """Mode and shape as asked; boxes inside the image, labels those of its indices; each
    image what ``compose_one`` makes: a mosaic of its 4 indices, or one letterboxed sample."""
    h, w = size
    assert batch.mode == mode and tuple(batch.image_size) == size
    assert tuple(batch.images.shape[1:]) == (3, h, w)
    stitched = mode == "stitch"
    for image, target, idx in zip(batch.images, batch.targets, batch.indices, strict=True):
        assert 1 <= len(idx) <= (4 if stitched else 1)
        boxes, labels = target["boxes"], target["labels"]
        if len(boxes):
            assert (boxes[:, :2] >= 0).all() and (boxes[:, 2] <= w).all()
            assert (boxes[:, 3] <= h).all()
            assert (boxes[:, 2:] - boxes[:, :2] > 2).all() if stitched else True
        assert set(labels.tolist()) <= {i + 1 for i in idx}
        canvas, composed = compose_one(
            DATASET,
            idx,
            2 if stitched else 1,
            BatchSizes.of(size),
            seed,
            batch.epoch,
            step=batch.step,
            mode=mode,
            layout="mosaic" if stitched else "grid",
        )
        assert np.array_equal(canvas, image.numpy()), (batch.step, idx)
        assert np.array_equal(composed.boxes, boxes.numpy()), (batch.step, idx)
        assert composed.labels.tolist() == labels.tolist()


def indices_of(batches: list[Batch] | list[dict[str, Any]]) -> list[int]:
    out: list[int] = []
    for b in batches:
        for idx in b["indices"] if isinstance(b, dict) else b.indices:
            out.extend(idx)
    return out


@pytest.mark.parametrize("size", [(64, 64), (48, 80)])
def test_each_stitched_image_is_a_mosaic_of_four(
    servers: dict[int, Server], size: tuple[int, int]
) -> None:
    seed = 4
    with make_client(servers[2].address, batch_size=2, image_size=size, seed=seed, **KW) as c:
        c.set_mode("stitch")
        c.set_epoch(0)
        batches = list(c)
    for b in batches:
        check_batch(b, size, seed, "stitch")
        assert b.manifest["stitch_layout"] == "mosaic"
    per_image = [len(idx) for b in batches for idx in b.indices]
    assert per_image == [4] * 10 + [2]  # only the last image holds fewer
    assert indices_of(batches) == epoch_order(N, seed, 0, True).tolist()
    # The centre is random: the four cells are not where a grid would put them.
    grids = [
        compose_one(DATASET, idx, 2, BatchSizes.of(size), seed, 0, mode="stitch")[0]
        for b in batches
        for idx in b.indices
    ]
    mosaics = [image.numpy() for b in batches for image in b.images]
    assert not any(np.array_equal(g, m) for g, m in zip(grids, mosaics, strict=True))


def steered_epoch(
    address: str, epoch: int, flips: dict[int, str], prefetch: int = 3, seed: int = 9
) -> tuple[list[Batch], dict[str, Any]]:
    """One epoch with ``set_mode(flips[step])`` called after batch ``step``, each next
    batch checked to honour it; the batches and the client's stats."""
    size = (64, 64)
    with make_client(
        address, batch_size=2, image_size=size, seed=seed, prefetch=prefetch, **KW
    ) as c:
        c.set_epoch(epoch)
        mode, got = "regular", []
        for batch in c:
            check_batch(batch, size, seed, mode)
            got.append(batch)
            if batch.step in flips:
                mode = flips[batch.step]
                c.set_mode(mode)
        stats = c.stats()
    return got, stats


FLIPS = {0: "stitch", 1: "regular", 2: "stitch", 4: "regular", 5: "stitch", 6: "regular"}


def test_flips_between_regular_and_mosaic_deliver_each_index_once(
    servers: dict[int, Server],
) -> None:
    batches, stats = steered_epoch(servers[2].address, 1, FLIPS)
    assert [b.mode for b in batches[:8]] == [
        "regular",
        "stitch",
        "regular",
        "stitch",
        "stitch",
        "regular",
        "stitch",
        "regular",
    ]
    assert all(b.mode == "regular" for b in batches[7:])
    assert indices_of(batches) == epoch_order(N, 9, 1, True).tolist()
    assert stats["flips"]["promoted"] > 0  # the lookahead covers mosaic flips too


def test_close_mosaic_is_honoured_by_the_next_batch(servers: dict[int, Server]) -> None:
    """Mosaic on for epoch 0 until its step 2, closed there (the next batch is regular,
    one sample an image), and closed between epochs for all of epoch 1."""
    seed, size = 5, (64, 64)
    with make_client(
        servers[2].address, batch_size=2, image_size=size, seed=seed, prefetch=4, **KW
    ) as c:
        c.set_mode("stitch")
        assert c.mode == "stitch"
        for epoch in (0, 1):
            c.set_epoch(epoch)
            got = []
            for batch in c:
                got.append(batch)
                closed = epoch == 1 or batch.step > 2
                check_batch(batch, size, seed, "regular" if closed else "stitch")
                if closed:
                    assert all(len(idx) == 1 for idx in batch.indices)
                if batch.step == 2 and epoch == 0:
                    c.set_mode("regular")  # close-mosaic, from a hook or the loop
                    assert c.mode == "regular"
            assert indices_of(got) == epoch_order(N, seed, epoch, True).tolist()
        assert [b.mode for b in got] == ["regular"] * (N // 2)


def test_mosaic_batches_are_bit_identical_on_one_and_two_workers(
    servers: dict[int, Server],
) -> None:
    runs = [[snap(b) for b in steered_epoch(servers[w].address, 2, FLIPS, 2)[0]] for w in (1, 2)]
    assert runs[0] == runs[1]
    assert {b["mode"] for b in runs[0]} == {"regular", "stitch"}


@pytest.mark.parametrize("k", [1, 9, 16])
def test_a_mosaic_takes_four_samples(servers: dict[int, Server], k: int) -> None:
    with pytest.raises(ValueError, match=r"stitch_layout='mosaic' takes 4 samples.*stitch_k=4"):
        make_client(servers[2].address, **{**KW, "stitch_k": k})

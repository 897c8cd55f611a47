"""YOLO's mosaic, ``mosaic_partners="window"`` (issue 24, item 3), through the public API on
real servers: every sample of the rank's epoch anchors one output (``batch.indices[i][0]``),
its 3 partners drawn from the window of positions before it (wrapping), so an epoch is N
outputs in mosaic and regular mode alike; exactly once holds for anchors across flips,
resumes, elastic resumes and worker deaths; ``mosaic_p`` mixes mosaics and regular images
in a batch; a failing partner leaves a 3-tile mosaic; every image is what ``compose_one``
makes for the same task, on 1 or 2 workers, and ``client.rebuild`` makes it again."""

from __future__ import annotations

import json
import math
from collections.abc import Iterator
from typing import Any

import numpy as np
import pytest
import torch
from aug_plugins import Jitter
from batches import flat_servers, snap
from clients import make_client
from conftest import Server
from ds_plugins import FlatDataset

from dataserver.data.pipeline import (
    Draw,
    Recipe,
    Source,
    compose_image,
    compose_one,
    finished,
    partner_flip,
    prepare,
)
from dataserver.protocol import BatchSizes
from dataserver_client import Batch, DataServerClient
from dataserver_client.plan.epoch import epoch_order, shard_of
from dataserver_client.plan.partners import window_size

pytestmark = pytest.mark.timeout(300)

N = 42
B = 4
SIZE = (64, 64)
FLAT = FlatDataset(N)
KW: dict[str, Any] = {
    "timeout": 20.0,
    "batch_size": B,
    "image_size": SIZE,
    "stitch_layout": "mosaic",
    "stitch_k": 4,
    "mosaic_partners": "window",
}


@pytest.fixture(scope="module")
def servers() -> Iterator[dict[int, Server]]:
    """The same flat dataset behind a 1-worker and a 2-worker server."""
    yield from flat_servers(N)


def shard(seed: int, epoch: int, rank: int = 0, world: int = 1, n: int = N) -> list[int]:
    return shard_of(epoch_order(n, seed, epoch, True), rank, world, False).tolist()


def anchors(batches: list[Batch]) -> list[int]:
    return [idx[0] for b in batches for idx in b.indices]


def check_images(batch: Batch, dataset: Any, seed: int) -> None:
    """Each image of ``batch`` is what ``compose_one`` makes of its task: a window mosaic of
    its 4 indices, or (1 index) its anchor as a regular image; labels those of its indices."""
    for image, target, idx in zip(batch.images, batch.targets, batch.indices, strict=True):
        mosaic = batch.mode == "stitch" and len(idx) > 1
        canvas, composed = compose_one(
            dataset,
            idx,
            2 if batch.mode == "stitch" else 1,
            BatchSizes.of(SIZE),
            seed,
            batch.epoch,
            step=batch.step,
            mode=batch.mode,
            layout="mosaic" if batch.mode == "stitch" else "grid",
            partners=batch.partners,
        )
        assert np.array_equal(canvas, image.numpy()), (batch.step, idx, mosaic)
        assert np.array_equal(composed.boxes, target["boxes"].numpy()), (batch.step, idx)
        assert composed.labels.tolist() == target["labels"].tolist()


def check_window(batches: list[Batch], order: list[int], seed: int) -> None:
    """Anchors in epoch order, each once; each stitched image's partners from the window of
    positions before its anchor's (wrapping); ``num_samples`` counts anchors."""
    assert anchors(batches) == order
    n, w = len(order), window_size(len(order), B)
    where = {index: p for p, index in enumerate(order)}
    for b in batches:
        assert b.num_samples == len(b.images) == len(b.indices)
        assert b.partners == (b.mode == "stitch")
        for idx in b.indices:
            if b.mode == "stitch":
                assert len(idx) in (1, 4)
            else:
                assert len(idx) == 1
            anchor = where[idx[0]]
            for partner in idx[1:]:
                assert 1 <= (anchor - where[partner]) % n <= w or w == n
        check_images(b, FLAT, seed)


def test_an_epoch_is_n_outputs_in_mosaic_and_regular_mode(servers: dict[int, Server]) -> None:
    seed = 3
    with make_client(servers[2].address, seed=seed, **KW) as c:
        assert len(c) == math.ceil(N / B) == 11
        c.set_mode("stitch")
        assert len(c) == 11  # (a "consume" mosaic epoch would be 3)
        c.set_epoch(0)
        batches = list(c)
        assert len(batches) == 11
        assert all(b.mode == "stitch" for b in batches)
        check_window(batches, shard(seed, 0), seed)
        assert sum(b.num_samples for b in batches) == N
        assert [len(i) for b in batches for i in b.indices] == [4] * N
        assert batches[0].manifest["mosaic_partners"] == "window"
        assert batches[0].manifest["mosaic_p"] == 1.0
        # The first positions draw partners from the epoch's end (the window wraps).
        order = shard(seed, 0)
        first = batches[0].indices[0]
        assert any(order.index(p) > order.index(first[0]) for p in first[1:])
    with make_client(servers[2].address, seed=seed, drop_last=True, **KW) as c:
        c.set_mode("stitch")
        assert len(c) == N // B == 10
        c.set_epoch(1)
        assert len(list(c)) == 10


def test_two_ranks_anchor_their_own_shards(servers: dict[int, Server]) -> None:
    seed = 5
    got = []
    for rank in (0, 1):
        with make_client(servers[2].address, seed=seed, rank=rank, world_size=2, **KW) as c:
            c.set_mode("stitch")
            assert len(c) == math.ceil(N / 2 / B)
            c.set_epoch(2)
            batches = list(c)
        check_window(batches, shard(seed, 2, rank, 2), seed)
        got.append(anchors(batches))
    assert sorted(got[0] + got[1]) == list(range(N))


def steered(
    address: str, flips: dict[int, str], seed: int = 9, **kw: Any
) -> tuple[list[Batch], dict[str, Any]]:
    """One epoch with ``set_mode(flips[step])`` after batch ``step``; its batches and the
    client's stats."""
    with make_client(address, seed=seed, prefetch=3, **{**KW, **kw}) as c:
        c.set_epoch(1)
        mode, got = "regular", []
        for batch in c:
            assert batch.mode == mode  # the next batch honours the steer
            got.append(batch)
            if batch.step in flips:
                mode = flips[batch.step]
                c.set_mode(mode)
        assert len(got) == len(c)
        stats = c.stats()
    return got, stats


FLIPS = {0: "stitch", 1: "regular", 2: "stitch", 4: "regular", 5: "stitch"}


def test_flips_deliver_each_anchor_once_and_are_the_same_on_one_and_two_workers(
    servers: dict[int, Server],
) -> None:
    runs, promoted = [], 0
    for w in (1, 2):
        batches, stats = steered(servers[w].address, FLIPS)
        runs.append(batches)
        promoted += stats["flips"]["promoted"]
    assert promoted > 0  # the lookahead's twins (same anchors, same partners) served flips
    for batches in runs:
        assert [b.mode for b in batches][:7] == [
            "regular",
            "stitch",
            "regular",
            "stitch",
            "stitch",
            "regular",
            "stitch",
        ]
        assert len(batches) == 11
        check_window(batches, shard(9, 1), 9)
    assert [snap(b) for b in runs[0]] == [snap(b) for b in runs[1]]


def test_resume_counts_anchors(servers: dict[int, Server]) -> None:
    seed = 11
    with make_client(servers[2].address, seed=seed, **KW) as c:
        c.set_mode("stitch")
        c.set_epoch(0)
        whole = [snap(b) for b in c]
    with make_client(servers[1].address, seed=seed, **KW) as c:
        c.set_mode("stitch")
        c.set_epoch(0)
        it = iter(c)
        first = [snap(next(it)) for _ in range(3)]
        state = c.state_dict()
    assert state["mosaic_partners"] == "window" and state["mosaic_p"] == 1.0
    assert state["position"] == 3 * B  # anchors, not 4 x anchors
    with make_client(servers[2].address, seed=seed, **KW) as c:
        c.load_state_dict(state)
        assert len(c) == 11
        rest = [snap(b) for b in c]
    assert first + rest == whole
    assert [i[0] for b in whole for i in b["indices"]] == shard(seed, 0)
    consume = {**KW, "mosaic_partners": "consume"}
    with (
        make_client(servers[2].address, seed=seed, **consume) as c,
        pytest.raises(ValueError, match="mosaic_partners"),
    ):
        c.load_state_dict(state)


def test_elastic_resume_delivers_the_remaining_anchors_once(servers: dict[int, Server]) -> None:
    seed, taken, states = 13, [], []
    for rank, steps in ((0, 2), (1, 3)):
        with make_client(servers[2].address, seed=seed, rank=rank, world_size=2, **KW) as c:
            c.set_mode("stitch")
            c.set_epoch(0)
            it = iter(c)
            taken += anchors([next(it) for _ in range(steps)])
            states.append(c.state_dict(gather=False))
    job = DataServerClient.merge_states(states)
    with make_client(servers[2].address, seed=seed, rank=0, world_size=1, **KW) as c:
        c.load_state_dict(job)
        rest = list(c)
    assert all(b.mode == "stitch" and b.partners for b in rest)
    assert sorted(taken + anchors(rest)) == list(range(N))


def test_mosaic_p_mixes_mosaics_and_regular_images(servers: dict[int, Server]) -> None:
    seed = 17
    with make_client(servers[2].address, seed=seed, mosaic_p=0.5, **KW) as c:
        c.set_mode("stitch")
        c.set_epoch(0)
        batches = list(c)
        manifest = batches[1].manifest
        again = c.rebuild(manifest)
    sizes = [len(i) for b in batches for i in b.indices]
    assert set(sizes) == {1, 4} and 8 < sizes.count(1) < N - 8
    assert any(len({len(i) for i in b.indices}) == 2 for b in batches)  # mixed in one batch
    check_window(batches, shard(seed, 0), seed)
    assert manifest["mosaic_p"] == 0.5
    assert snap(again) == snap(batches[1])
    assert again.partners and again.manifest["mosaic_partners"] == "window"


def test_a_failing_partner_leaves_a_three_tile_mosaic() -> None:
    n, bad, seed = 24, 5, 2
    args = ("--dataset", "ds_plugins:failing", "--dataset-args", json.dumps({"n": n, "bad": [bad]}))
    server = Server(*args, workers=1)
    try:
        with make_client(server.address, seed=seed, on_error="skip", **KW) as c:
            c.set_mode("stitch")
            c.set_epoch(0)
            batches = list(c)
    finally:
        server.stop()
    order = shard(seed, 0, n=n)
    assert anchors(batches) == [i for i in order if i != bad]  # the bad anchor is skipped
    assert [i for b in batches for i in b.skipped_indices] == [bad]
    assert sum(b.skipped for b in batches) == 1
    short = [idx for b in batches for idx in b.indices if len(idx) < 4]
    assert short and all(bad not in idx and len(idx) == 3 for idx in short)
    assert all(bad not in idx for b in batches for idx in b.indices)


def test_a_partner_that_kills_workers_is_left_out_not_its_anchor() -> None:
    n, poison, seed = 16, 7, 4
    args = (
        "--dataset",
        "ds_plugins:poison",
        "--dataset-args",
        json.dumps({"n": n, "index": poison}),
    )
    server = Server(*args, workers=2)
    try:
        kw = {**KW, "timeout": 60.0, "batch_size": 2}
        with make_client(server.address, seed=seed, on_error="skip", **kw) as c:
            c.set_mode("stitch")
            c.set_epoch(0)
            batches = list(c)
    finally:
        server.stop()
    order = shard(seed, 0, n=n)
    assert anchors(batches) == [i for i in order if i != poison]
    assert [i for b in batches for i in b.skipped_indices] == [poison]
    assert all(poison not in idx for b in batches for idx in b.indices)


def test_partners_are_augmented_for_their_anchor_and_cell() -> None:
    """With a dataset's ``augment``, a worker's window mosaic is ``compose_one``'s with
    ``partners=True``, and not what a partner augmented for its own index would give."""
    n, seed = 24, 6
    args = ("--dataset", "aug_plugins:jitter", "--dataset-args", json.dumps({"n": n}))
    server = Server(*args, workers=2)
    try:
        with make_client(server.address, seed=seed, **KW) as c:
            c.set_mode("stitch")
            c.set_epoch(0)
            batches = list(c)
    finally:
        server.stop()
    dataset = Jitter(n)
    for b in batches:
        check_images(b, dataset, seed)
    b = batches[2]
    own, _ = compose_one(
        dataset,
        b.indices[0],
        2,
        BatchSizes.of(SIZE),
        seed,
        0,
        step=2,
        mode="stitch",
        layout="mosaic",
    )
    assert not np.array_equal(own, b.images[0].numpy())


@pytest.mark.parametrize(
    ("kw", "match"),
    [
        ({"mosaic_partners": "buffer"}, "mosaic_partners must be 'consume' or 'window'"),
        ({"stitch_layout": "spatial"}, "mosaic_partners='window' needs stitch_layout='mosaic'"),
        ({"mosaic_p": 1.5}, r"mosaic_p must be a probability in \[0, 1\]"),
        ({"mosaic_p": float("nan")}, "mosaic_p must be a probability"),
        ({"mosaic_p": True}, "mosaic_p must be a probability"),
        ({"mosaic_partners": "consume", "mosaic_p": 0.5}, "mosaic_p=0.5 needs mosaic_partners"),
    ],
)
def test_bad_parameters_are_refused_by_name(
    servers: dict[int, Server], kw: dict[str, Any], match: str
) -> None:
    with pytest.raises(ValueError, match=match):
        make_client(servers[1].address, **{**KW, **kw})


def test_consume_stays_the_default(servers: dict[int, Server]) -> None:
    kw = {k: v for k, v in KW.items() if k != "mosaic_partners"}
    with make_client(servers[1].address, seed=1, **kw) as c:
        c.set_mode("stitch")
        assert len(c) == math.ceil(N / (4 * B))
        c.set_epoch(0)
        batches = list(c)
    assert not any(b.partners for b in batches)
    assert sum(b.num_samples for b in batches) == N
    assert batches[0].manifest["mosaic_partners"] == "consume"
    assert isinstance(batches[0].images, torch.Tensor)


def test_composition_draws_each_partner_for_its_anchor_and_cell() -> None:
    """(pure) The worker's composition of a window mosaic asks for each partner by (anchor,
    cell); a partner of two anchors is augmented differently in each; the anchor alone is
    exactly the regular image of that index."""
    dataset = Jitter(16)
    recipe = Recipe(1, 2, 0, "stitch", BatchSizes.of(SIZE), {}, partners=True)
    asked: list[tuple[int, Draw]] = []

    def source(index: int, draw: Draw = None) -> Source:
        asked.append((index, draw))
        return finished(dataset, index, prepare(dataset, index, SIZE), recipe, draw)

    canvas = np.zeros((3, *SIZE), np.uint8)
    compose_image(canvas, source, (3, 9, 9, 4), 2, "mosaic", recipe, False)
    assert asked == [(3, None), (9, (3, 1)), (9, (3, 2)), (4, (3, 3))]
    stored = prepare(dataset, 9, SIZE)
    one, two = (finished(dataset, 9, stored, recipe, (a, 1)).image for a in (3, 5))
    assert not np.array_equal(one, two)
    flips = {partner_flip(1, 2, a, t) for a in range(8) for t in (1, 2, 3)}
    assert flips == {True, False}
    alone, _ = compose_one(
        dataset, (3,), 2, BatchSizes.of(SIZE), 1, 2, mode="stitch", layout="mosaic", partners=True
    )
    regular, _ = compose_one(dataset, (3,), 1, BatchSizes.of(SIZE), 1, 2, mode="stitch")
    assert np.array_equal(alone, regular)

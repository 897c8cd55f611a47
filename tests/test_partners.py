"""Window mosaics planned (pure): ``partners.py`` and ``epoch.Cursor`` with
``mosaic_partners="window"``: every position anchors one output, its partners come from the
window of positions before it (wrapping), drawn by (seed, epoch, position) only."""

from __future__ import annotations

import numpy as np
import pytest

from dataserver_client.plan.epoch import REGULAR, STITCH, BatchPlan, Cursor, Layout
from dataserver_client.plan.partners import is_mosaic, partner_positions, window_size


def layout(batch: int = 4, p: float = 1.0, drop_last: bool = False) -> Layout:
    return Layout(batch, (64, 64), 4, "mosaic", drop_last, mosaic_partners="window", mosaic_p=p)


def plans(cursor: Cursor) -> list[BatchPlan]:
    out = []
    while (plan := cursor.next_plan()) is not None:
        out.append(plan)
    return out


def anchors(batches: list[BatchPlan]) -> list[int]:
    return [image.indices[0] for plan in batches for image in plan.images]


def test_window_is_yolos_buffer_length() -> None:
    assert window_size(10_000, 16) == 128  # 8 x batch
    assert window_size(10_000, 256) == 1000  # capped
    assert window_size(50, 16) == 50  # the whole shard
    assert window_size(0, 4) == 1


@pytest.mark.parametrize("n", [37, 40])
def test_every_position_anchors_one_output(n: int) -> None:
    shard = np.random.default_rng(0).permutation(1000)[:n]
    batches = plans(Cursor(shard, layout(), STITCH, 1, epoch=2, seed=3))
    assert [len(p.images) for p in batches] == [4] * (n // 4) + ([n % 4] if n % 4 else [])
    assert anchors(batches) == shard.tolist()  # each once, in epoch order
    assert all(p.partners and p.layout == "mosaic" for p in batches)
    assert all(len(image.indices) == 4 for p in batches for image in p.images)
    regular = plans(Cursor(shard, layout(), REGULAR, 1))
    assert [len(p.images) for p in regular] == [len(p.images) for p in batches]
    assert not any(p.partners for p in regular)


def test_partners_come_from_the_previous_positions_wrapping() -> None:
    n, batch = 300, 4
    w = window_size(n, batch)
    assert w == 32
    shard = np.arange(1000, 1000 + n)  # index = 1000 + position
    seen_wrap = False
    for plan in plans(Cursor(shard, layout(batch), STITCH, 1, epoch=1, seed=7)):
        for j, image in enumerate(plan.images):
            position = plan.start + j
            assert image.indices[0] == 1000 + position
            for partner in image.indices[1:]:
                back = (position - (partner - 1000)) % n
                assert 1 <= back <= w, (position, partner)
                seen_wrap |= partner - 1000 > position
    assert seen_wrap  # the first positions draw from the epoch's end


def test_the_draws_depend_on_seed_epoch_and_position_only() -> None:
    a = [partner_positions(1, 2, p, 500, 64) for p in range(500)]
    assert a == [partner_positions(1, 2, p, 500, 64) for p in range(500)]
    assert a != [partner_positions(1, 3, p, 500, 64) for p in range(500)]
    assert a != [partner_positions(2, 2, p, 500, 64) for p in range(500)]
    # Uniform-ish over the window: every offset 1..64 drawn, none outside.
    offsets = {(p - q) % 500 for p, qs in enumerate(a) for q in qs}
    assert offsets == set(range(1, 65))
    # Planned from any position (a flip, a rewind, a resume): the same partners there.
    shard = np.arange(200)
    whole = plans(Cursor(shard, layout(), STITCH, 1, epoch=4, seed=1))
    late = Cursor(shard, layout(), STITCH, 1, epoch=4, seed=1)
    late.jump(7, 28, STITCH)
    assert [p.images for p in plans(late)] == [p.images for p in whole[7:]]


def test_mosaic_p_mixes_mosaics_and_regular_images_per_output() -> None:
    shard = np.arange(400)
    batches = plans(Cursor(shard, layout(p=0.5), STITCH, 1, epoch=0, seed=5))
    sizes = [len(image.indices) for p in batches for image in p.images]
    assert set(sizes) == {1, 4}
    assert 0.4 < sizes.count(4) / len(sizes) < 0.6
    assert anchors(batches) == shard.tolist()
    again = plans(Cursor(shard, layout(p=0.5), STITCH, 1, epoch=0, seed=5))
    assert [p.images for p in again] == [p.images for p in batches]
    assert all(is_mosaic(0, 0, q, 1.0) for q in range(100))
    assert not any(is_mosaic(0, 0, q, 0.0) for q in range(100))
    none = plans(Cursor(shard, layout(p=0.0), STITCH, 1))
    assert all(len(image.indices) == 1 for p in none for image in p.images)


def test_flips_rewinds_and_drop_last_count_anchors() -> None:
    shard = np.arange(22)
    cursor = Cursor(shard, layout(drop_last=True), REGULAR, 1)
    first = cursor.next_plan()
    assert first is not None and (first.start, first.stop) == (0, 4)
    plan = cursor.plan_at(1, first.stop, STITCH)  # the lookahead's twin: same positions
    assert plan is not None and (plan.start, plan.stop) == (4, 8)
    assert [i.indices[0] for i in plan.images] == [4, 5, 6, 7]
    cursor.jump(2, plan.stop, STITCH)
    rest = plans(cursor)
    assert [(p.start, p.stop) for p in rest] == [(8, 12), (12, 16), (16, 20)]  # 2 dropped
    assert Layout(4, (64, 64), 4, "mosaic", False).samples_per_batch(STITCH) == 16
    assert layout().samples_per_batch(STITCH) == layout().samples_per_batch(REGULAR) == 4
    assert layout().samples_per_image(STITCH) == 1

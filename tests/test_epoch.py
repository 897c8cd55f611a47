"""The epoch plan (pure): order, DistributedSampler sharding, batch cutting, rewinds."""

from __future__ import annotations

import numpy as np
import pytest

from dataserver_client.plan.epoch import (
    REGULAR,
    STITCH,
    Cursor,
    Layout,
    epoch_order,
    shard_of,
    shard_size,
)


def layout(batch: int = 4, k: int = 4, kind: str = "spatial", drop_last: bool = False) -> Layout:
    return Layout(batch, (64, 64), k, kind, drop_last)


def test_order_is_fixed_by_seed_and_epoch() -> None:
    a = epoch_order(100, 1, 0, True)[:]
    assert np.array_equal(a, epoch_order(100, 1, 0, True)[:])
    assert not np.array_equal(a, epoch_order(100, 1, 1, True)[:])
    assert not np.array_equal(a, epoch_order(100, 2, 0, True)[:])
    assert sorted(a.tolist()) == list(range(100))
    assert epoch_order(5, 1, 0, False).tolist() == [0, 1, 2, 3, 4]


@pytest.mark.parametrize("n", [10, 11, 12, 13])
@pytest.mark.parametrize("world", [1, 2, 3, 4])
def test_shards_follow_distributed_sampler(n: int, world: int) -> None:
    order = epoch_order(n, 0, 0, True)
    shards = [shard_of(order, r, world, drop_last=False)[:] for r in range(world)]
    assert {len(s) for s in shards} == {shard_size(n, world, False)}
    assert set(np.concatenate(shards).tolist()) == set(range(n))  # cover
    if n % world == 0:
        assert len(np.concatenate(shards)) == n  # disjoint
    dropped = [shard_of(order, r, world, drop_last=True)[:] for r in range(world)]
    flat = np.concatenate(dropped).tolist()
    assert len(flat) == len(set(flat)) == (n // world) * world  # disjoint, tail dropped


def collect(cursor: Cursor) -> list[list[int]]:
    out = []
    while (plan := cursor.next_plan()) is not None:
        out.append([i for t in plan.images for i in t.indices])
    return out


def test_regular_and_stitched_batches_consume_b_and_kb_samples() -> None:
    shard = np.arange(37)
    regular = collect(Cursor(shard, layout(), REGULAR, 1))
    assert [len(b) for b in regular] == [4] * 9 + [1]
    stitched = Cursor(shard, layout(), STITCH, 1)
    plan = stitched.next_plan()
    assert plan is not None and len(plan.images) == 4 and plan.images[0].grid == 2
    assert [t.indices for t in plan.images][1] == (4, 5, 6, 7)
    rest = collect(stitched)
    assert [len(b) for b in rest] == [16, 5]  # a short last group
    last = Cursor(shard, layout(), STITCH, 1)
    last.position = 32
    final = last.next_plan()
    assert final is not None and [t.indices for t in final.images] == [(32, 33, 34, 35), (36,)]


def test_batch_layout_is_k_times_more_images_at_a_quarter_size() -> None:
    plan = Cursor(np.arange(64), layout(kind="batch"), STITCH, 1).next_plan()
    assert plan is not None
    assert len(plan.images) == 16 and plan.sizes.out == (32, 32)
    assert all(t.grid == 1 and len(t.indices) == 1 for t in plan.images)


def test_drop_last_drops_the_short_tail() -> None:
    batches = collect(Cursor(np.arange(10), layout(drop_last=True), REGULAR, 1))
    assert [len(b) for b in batches] == [4, 4]


def test_rewind_replans_the_same_samples_in_order() -> None:
    p = Cursor(np.arange(40), layout(), REGULAR, 1)
    first = p.next_plan()
    second = p.next_plan()
    assert first is not None and second is not None
    p.rewind(second.step, second.start, STITCH, 2)
    again = p.next_plan()
    assert again is not None
    assert (again.step, again.start, again.mode, again.plan_version) == (1, 4, STITCH, 2)
    assert [i for t in again.images for i in t.indices] == list(range(4, 20))
    with pytest.raises(ValueError, match="raise plan_version"):
        p.rewind(0, 0, REGULAR, 2)

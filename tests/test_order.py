"""Issue 28, item 1: the epoch order computed per position (``order.py``) and what is built on
it: a permutation of [0, n) for every n (checked whole up to 10**6, sampled at 2**31, 2**40
and the protocol's 2**48), fixed by (seed, epoch); shards with DistributedSampler's
semantics (torch's own index math on the same order); the first batch of an epoch of 2**31
samples in milliseconds and kilobytes; elastic deals of O(world size) at 2**40."""

from __future__ import annotations

import math
import time
import tracemalloc
from collections import Counter
from typing import Any

import numpy as np
import pytest
import torch
from torch.utils.data import DistributedSampler

from dataserver.hashing import mix64
from dataserver_client.config import MAX_DATASET_LEN, WELCOME_MAX_DATASET_LEN, ClientConfig
from dataserver_client.plan.epoch import (
    REGULAR,
    STITCH,
    Cursor,
    Layout,
    epoch_order,
    global_order,
    shard_of,
    shard_size,
)
from dataserver_client.plan.order import BLOCK, EpochOrder, Shard, Strided, mix
from dataserver_client.plan.resume import IntervalDeal, epoch_shard, undelivered

PRIMES = [2, 3, 5, 7, 11, 13, 97, 101, 65_537]
POWERS = [n for k in (1, 2, 3, 4, 5, 8, 10, 16, 20) for n in (2**k - 1, 2**k, 2**k + 1)]
SIZES = sorted({1, 2, 3, *PRIMES, *POWERS, 10**6})


def check_permutation(order: EpochOrder) -> None:
    whole = order[:]
    assert whole.dtype == np.int64 and len(whole) == len(order)
    assert np.array_equal(np.sort(whole), np.arange(len(order)))
    assert np.array_equal(order.position_of(whole), np.arange(len(order)))  # the inverse


@pytest.mark.parametrize("n", SIZES)
def test_the_order_is_a_permutation_of_every_size(n: int) -> None:
    check_permutation(epoch_order(n, 11, 3, True))
    if n <= 1000:  # other keys too
        for seed, epoch in [(0, 0), (1, 0), (0, 1), (2**63 - 1, 10**9)]:
            check_permutation(epoch_order(n, seed, epoch, True))


@pytest.mark.parametrize("n", [2**31, 2**31 + 1, 2**40, WELCOME_MAX_DATASET_LEN])
def test_the_order_at_scale_is_sampled_distinct_in_range_and_inverted(n: int) -> None:
    order = epoch_order(n, 5, 2, True)
    rng = np.random.default_rng(n % 1000)
    positions = np.unique(
        np.concatenate(
            [
                np.arange(0, 50_000),  # a run of first positions: an epoch's first batches
                np.arange(n - 50_000, n),  # and its last
                rng.integers(0, n, 100_000, dtype=np.int64),
            ]
        )
    )
    out = order[positions]
    assert out.dtype == np.int64
    assert int(out.min()) >= 0 and int(out.max()) < n
    assert len(np.unique(out)) == len(positions)  # distinct over the sample
    assert np.array_equal(order.position_of(out), positions)
    if n > 2**32:
        assert out.max() >= 2**32  # indices past 32 bits come out (all of [0, n) is reached)
    # Spread: the first positions are not bunched at the start of the dataset.
    assert abs(float(np.mean(out[:50_000])) / n - 0.5) < 0.01


def test_the_order_is_fixed_by_seed_and_epoch_and_unshuffled_is_the_identity() -> None:
    n = 10_000
    a = epoch_order(n, 1, 0, True)
    assert np.array_equal(a[:], epoch_order(n, 1, 0, True)[:])  # another instance, same order
    assert np.array_equal(a[:], a[:]) and a[17] == int(a[:][17])
    assert np.array_equal(a[[5, 3, 5]], a[:][[5, 3, 5]])
    others = [epoch_order(n, 1, 1, True)[:], epoch_order(n, 2, 0, True)[:]]
    for other in others:  # unrelated orders: about 1 of n positions agree
        assert (other == a[:]).sum() < 10
    whole = a[:]
    assert abs(np.corrcoef(whole, np.arange(n))[0, 1]) < 0.05  # no trace of the identity
    assert abs(np.corrcoef(whole[:-1], whole[1:])[0, 1]) < 0.05  # nor of its neighbours
    assert epoch_order(5, 1, 0, False)[:].tolist() == [0, 1, 2, 3, 4]
    assert epoch_order(2**40, 9, 9, False)[[0, 2**40 - 1]].tolist() == [0, 2**40 - 1]
    with pytest.raises(ValueError, match="at least one sample"):
        epoch_order(0, 1, 0, True)


def chi2_bound(dof: int, z: float = 3.09) -> float:
    """The chi-square value a fair draw exceeds with probability 0.001 (z: that tail of the
    normal), by Wilson and Hilferty's approximation."""
    h = 2 / (9 * dof)
    return dof * (1 - h + z * math.sqrt(h)) ** 3


@pytest.mark.parametrize("n", [3, 4, 5])
def test_the_orders_of_a_few_samples_come_out_about_equally_often(n: int) -> None:
    """Over many seeds every order of n samples comes out, each about as often as a fair
    draw would give (8 rounds everywhere gave a chi-square of 315 at n = 5, over 2x the
    bound)."""
    orders = math.factorial(n)
    seeds = 250 * orders if n < 5 else 12_000
    counts = Counter(tuple(epoch_order(n, seed, 1, True)[:].tolist()) for seed in range(seeds))
    assert len(counts) == orders  # every order
    expected = seeds / orders
    chi2 = sum((c - expected) ** 2 / expected for c in counts.values())
    assert chi2 < chi2_bound(orders - 1), chi2


def test_a_lazy_sequence_indexes_like_an_array() -> None:
    order = epoch_order(1000, 4, 1, True)
    whole = order[:]
    shard = shard_of(order, 1, 3, False)
    ref = np.resize(whole, 1002)[1::3]  # padded with the order's first samples
    assert len(shard) == len(ref) and shard.tolist() == ref.tolist() == list(shard)
    assert shard[-1] == int(ref[-1]) and isinstance(shard[0], int)
    assert np.array_equal(shard[10:50:7], ref[10:50:7]) and np.array_equal(shard[::-1], ref[::-1])
    assert np.array_equal(shard[np.array([3, 1, 4])], ref[[3, 1, 4]])
    assert shard[5:5].size == 0
    for bad in (len(ref), -len(ref) - 1):
        with pytest.raises(IndexError):
            shard[bad]
    with pytest.raises(IndexError):
        shard[np.array([0, len(ref)])]


@pytest.mark.parametrize("drop_last", [False, True])
def test_shards_are_torchs_distributed_sampler_on_the_same_order(drop_last: bool) -> None:
    for n in [1, 2, 3, 5, 7, 10, 11, 12, 13, 29, 64]:
        order = epoch_order(n, 3, 5, True)
        whole = order[:]
        for world in range(1, 6):
            if drop_last and n < world:
                continue  # DistributedSampler's own count is 0 there
            total = shard_size(n, world, drop_last) * world
            g = global_order(order, world, drop_last)
            assert len(g) == total
            seen: list[int] = []
            for rank in range(world):
                dataset: Any = range(n)  # (DistributedSampler reads its len only)
                sampler: DistributedSampler[int] = DistributedSampler(
                    dataset, num_replicas=world, rank=rank, shuffle=False, drop_last=drop_last
                )
                expected = whole[list(sampler)].tolist()
                shard = shard_of(order, rank, world, drop_last)
                assert shard.tolist() == expected, (n, world, rank)
                assert g[rank::world].tolist() == expected
                seen += expected
            if not drop_last:  # covering, padded with the order's own first samples
                assert set(seen) == set(range(n))
                assert sorted(seen) == sorted(np.resize(whole, total).tolist())
            else:  # disjoint, the tail dropped
                assert len(seen) == len(set(seen)) == (n // world) * world


def config(**kw: object) -> ClientConfig:
    return ClientConfig(("tcp://127.0.0.1:1",), device=torch.device("cpu"), **kw)  # type: ignore[arg-type]


def test_the_first_batch_of_an_epoch_of_2_31_samples_is_planned_at_once() -> None:
    """What costs 8 GiB and minutes with a table of the order: the shard and the first batch
    (and a window mosaic's) of 2**31 samples on 8 ranks, in milliseconds and kilobytes."""
    n = 2**31
    layout = Layout(64, (64, 64), 4, "mosaic", False, mosaic_partners="window")
    tracemalloc.start()
    try:
        started = time.perf_counter()
        shard, spare = epoch_shard(config(rank=3, world_size=8, batch_size=64), n, 7)
        cursor = Cursor(shard, layout, REGULAR, 1, spare, epoch=7, seed=0)
        regular = cursor.next_plan()
        cursor.mode = STITCH
        mosaic = cursor.next_plan()
        took = time.perf_counter() - started
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert regular is not None and mosaic is not None
    assert took < 1.0, took  # (measured: about 1 ms; the bound is for a loaded test host)
    assert peak < 4 << 20, peak  # no table of n
    order = epoch_order(n, 0, 7, True)
    assert [i for im in regular.images for i in im.indices] == order[3 : 3 + 64 * 8 : 8].tolist()
    assert [im.indices[0] for im in mosaic.images] == order[3 + 64 * 8 : 3 + 128 * 8 : 8].tolist()
    assert len(shard) == n // 8 and spare == 0


def test_the_default_max_dataset_len_is_2_40_and_within_the_wire() -> None:
    assert MAX_DATASET_LEN == 2**40 <= WELCOME_MAX_DATASET_LEN
    assert config().max_dataset_len == 2**40
    config(max_dataset_len=WELCOME_MAX_DATASET_LEN).validate()  # the wire's bound: accepted
    with pytest.raises(ValueError, match="max_dataset_len"):
        config(max_dataset_len=WELCOME_MAX_DATASET_LEN + 1).validate()


def undelivered_before(g: int, world: int, done: np.ndarray, own: np.ndarray) -> int:
    """How many positions below global position ``g`` a job of ``world`` ranks, rank r at
    ``done[r]`` of its ``own[r]`` positions, has not delivered (counted rank by rank)."""
    below = -(-(g - np.arange(world)) // world)  # rank r's positions r + i x world < g
    return int(np.maximum(0, np.minimum(own, below) - done).sum())


def test_an_elastic_deal_of_2_40_samples_is_o_world_size() -> None:
    n, old, new = 2**40 + 3, 1000, 7
    rng = np.random.default_rng(8)
    per = shard_size(n, old, False)
    done = rng.integers(per - 10**6, per + 1, old)  # ranks far from lockstep
    done[:5] = per  # some finished
    tracemalloc.start()
    try:
        started = time.perf_counter()
        deal = undelivered(n, False, old, done.tolist(), None)
        share = deal.share(3, new)
        first = share[:256]
        took = time.perf_counter() - started
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert isinstance(deal, IntervalDeal)
    assert took < 1.0 and peak < 4 << 20, (took, peak)
    own = np.full(old, per)
    assert deal.count == int((own - done).sum()) == sum(deal.share_len(j, new) for j in range(new))
    # The k-th undelivered position has exactly k undelivered positions before it, and is one.
    positions = deal.positions()
    ks = np.unique(np.concatenate([np.arange(5000), rng.integers(0, deal.count, 5000)]))
    got = positions[ks]
    assert np.all(np.diff(got) > 0)
    for k, g in zip(ks[::50].tolist(), got[::50].tolist(), strict=True):
        assert undelivered_before(g, old, done, own) == k
        assert g // old >= done[g % old]  # not delivered by its rank
    assert np.array_equal(first, positions[np.arange(3, 3 + 256 * new, new)])
    # Saved again and dealt again (7 -> 2), still O(world size), every position once.
    again = undelivered(n, False, new, [deal.share_len(j, new) // 2 for j in range(new)], deal)
    assert isinstance(again, IntervalDeal) and len(again.levels) == 2
    tail = again.positions()[again.count - 1000 :]
    assert np.array_equal(tail, positions[deal.count - 1000 :])  # the tail is undelivered by all


def test_a_nested_deal_matches_its_bitmap_at_small_sizes() -> None:
    """The interval deal against the bitmap one (the deal of before), nested three deep."""
    rng = np.random.default_rng(2)
    for _ in range(300):
        n = int(rng.integers(1, 120))
        drop = bool(rng.random() < 0.3)
        deal = bitmap = None
        for world in rng.integers(1, 8, 3).tolist():
            if deal is None:
                own = [shard_size(n, world, drop)] * world
            else:
                own = [deal.share_len(r, world) for r in range(world)]
            done = [int(rng.integers(0, o + 1)) for o in own]
            deal = undelivered(n, drop, world, done, deal)
            bitmap = undelivered(n, drop, world, done, bitmap, legacy=True)
            assert deal.positions().tolist() == bitmap.positions().tolist()
            for j in range(1, 4):
                assert [deal.share(r, j).tolist() for r in range(j)] == [
                    bitmap.share(r, j).tolist() for r in range(j)
                ]


def test_strided_positions_are_int64_past_2_31() -> None:
    s = Strided(5, 1000, 2**33)
    assert s[2**33 - 1] == 5 + (2**33 - 1) * 1000
    assert s[[0, 2**32]].dtype == np.int64


def test_the_round_hash_is_the_shared_splitmix_finaliser() -> None:
    values = [0, 1, 2**32 + 7, 2**63, 2**64 - 1]
    got = mix(np.array(values, dtype=np.uint64)).tolist()
    assert got == [mix64(v) for v in values]


def test_a_shard_reads_batches_from_its_blocks_as_computed_anew() -> None:
    """``Shard`` keeps the last two blocks of positions it computed (a batch's lookup costs
    a slice, not the Feistel rounds): what it returns from them is what it computes anew,
    within a block, across a block's edge, scattered, and for more positions than a block."""
    n = 3 * BLOCK + 77
    order = EpochOrder(n, 5, 2, True)
    shard = Shard(order, Strided(1, 2, n // 2))

    def fresh(positions: np.ndarray) -> np.ndarray:
        return order.at((1 + 2 * positions) % n)

    for positions in (
        np.arange(10, 26),
        np.arange(BLOCK - 8, BLOCK + 8),  # across an edge
        np.arange(BLOCK - 8, BLOCK + 8)[::-1],
        np.array([3, 2 * BLOCK + 5, 7]),  # scattered over three blocks
        np.arange(0, BLOCK + 100),  # more than a block
        np.arange(n // 2 - 16, n // 2),  # the last, short block
    ):
        assert np.array_equal(shard.at(positions), fresh(positions)), positions[:4]
    assert np.array_equal(shard[5:40], fresh(np.arange(5, 40)))
    edge = np.arange(BLOCK - 3, BLOCK + 3)
    assert np.array_equal(shard[BLOCK - 3 : BLOCK + 3], fresh(edge))
    assert np.array_equal(shard[-5:], fresh(np.arange(n // 2 - 5, n // 2)))
    assert np.array_equal(shard[7:3], fresh(np.arange(0)))

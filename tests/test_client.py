"""End to end through the public API: real servers, real sockets."""

from __future__ import annotations

import threading
from typing import Any

import pytest
import torch
from clients import make_client

from dataserver_client import Batch, DataServerClient

pytestmark = pytest.mark.timeout(90)


def epoch_batches(client: DataServerClient, epoch: int) -> list[Batch]:
    client.set_epoch(epoch)
    return list(client)


def flat_indices(batches: list[Batch]) -> list[int]:
    return [i for b in batches for idx in b.indices for i in idx]


def test_batches_have_the_documented_fields(synthetic_server: Any) -> None:
    with make_client(synthetic_server.address, batch_size=8, image_size=(96, 128)) as client:
        assert client.num_samples == 96 and len(client) == 12
        batches = epoch_batches(client, 0)
    b = batches[0]
    assert b.images.dtype == torch.uint8 and b.images.shape == (8, 3, 96, 128)
    assert b.images.device.type == "cpu"
    assert len(b.targets) == len(b.indices) == 8
    for t, idx in zip(b.targets, b.indices, strict=True):
        assert t["boxes"].dtype == torch.float32 and t["boxes"].shape[1] == 4
        assert t["labels"].dtype == torch.int64 and t["labels"].shape == (len(t["boxes"]),)
        assert len(idx) == 1
        boxes = t["boxes"]
        assert (boxes[:, 2] > boxes[:, 0]).all() and (boxes[:, 3] > boxes[:, 1]).all()
        assert (boxes[:, 0::2] <= 128).all() and (boxes[:, 1::2] <= 96).all() and (boxes >= 0).all()
    assert (b.mode, b.epoch, b.feedback_seq, b.skipped) == ("regular", 0, 0, 0)
    assert [x.step for x in batches] == list(range(12))
    assert b.images.float().mean() > 5  # real pixels, not an empty canvas


def test_exactly_once_and_order_fixed_by_seed_and_epoch(synthetic_server: Any) -> None:
    kw: dict[str, Any] = {"batch_size": 10, "image_size": (64, 64), "seed": 5}
    with (
        make_client(synthetic_server.address, **kw) as a,
        make_client(synthetic_server.address, **kw) as b,
    ):
        e0 = flat_indices(epoch_batches(a, 0))
        assert sorted(e0) == list(range(96))  # every index exactly once
        assert len(epoch_batches(a, 0)[-1].indices) == 6  # 96 = 9 x 10 + 6
        assert flat_indices(epoch_batches(b, 0)) == e0  # same (seed, epoch): same order
        e1 = flat_indices(epoch_batches(a, 1))
        assert sorted(e1) == list(range(96)) and e1 != e0  # a new order for a new epoch
    with make_client(synthetic_server.address, **{**kw, "seed": 6}) as c:
        assert flat_indices(epoch_batches(c, 0)) != e0


def test_two_ranks_get_disjoint_shards_that_cover_the_dataset(synthetic_server: Any) -> None:
    seen = []
    for rank in (0, 1):
        with make_client(
            synthetic_server.address,
            batch_size=8,
            image_size=(64, 64),
            rank=rank,
            world_size=2,
        ) as client:
            assert client.num_samples == 48
            seen.append(flat_indices(epoch_batches(client, 3)))
    assert len(seen[0]) == len(seen[1]) == 48
    assert not set(seen[0]) & set(seen[1])
    assert set(seen[0]) | set(seen[1]) == set(range(96))


def test_rank_and_world_size_default_from_the_environment(
    synthetic_server: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("RANK", "2")
    monkeypatch.setenv("WORLD_SIZE", "4")
    with make_client(synthetic_server.address, batch_size=8, image_size=(32, 32)) as client:
        assert (client.config.rank, client.config.world_size) == (2, 4)
        assert client.num_samples == 24


def test_drop_last(synthetic_server: Any) -> None:
    with make_client(
        synthetic_server.address, batch_size=10, image_size=(32, 32), drop_last=True
    ) as client:
        batches = epoch_batches(client, 0)
    assert [len(b) for b in batches] == [10] * 9


def test_two_clients_at_once_are_both_served(synthetic_server: Any) -> None:
    results: dict[int, list[int]] = {}

    def run(seed: int) -> None:
        with make_client(
            synthetic_server.address, batch_size=4, image_size=(64, 64), seed=seed
        ) as c:
            results[seed] = flat_indices(epoch_batches(c, 0))

    threads = [threading.Thread(target=run, args=(s,)) for s in (1, 2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    assert sorted(results) == [1, 2]
    assert all(sorted(v) == list(range(96)) for v in results.values())


def test_bit_identical_batches_from_one_and_two_workers(start_server: Any) -> None:
    one = start_server("--dataset", "synthetic:images=40,seed=9", workers=1)
    two = start_server("--dataset", "synthetic:images=40,seed=9", workers=2)
    outs = []
    for server in (one, two):
        with make_client(server.address, batch_size=6, image_size=(80, 112), seed=4) as c:
            outs.append(epoch_batches(c, 2))
    for a, b in zip(*outs, strict=True):
        assert a.indices == b.indices
        assert torch.equal(a.images, b.images)
        for ta, tb in zip(a.targets, b.targets, strict=True):
            assert torch.equal(ta["boxes"], tb["boxes"]) and torch.equal(ta["labels"], tb["labels"])


def test_coco_dataset_from_jpeg_files(start_server: Any, coco_dir: Any) -> None:
    server = start_server("--dataset", f"coco:{coco_dir / 'annotations.json'}", workers=2)
    assert server.samples == 48
    with make_client(server.address, batch_size=8, image_size=(128, 128)) as c:
        batches = epoch_batches(c, 0)
    assert sorted(flat_indices(batches)) == list(range(48))
    assert sum(len(t["boxes"]) for b in batches for t in b.targets) > 48 * 5  # many objects


def test_resume_mid_epoch_continues_with_the_remaining_samples(synthetic_server: Any) -> None:
    kw: dict[str, Any] = {"batch_size": 8, "image_size": (32, 32), "seed": 1}
    with make_client(synthetic_server.address, **kw) as full:
        expected = flat_indices(epoch_batches(full, 0))
    with make_client(synthetic_server.address, **kw) as first:
        first.set_epoch(0)
        it = iter(first)
        head = [next(it) for _ in range(5)]
        state = first.state_dict()
    with make_client(synthetic_server.address, **kw) as second:
        second.load_state_dict(state)
        tail = list(second)
    assert [b.step for b in tail] == list(range(5, 12))
    assert flat_indices(head) + flat_indices(tail) == expected


def test_close_leaves_no_threads_behind(synthetic_server: Any) -> None:
    before = {t.ident for t in threading.enumerate()}
    client = make_client(synthetic_server.address, batch_size=4, image_size=(32, 32))
    client.set_epoch(0)
    next(iter(client))
    client.close()
    left = [t for t in threading.enumerate() if t.ident not in before and t.is_alive()]
    assert not left, left


def test_iterator_protocol_continues_and_a_new_iter_restarts(synthetic_server: Any) -> None:
    with make_client(synthetic_server.address, batch_size=8, image_size=(32, 32)) as c:
        c.set_epoch(0)
        it = iter(c)
        head = [next(it), next(it)]
        rest = list(it)  # iter(it) is it: the epoch goes on, it does not restart
        assert [b.step for b in head + rest] == list(range(12))
        assert sorted(flat_indices(head + rest)) == list(range(96))
        again = iter(c)  # a new iter(client) starts the epoch over
        assert next(again).step == 0
        with pytest.raises(Exception, match="superseded"):
            next(it)


def test_cpu_buffers_are_reused_only_after_the_trainer_lets_go(synthetic_server: Any) -> None:
    with make_client(synthetic_server.address, batch_size=8, image_size=(48, 48)) as c:
        c.set_epoch(0)
        kept = list(c)  # every batch held at once: no buffer may be reused under them
        copies = [b.images.clone() for b in kept]
        c.set_epoch(1)
        for _ in c:
            pass
        assert all(torch.equal(b.images, copy) for b, copy in zip(kept, copies, strict=True))
        view = kept[0].images[2]  # a view alone still pins its buffer
        before = view.clone()
        del kept, copies
        allocated = c.stats()["host_buffers_allocated"]
        for epoch in (2, 3):
            c.set_epoch(epoch)
            for _ in c:  # batches dropped at once: their buffers come back
                pass
        assert torch.equal(view, before)
        assert c.stats()["host_buffers_allocated"] <= allocated + 1

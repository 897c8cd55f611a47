"""Guarantee 3: feedback, set_mode and control are honoured by the very next batch, with
prefetch deeper than one batch, and exactly-once holds across any sequence of switches."""

from __future__ import annotations

import json
import random
import time
from typing import Any

import pytest
import torch
from clients import make_client

from dataserver_client import Batch

pytestmark = pytest.mark.timeout(120)


def indices_of(batches: list[Batch]) -> list[int]:
    return [i for b in batches for idx in b.indices for i in idx]


@pytest.fixture(scope="module")
def flat_server(request: Any) -> Any:
    from conftest import Server

    server = Server(
        "--dataset", "ds_plugins:flat", "--dataset-args", json.dumps({"n": 203}), workers=2
    )
    yield server
    server.stop()


def test_control_reaches_the_dataset_before_the_next_batch(start_server: Any) -> None:
    """The seed's scenario: a flag set with control() after batch t is seen by every sample
    of every batch from t + 1 on, and by none before."""
    server = start_server("--dataset", "ds_plugins:flag", "--dataset-args", json.dumps({"n": 256}))
    with make_client(server.address, batch_size=8, image_size=(32, 32), prefetch=4) as c:
        c.set_epoch(0)
        it = iter(c)
        seen = []
        for t in range(12):
            batch = next(it)
            time.sleep(0.05)  # let the prefetch fill: stale batches would be ready by now
            seen.append(batch)
            if t == 5:
                c.control(active=1)
        for t, batch in enumerate(seen):
            flag = 1 if t > 5 else 0
            labels = torch.cat([x["labels"] for x in batch.targets])
            assert (labels == 1 + flag).all(), f"batch {t} built with active={1 - flag}"
            assert (batch.images[:, :, :2, :2] == (200 if flag else 10)).all()
            assert batch.feedback_seq == (1 if t > 5 else 0)


def test_random_feedback_is_never_stale_and_every_index_comes_once(flat_server: Any) -> None:
    rng = random.Random(7)
    with make_client(
        flat_server.address,
        batch_size=5,
        image_size=(64, 64),
        prefetch=3,
        stitch_threshold=0.5,
    ) as c:
        for epoch in range(2):
            c.set_epoch(epoch)
            batches = []
            decided = c.mode
            calls = c.state_dict()["feedback_seq"]
            for batch in c:
                assert batch.mode == decided, f"batch {batch.step} is stale"
                assert batch.feedback_seq == calls
                calls += 1
                batches.append(batch)
                if rng.random() < 0.5:
                    time.sleep(0.02)
                decided = c.feedback(rng.random())
            assert [b.step for b in batches] == list(range(len(batches)))
            got = indices_of(batches)
            assert sorted(got) == list(range(203)), "exactly once across mode switches"
            assert {b.mode for b in batches} == {"regular", "stitch"}
            stitched = [b for b in batches if b.mode == "stitch"]
            assert all(len(idx) <= 4 for b in stitched for idx in b.indices)
            assert sum(len(idx) for b in stitched for idx in b.indices[:-1]) % 4 == 0


def test_set_mode_switches_shapes_immediately(flat_server: Any) -> None:
    with make_client(flat_server.address, batch_size=4, image_size=(64, 96), prefetch=3) as c:
        c.set_epoch(0)
        it = iter(c)
        assert next(it).images.shape == (4, 3, 64, 96)
        c.set_mode("stitch")
        b = next(it)
        assert b.mode == "stitch" and b.images.shape == (4, 3, 64, 96) and len(b.indices[0]) == 4
        c.set_mode("regular")
        assert next(it).images.shape == (4, 3, 64, 96)
        with pytest.raises(ValueError, match="regular' or 'stitch"):
            c.set_mode("mosaic")


def test_order_is_the_same_whatever_the_switches(flat_server: Any) -> None:
    """Re-planning gives samples back in order: the concatenated index stream of an epoch
    is the same with and without mode switches."""
    kw: dict[str, Any] = {"batch_size": 6, "image_size": (32, 32), "seed": 3}
    with make_client(flat_server.address, **kw) as plain:
        plain.set_epoch(1)
        reference = indices_of(list(plain))
    with make_client(flat_server.address, **kw, prefetch=4) as switching:
        switching.set_epoch(1)
        batches = []
        for n, b in enumerate(switching):
            batches.append(b)
            switching.set_mode("stitch" if n % 3 == 0 else "regular")
    assert indices_of(batches) == reference


def test_same_feedback_gives_bit_identical_batches_on_1_and_2_workers(start_server: Any) -> None:
    one = start_server("--dataset", "synthetic:images=80,seed=4", workers=1)
    two = start_server("--dataset", "synthetic:images=80,seed=4", workers=2)
    runs = []
    for server in (one, two):
        rng = random.Random(11)
        with make_client(server.address, batch_size=4, image_size=(64, 64), prefetch=3) as c:
            c.set_epoch(0)
            out = []
            for b in c:
                out.append(b)
                c.feedback(rng.random(), sync=False) if rng.random() < 0.7 else c.set_mode("stitch")
            runs.append(out)
    assert len(runs[0]) == len(runs[1])
    assert {b.mode for b in runs[0]} == {"regular", "stitch"}
    for a, b in zip(*runs, strict=True):
        assert (a.mode, a.indices, a.feedback_seq) == (b.mode, b.indices, b.feedback_seq)
        assert torch.equal(a.images, b.images)
        for ta, tb in zip(a.targets, b.targets, strict=True):
            assert torch.equal(ta["boxes"], tb["boxes"]) and torch.equal(ta["labels"], tb["labels"])

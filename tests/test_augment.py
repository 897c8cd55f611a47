"""The two stages on real servers: a source is stored only when its dataset says it is a
pure function of the index, and ``augment`` (seeded by (seed, epoch, index), told the
batch's parameters) is never stored."""

from __future__ import annotations

from typing import Any

import numpy as np
import pytest
from aug_plugins import Jitter, untold
from batches import epoch_by_index
from clients import make_client
from conftest import wait_until

from dataserver.data.pipeline import augment_rng, compose_one
from dataserver.protocol import BatchSizes
from dataserver.server import parse_ready_line
from dataserver_client import DataServerError

pytestmark = pytest.mark.timeout(180)

KW: dict[str, Any] = {"batch_size": 4, "image_size": (40, 56), "seed": 5}


def ready_fields(server: Any) -> dict[str, str]:
    line = next(x for x in server.lines if x.startswith("dataserver ready"))
    return parse_ready_line(line)


def test_a_random_getitem_is_not_frozen_by_the_store(start_server: Any) -> None:
    """The issue's case: a dataset that paints every sample a random colour on each call,
    served with default flags (the store on): epoch 1 must not replay epoch 0."""
    server = start_server("--dataset", "aug_plugins:painted", "--dataset-args", '{"n": 32}')
    assert ready_fields(server)["sources"] == "fresh:not-deterministic"
    assert server.stats()["sources"] == "fresh:not-deterministic"
    with make_client(server.address, **KW) as client:
        first = epoch_by_index(client, 0)
        second = epoch_by_index(client, 1)
    assert sorted(first) == sorted(second) == list(range(32))
    same = [i for i in first if first[i][0] == second[i][0]]
    assert not same, f"indices {same} came back with epoch 0's random colour"
    assert server.stats()["store"] is None


def test_a_deterministic_dataset_is_stored_and_says_so(start_server: Any) -> None:
    server = start_server("--dataset", "aug_plugins:jitter", "--cache-gb", "0.05", workers=1)
    assert ready_fields(server)["sources"] == "stored"
    off = start_server("--dataset", "aug_plugins:jitter", "--cache-gb", "0", workers=1)
    assert ready_fields(off)["sources"] == "fresh:no-store"
    with make_client(server.address, **KW) as client:
        first = epoch_by_index(client, 0)
        second = epoch_by_index(client, 1)
    # (a worker's DONE reaches the front after its result reached us: wait for the last)
    wait_until(lambda: server.stats()["counters"].get("sources_reused", 0) >= 32, 10)
    counters = server.stats()["counters"]
    assert counters["sources_decoded"] == 32  # each source read once, for both epochs
    assert counters["sources_reused"] >= 32
    # ... and the augmentation is drawn anew each epoch all the same
    changed = [i for i in first if first[i][0] != second[i][0]]
    assert len(changed) >= 28, f"only {len(changed)} of 32 indices changed between epochs"


def test_augment_is_bit_identical_on_any_number_of_workers(start_server: Any) -> None:
    one = start_server("--dataset", "aug_plugins:jitter", workers=1)
    two = start_server("--dataset", "aug_plugins:jitter", "--cache-gb", "0", workers=2)
    with make_client(one.address, **KW) as a, make_client(two.address, **KW) as b:
        for epoch in (0, 1):
            got_a, got_b = epoch_by_index(a, epoch), epoch_by_index(b, epoch)
            assert sorted(got_a) == sorted(got_b) == list(range(32))
            for i, (pixels, boxes, labels) in got_a.items():
                assert pixels == got_b[i][0], f"epoch {epoch} index {i}: pixels differ"
                assert np.array_equal(boxes, got_b[i][1]) and np.array_equal(labels, got_b[i][2])
    # What the servers composed is what the pipeline gives here for the same (seed, epoch,
    # index): the augmentation depends on nothing else (not the worker, not the server).
    local = Jitter(32)
    for i in (0, 7, 31):
        canvas, _ = compose_one(local, [i], 1, BatchSizes.of((40, 56)), 5, 1)
        assert canvas.tobytes() == got_a[i][0]
    draws = [augment_rng(5, 1, 7).integers(0, 1 << 30, size=4).tolist() for _ in range(2)]
    assert draws[0] == draws[1] != augment_rng(5, 2, 7).integers(0, 1 << 30, size=4).tolist()


def test_augment_is_told_epoch_step_mode_size_and_control(start_server: Any) -> None:
    server = start_server("--dataset", "aug_plugins:jitter", workers=2)
    with make_client(server.address, prefetch=3, **KW) as client:
        client.set_epoch(3)
        it = iter(client)
        first = next(it)
        told = untold(int(first.targets[0]["labels"][0]))
        assert told == {"epoch": 3, "step": 0, "stitch": 0, "height": 40, "gain": 0}
        client.control(gain=9)
        client.set_image_size((32, 48))
        second = next(it)
        assert second.image_size == (32, 48) and tuple(second.images.shape[-2:]) == (32, 48)
        told = untold(int(second.targets[0]["labels"][0]))
        assert told == {"epoch": 3, "step": 1, "stitch": 0, "height": 32, "gain": 9}
        client.set_mode("stitch")
        third = next(it)
        assert third.mode == "stitch"
        labels = {int(x) for t in third.targets for x in t["labels"]}
        assert labels and all(
            untold(x) == {"epoch": 3, "step": 2, "stitch": 1, "height": 32, "gain": 9}
            for x in labels
        )


def test_a_bad_augment_is_a_sample_error_naming_the_index(start_server: Any) -> None:
    server = start_server("--dataset", "aug_plugins:bad_augment", workers=2)
    with make_client(server.address, on_error="skip", shuffle=False, **KW) as client:
        client.set_epoch(0)
        delivered = [i for batch in client for idx in batch.indices for i in idx]
        skipped_total = 16 - len(delivered)
    assert sorted(delivered) == [i for i in range(16) if i not in (3, 5, 6)]
    assert skipped_total == 3
    one_each = {**KW, "batch_size": 1}
    with make_client(server.address, shuffle=False, **one_each) as client:
        client.set_epoch(0)
        messages = []
        it = iter(client)
        while True:
            try:
                next(it)
            except StopIteration:
                break
            except DataServerError as exc:
                messages.append(str(exc))
    assert any("sample 3" in m and "larger than the image size" in m for m in messages), messages
    assert any("sample 5" in m and "augment raised RuntimeError" in m for m in messages), messages
    assert any("sample 6" in m and "augment returned list" in m for m in messages), messages
    assert server.stats()["workers_alive"] == 2  # and the server kept serving

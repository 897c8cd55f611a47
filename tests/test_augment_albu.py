"""Albumentations as a dataset's ``augment`` on real servers (``dataserver.data.albu``): an
``A.Compose`` with ``bbox_params`` seeded from the server's rng gives bit-identical pixels
and boxes on any number of workers, new ones every epoch, and the store keeps the sources,
never the augmentation."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from batches import Epoch
from batches import epoch_by_index as each_index
from clients import make_client
from conftest import wait_until

pytest.importorskip("albumentations")

from dataserver.data.albu import augmented
from dataserver.data.pipeline import compose_one
from dataserver.protocol import BatchSizes
from dataserver.server import parse_ready_line
from dataserver_client import DataServerClient

pytestmark = pytest.mark.timeout(180)

N = 32
SIZE = (96, 128)
SEED = 7
BASE = f"synthetic:images={N},seed=2"
ARGS = json.dumps({"base": BASE})
DATASET = ("--dataset", "dataserver.data.albu:augmented", "--dataset-args", ARGS)
KW: dict[str, Any] = {"batch_size": 4, "image_size": SIZE, "seed": SEED}


def epoch_by_index(client: DataServerClient, epoch: int) -> Epoch:
    """``batches.epoch_by_index``, every index of the set delivered."""
    out = each_index(client, epoch)
    assert sorted(out) == list(range(N))
    return out


def assert_boxes_inside(got: Epoch) -> None:
    height, width = SIZE
    for i, (_, boxes, labels) in got.items():
        assert len(boxes) == len(labels), i
        assert (boxes[:, 0] >= 0).all() and (boxes[:, 1] >= 0).all(), (i, boxes)
        assert (boxes[:, 2] <= width).all() and (boxes[:, 3] <= height).all(), (i, boxes)
        assert (boxes[:, 2] > boxes[:, 0]).all() and (boxes[:, 3] > boxes[:, 1]).all(), (i, boxes)


def changed(a: Epoch, b: Epoch) -> list[int]:
    return [i for i in a if a[i][0] != b[i][0]]


def test_bit_identical_on_1_and_2_workers_and_new_every_epoch(start_server: Any) -> None:
    one = start_server(*DATASET, "--cache-gb", "0", workers=1)
    two = start_server(*DATASET, "--cache-gb", "0", workers=2)
    got: dict[int, list[Epoch]] = {}
    with make_client(one.address, **KW) as a, make_client(two.address, **KW) as b:
        for epoch in (0, 1):
            got[epoch] = [epoch_by_index(a, epoch), epoch_by_index(b, epoch)]
            by_one, by_two = got[epoch]
            for i, (pixels, boxes, labels) in by_one.items():
                assert pixels == by_two[i][0], f"epoch {epoch} index {i}: pixels differ"
                assert np.array_equal(boxes, by_two[i][1]), f"epoch {epoch} index {i}: boxes"
                assert np.array_equal(labels, by_two[i][2]), f"epoch {epoch} index {i}: labels"
            assert_boxes_inside(by_one)
    moved = changed(got[0][0], got[1][0])
    assert len(moved) >= 0.8 * N, f"only {len(moved)} of {N} indices changed between epochs"
    # What the servers sent is what the same pipeline gives in this process for the same
    # (seed, epoch, index), and it is not the plain (unaugmented) base.
    local = augmented(base=BASE)
    plain = augmented(base=BASE).base
    for i in (0, 5, N - 1):
        canvas, composed = compose_one(local, [i], 1, BatchSizes.of(SIZE), SEED, 1)
        assert canvas.tobytes() == got[1][0][i][0], i
        assert np.array_equal(composed.boxes, got[1][0][i][1]), i
    unaugmented = [
        i
        for i in range(N)
        if compose_one(plain, [i], 1, BatchSizes.of(SIZE), SEED, 0)[0].tobytes() == got[0][0][i][0]
    ]
    assert len(unaugmented) <= 0.2 * N, f"indices {unaugmented} came back unaugmented"


def maps_torch(pid: int) -> bool:
    return any(
        "torch" in Path(line.split()[-1]).name or "/torch/" in line
        for line in Path(f"/proc/{pid}/maps").read_text().splitlines()
        if len(line.split()) >= 6
    )


def test_the_store_keeps_sources_and_augments_them_anew(start_server: Any) -> None:
    server = start_server(*DATASET, "--cache-gb", "0.1", workers=2)
    line = next(x for x in server.lines if x.startswith("dataserver ready"))
    assert parse_ready_line(line)["sources"] == "stored"
    with make_client(server.address, **KW) as client:
        first = epoch_by_index(client, 0)
        second = epoch_by_index(client, 1)
    # (a worker's DONE reaches the front after its result reached us: wait for the last)
    wait_until(lambda: server.stats()["counters"].get("sources_reused", 0) >= N, 10)
    counters = server.stats()["counters"]
    assert counters["sources_decoded"] == N, counters  # each source read once, both epochs
    assert counters["sources_reused"] >= N, counters
    moved = changed(first, second)
    assert len(moved) >= 0.8 * N, f"only {len(moved)} of {N} indices changed: store froze them?"
    assert_boxes_inside(second)
    local = augmented(base=BASE)
    for i in (1, 17):
        canvas, _ = compose_one(local, [i], 1, BatchSizes.of(SIZE), SEED, 1)
        assert canvas.tobytes() == second[i][0], i
    # albumentations ran in the workers without loading torch (Guarantee 1)
    pids = [server.pid, *server.worker_pids()]
    assert len(pids) == 3 and not [p for p in pids if maps_torch(p)]

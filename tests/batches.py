"""What the tests of batches share: a batch as plain data, and servers of one flat dataset."""

from __future__ import annotations

import json
from collections.abc import Iterator
from typing import Any

import numpy as np
from conftest import Server

from dataserver_client import Batch, DataServerClient

Epoch = dict[int, tuple[bytes, np.ndarray, np.ndarray]]


def snap(batch: Batch) -> dict[str, Any]:
    """Everything a batch is, as plain bytes and lists (its buffers may be reused later)."""
    return {
        "images": batch.images.numpy().tobytes(),
        "shape": tuple(batch.images.shape),
        "boxes": [t["boxes"].numpy().tobytes() for t in batch.targets],
        "labels": [t["labels"].tolist() for t in batch.targets],
        "indices": [list(i) for i in batch.indices],
        "mode": batch.mode,
        "image_size": tuple(batch.image_size),
        "epoch": batch.epoch,
        "step": batch.step,
        "skipped": batch.skipped,
    }


def flat_servers(n: int, workers: tuple[int, ...] = (1, 2)) -> Iterator[dict[int, Server]]:
    """``ds_plugins:flat`` of ``n`` images behind one server per worker count (a fixture's
    body: yields them, stops them after)."""
    args = ("--dataset", "ds_plugins:flat", "--dataset-args", json.dumps({"n": n}))
    started = {w: Server(*args, workers=w) for w in workers}
    try:
        yield started
    finally:
        for server in started.values():
            server.stop()


def epoch_by_index(client: DataServerClient, epoch: int) -> Epoch:
    """Each index's (pixels, boxes, labels) in ``epoch`` (regular mode: one per image)."""
    client.set_epoch(epoch)
    out: Epoch = {}
    for batch in client:
        for j, indices in enumerate(batch.indices):
            (index,) = indices
            assert index not in out, f"index {index} delivered twice"
            target = batch.targets[j]
            out[index] = (
                batch.images[j].numpy().tobytes(),
                target["boxes"].numpy().copy(),
                target["labels"].numpy().copy(),
            )
    return out

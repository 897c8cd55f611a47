"""The GPU path: pinned host buffers, a side-stream copy, batches on the device. Skipped
without CUDA (the CPU path is what every other test runs)."""

from __future__ import annotations

from typing import Any

import pytest
import torch
from clients import make_client

pytestmark = [
    pytest.mark.timeout(120),
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA"),
]


def test_batches_arrive_on_the_gpu_identical_to_cpu(synthetic_server: Any) -> None:
    kw: dict[str, Any] = {"batch_size": 8, "image_size": (64, 96), "seed": 3}
    with make_client(synthetic_server.address, **kw) as c:
        c.set_epoch(0)
        cpu = list(c)
    with make_client(synthetic_server.address, device="cuda", **kw) as c:
        assert c.config.device.index is not None  # pinned to the current device
        c.set_epoch(0)
        for a, b in zip(cpu, c, strict=True):
            assert b.images.is_cuda and b.images.dtype == torch.uint8
            assert all(t["boxes"].is_cuda and t["labels"].is_cuda for t in b.targets)
            assert torch.equal(a.images, b.images.cpu())
            for ta, tb in zip(a.targets, b.targets, strict=True):
                assert torch.equal(ta["boxes"], tb["boxes"].cpu())
                assert torch.equal(ta["labels"], tb["labels"].cpu())
        # Steady state: pinned buffers are recycled, not allocated per batch.
        allocated = c.stats()["host_buffers_allocated"]
        c.set_epoch(1)
        for b in c:
            b.images.float().mean().item()  # use it on the compute stream
        assert c.stats()["host_buffers_allocated"] <= allocated + 1


def test_feedback_works_with_batches_on_the_gpu(synthetic_server: Any) -> None:
    with make_client(
        synthetic_server.address, batch_size=4, image_size=(64, 64), device="cuda"
    ) as c:
        c.set_epoch(0)
        it = iter(c)
        next(it)
        c.set_mode("stitch")
        b = next(it)
        assert b.mode == "stitch" and b.images.is_cuda and len(b.indices[0]) == 4

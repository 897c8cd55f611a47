"""Stitcher's feedback signal, and the example training loop that uses it."""

from __future__ import annotations

import math
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import torch
from clients import make_client

from dataserver_client.stitcher import small_object_loss_ratio
from dataserver_client.tinydet import TinyDetector

ROOT = Path(__file__).resolve().parent.parent


def test_ratio_is_the_small_share_of_the_regression_loss() -> None:
    losses = torch.tensor([1.0, 2.0, 3.0, 4.0])
    areas = torch.tensor([100.0, 1023.0, 1024.0, 5000.0])  # small = area < 32 * 32
    assert small_object_loss_ratio(losses, areas) == pytest.approx(3.0 / 10.0)
    assert small_object_loss_ratio(losses, areas, small_area=2000) == pytest.approx(6.0 / 10.0)
    per_coord = torch.tensor([[0.5, 0.5, 0.0, 0.0], [1.0, 1.0, 1.0, 1.0]])
    assert small_object_loss_ratio(per_coord, torch.tensor([10.0, 1e6])) == pytest.approx(1.0 / 5.0)


def test_ratio_without_loss_is_nan_and_keeps_regular_mode() -> None:
    ratio = small_object_loss_ratio(torch.zeros(0), torch.zeros(0))
    assert math.isnan(ratio) and not ratio < 0.1
    with pytest.raises(ValueError, match="differ"):
        small_object_loss_ratio(torch.ones(3), torch.ones(2))


def test_tiny_detector_trains_and_reports_a_ratio() -> None:
    torch.manual_seed(0)
    model = TinyDetector()
    images = torch.randint(0, 255, (2, 3, 64, 64), dtype=torch.uint8)
    targets = [
        {
            "boxes": torch.tensor([[2.0, 2.0, 10.0, 10.0], [0.0, 0.0, 60.0, 60.0]]),
            "labels": torch.tensor([1, 2]),
        },
        {"boxes": torch.zeros((0, 4)), "labels": torch.zeros((0,), dtype=torch.int64)},
    ]
    loss, ratio = model.loss(images, targets)
    loss.backward()
    assert loss.item() > 0 and 0.0 < ratio < 1.0
    assert all(p.grad is not None for p in model.parameters() if p.requires_grad)


@pytest.mark.timeout(120)
def test_example_training_loop_runs_against_a_server(start_server: Any, tmp_path: Path) -> None:
    server = start_server("--dataset", "synthetic:images=64,seed=0", workers=2)
    ckpt = tmp_path / "ckpt.pt"
    cmd = [
        sys.executable,
        str(ROOT / "examples" / "train_detector.py"),
        "--servers",
        server.address,
        "--model",
        "tiny",
        "--steps",
        "12",
        "--image-size",
        "128",
        "--threshold",
        "0.75",
        "--checkpoint",
        str(ckpt),
    ]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=100)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "epoch 0 step     0" in proc.stdout and "samples/s" in proc.stdout
    # One loader state for the whole job (state_dict gathers every rank's position).
    assert ckpt.exists() and Path(f"{ckpt}.loader").exists()
    state = torch.load(f"{ckpt}.loader", weights_only=False)
    assert state["epoch"] == 0 and state["step"] == 1 and state["world_size"] == 1


@pytest.mark.timeout(300)
def test_torchvision_faster_rcnn_probe_reports_a_ratio(start_server: Any) -> None:
    """The example's torchvision path (skipped where torchvision is not installed; run by hand
    with torch 2.14.1 + torchvision 0.29.1)."""
    pytest.importorskip("torchvision")
    sys.path.insert(0, str(ROOT / "examples"))
    from train_detector import build_model

    server = start_server("--dataset", "synthetic:images=16,seed=0", workers=1)
    model, step = build_model("fasterrcnn", (384, 384), torch.device("cpu"))
    with make_client(server.address, batch_size=2, image_size=(384, 384)) as c:
        c.set_epoch(0)
        batch = next(iter(c))
        loss, ratio = step(model, batch.images, batch.targets)
        loss.backward()
        assert loss.item() > 0 and (math.isnan(ratio) or 0.0 <= ratio <= 1.0)
        assert c.feedback(ratio) in ("regular", "stitch")

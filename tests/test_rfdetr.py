"""``train_rfdetr`` (issue 37, item 1): RF-DETR's own training (its Lightning module, trainer,
callbacks and COCO evaluation) fed by dataserver pools, on CPU with a random-init
``RFDETRNano`` at a tiny resolution: losses finite and falling, a finite mAP from served
validation, the dataset's class names on the trained model, and served validation batches
as RF-DETR's loaders make them (stretched, ImageNet-normalized, normalized cxcywh boxes,
class indices, original sizes), never mirrored."""

from __future__ import annotations

import csv
import json
import math
import os
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import cv2
import numpy as np
import pytest
from conftest import Server
from ds_plugins import Blocks

pytest.importorskip("rfdetr")
pytest.importorskip("pytorch_lightning")
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("YOLO_OFFLINE", "1")

import torch
from rfdetr import RFDETRNano
from rfdetr.config import RFDETRNanoConfig, TrainConfig

from dataserver_client.integrations.rfdetr import MEAN, STD, RFDETRServedDataModule, train_rfdetr

pytestmark = pytest.mark.timeout(900)

N = 16
SIDE = 64
DATA = Blocks(N, 0)
NAMES = ["red", "green", "blue", "yellow"]


@pytest.fixture(scope="module")
def servers() -> Iterator[dict[str, Server]]:
    args = ("--dataset", "ds_plugins:blocks", "--dataset-args")
    started = {
        "train": Server(*args, json.dumps({"images": N, "seed": 0}), workers=1),
        "val": Server(*args, json.dumps({"images": N // 2, "seed": 0}), workers=1),
    }
    yield started
    for server in started.values():
        server.stop()


def epoch_rows(path: Path) -> tuple[list[float], list[float]]:
    """(train/loss per epoch, val/mAP_50_95 per validation) from RF-DETR's metrics.csv."""
    losses, maps = [], []
    with open(path) as f:
        for row in csv.DictReader(f):
            if row.get("train/loss"):
                losses.append(float(row["train/loss"]))
            if row.get("val/mAP_50_95"):
                maps.append(float(row["val/mAP_50_95"]))
    return losses, maps


def test_trains_and_evaluates(servers: dict[str, Server], tmp_path: Path) -> None:
    model = RFDETRNano(pretrain_weights=None)
    train_rfdetr(
        model,
        servers["train"].address,
        val=servers["val"].address,
        epochs=2,
        batch_size=4,
        resolution=SIDE,
        device="cpu",
        lr=1e-3,
        multi_scale=False,
        use_ema=False,
        run_test=False,
        progress_bar=False,
        seed=0,
        output_dir=str(tmp_path),
    )
    losses, maps = epoch_rows(tmp_path / "metrics.csv")
    assert len(losses) == 2 and all(math.isfinite(x) for x in losses), losses
    assert losses[-1] < losses[0], losses
    assert len(maps) == 2 and all(math.isfinite(x) and 0 <= x <= 1 for x in maps), maps
    # RFDETR.train()'s post-fit steps: class names and class count from the dataset.
    assert model.model.class_names == NAMES
    assert model.model_config.num_classes == len(NAMES)
    saved = json.loads((tmp_path / "training_config.json").read_text())
    assert saved["class_names"] == NAMES


def test_served_validation_is_rfdetrs_own(servers: dict[str, Server]) -> None:
    """Each val image: stretched to the resolution (pixels within interpolation of cv2's
    bilinear resize of the raw image, never its mirror), normalized with ImageNet mean/std,
    no padding in its mask; boxes normalized cxcywh of the raw boxes, labels class indices,
    ``orig_size`` the image as read."""
    dm = RFDETRServedDataModule(
        RFDETRNanoConfig(resolution=SIDE), TrainConfig(dataset_dir=None, batch_size=4), "unused",
        val=servers["val"].address,
    )  # fmt: skip
    dm.setup("validate")
    mean = torch.tensor(MEAN).view(3, 1, 1)
    std = torch.tensor(STD).view(3, 1, 1)
    seen = []
    try:
        assert dm.class_names == NAMES
        for batch in dm.val_dataloader():
            samples, targets = dm.on_after_batch_transfer(batch, 0)
            assert samples.tensors.shape[-2:] == (SIDE, SIDE)
            assert not bool(samples.mask.any())
            for image, target in zip(samples.tensors, targets, strict=True):
                index = int(target["image_id"])
                seen.append(index)
                sample = DATA[index]
                h, w = sample["orig_size"]
                assert target["orig_size"].tolist() == [h, w]
                pixels = ((image * std + mean) * 255).permute(1, 2, 0).numpy()
                want = cv2.resize(sample["image"], (SIDE, SIDE), interpolation=cv2.INTER_LINEAR)
                straight = float(np.abs(pixels - want).mean())
                mirrored = float(np.abs(pixels - want[:, ::-1]).mean())
                assert straight < 6 and straight < mirrored / 2, (index, straight, mirrored)
                x1, y1, x2, y2 = torch.from_numpy(sample["boxes"]).unbind(-1)
                cxcywh = torch.stack(
                    [(x1 + x2) / 2 / w, (y1 + y2) / 2 / h, (x2 - x1) / w, (y2 - y1) / h], -1
                )
                torch.testing.assert_close(target["boxes"], cxcywh, atol=1e-5, rtol=0)
                assert target["labels"].tolist() == [int(c) - 1 for c in sample["labels"]]
    finally:
        dm.teardown("validate")
    assert sorted(seen) == list(range(N // 2))


def test_resumes_from_its_checkpoint(servers: dict[str, Server], tmp_path: Path) -> None:
    """The training client's state rides in RF-DETR's own ``last.ckpt``; ``resume=`` goes on
    with the next epoch (client and Lightning alike), not a repeat of the first."""
    kw: dict[str, Any] = dict(
        batch_size=4, resolution=SIDE, device="cpu", multi_scale=False, use_ema=False,
        run_test=False, progress_bar=False, output_dir=str(tmp_path),
    )  # fmt: skip
    train_rfdetr(RFDETRNano(pretrain_weights=None), servers["train"].address, epochs=1, **kw)
    last = tmp_path / "last.ckpt"
    saved = torch.load(last, map_location="cpu", weights_only=False)
    state = saved["RFDETRServedDataModule"]["client"]
    assert (saved["epoch"], saved["global_step"]) == (0, N // 4)
    assert (state["epoch"], state["step"]) == (1, 0)  # the next epoch, from its start
    train_rfdetr(
        RFDETRNano(pretrain_weights=None),
        servers["train"].address,
        epochs=2,
        resume=str(last),
        **kw,
    )
    saved = torch.load(last, map_location="cpu", weights_only=False)
    state = saved["RFDETRServedDataModule"]["client"]
    assert (saved["epoch"], saved["global_step"]) == (1, 2 * N // 4)
    assert (state["epoch"], state["step"]) == (2, 0)

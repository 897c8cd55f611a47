"""``train_rfdetr`` (issue 37, item 1): RF-DETR's own training (its Lightning module, trainer,
callbacks and COCO evaluation) fed by dataserver pools, on CPU with a random-init
``RFDETRNano`` at a tiny resolution: losses finite and falling, a finite mAP from served
validation, the dataset's class names on the trained model; served validation batches as
RF-DETR's loaders make them (stretched, ImageNet-normalized, normalized cxcywh boxes, class
indices, original sizes), never mirrored, image by image beside RF-DETR's own val loader on
the same COCO set, and its COCO evaluation's ground truth in original pixels; epochs of whole accumulation windows; RF-DETR's ``aug_config`` as its Kornia stage;
its per-batch multi-scale served; a mid-epoch checkpoint that resumes with exactly the
batches of an uninterrupted run."""

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

import pytorch_lightning as pl
import torch
from pytorch_lightning.callbacks import ModelCheckpoint
from rfdetr import RFDETRNano
from rfdetr.config import MultiScale as Mode
from rfdetr.config import RFDETRNanoConfig, TrainConfig
from rfdetr.training import RFDETRDataModule
from rfdetr.training.callbacks.coco_eval import COCOEvalCallback

from dataserver.bench.rfdetr import rfdetr_layout
from dataserver.data.coco import write_synthetic_coco
from dataserver_client.batch import Batch
from dataserver_client.integrations.rfdetr import (
    MEAN,
    STD,
    RFDETRServedDataModule,
    rfdetr_batch,
    train_rfdetr,
)
from dataserver_client.plan.sizes import MultiScale

pytestmark = pytest.mark.timeout(900)

N = 20  # batch 4: 5 batches, 2 windows of grad_accum_steps=2 (the 5th is left out)
VAL = 8
SIDE = 64
NAMES = ["red", "green", "blue", "yellow"]
# Quiet, small runs: no EMA, no progress bar, no test pass.
QUIET: dict[str, Any] = dict(
    device="cpu", use_ema=False, run_test=False, progress_bar=False, tensorboard=False
)
# A smaller decoder than Nano's (one query group, 30 queries): about 6x less CPU a step.
SMALL: dict[str, Any] = dict(pretrain_weights=None, group_detr=1, num_queries=30, num_select=30)


@pytest.fixture(scope="module")
def servers() -> Iterator[dict[str, Server]]:
    args = ("--dataset", "ds_plugins:blocks", "--dataset-args")
    started = {
        "train": Server(*args, json.dumps({"images": N, "seed": 0}), workers=1),
        "val": Server(*args, json.dumps({"images": VAL, "seed": 0}), workers=1),
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


class Recorder(pl.Callback):
    """Each training batch as the model gets it: (epoch, batch index, image ids, shape,
    pixel sum); ``crash_at`` (epoch, batch index): raise ``Crash`` before that batch."""

    def __init__(self, crash_at: tuple[int, int] | None = None) -> None:
        self.seen: list[tuple[int, int, tuple[int, ...], tuple[int, ...], float]] = []
        self.crash_at = crash_at

    def on_train_batch_start(self, trainer: Any, module: Any, batch: Any, batch_idx: int) -> None:
        if (trainer.current_epoch, batch_idx) == self.crash_at:
            raise Crash(f"stopped before batch {batch_idx}")
        samples, targets = batch
        ids = tuple(int(t["image_id"]) for t in targets)
        shape = tuple(samples.tensors.shape)
        total = round(float(samples.tensors.double().sum()), 3)
        self.seen.append((trainer.current_epoch, batch_idx, ids, shape, total))


class Crash(RuntimeError):
    """A training process that dies mid-epoch."""


def test_trains_and_evaluates(servers: dict[str, Server], tmp_path: Path) -> None:
    """Two epochs through ``train_rfdetr`` with ``grad_accum_steps=2`` and an ``aug_config``
    (RF-DETR's Kornia stage on the trainer): losses finite and falling, mAP finite from the
    served validation, epochs of whole windows (2 optimizer steps each, the fifth batch
    left out), class names and count from the dataset."""
    model = RFDETRNano(**SMALL)
    recorder = Recorder()
    train_rfdetr(
        model,
        servers["train"].address,
        val=servers["val"].address,
        trainer_callbacks=[recorder],
        epochs=2,
        batch_size=4,
        grad_accum_steps=2,
        resolution=SIDE,
        lr=1e-3,
        multi_scale=False,
        aug_config={"HorizontalFlip": {"p": 0.5}},
        seed=0,
        output_dir=str(tmp_path),
        **QUIET,
    )
    losses, maps = epoch_rows(tmp_path / "metrics.csv")
    assert len(losses) == 2 and all(math.isfinite(x) for x in losses), losses
    assert losses[-1] < losses[0], losses
    assert len(maps) == 2 and all(math.isfinite(x) and 0 <= x <= 1 for x in maps), maps
    # Epochs of whole windows: 4 of the 5 batches, each sample at most once an epoch.
    for epoch in (0, 1):
        ids = [i for e, _, batch, _, _ in recorder.seen if e == epoch for i in batch]
        assert len(ids) == 16 and len(set(ids)) == 16, ids
    last = torch.load(tmp_path / "last.ckpt", map_location="cpu", weights_only=False)
    assert (last["epoch"], last["global_step"]) == (1, 4)
    state = last["RFDETRServedDataModule"]["client"]
    assert (state["epoch"], state["step"], state["augment"]) == (2, 0, False)
    # RFDETR.train()'s post-fit steps: class names and class count from the dataset.
    assert model.model.class_names == NAMES
    assert model.model_config.num_classes == len(NAMES)
    saved = json.loads((tmp_path / "training_config.json").read_text())
    assert saved["class_names"] == NAMES


def test_served_validation_is_rfdetrs_own(servers: dict[str, Server]) -> None:
    """Each val image: stretched to the resolution (pixels within interpolation of cv2's
    bilinear resize of the raw image, never its mirror), normalized with ImageNet mean/std,
    no padding in its mask; boxes normalized cxcywh of the raw boxes, labels class indices,
    ``orig_size`` the image as read; and RF-DETR's ``COCOEvalCallback`` turns the served
    targets into the raw boxes, in original pixels. A multi-scale training setting leaves
    validation at ``resolution``."""
    data = Blocks(VAL, 0)
    train_config = TrainConfig(dataset_dir=None, batch_size=4, multi_scale=Mode.PER_BATCH)
    dm = RFDETRServedDataModule(
        RFDETRNanoConfig(resolution=SIDE), train_config, "unused", val=servers["val"].address
    )
    dm.setup("validate")
    mean = torch.tensor(MEAN).view(3, 1, 1)
    std = torch.tensor(STD).view(3, 1, 1)
    evaluation = COCOEvalCallback()
    seen = []
    try:
        assert dm.class_names == NAMES
        for batch in dm.val_dataloader():
            samples, targets = dm.on_after_batch_transfer(batch, 0)
            assert samples.tensors.shape[-2:] == (SIDE, SIDE)
            assert not bool(samples.mask.any())
            in_pixels = evaluation._convert_targets(targets, None, crowd_regions={})
            for image, target, coco in zip(samples.tensors, targets, in_pixels, strict=True):
                index = int(target["image_id"])
                seen.append(index)
                sample = data[index]
                h, w = sample["orig_size"]
                assert target["orig_size"].tolist() == [h, w]
                pixels = ((image * std + mean) * 255).permute(1, 2, 0).numpy()
                want = cv2.resize(sample["image"], (SIDE, SIDE), interpolation=cv2.INTER_LINEAR)
                straight = float(np.abs(pixels - want).mean())
                mirrored = float(np.abs(pixels - want[:, ::-1]).mean())
                assert straight < 6 and straight < mirrored / 2, (index, straight, mirrored)
                raw = torch.from_numpy(sample["boxes"]).float()
                x1, y1, x2, y2 = raw.unbind(-1)
                cxcywh = torch.stack(
                    [(x1 + x2) / 2 / w, (y1 + y2) / 2 / h, (x2 - x1) / w, (y2 - y1) / h], -1
                )
                torch.testing.assert_close(target["boxes"], cxcywh, atol=1e-5, rtol=0)
                torch.testing.assert_close(coco["boxes"], raw, atol=1e-2, rtol=0)
                labels = [int(c) - 1 for c in sample["labels"]]
                assert target["labels"].tolist() == labels == coco["labels"].tolist()
    finally:
        dm.teardown("validate")
    assert sorted(seen) == list(range(VAL))


# RF-DETR resizes a PIL image (torchvision ``resize``: PIL's bilinear, antialiased when
# shrinking); the servers resize with OpenCV's ``INTER_LINEAR`` (no antialias). Same decode
# (identical RGB), same stretch, same boxes: only the filter differs. Measured on these 8
# synthetic COCO JPEGs (360..640 px) at resolution 64, in 0..255 units: mean |difference| per
# image 1.92..3.35 (2.51 over all), worst pixel 139 (aliased edges), signed mean per channel
# within 0.07. The bounds below catch, on the same images: a mirror (27..68), RGB as BGR
# (22..42), no or another normalization (13..29; signed >= 3.7), std 0.25 for 0.229 (5.2..6.9;
# signed >= 2.4), an off-by-one scale (65 cropped to 64: 6.7..8.2), a one-pixel shift (7.9..13).
PIXEL_MEAN_ABS = 4.5  # per image, 0..255 units
PIXEL_SIGNED = 1.0  # per channel over the set, 0..255 units


def test_served_validation_matches_rfdetrs_own_loader(start_server: Any, tmp_path: Path) -> None:
    """Served val batches beside RF-DETR's own val loader (``RFDETRDataModule`` on the same
    COCO set in its folder layout, through its ``on_after_batch_transfer``), image by image
    (matched by COCO image id; served ``image_id`` is the dataset index, RF-DETR's the COCO
    id): tensor sizes and padding masks equal, boxes (normalized cxcywh), labels, ``orig_size``
    and ``size`` equal; pixels within interpolation, as an exact match cannot be: RF-DETR
    shrinks with PIL's antialiased bilinear, the servers with OpenCV's ``INTER_LINEAR``
    (measured here: mean |difference| 1.9..3.4 of 255 an image, no bias; the bounds and
    what they catch at ``PIXEL_MEAN_ABS``)."""
    annotations = write_synthetic_coco(tmp_path / "coco", images=VAL, seed=1)
    doc = json.loads(annotations.read_text())
    coco_id = [int(image["id"]) for image in doc["images"]]  # by dataset index
    folder = rfdetr_layout(annotations, tmp_path / "rfdetr", VAL)
    model_config = RFDETRNanoConfig(resolution=SIDE)

    def config(dataset_dir: Path | None) -> TrainConfig:
        return TrainConfig(
            dataset_dir=None if dataset_dir is None else str(dataset_dir),
            batch_size=4,
            num_workers=0,
            multi_scale=Mode.OFF,
            aug_config={},
            output_dir=str(tmp_path / "out"),
        )

    def by_id(dm: Any, ids: Any) -> dict[int, tuple[torch.Tensor, torch.Tensor, dict[str, Any]]]:
        out = {}
        for batch in dm.val_dataloader():
            samples, targets = dm.on_after_batch_transfer(batch, 0)
            for image, mask, target in zip(samples.tensors, samples.mask, targets, strict=True):
                out[ids(int(target["image_id"]))] = (image, mask, target)
        return out

    own_dm = RFDETRDataModule(model_config, config(folder))
    own_dm.setup("validate")
    own = by_id(own_dm, lambda i: i)
    server = start_server("--dataset", f"coco:{annotations}", workers=1)
    served_dm = RFDETRServedDataModule(model_config, config(None), "unused", val=server.address)
    served_dm.setup("validate")
    try:
        assert served_dm.class_names == [c["name"] for c in doc["categories"]]
        served = by_id(served_dm, lambda i: coco_id[i])
    finally:
        served_dm.teardown("validate")
    assert sorted(own) == sorted(served) == sorted(coco_id)

    mean = torch.tensor(MEAN).view(3, 1, 1)
    std = torch.tensor(STD).view(3, 1, 1)
    signed = []
    for key, (image, mask, target) in own.items():
        s_image, s_mask, s_target = served[key]
        assert s_image.shape == image.shape == (3, SIDE, SIDE)
        assert torch.equal(s_mask, mask)
        theirs, ours = (image * std + mean) * 255, (s_image * std + mean) * 255
        off = float((ours - theirs).abs().mean())
        assert off < PIXEL_MEAN_ABS, (key, off)
        signed.append((ours - theirs).mean((1, 2)))
        torch.testing.assert_close(s_target["boxes"], target["boxes"], atol=1e-6, rtol=0)
        assert s_target["labels"].tolist() == target["labels"].tolist()
        assert s_target["orig_size"].tolist() == target["orig_size"].tolist()
        assert s_target["size"].tolist() == target["size"].tolist()
    bias = torch.stack(signed).mean(0).abs().max()
    assert float(bias) < PIXEL_SIGNED, bias


def test_aug_config_runs_as_its_kornia_stage(servers: dict[str, Server]) -> None:
    """``aug_config`` is RF-DETR's Kornia stage on the trainer: the training client gets
    ``augment=False`` (no server flip on top) and a ``VerticalFlip`` with p=1 mirrors
    every served picture top to bottom, boxes with it; ``aug_config=None`` is the servers'
    flip (RF-DETR's default ``HorizontalFlip(p=0.5)``), ``{}`` none."""
    model_config = RFDETRNanoConfig(resolution=SIDE)

    def module(aug: Any) -> RFDETRServedDataModule:
        config = TrainConfig(dataset_dir=None, batch_size=4, multi_scale=Mode.OFF, aug_config=aug)
        return RFDETRServedDataModule(model_config, config, servers["train"].address)

    assert module(None).client_kwargs["augment"] is True
    assert module({}).client_kwargs["augment"] is False
    dm = module({"VerticalFlip": {"p": 1.0}})
    assert dm.client_kwargs["augment"] is False
    dm.setup("fit")
    try:
        assert dm.client is not None and dm._classes is not None
        batch = next(iter(dm.train_dataloader()))
        assert isinstance(batch, Batch)
        plain, plain_targets = rfdetr_batch(batch, dm._classes)
        flipped, flipped_targets = rfdetr_batch(batch, dm._classes, dm._augment)
    finally:
        dm.teardown("fit")
    torch.testing.assert_close(flipped.tensors, plain.tensors.flip(-2), atol=1e-4, rtol=0)
    for a, b in zip(plain_targets, flipped_targets, strict=True):
        mirrored = a["boxes"].clone()
        mirrored[:, 1] = 1 - a["boxes"][:, 1]
        # (Kornia mirrors box corners about pixel centres, y -> H - 1 - y: within a pixel)
        torch.testing.assert_close(b["boxes"], mirrored, atol=1.01 / SIDE, rtol=0)
        assert b["labels"].tolist() == a["labels"].tolist()


def test_resumes_mid_epoch_from_its_checkpoint(servers: dict[str, Server], tmp_path: Path) -> None:
    """RF-DETR's per-batch multi-scale served (``MultiScale`` of its scales, one size an
    accumulation window), the servers' flip, ``grad_accum_steps=2``: a run that dies in its
    first epoch after a mid-epoch ``ModelCheckpoint`` resumes from it (``resume=``) with
    exactly the batches an uninterrupted run trained on from there: the same images, the
    same sizes, the same pixels, and epochs of whole windows."""
    kw: dict[str, Any] = dict(
        epochs=2, batch_size=4, grad_accum_steps=2, resolution=32, multi_scale="per-batch",
        expanded_scales=False, seed=3, **QUIET,
    )  # fmt: skip
    whole = Recorder()
    address = servers["train"].address
    dm = train_rfdetr(
        RFDETRNano(**SMALL),
        address,
        trainer_callbacks=[whole],
        output_dir=str(tmp_path / "whole"),
        **kw,
    )
    assert isinstance(dm.client_kwargs["image_size"], MultiScale)
    assert [(e, i) for e, i, *_ in whole.seen] == [(e, i) for e in (0, 1) for i in range(4)]
    sizes = {shape[-1] for *_, shape, _ in whole.seen}
    scales = {w for _, w in dm.client_kwargs["image_size"].sizes}
    assert len(sizes) > 1 and sizes <= scales, sizes
    for step in range(0, 8, 2):  # one size an accumulation window
        assert whole.seen[step][3] == whole.seen[step + 1][3]

    mid = tmp_path / "mid"
    save = ModelCheckpoint(dirpath=mid, filename="mid-{step}", every_n_train_steps=1, save_top_k=-1)
    crash = Recorder(crash_at=(0, 2))
    with pytest.raises(Crash):
        train_rfdetr(
            RFDETRNano(**SMALL),
            address,
            trainer_callbacks=[crash, save],
            output_dir=str(tmp_path / "crash"),
            **kw,
        )
    assert crash.seen == whole.seen[:2]
    checkpoint = mid / "mid-step=1.ckpt"
    state = torch.load(checkpoint, map_location="cpu", weights_only=False)
    client = state["RFDETRServedDataModule"]["client"]
    assert (client["epoch"], client["step"], client["position"]) == (0, 2, 8)

    resumed = Recorder()
    train_rfdetr(
        RFDETRNano(**SMALL),
        address,
        trainer_callbacks=[resumed],
        output_dir=str(tmp_path / "resumed"),
        resume=str(checkpoint),
        **kw,
    )
    assert resumed.seen == whole.seen[2:]

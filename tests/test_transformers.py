"""``DataServerTrainer`` (issue 37, item 2): a ``transformers.Trainer`` fed by dataserver
pools, through ``Trainer.train()``/``evaluate()`` with a tiny random-init RT-DETR on CPU:
losses finite and falling, a finite mAP from served validation, validation never mirrored,
served val batches equal to the HF image processor's own output image by image, and a
mid-epoch resume from a Trainer checkpoint that delivers every sample exactly once."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any, cast

import numpy as np
import pytest
from conftest import Server
from ds_plugins import Blocks

pytest.importorskip("transformers")
pytest.importorskip("pycocotools")
os.environ.setdefault("HF_HUB_OFFLINE", "1")

import torch
from transformers import (
    RTDetrConfig,
    RTDetrForObjectDetection,
    RTDetrImageProcessor,
    RTDetrResNetConfig,
    TrainerCallback,
    TrainingArguments,
)

from dataserver_client.integrations.transformers import DataServerTrainer, served_geometry

pytestmark = pytest.mark.timeout(600)

N = 16
SIDE = 64
DATA = Blocks(N, 0)


@pytest.fixture(scope="module")
def servers() -> Iterator[dict[str, Server]]:
    args = ("--dataset", "ds_plugins:blocks", "--dataset-args")
    started = {
        "train": Server(*args, json.dumps({"images": N, "seed": 0}), workers=2),
        "val": Server(*args, json.dumps({"images": N, "seed": 0}), workers=1),
    }
    yield started
    for server in started.values():
        server.stop()


def tiny_model(seed: int = 0) -> RTDetrForObjectDetection:
    torch.manual_seed(seed)
    backbone_kw: dict[str, Any] = dict(
        embedding_size=16,
        hidden_sizes=[16, 32, 64, 64],
        depths=[1, 1, 1, 1],
        layer_type="basic",
        out_features=["stage2", "stage3", "stage4"],
    )
    config_kw: dict[str, Any] = dict(
        backbone_config=RTDetrResNetConfig(**backbone_kw),
        use_pretrained_backbone=False,
        encoder_hidden_dim=32,
        encoder_in_channels=[32, 64, 64],
        decoder_in_channels=[32, 32, 32],
        d_model=32,
        encoder_ffn_dim=64,
        decoder_ffn_dim=64,
        encoder_layers=1,
        decoder_layers=1,
        num_queries=30,
        num_denoising=10,
        encoder_attention_heads=2,
        decoder_attention_heads=2,
        num_labels=4,
    )
    return RTDetrForObjectDetection(RTDetrConfig(**config_kw))


def processor() -> RTDetrImageProcessor:
    return RTDetrImageProcessor(size={"height": SIDE, "width": SIDE})


def arguments(out: Path, **kw: Any) -> TrainingArguments:
    base: dict[str, Any] = dict(
        output_dir=str(out),
        per_device_train_batch_size=4,
        per_device_eval_batch_size=4,
        learning_rate=1e-3,
        num_train_epochs=1,
        logging_steps=1,
        save_strategy="no",
        report_to=[],
        use_cpu=True,
        seed=5,
        disable_tqdm=True,
    )
    return TrainingArguments(**{**base, **kw})


class Seen(TrainerCallback):
    """Every training step's loss (from the logs)."""

    def __init__(self) -> None:
        self.losses: list[float] = []

    def on_log(self, args: Any, state: Any, control: Any, logs: Any = None, **kw: Any) -> None:
        if logs and "loss" in logs:
            self.losses.append(float(logs["loss"]))


def trainer_of(servers: dict[str, Server], args: TrainingArguments, **kw: Any) -> DataServerTrainer:
    return DataServerTrainer(
        model=tiny_model(),
        args=args,
        train=servers["train"].address,
        val=servers["val"].address,
        image_processor=processor(),
        client_kwargs={"timeout": 30.0},
        **kw,
    )


def test_trains_and_evaluates(servers: dict[str, Server], tmp_path: Path) -> None:
    seen = Seen()
    trainer = trainer_of(servers, arguments(tmp_path, num_train_epochs=6), callbacks=[seen])
    try:
        trainer.train()
        metrics = trainer.evaluate()
    finally:
        trainer.close()
    assert len(seen.losses) == 6 * N // 4
    assert all(np.isfinite(seen.losses))
    first, last = np.mean(seen.losses[:4]), np.mean(seen.losses[-4:])
    assert last < first, seen.losses
    assert np.isfinite(metrics["eval_loss"]) and np.isfinite(metrics["eval_map"])
    assert 0.0 <= metrics["eval_map"] <= 1.0
    assert cast(Any, trainer.model).config.id2label == {
        0: "red",
        1: "green",
        2: "blue",
        3: "yellow",
    }


def test_served_validation_is_the_processors_own(
    servers: dict[str, Server], tmp_path: Path
) -> None:
    """Each val image as the processor makes it from the raw image and its COCO annotation
    (category ids mapped to 0..n-1 as the HF guide does): sizes exactly, pixels within
    interpolation (cv2's bilinear against torchvision's antialiased one), boxes and labels
    exactly; never mirrored."""
    trainer = trainer_of(servers, arguments(tmp_path))
    proc = processor()
    try:
        loader = trainer.get_eval_dataloader()
        seen = []
        for inputs in loader:
            for image, label in zip(inputs["pixel_values"], inputs["labels"], strict=True):
                index = int(label["image_id"])
                seen.append(index)
                sample = DATA[index]
                boxes = sample["boxes"]
                annotation = {
                    "image_id": index,
                    "annotations": [
                        {
                            "bbox": [x1, y1, x2 - x1, y2 - y1],
                            "category_id": int(c) - 1,
                            "area": float((x2 - x1) * (y2 - y1)),
                            "iscrowd": 0,
                        }
                        for (x1, y1, x2, y2), c in zip(
                            boxes.tolist(), sample["labels"], strict=True
                        )
                    ],
                }
                want = proc(
                    images=sample["image"],
                    annotations=annotation,  # type: ignore[call-arg]
                    return_tensors="pt",
                )
                pixels, target = want["pixel_values"][0], want["labels"][0]
                assert image.shape == pixels.shape
                # (cv2 samples the dark noisy ground where torchvision averages it: compared
                # over 4x4 means; a mirrored image is far off there)
                ours, theirs = pooled(image), pooled(pixels)
                diff = float((ours - theirs).abs().mean())
                mirrored = float((pooled(image.flip(-1)) - theirs).abs().mean())
                assert diff < 0.02 and diff < mirrored, (index, diff, mirrored)
                assert label["class_labels"].tolist() == target["class_labels"].tolist()
                assert torch.allclose(label["boxes"], target["boxes"], atol=1e-5)
                assert label["orig_size"].tolist() == target["orig_size"].tolist()
                assert label["size"].tolist() == target["size"].tolist()
        assert sorted(seen) == list(range(N))
        assert "pixel_mask" not in inputs  # a stretch: no padding, as the processor
    finally:
        trainer.close()


def test_a_letterbox_processor_gets_its_pixel_mask(
    servers: dict[str, Server], tmp_path: Path
) -> None:
    """A processor that keeps the aspect (``max_height``/``max_width``) and pads
    (``do_pad``, ``pad_size`` the canvas): served as a top-left letterbox, ``pixel_mask``
    and labels as the processor's own, image by image."""
    size = {"max_height": SIDE, "max_width": SIDE}
    pad = {"height": SIDE, "width": SIDE}
    proc = RTDetrImageProcessor(size=size, do_pad=True, pad_size=pad)
    trainer = DataServerTrainer(
        model=tiny_model(),
        args=arguments(tmp_path),
        train=servers["train"].address,
        val=servers["val"].address,
        image_processor=proc,
    )
    try:
        inputs = next(iter(trainer.get_eval_dataloader()))
    finally:
        trainer.close()
    masks = inputs["pixel_mask"]
    padded = 0
    for n, label in enumerate(inputs["labels"]):
        sample = DATA[int(label["image_id"])]
        annotation = {
            "image_id": int(label["image_id"]),
            "annotations": [
                {"bbox": [x1, y1, x2 - x1, y2 - y1], "category_id": int(c) - 1,
                 "area": float((x2 - x1) * (y2 - y1)), "iscrowd": 0}
                for (x1, y1, x2, y2), c in zip(
                    sample["boxes"].tolist(), sample["labels"], strict=True
                )
            ],
        }  # fmt: skip
        want = proc(
            images=sample["image"],
            annotations=annotation,  # type: ignore[call-arg]
            return_tensors="pt",
        )
        assert torch.equal(masks[n], want["pixel_mask"][0])
        target = want["labels"][0]
        assert label["size"].tolist() == target["size"].tolist()
        assert label["class_labels"].tolist() == target["class_labels"].tolist()
        assert torch.allclose(label["boxes"], target["boxes"], atol=1e-5)
        inside = masks[n].bool()
        image = inputs["pixel_values"][n]
        assert bool((image[:, ~inside] == 0).all()) and bool(
            (want["pixel_values"][0][:, ~inside] == 0).all()
        )
        padded += int((~inside).sum()) > 0
    assert padded  # (the test sees padding: a 480x640 or 360x640 image is among them)


def pooled(image: torch.Tensor) -> torch.Tensor:
    return torch.nn.functional.avg_pool2d(image[None], 4)[0]


class StopAt(TrainerCallback):
    def __init__(self, step: int) -> None:
        self.step = step

    def on_step_end(self, args: Any, state: Any, control: Any, **kw: Any) -> None:
        if state.global_step == self.step:
            control.should_training_stop = True


class Indices(TrainerCallback):
    """The dataset indices of every training batch (from the labels' image_id)."""

    def __init__(self) -> None:
        self.seen: list[int] = []


def record(trainer: DataServerTrainer, seen: list[int]) -> None:
    loader = trainer.get_train_dataloader()
    prepare = loader.prepare

    def wrapped(batch: Any) -> dict[str, Any]:
        seen.extend(i[0] for i in batch.indices)
        return prepare(batch)

    loader.prepare = wrapped


@pytest.mark.parametrize("stop", [3, 4])
def test_resume_mid_epoch_and_at_its_end(
    servers: dict[str, Server], tmp_path: Path, stop: int
) -> None:
    """Stopped after ``stop`` steps (3: mid-epoch, 4 = N / 4: at the epoch's end), saved,
    resumed from the checkpoint: each epoch delivers every sample exactly once, in the
    order of an unbroken run."""
    kw = dict(num_train_epochs=2, save_strategy="steps", save_steps=stop)
    whole: list[int] = []
    unbroken = trainer_of(servers, arguments(tmp_path / "a", **kw))
    record(unbroken, whole)
    try:
        unbroken.train()
    finally:
        unbroken.close()
    first: list[int] = []
    part = trainer_of(servers, arguments(tmp_path / "b", **kw), callbacks=[StopAt(stop)])
    record(part, first)
    try:
        part.train()
    finally:
        part.close()
    assert len(first) == stop * 4
    rest: list[int] = []
    resumed = trainer_of(servers, arguments(tmp_path / "b", **kw))
    record(resumed, rest)
    try:
        resumed.train(resume_from_checkpoint=True)
    finally:
        resumed.close()
    assert first + rest == whole
    assert sorted(whole[:N]) == list(range(N)) and sorted(whole[N:]) == list(range(N))


def test_two_ranks_resume_mid_epoch(servers: dict[str, Server], tmp_path: Path) -> None:
    """Under torchrun (2 CPU ranks, gloo): the client state saved beside a checkpoint (a
    collective: both ranks save) resumes each rank where it stood; every rank's batches
    are those of an unbroken run, and each epoch holds every sample once across ranks."""
    job = Path(__file__).parent / "plugins" / "hf_ddp_job.py"
    here = Path(__file__).parent
    path = os.pathsep.join([str(here), str(here / "plugins"), os.environ.get("PYTHONPATH", "")])
    env = {**os.environ, "PYTHONPATH": path, "HF_HUB_OFFLINE": "1", "OMP_NUM_THREADS": "1"}

    def run(output: str, record: str, *extra: str) -> None:
        cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone"]
        cmd += ["--nproc_per_node", "2", str(job), "--train", servers["train"].address]
        cmd += ["--output", str(tmp_path / output), "--record", str(tmp_path / record), *extra]
        done = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=240)
        assert done.returncode == 0, done.stderr[-3000:]

    def lines(record: str, rank: int) -> list[list[int]]:
        text = (tmp_path / f"{record}.rank{rank}").read_text()
        return [json.loads(line) for line in text.splitlines()]

    run("whole", "whole")
    run("part", "first", "--stop-after", "3")  # checkpoint-2, then one step more
    run("part", "rest", "--resume")
    per_epoch = N // 2 // 2  # batches a rank trains in an epoch (2 ranks, batch 2)
    for rank in (0, 1):
        assert lines("first", rank)[:2] + lines("rest", rank) == lines("whole", rank)
    for epoch in (0, 1):
        got = [
            i
            for rank in (0, 1)
            for batch in lines("whole", rank)[epoch * per_epoch : (epoch + 1) * per_epoch]
            for i in batch
        ]
        assert sorted(got) == list(range(N))


def test_the_processors_geometry_is_read_or_refused_by_name() -> None:
    said: list[str] = []
    assert served_geometry(processor(), said.append) == ((SIDE, SIDE), "stretch")
    assert not said
    letterbox = RTDetrImageProcessor(size={"max_height": 48, "max_width": 80})
    assert served_geometry(letterbox, said.append) == ((48, 80), "letterbox")
    detr = RTDetrImageProcessor(size={"shortest_edge": 800, "longest_edge": 1333}, resample=3)
    assert served_geometry(detr, said.append) == ((1333, 1333), "letterbox")
    assert any("resample" in s for s in said) and any("longest_edge" in s for s in said)
    with pytest.raises(ValueError, match="do_resize=False"):
        served_geometry(RTDetrImageProcessor(do_resize=False))

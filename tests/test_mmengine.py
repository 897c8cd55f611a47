"""The MMEngine integration with the real Runner: feedback reaches the next batch at every
iteration, a control flag set by a hook reaches the dataset for the next batch, and a run
killed after a mid-epoch checkpoint and resumed trains on what an unbroken run does."""

from __future__ import annotations

import itertools
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pytest
import torch
from clients import make_client

pytest.importorskip("mmengine")

from conftest import PLUGINS, server_env, wait_until

from dataserver_client.integrations.mmengine import (
    CloseMosaicHook,
    DataServerHook,
    DataServerLoader,
    StitcherFeedbackHook,
    as_data_batch,
)

pytestmark = pytest.mark.timeout(300)

N_IMAGES = 32  # batch 4: 8 regular batches per epoch, 2 stitched


def by_epoch(records: list[dict[str, Any]]) -> dict[int, list[int]]:
    out: dict[int, list[int]] = {}
    for r in records:
        out.setdefault(r["epoch"], []).extend(i for image in r["indices"] for i in image)
    return out


def assert_whole_epochs(epochs: dict[int, list[int]], n: int) -> None:
    """Every epoch but the last (which a run may stop in) delivered each index once."""
    assert sorted(epochs) == list(range(len(epochs)))
    for epoch in sorted(epochs)[:-1]:
        assert sorted(epochs[epoch]) == list(range(n)), epoch


def assert_decisions_honoured(records: list[dict[str, Any]]) -> None:
    for before, after in itertools.pairwise(records):
        assert after["mode"] == before["decision"], (before, after)


def test_two_epochs_feedback_reaches_the_next_batch_every_step(
    tmp_path: Path, start_server: Any
) -> None:
    from mmengine.structures import BaseDataElement, InstanceData
    from mmengine_job import RecordHook, job_client, make_runner, scripted_ratio

    server = start_server("--dataset", f"synthetic:images={N_IMAGES},seed=2", workers=3)
    record = RecordHook()
    with job_client(server.address) as client:
        runner = make_runner(client, str(tmp_path), "epoch", 2, [record], name="two-epochs")
        assert len(runner.train_dataloader) == N_IMAGES // 4
        runner.train()
        assert runner.train_loop.max_iters == 2 * (N_IMAGES // 4)  # len() when it was built
        assert runner.message_hub.get_scalar("train/next_stitch") is not None
    records = record.records
    # The hook's decision after iteration t is the mode of iteration t + 1, every time,
    # across the epoch boundary too; and the script asked for both modes.
    assert_decisions_honoured(records)
    assert [r["decision"] for r in records] == [
        "stitch" if scripted_ratio(r["step"]) < 0.1 else "regular" for r in records
    ]
    assert {r["mode"] for r in records} == {"regular", "stitch"}
    # MMEngine's DistSamplerSeedHook drove the epochs: two different orders, each exactly once.
    epochs = by_epoch(records)
    assert sorted(epochs) == [0, 1]
    assert all(sorted(v) == list(range(N_IMAGES)) for v in epochs.values())
    assert epochs[0] != epochs[1]
    assert [r["step"] for r in records if r["epoch"] == 0] == list(
        range(len([r for r in records if r["epoch"] == 0]))
    )
    # MMEngine's data format.
    batch = record.batches[0]
    assert set(batch) == {"inputs", "data_samples"}
    assert len(batch["inputs"]) == len(batch["data_samples"]) == 4
    for image, sample in zip(batch["inputs"], batch["data_samples"], strict=True):
        assert image.dtype.is_floating_point is False and str(image.dtype) == "torch.uint8"
        assert tuple(image.shape) == (3, 64, 64)
        assert isinstance(sample, BaseDataElement)
        assert isinstance(sample.gt_instances, InstanceData)
        boxes, labels = sample.gt_instances.bboxes, sample.gt_instances.labels
        assert str(boxes.dtype) == "torch.float32" and boxes.shape[1] == 4 and len(boxes) > 0
        assert str(labels.dtype) == "torch.int64" and labels.shape == (len(boxes),)
        assert (boxes[:, 2] > boxes[:, 0]).all() and (boxes[:, 3] > boxes[:, 1]).all()
        meta = sample.metainfo
        assert meta["img_shape"] == meta["ori_shape"] == (64, 64)
        assert meta["scale_factor"] == (1.0, 1.0) and meta["flip"] is False
        assert meta["mode"] == "regular" and len(meta["indices"]) == 1
    stitched = next(r for r in records if r["mode"] == "stitch")
    assert all(len(image) == 4 for image in stitched["indices"])  # k = 4 samples per image


class ControlHook:
    """What a user's hook does instead of ``runner.train_dataloader.dataset.active = True``."""

    def __init__(self, at_iter: int) -> None:
        self.at_iter = at_iter

    def make(self) -> Any:
        from mmengine.hooks import Hook

        at_iter = self.at_iter

        class SetFlag(Hook):
            def after_train_iter(
                self, runner: Any, batch_idx: int, data_batch: Any = None, outputs: Any = None
            ) -> None:
                if runner.iter == at_iter:
                    runner.train_dataloader.client.control(active=1)

        return SetFlag()


def test_a_control_flag_from_a_hook_reaches_the_dataset_for_the_next_batch(
    tmp_path: Path, start_server: Any
) -> None:
    from mmengine_job import RecordHook, job_client, make_runner

    server = start_server("--dataset", "ds_plugins:flag", "--dataset-args", '{"n": 32}', workers=2)
    record = RecordHook()
    with job_client(server.address) as client:
        # IterBasedTrainLoop over more than one epoch (the loader goes on by itself).
        runner = make_runner(
            client,
            str(tmp_path),
            "iter",
            14,
            [ControlHook(at_iter=3).make(), record],
            name="control",
        )
        started = time.monotonic()
        runner.train()
        elapsed = time.monotonic() - started
    records = record.records
    assert len(records) == 14
    # The Flag dataset labels every box 1 + active: the batch after iteration index 3 on.
    for r in records:
        expected = 2 if r["iter"] > 4 else 1
        assert {label for image in r["labels"] for label in image} == {expected}, r
    epochs = by_epoch(records)
    assert len(epochs) >= 2
    assert_whole_epochs(epochs, 32)
    assert_decisions_honoured(records)
    # No restart of the loop's iterator at the epoch's end (MMEngine's own sleeps 2 s).
    assert elapsed < 30


def run_job(
    args: list[str], record: Path, timeout: float = 180
) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, str(PLUGINS / "mmengine_job.py"), "--record", str(record), *args],
        capture_output=True,
        text=True,
        timeout=timeout,
        env=server_env(),
    )


def read_records(path: Path) -> list[dict[str, Any]]:
    return [json.loads(line) for line in path.read_text().splitlines() if line.startswith("{")]


@pytest.mark.parametrize("loop,length", [("epoch", 2), ("iter", 14)])
def test_killed_and_resumed_from_a_checkpoint_mid_epoch_equals_an_unbroken_run(
    tmp_path: Path, start_server: Any, loop: str, length: int
) -> None:
    server = start_server("--dataset", f"synthetic:images={N_IMAGES},seed=4", workers=2)
    common = [
        "--address",
        server.address,
        "--loop",
        loop,
        "--length",
        str(length),
        "--ckpt-interval",
        "3",
    ]

    unbroken = tmp_path / "unbroken.jsonl"
    done = run_job([*common, "--work-dir", str(tmp_path / "w0")], unbroken)
    assert done.returncode == 0, done.stderr[-3000:]
    full = read_records(unbroken)

    # Killed (SIGKILL) two iterations after the checkpoint of iteration 3: batch 2's
    # feedback asked for stitching, so the state resumed holds a pending mode switch.
    work = tmp_path / "w1"
    broken = tmp_path / "broken.jsonl"
    proc = subprocess.Popen(
        [
            sys.executable,
            str(PLUGINS / "mmengine_job.py"),
            *common,
            "--work-dir",
            str(work),
            "--record",
            str(broken),
            "--block-at",
            "5",
        ],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
        env=server_env(),
    )
    try:
        assert wait_until(lambda: broken.exists() and "BLOCKED" in broken.read_text(), 120), (
            proc.stderr.read().decode()[-3000:]
            if proc.poll() is not None and proc.stderr
            else "no BLOCKED"
        )
        os.kill(proc.pid, signal.SIGKILL)
        proc.wait(10)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait(10)
        if proc.stderr:
            proc.stderr.close()
    assert (work / "iter_3.pth").exists() and (work / "last_checkpoint").exists()
    assert read_records(broken) == full[:5]
    assert full[2]["decision"] == "stitch" and full[3]["mode"] == "stitch"

    resumed_path = tmp_path / "resumed.jsonl"
    resumed = run_job([*common, "--work-dir", str(work), "--resume"], resumed_path)
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    # From the checkpoint on, the same batches (samples, pixels, boxes, modes, decisions).
    assert read_records(resumed_path) == full[3:]
    assert_decisions_honoured(full)
    assert_whole_epochs(by_epoch(full), N_IMAGES)


def test_the_loader_rejects_what_it_cannot_serve(start_server: Any) -> None:
    from mmengine_job import job_client

    server = start_server("--dataset", "synthetic:images=8,seed=1", workers=1)
    with pytest.raises(TypeError, match="DataServerClient"):
        DataServerLoader(object())  # type: ignore[arg-type]
    with job_client(server.address) as client:
        loader = DataServerLoader(client, metainfo={"classes": ("a", "b")})
        assert loader.dataset.metainfo == {"classes": ("a", "b")}
        assert len(loader.dataset) == 8 and len(loader.sampler) == 8 and len(loader) == 2
        with pytest.raises(TypeError, match=r"client\.control"):
            loader.dataset[0]
        with pytest.raises(ValueError, match="DataServerLoader state"):
            loader.load_state_dict({"version": 99})

        class FakeLoop:
            dataloader = object()

        class FakeRunner:
            train_loop = FakeLoop()

        with pytest.raises(TypeError, match="not a DataServerLoader"):
            DataServerHook.loader(FakeRunner())

        FakeLoop.dataloader = loader
        hook = StitcherFeedbackHook()
        with pytest.raises(KeyError, match="small_object_ratio"):
            hook.after_train_iter(FakeRunner(), 0, None, outputs={"loss": torch.tensor(1.0)})
        with pytest.raises(ValueError, match="one value"):
            hook.after_train_iter(FakeRunner(), 0, None, {"small_object_ratio": torch.ones(2)})
        assert client.mode == "regular"


def test_another_rank_resumes_from_rank_0s_state(start_server: Any) -> None:
    """MMEngine saves checkpoints on rank 0 only; every rank of a run is at rank 0's step
    and position (equal shards, the same averaged feedback), so rank 1 resumes from it."""
    from dataserver_client import DataServerClient

    server = start_server("--dataset", f"synthetic:images={N_IMAGES},seed=4", workers=2)

    def client(rank: int, world_size: int = 2) -> DataServerClient:
        return make_client(
            server.address,
            batch_size=4,
            image_size=(64, 64),
            rank=rank,
            world_size=world_size,
        )

    def indices(data: Any) -> list[list[int]]:
        return [s.metainfo["indices"] for s in data["data_samples"]]

    def first_two(loader: DataServerLoader) -> tuple[list[list[list[int]]], Any]:
        """Two regular batches, then a switch to stitching, as a hook would take it."""
        it = iter(loader)
        out = [indices(next(it)), indices(next(it))]
        loader.client.set_mode("stitch")
        return out, it

    with client(0) as c0:
        rank0 = DataServerLoader(c0)
        first0, _ = first_two(rank0)
        state = rank0.state_dict()
    with client(1) as c1:  # rank 1, unbroken
        first, it = first_two(DataServerLoader(c1))
        rest = [indices(d) for d in it]
    with client(1) as c1:  # rank 1, resumed from rank 0's checkpoint
        resumed = DataServerLoader(c1)
        resumed.load_state_dict(state)
        assert c1.mode == "stitch"
        again = [indices(d) for d in resumed]
    assert again == rest and len(again) == 1 and len(again[0][0]) == 4
    # On one rank (elastic resume): what neither rank had trained on, each sample once.
    with client(0, world_size=1) as c:
        alone = DataServerLoader(c)
        alone.load_state_dict(state)
        left = [i for d in alone for s in d["data_samples"] for i in s.metainfo["indices"]]
    done = [i for batch in first0 + first for image in batch for i in image]
    assert sorted(left + done) == list(range(N_IMAGES))
    seen = [i for batch in first + again for image in batch for i in image]
    assert len(seen) == len(set(seen)) == N_IMAGES // 2


def test_resume_from_an_epoch_end_checkpoint_starts_the_next_epoch(
    tmp_path: Path, start_server: Any
) -> None:
    """MMEngine's default CheckpointHook saves after each epoch: the resumed run's next
    epoch is the unbroken run's, in the mode the last feedback chose; and a checkpoint
    loaded with ``load_from`` alone (weights, no resume) leaves the loader alone."""
    from mmengine_job import RecordHook, job_client, make_runner

    # 12 images: batches of steps 0, 1, 2, and step 2's feedback asks for stitching, so
    # the checkpoint after epoch 0 holds a pending switch.
    server = start_server("--dataset", "synthetic:images=12,seed=4", workers=2)

    def run(
        work: Path, epochs: int, resume: bool = False, load_from: str | None = None
    ) -> list[Any]:
        record = RecordHook()
        with job_client(server.address) as client:
            runner = make_runner(
                client,
                str(work),
                "epoch",
                epochs,
                [record],
                resume=resume,
                epoch_checkpoints=True,
                load_from=load_from,
            )
            runner.train()
        return record.records

    full = run(tmp_path / "a", 2)
    first = run(tmp_path / "b", 1)
    assert first == full[: len(first)]
    second = run(tmp_path / "b", 2, resume=True)
    assert second == full[len(first) :]
    assert first[-1]["decision"] == "stitch"
    assert second[0]["epoch"] == 1 and second[0]["mode"] == "stitch"
    # Weights only: a fresh run from epoch 0.
    fresh = run(tmp_path / "c", 1, load_from=str(tmp_path / "b" / "epoch_1.pth"))
    assert fresh == first


def test_the_example_trains_with_zero_stale_batches(start_server: Any) -> None:
    server = start_server("--dataset", f"synthetic:images={N_IMAGES},seed=2", workers=2)
    example = Path(__file__).resolve().parent.parent / "examples" / "mmengine_train.py"
    args = ["--servers", server.address, "--iters", "12", "--batch-size", "4"]
    proc = subprocess.run(
        [sys.executable, str(example), *args, "--image-size", "64", "--threshold", "0.9"],
        capture_output=True,
        text=True,
        timeout=180,
    )
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-2000:]
    lines = [line for line in proc.stdout.splitlines() if line.startswith("iter ")]
    assert len(lines) == 12 and "-> " in lines[0]
    assert "0 stale batches" in proc.stdout


def shape_hook() -> Any:
    """A hook keeping, per iteration, the batch's epoch, step, mode, input shapes, the data
    samples' shape metainfo and the images' sample counts."""
    from mmengine.hooks import Hook

    class Shapes(Hook):
        priority = "LOW"

        def __init__(self) -> None:
            self.records: list[dict[str, Any]] = []

        def after_train_iter(
            self, runner: Any, batch_idx: int, data_batch: Any = None, outputs: Any = None
        ) -> None:
            samples = data_batch["data_samples"]
            meta = samples[0].metainfo
            self.records.append(
                {
                    "epoch": meta["epoch"],
                    "step": meta["step"],
                    "mode": meta["mode"],
                    "inputs": {tuple(t.shape[-2:]) for t in data_batch["inputs"]},
                    "shapes": {
                        (s.img_shape, s.pad_shape, s.batch_input_shape, s.image_size)
                        for s in samples
                    },
                    "per_image": [len(s.metainfo["indices"]) for s in samples],
                    "indices": [list(s.metainfo["indices"]) for s in samples],
                }
            )

    return Shapes()


def test_a_multiscale_client_trains_and_img_shape_follows_each_batch(
    tmp_path: Path, start_server: Any
) -> None:
    """``MultiScale`` goes through ``DataServerLoader`` unchanged: the Runner trains on
    batches of changing size (stitched ones too) and every data sample's ``img_shape``,
    ``pad_shape`` and ``batch_input_shape`` are its batch's ``image_size``, the schedule's."""
    from mmengine_job import THRESHOLD, make_runner

    from dataserver_client import MultiScale

    server = start_server("--dataset", f"synthetic:images={N_IMAGES},seed=2", workers=2)
    schedule = MultiScale([48, 64, (80, 64)], every=2)
    record = shape_hook()
    with make_client(
        server.address,
        batch_size=4,
        image_size=schedule,
        seed=5,
        stitch_threshold=THRESHOLD,
    ) as client:
        runner = make_runner(client, str(tmp_path), "epoch", 2, [record], name="multiscale")
        assert client.config.sizes == schedule and "MultiScale" in repr(runner.train_dataloader)
        runner.train()
        # Straight from the client: as_data_batch's shapes are batch.image_size.
        client.set_epoch(2)
        for batch, _ in zip(client, range(3), strict=False):
            meta = as_data_batch(batch)["data_samples"][0].metainfo
            assert meta["img_shape"] == meta["batch_input_shape"] == batch.image_size
            assert batch.image_size == schedule.size_at(5, 2, batch.step)
    records = record.records
    assert {r["mode"] for r in records} == {"regular", "stitch"}
    for r in records:
        size = schedule.size_at(5, r["epoch"], r["step"])
        assert r["inputs"] == {size} and r["shapes"] == {(size, size, size, size)}, r
    assert len({next(iter(r["inputs"])) for r in records}) > 1  # the size did change
    assert_whole_epochs(by_epoch(records), N_IMAGES)


def mosaic_runner(
    client: Any, work_dir: Path, loop: str, length: int, hooks: list[Any], name: str
) -> Any:
    """``make_runner``'s Runner with ``DataServerHook`` in place of the feedback hook."""
    from mmengine.runner import Runner
    from mmengine_job import ScriptedModel

    train_cfg = (
        dict(by_epoch=True, max_epochs=length)
        if loop == "epoch"
        else dict(by_epoch=False, max_iters=length)
    )
    return Runner(
        model=ScriptedModel(),
        work_dir=str(work_dir),
        train_dataloader=DataServerLoader(client),
        train_cfg=train_cfg,
        optim_wrapper=dict(optimizer=dict(type="SGD", lr=0.1)),
        default_hooks=dict(checkpoint=None, logger=dict(type="LoggerHook", interval=100)),
        custom_hooks=[DataServerHook(), *hooks],
        randomness=dict(seed=0),
        log_level="WARNING",
        experiment_name=f"{name}-{time.monotonic_ns()}",
    )


@pytest.mark.parametrize("loop,length", [("epoch", 3), ("iter", 12)])
def test_close_mosaic_hook_switches_to_regular_at_its_epoch(
    tmp_path: Path, start_server: Any, loop: str, length: int
) -> None:
    """``CloseMosaicHook(close_epoch, mosaic_from_start=True)``: every batch of an epoch
    before ``close_epoch`` is a mosaic of 4 samples an image, every batch from it on is
    regular, under both loops (IterBasedTrainLoop: by the epoch the loader serves)."""
    from dataserver_client import DataServerClient

    server = start_server("--dataset", f"synthetic:images={N_IMAGES},seed=2", workers=2)
    close_epoch = 2 if loop == "epoch" else 1
    record = shape_hook()

    def client() -> DataServerClient:
        return make_client(
            server.address, batch_size=4, image_size=(64, 64), seed=5,
            stitch_layout="mosaic",
        )  # fmt: skip

    with client() as c:
        hook = CloseMosaicHook(close_epoch, mosaic_from_start=True)
        runner = mosaic_runner(c, tmp_path / "a", loop, length, [hook, record], "close-mosaic")
        runner.train()
    records = record.records
    # epoch loop: 2 mosaic epochs of 2 batches, then 8 regular; iter loop: 2 + 8 + 2.
    assert len(records) == (12 if loop == "epoch" else length)
    for r in records:
        mosaic = r["epoch"] < close_epoch
        assert r["mode"] == ("stitch" if mosaic else "regular"), r
        assert r["per_image"] == [4 if mosaic else 1] * 4 and r["inputs"] == {(64, 64)}
    epochs = by_epoch(records)
    assert sorted(epochs)[-1] > close_epoch - 1 >= 0
    for epoch in sorted(epochs)[: close_epoch + 1]:  # whole epochs, each sample once
        assert sorted(epochs[epoch]) == list(range(N_IMAGES)), epoch
    # Without mosaic_from_start the epochs before close_epoch keep the client's mode.
    assert CloseMosaicHook(3).mode_of(2) is None and CloseMosaicHook(3).mode_of(3) == "regular"
    with pytest.raises(ValueError, match="close_epoch"):
        CloseMosaicHook(-1)
    # It refuses a client without mosaic, and StitcherFeedbackHook beside it.
    with client() as c:
        both = mosaic_runner(c, tmp_path / "b", "epoch", 1, [StitcherFeedbackHook(), hook], "x")
        with pytest.raises(ValueError, match="StitcherFeedbackHook"):
            both.train()
    from mmengine_job import job_client

    with job_client(server.address) as c:
        spatial = mosaic_runner(c, tmp_path / "c", "epoch", 1, [CloseMosaicHook(1)], "y")
        with pytest.raises(ValueError, match="stitch_layout='mosaic'"):
            spatial.train()

"""An MMEngine training run against a dataserver, for tests/test_mmengine.py.

Also imported by the tests (the model and hooks) to run the Runner in the test process.
Run as a script, it trains, appends one JSON line per iteration to ``--record`` and, with
``--block-at N``, stops still after iteration N (after that iteration's checkpoint, if
any) until it is killed.
"""

from __future__ import annotations

import argparse
import json
import time
from typing import Any

import torch
from clients import make_client
from mmengine.hooks import Hook
from mmengine.model import BaseModel
from mmengine.registry import HOOKS, MODELS
from mmengine.runner import Runner

from dataserver_client import DataServerClient
from dataserver_client.integrations.mmengine import DataServerLoader, StitcherFeedbackHook

THRESHOLD = 0.1


def scripted_ratio(step: int) -> float:
    """A ratio that asks for a stitched batch after every batch whose step is 2 mod 3."""
    return 0.05 if step % 3 == 2 else 0.5


@MODELS.register_module(force=True)
class ScriptedModel(BaseModel):
    """One parameter fitted to the mean pixel; the ratio is ``scripted_ratio(step)`` of the
    batch, as a 0-d tensor, so the modes a run must have are known in advance."""

    def __init__(self) -> None:
        super().__init__()
        self.w = torch.nn.Parameter(torch.zeros(()))

    def forward(
        self, inputs: list[torch.Tensor], data_samples: Any = None, mode: str = "tensor"
    ) -> Any:
        mean = torch.stack(inputs).float().mean() / 255.0
        if mode != "loss":
            return mean
        step = data_samples[0].metainfo["step"]
        return {
            "loss": (self.w - mean) ** 2,
            "small_object_ratio": torch.tensor(scripted_ratio(step)),
        }


@HOOKS.register_module(force=True)
class RecordHook(Hook):
    """Keeps (and with ``path``, appends as JSON lines) what every iteration trained on and
    the mode the client will give the next batch."""

    priority = "LOW"  # after StitcherFeedbackHook (NORMAL), before CheckpointHook (VERY_LOW)

    def __init__(self, path: str | None = None, block_at: int = 0) -> None:
        self.path = path
        self.block_at = block_at
        self.records: list[dict[str, Any]] = []
        self.batches: list[dict[str, Any]] = []

    def after_train_iter(
        self, runner: Any, batch_idx: int, data_batch: Any = None, outputs: Any = None
    ) -> None:
        samples = data_batch["data_samples"]
        meta = samples[0].metainfo
        record = {
            "iter": runner.iter + 1,
            "epoch": meta["epoch"],
            "step": meta["step"],
            "mode": meta["mode"],
            "indices": [list(s.metainfo["indices"]) for s in samples],
            "labels": [s.gt_instances.labels.tolist() for s in samples],
            "pixels": int(sum(int(t.to(torch.int64).sum()) for t in data_batch["inputs"])),
            "boxes": float(sum(float(s.gt_instances.bboxes.sum()) for s in samples)),
            "decision": runner.train_dataloader.client.mode,
        }
        self.records.append(record)
        if len(self.batches) < 2:
            self.batches.append(data_batch)
        if self.path:
            with open(self.path, "a") as f:
                f.write(json.dumps(record) + "\n")


@HOOKS.register_module(force=True)
class BlockHook(Hook):
    """After iteration ``at`` (and its checkpoint) say so in ``path`` and wait to be killed."""

    priority = "LOWEST"

    def __init__(self, path: str, at: int) -> None:
        self.path, self.at = path, at

    def after_train_iter(
        self, runner: Any, batch_idx: int, data_batch: Any = None, outputs: Any = None
    ) -> None:
        if runner.iter + 1 == self.at:
            with open(self.path, "a") as f:
                f.write("BLOCKED\n")
            time.sleep(600)


def make_runner(
    client: DataServerClient,
    work_dir: str,
    loop: str,
    length: int,
    hooks: list[Any],
    ckpt_interval: int = 0,
    resume: bool = False,
    name: str = "ds",
    epoch_checkpoints: bool = False,
    load_from: str | None = None,
) -> Runner:
    """A Runner training ``ScriptedModel`` from ``client`` with ``StitcherFeedbackHook``
    and ``hooks``: ``loop`` "epoch" (``length`` epochs) or "iter" (``length`` iters)."""
    train_cfg = (
        dict(by_epoch=True, max_epochs=length)
        if loop == "epoch"
        else dict(by_epoch=False, max_iters=length)
    )
    default_hooks: dict[str, Any] = dict(
        checkpoint=None, logger=dict(type="LoggerHook", interval=100)
    )
    if epoch_checkpoints:
        default_hooks["checkpoint"] = dict(type="CheckpointHook", by_epoch=True, interval=1)
    if ckpt_interval:
        default_hooks["checkpoint"] = dict(
            type="CheckpointHook", by_epoch=False, interval=ckpt_interval
        )
    return Runner(
        model=ScriptedModel(),
        work_dir=work_dir,
        train_dataloader=DataServerLoader(client),
        train_cfg=train_cfg,
        optim_wrapper=dict(optimizer=dict(type="SGD", lr=0.1)),
        default_hooks=default_hooks,
        custom_hooks=[StitcherFeedbackHook(), *hooks],
        randomness=dict(seed=0),
        resume=resume,
        load_from=load_from,
        log_level="WARNING",
        experiment_name=f"{name}-{time.monotonic_ns()}",
    )


def job_client(address: str) -> DataServerClient:
    return make_client(
        address, batch_size=4, image_size=(64, 64), seed=5, stitch_threshold=THRESHOLD
    )


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--address", required=True)
    parser.add_argument("--work-dir", required=True)
    parser.add_argument("--loop", choices=["epoch", "iter"], default="epoch")
    parser.add_argument("--length", type=int, required=True)
    parser.add_argument("--ckpt-interval", type=int, default=0)
    parser.add_argument("--record", required=True)
    parser.add_argument("--block-at", type=int, default=0)
    parser.add_argument("--resume", action="store_true")
    args = parser.parse_args()
    hooks: list[Any] = [RecordHook(args.record)]
    if args.block_at:
        hooks.append(BlockHook(args.record, args.block_at))
    with job_client(args.address) as client:
        runner = make_runner(
            client, args.work_dir, args.loop, args.length, hooks, args.ckpt_interval, args.resume
        )
        runner.train()


if __name__ == "__main__":
    main()

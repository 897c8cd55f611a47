"""Train a small detector with MMEngine's Runner on batches from dataserver, with
Stitcher's feedback steering stitching from one iteration to the next.

    pip install -e ".[mmengine]"
    python examples/mmengine_train.py --iters 40                     # starts its own server
    python examples/mmengine_train.py --servers tcp://127.0.0.1:5555 --iters 200
    python examples/mmengine_train.py --multiscale                   # sizes 192..320, every 10
    python examples/mmengine_train.py --epochs 4 --close-mosaic 1    # YOLO mosaic, then regular

The three lines that replace MMEngine's DataLoader by the servers are marked below; the
rest is an ordinary Runner config. Every iteration prints the batch's mode, the model's
small-object loss ratio and the decision ``StitcherFeedbackHook`` took from it, which the
next batch must have; the run ends with the count of batches that did not (0).

``--multiscale`` builds the client with ``image_size=MultiScale(...)`` (0.75x to 1.25x
``--image-size``, a new size every 10 iterations), passed through ``DataServerLoader`` as it
is. ``--close-mosaic N`` (with ``--epochs E``) trains YOLO-style instead of with Stitcher's
feedback: ``stitch_layout="mosaic"`` and ``CloseMosaicHook(E - N, mosaic_from_start=True)``,
mosaics for epochs 0 .. E - N - 1 and regular batches for the last N.
"""

from __future__ import annotations

import argparse
import math
import os
import sys
import tempfile
from typing import Any

import torch
from mmengine.config import Config
from mmengine.hooks import Hook
from mmengine.model import BaseModel
from mmengine.registry import HOOKS, MODELS
from mmengine.runner import Runner

from dataserver_client import DataServerClient, MultiScale
from dataserver_client.integrations.mmengine import DataServerLoader
from dataserver_client.tinydet import TinyDetector


@MODELS.register_module(force=True)
class TinyMMDetector(BaseModel):
    """``TinyDetector`` (one-level FCOS-like, CPU-sized) as an MMEngine model: it takes
    the loader's ``inputs`` and ``data_samples`` and returns its loss with Stitcher's
    small-object ratio beside it, under a key without "loss" (logged, not summed)."""

    def __init__(self, width: int = 32) -> None:
        super().__init__()
        self.detector = TinyDetector(width)

    def forward(
        self, inputs: list[torch.Tensor], data_samples: Any = None, mode: str = "tensor"
    ) -> Any:
        images = torch.stack(inputs)
        if mode != "loss":
            return self.detector(images)
        targets = [
            {"boxes": s.gt_instances.bboxes, "labels": s.gt_instances.labels} for s in data_samples
        ]
        loss, ratio = self.detector.loss(images, targets)
        return {"loss": loss, "small_object_ratio": torch.tensor(ratio)}


@HOOKS.register_module(force=True)
class PrintFeedbackHook(Hook):
    """Prints each iteration's mode, ratio and decision; counts batches whose mode is not
    the decision taken after the batch before (stale batches: there must be none)."""

    priority = "LOW"  # after StitcherFeedbackHook and CloseMosaicHook (NORMAL) decided

    def __init__(self) -> None:
        self.decided: str | None = None
        self.stale = 0
        self.counts = {"regular": 0, "stitch": 0}

    def before_train_epoch(self, runner: Any) -> None:
        self.decided = runner.train_dataloader.client.mode  # CloseMosaicHook's, if any

    def after_train_iter(
        self, runner: Any, batch_idx: int, data_batch: Any = None, outputs: Any = None
    ) -> None:
        samples = data_batch["data_samples"]
        mode = samples[0].metainfo["mode"]
        if self.decided is not None and mode != self.decided:
            self.stale += 1
        self.counts[mode] += 1
        ratio = float(outputs["small_object_ratio"])
        decision = runner.train_dataloader.client.mode
        self.decided = decision
        shown = "  n/a" if math.isnan(ratio) else f"{ratio:5.3f}"
        n_samples = sum(len(s.metainfo["indices"]) for s in samples)
        h, w = samples[0].metainfo["img_shape"]
        print(
            f"iter {runner.iter + 1:4d}  epoch {samples[0].metainfo['epoch']}  {mode:<8} {h}x{w} "
            f"{len(samples):3d} imgs {n_samples:4d} samples  loss {float(outputs['loss'].detach()):6.3f}  "
            f"ratio {shown}  -> {decision}",
            flush=True,
        )


def main() -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--iters", type=int, default=40)
    parser.add_argument(
        "--epochs", type=int, default=0, help="train E epochs (EpochBasedTrainLoop), not --iters"
    )
    parser.add_argument(
        "--multiscale", action="store_true", help="MultiScale sizes 0.75x..1.25x, every 10 iters"
    )
    parser.add_argument(
        "--close-mosaic",
        type=int,
        default=None,
        metavar="N",
        help="mosaic (stitch_layout='mosaic') until epoch E - N, then regular (needs --epochs)",
    )
    parser.add_argument(
        "--servers",
        default=os.environ.get("DATASERVER_ADDRESS"),
        help="comma-separated server addresses (default: start a local server)",
    )
    parser.add_argument("--workers", type=int, default=2, help="workers of the local server")
    parser.add_argument("--batch-size", type=int, default=8)
    parser.add_argument("--image-size", type=int, default=256)
    parser.add_argument(
        "--threshold",
        type=float,
        default=0.75,
        help="Stitcher's tau (0.1 suits COCO; the synthetic set is mostly small objects)",
    )
    parser.add_argument(
        "--work-dir", default=None, help="checkpoints and logs (default: a temp dir)"
    )
    parser.add_argument(
        "--resume", action="store_true", help="resume from --work-dir's last checkpoint"
    )
    args = parser.parse_args()
    if args.close_mosaic is not None and not 0 <= args.close_mosaic <= args.epochs:
        parser.error("--close-mosaic N needs --epochs E with 0 <= N <= E")

    proc = None
    if args.servers:
        addresses = args.servers.split(",")
    else:
        from dataserver.demo import start_server

        print(f"starting `dataserver serve --workers {args.workers}` on 1024 synthetic images ...")
        proc, address = start_server(
            ["--dataset", "synthetic:images=1024,seed=0", "--workers", str(args.workers)]
        )
        addresses = [address]
    try:
        with tempfile.TemporaryDirectory(prefix="mmengine-train-") as tmp:
            return train(args, addresses, args.work_dir or tmp)
    finally:
        if proc is not None:
            from dataserver.demo import stop_server

            stop_server(proc)


def train(args: argparse.Namespace, addresses: list[str], work_dir: str) -> int:
    torch.manual_seed(0)
    size: tuple[int, int] | MultiScale = (args.image_size, args.image_size)
    if args.multiscale:
        from train_detector import multiscale_sizes  # (this script's directory)

        size = MultiScale(multiscale_sizes(args.image_size), every=10)
    mosaic = args.close_mosaic is not None
    client = DataServerClient(
        addresses,
        batch_size=args.batch_size,
        image_size=size,  # a MultiScale goes through DataServerLoader as it is
        device="cpu",
        stitch_threshold=args.threshold,
        stitch_layout="mosaic" if mosaic else "spatial",
    )
    # Stitcher's feedback, or YOLO's schedule: mosaics, closed for the last N epochs.
    steering: list[Any] = [dict(type="StitcherFeedbackHook", ratio_key="small_object_ratio")]
    if mosaic:
        close = dict(close_epoch=args.epochs - args.close_mosaic, mosaic_from_start=True)
        steering = [dict(type="DataServerHook"), dict(type="CloseMosaicHook", **close)]
    by_epoch = args.epochs > 0
    length = args.epochs if by_epoch else args.iters
    printer = PrintFeedbackHook()
    cfg = Config(
        dict(
            model=dict(type="TinyMMDetector"),
            work_dir=work_dir,
            # What swaps MMEngine's DataLoader for the servers (with the import of
            # dataserver_client.integrations.mmengine, which registers the hook):
            train_dataloader=DataServerLoader(client),
            custom_hooks=steering,
            # The rest is an ordinary config.
            train_cfg=dict(by_epoch=True, max_epochs=length)
            if by_epoch
            else dict(by_epoch=False, max_iters=length),
            optim_wrapper=dict(optimizer=dict(type="Adam", lr=2e-3)),
            param_scheduler=[
                dict(type="LinearLR", start_factor=0.1, by_epoch=False, begin=0, end=10)
            ],
            default_hooks=dict(
                logger=dict(type="LoggerHook", interval=10),
                checkpoint=dict(
                    type="CheckpointHook", by_epoch=by_epoch, interval=max(1, length // 2)
                ),
            ),
            randomness=dict(seed=0),
            resume=args.resume,
            log_level="WARNING",
        )
    )
    runner = Runner.from_cfg(cfg)
    runner.register_hook(printer)
    loop = (
        f"EpochBasedTrainLoop for {length} epochs"
        if by_epoch
        else (f"IterBasedTrainLoop for {length} iterations")
    )
    steer = (
        f"mosaic until epoch {args.epochs - args.close_mosaic}"
        if mosaic
        else f"tau = {args.threshold}"
    )
    print(
        f"training TinyMMDetector with MMEngine's {loop}, batch {args.batch_size}, "
        f"image_size={size}, {steer}"
    )
    try:
        runner.train()
    finally:
        client.close()
    counts = printer.counts
    where = (
        f"in {work_dir}"
        if args.work_dir
        else "were in a temporary directory (--work-dir keeps them)"
    )
    print(
        f"\n{sum(counts.values())} iterations: {counts['regular']} regular, {counts['stitch']} "
        f"{'mosaic' if mosaic else 'stitched'} batches; checkpoints {where}."
    )
    print(f"every batch had the mode decided before it: {printer.stale} stale batches.")
    return 0 if printer.stale == 0 else 1


if __name__ == "__main__":
    sys.exit(main())

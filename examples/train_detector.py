"""Train a detector on batches from dataserver, steering stitching with Stitcher's feedback.

    dataserver serve --dataset coco:annotations.json:images --workers 8 &
    python examples/train_detector.py --servers tcp://127.0.0.1:5555 --epochs 2

    torchrun --nproc-per-node 4 examples/train_detector.py --servers tcp://data-0:5555,tcp://data-1:5555
    python examples/train_detector.py --multiscale --image-size 512   # 384..640, every 10 steps

With torchvision installed it trains Faster R-CNN (MobileNetV3-FPN, from scratch) and takes
Stitcher's ratio from its ROI head; without it, the small TinyDetector. Either way every
iteration ends with ``client.feedback(ratio)``, which the very next batch honours; under
torchrun the ratio is averaged over ranks so all ranks stitch together.

``--multiscale``: the client is built with ``image_size=MultiScale(sizes, every=10)`` (YOLOX's
multi-scale training: sizes from 0.75x to 1.25x ``--image-size`` in steps of 32, a new one
drawn every 10 steps, the same on every rank); the servers make each batch at its size, so
the model gets batches of changing size (both models take any size; Faster R-CNN is told
not to resize them). The run ends, on rank 0, with ``trained E epochs, N samples on R ranks,
S stale``: S counts the batches whose mode was not the one decided after the batch before,
or whose size was not the schedule's for their step (there must be none).
"""

from __future__ import annotations

import argparse
import gc
import os
import time
from typing import Any

import torch
import torch.distributed as dist
import torch.nn.functional as F

from dataserver_client import DataServerClient, MultiScale, StepSizes
from dataserver_client.stitcher import small_object_loss_ratio
from dataserver_client.tinydet import TinyDetector


class TorchvisionStitcherRatio:
    """Computes Stitcher's ratio inside a torchvision ``RoIHeads`` on each training forward:
    the smooth-L1 regression loss of every positive proposal, split by the area of the
    ground-truth box it was matched to (as the official Stitcher code does)."""

    def __init__(self, roi_heads: Any) -> None:
        self.ratio = float("nan")
        self._labels: list[torch.Tensor] = []
        self._reg_targets: list[torch.Tensor] = []
        self._areas = torch.zeros(0)
        select = roi_heads.select_training_samples

        def select_and_remember(proposals: Any, targets: Any) -> Any:
            out = select(proposals, targets)
            _, matched_idxs, labels, regression_targets = out
            areas = []
            for target, matched, lab in zip(targets, matched_idxs, labels, strict=True):
                gt = target["boxes"][matched]
                area = (gt[:, 2] - gt[:, 0]) * (gt[:, 3] - gt[:, 1])
                areas.append(area[lab > 0])
            self._labels, self._reg_targets, self._areas = (
                labels,
                regression_targets,
                torch.cat(areas),
            )
            return out

        roi_heads.select_training_samples = select_and_remember
        roi_heads.box_predictor.register_forward_hook(self._on_predictions)

    def _on_predictions(self, module: Any, inputs: Any, outputs: Any) -> None:
        if not module.training or not self._labels:
            return
        class_logits, box_regression = outputs
        labels = torch.cat(self._labels)
        targets = torch.cat(self._reg_targets)
        positive = torch.where(labels > 0)[0]
        n = class_logits.shape[0]
        per_class = box_regression.reshape(n, box_regression.size(-1) // 4, 4)
        losses = F.smooth_l1_loss(
            per_class[positive, labels[positive]], targets[positive], beta=1 / 9, reduction="none"
        )
        self.ratio = small_object_loss_ratio(losses.sum(dim=1), self._areas)
        self._labels = []


def multiscale_sizes(base: int) -> list[int]:
    """YOLOX-style sizes around ``base``: from 0.75x to 1.25x in steps of 32 (of 8 for a
    ``base`` under 256, so small test runs still change size), e.g. 384, 416, ..., 640 for 512."""
    step = 32 if base >= 256 else 8
    low = max(step, -(-base * 3 // 4 // step) * step)
    return list(range(low, base * 5 // 4 + 1, step))


def build_model(
    kind: str, image_size: tuple[int, int], device: torch.device, *, any_size: bool = False
) -> tuple[Any, Any]:
    """(model, step function ``step(net, images, targets) -> (loss, ratio)``, ``net`` the
    model or its DDP wrapper). ``any_size``: batches come at changing
    sizes (``image_size`` is the largest); Faster R-CNN must then not resize them."""
    if kind in ("auto", "fasterrcnn"):
        try:
            from torchvision.models.detection import fasterrcnn_mobilenet_v3_large_fpn
        except ImportError:
            if kind == "fasterrcnn":
                raise
        else:
            model = fasterrcnn_mobilenet_v3_large_fpn(
                weights=None,
                weights_backbone=None,
                num_classes=91,
                min_size=min(image_size),  # images arrive at their final size: no resize
                max_size=max(image_size),
                # Multi-scale: every size is final (torchvision's own switch for it, in training)
                **({"_skip_resize": True} if any_size else {}),
            ).to(device)
            probe = TorchvisionStitcherRatio(model.roi_heads)

            def step_tv(net: Any, images: torch.Tensor, targets: list[dict[str, Any]]) -> Any:
                losses = net(list(images.float().div_(255.0)), targets)
                return sum(losses.values()), probe.ratio

            return model, step_tv
    tiny = TinyDetector().to(device)
    return tiny, lambda net, images, targets: TinyDetector.loss_of(net(images), targets)


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument(
        "--servers", default=os.environ.get("DATASERVER_ADDRESS", "tcp://127.0.0.1:5555")
    )
    parser.add_argument("--epochs", type=int, default=1)
    parser.add_argument(
        "--steps", type=int, default=0, help="stop after this many steps (0: whole epochs)"
    )
    parser.add_argument("--batch-size", type=int, default=8)
    parser.add_argument("--image-size", type=int, default=512)
    parser.add_argument(
        "--multiscale",
        action="store_true",
        help="YOLOX-style sizes 0.75x..1.25x --image-size, a new one every 10 steps",
    )
    parser.add_argument("--lr", type=float, default=1e-3)
    parser.add_argument("--threshold", type=float, default=0.1, help="Stitcher's tau")
    parser.add_argument("--model", choices=["auto", "fasterrcnn", "tiny"], default="auto")
    parser.add_argument("--checkpoint", default=None, help="save/resume model + loader state here")
    parser.add_argument(
        "--metrics-port",
        type=int,
        default=None,
        help="serve the loader's Prometheus metrics on this port + LOCAL_RANK",
    )
    args = parser.parse_args()

    distributed = int(os.environ.get("WORLD_SIZE", "1")) > 1
    if distributed:
        dist.init_process_group("nccl" if torch.cuda.is_available() else "gloo")
    local_rank = int(os.environ.get("LOCAL_RANK", "0"))
    device = torch.device(f"cuda:{local_rank}" if torch.cuda.is_available() else "cpu")
    if device.type == "cuda":
        torch.cuda.set_device(device)
    size = (args.image_size, args.image_size)
    schedule = MultiScale(multiscale_sizes(args.image_size), every=10) if args.multiscale else None
    largest = schedule.stored if schedule else size
    model, step_fn = build_model(args.model, largest, device, any_size=schedule is not None)
    if distributed:
        model = torch.nn.parallel.DistributedDataParallel(model)
    optimizer = torch.optim.AdamW(model.parameters(), lr=args.lr)
    rank = dist.get_rank() if distributed else 0
    if rank == 0 and schedule is not None:
        print(f"multi-scale: image_size={schedule}", flush=True)

    with DataServerClient(
        args.servers.split(","),
        batch_size=args.batch_size,
        image_size=schedule or size,
        device=device,
        stitch_threshold=args.threshold,
        metrics_port=None if args.metrics_port is None else args.metrics_port + local_rank,
    ) as client:
        start_epoch = 0
        # One loader file for the whole job: state_dict() gathers every rank's position, so
        # any number of ranks can resume from it (elastic resume).
        loader_file = f"{args.checkpoint}.loader"
        if args.checkpoint and os.path.exists(args.checkpoint) and os.path.exists(loader_file):
            state = torch.load(args.checkpoint, map_location="cpu", weights_only=False)
            model.load_state_dict(state["model"])
            optimizer.load_state_dict(state["optimizer"])
            loader_state = torch.load(loader_file, weights_only=False)
            client.load_state_dict(loader_state)
            start_epoch = loader_state["epoch"]
        steps = total = stale = epochs = 0
        decided, sizing = client.mode, client.image_size  # (a loaded state's, if resumed)
        for epoch in range(start_epoch, args.epochs):
            client.set_epoch(epoch)
            epochs += 1
            t0, samples = time.perf_counter(), 0
            for batch in client:
                # Stale: not the mode decided after the batch before, or not the scheduled size.
                planned = (
                    sizing.size_at(client.config.seed, epoch, batch.step)
                    if isinstance(sizing, MultiScale | StepSizes)
                    else sizing
                )
                stale += batch.mode != decided or tuple(batch.image_size) != tuple(planned)
                # (through ``model``: under DDP its forward is what averages the gradients)
                loss, ratio = step_fn(model, batch.images, batch.targets)
                optimizer.zero_grad(set_to_none=True)
                loss.backward()
                optimizer.step()
                mode = decided = client.feedback(ratio)  # NaN (no positives) keeps regular mode
                samples += batch.num_samples
                total += batch.num_samples
                steps += 1
                if rank == 0 and batch.step % 10 == 0:
                    rate = samples / (time.perf_counter() - t0)
                    h, w = batch.image_size
                    print(
                        f"epoch {epoch} step {batch.step:5d} {batch.mode:<7} {h}x{w} "
                        f"loss {loss.item():.3f} ratio {ratio:.3f} next {mode:<7} "
                        f"{rate:.0f} samples/s",
                        flush=True,
                    )
                if args.checkpoint and batch.step % 100 == 0:
                    loader_state = client.state_dict()  # collective: every rank calls it
                    if rank == 0:
                        torch.save(loader_state, loader_file)
                        state = {"model": model.state_dict(), "optimizer": optimizer.state_dict()}
                        torch.save(state, args.checkpoint)
                if args.steps and steps >= args.steps:
                    break
            if args.steps and steps >= args.steps:
                break
    counts = torch.tensor([total, stale], dtype=torch.int64, device=device)
    world = dist.get_world_size() if distributed else 1
    if distributed:
        dist.all_reduce(counts)
    if rank == 0:
        n, s = (int(v) for v in counts.tolist())
        print(f"trained {epochs} epochs, {n} samples on {world} ranks, {s} stale", flush=True)
    if distributed:
        # DDP's reducer holds the process group: dropped here, the group goes with
        # destroy_process_group(), not at interpreter exit, where gloo's threads can abort
        # the process ("terminate called without an active exception", seen in the Slurm
        # tests after the run's last line). Every rank done before any tears down.
        del model, optimizer, step_fn
        gc.collect()
        dist.barrier()
        dist.destroy_process_group()


if __name__ == "__main__":
    main()

"""Train the tiny detector with Ray Train on a data tier of Ray actors, steering stitching
with Stitcher's feedback; checkpoints carry the loader's state, so a run resumes mid-epoch.

    pip install -e ".[ray]"
    ray start --head --num-cpus 4                                   # the trainers' node
    ray start --address HEAD:6379 --resources '{"data": 1}'         # on each data node
    python examples/ray_train.py --servers 2 --server-workers 8 --trainers 4 --epochs 2 \\
        --dataset coco:/data/annotations.json:/data/images --resources '{"data": 1}'
    python examples/ray_train.py --epochs 3 --resume                # continue the last run

The data tier (``DataTier``, tier name ``--tier``) is found if it runs already, else started
here (and shut down at the end). ``TorchTrainer`` runs ``--trainers`` workers (gloo on CPU,
NCCL with ``--gpu``); each builds ``DataServerClient("ray://TIER", ...)`` with the rank and
world size of ``ray.train.get_context()``, trains, and calls ``client.feedback(ratio)``
after every step (averaged over the ranks: all ranks stitch together). Every
``--checkpoint-every`` steps, at the end of each epoch and where the run stops (``--steps``),
the ranks report a ``ray.train.Checkpoint`` holding the model, the optimizer and
``client.state_dict()`` (a collective: every rank's position). The checkpoint is picked up by
``ray.train.get_checkpoint()`` when Ray Train restarts failed workers, and by ``--resume``,
which runs the same run name (``--name``) again: Ray Train restores the run's latest
checkpoint and the loader continues with exactly the samples not yet delivered.

Rank 0 ends with ``trained E epochs, N samples on R ranks, S stale`` (S: batches whose mode
was not the one decided after the batch before; there must be none), and so does the driver.
``--record DIR``: every rank appends each batch's indices to ``DIR/rank-R.jsonl``.
"""

from __future__ import annotations

import os

# Ray Train V2 (Ray >= 2.43; the default in recent releases): a run started again under the
# same name restores its last checkpoint, which --resume relies on. Passed on to the workers.
os.environ.setdefault("RAY_TRAIN_V2_ENABLED", "1")

import argparse
import json
import sys
import tempfile
from pathlib import Path
from typing import Any

import ray
import ray.train
import ray.train.torch
import torch
import torch.distributed as dist
from ray.train import Checkpoint, RunConfig, ScalingConfig
from ray.train.torch import TorchTrainer
from torch import nn

from dataserver_client import DataServerClient
from dataserver_client.integrations.ray import DataTier
from dataserver_client.tinydet import TinyDetector


class DetectorLoss(nn.Module):
    """The detector's loss as the module's forward, so DDP sees the forward it wraps."""

    def __init__(self) -> None:
        super().__init__()
        self.detector = TinyDetector()

    def forward(self, images: torch.Tensor, targets: list[dict[str, torch.Tensor]]) -> Any:
        return self.detector.loss(images, targets)


def _unwrapped(model: nn.Module) -> nn.Module:
    """The model inside ``prepare_model``'s DistributedDataParallel, if it wrapped it."""
    if isinstance(model, nn.parallel.DistributedDataParallel):
        return model.module
    return model


def _save(
    model: nn.Module, optimizer: torch.optim.Optimizer, loader: dict[str, Any], out: Path
) -> None:
    inner = _unwrapped(model)
    state = {"model": inner.state_dict(), "optimizer": optimizer.state_dict()}
    torch.save(state, out / "model.pt")
    torch.save(loader, out / "loader.pt")


def _restore(model: nn.Module, optimizer: torch.optim.Optimizer, client: DataServerClient) -> int:
    """Load Ray Train's checkpoint of this run, if it has one; the epoch to start at."""
    checkpoint = ray.train.get_checkpoint()
    if checkpoint is None:
        return 0
    with checkpoint.as_directory() as where:
        state = torch.load(Path(where) / "model.pt", map_location="cpu", weights_only=False)
        loader = torch.load(Path(where) / "loader.pt", weights_only=False)
    inner = _unwrapped(model)
    inner.load_state_dict(state["model"])
    optimizer.load_state_dict(state["optimizer"])
    client.load_state_dict(loader)
    return int(loader["epoch"])


def _report(
    metrics: dict[str, Any],
    model: nn.Module,
    optimizer: torch.optim.Optimizer,
    client: DataServerClient,
) -> None:
    """Every rank: the loader's state (collective), then one checkpoint from rank 0."""
    loader = client.state_dict()
    if ray.train.get_context().get_world_rank() != 0:
        ray.train.report(metrics)
        return
    with tempfile.TemporaryDirectory() as tmp:
        _save(model, optimizer, loader, Path(tmp))
        ray.train.report(metrics, checkpoint=Checkpoint.from_directory(tmp))


def train_loop(config: dict[str, Any]) -> None:
    """One Ray Train worker: a client of the tier, the tiny detector, Stitcher's feedback."""
    ctx = ray.train.get_context()
    rank, world = ctx.get_world_rank(), ctx.get_world_size()
    device = ray.train.torch.get_device()
    model = ray.train.torch.prepare_model(DetectorLoss())
    optimizer = torch.optim.AdamW(model.parameters(), lr=config["lr"])
    record = None
    if config.get("record"):
        Path(config["record"]).mkdir(parents=True, exist_ok=True)
        record = open(Path(config["record"]) / f"rank-{rank}.jsonl", "a")  # noqa: SIM115
    size = (config["image_size"], config["image_size"])
    with DataServerClient(
        config["address"],
        batch_size=config["batch_size"],
        image_size=size,
        rank=rank,
        world_size=world,
        device=device,
        stitch_threshold=config["threshold"],
        discovery_interval=config["discovery_interval"],
        timeout=config["timeout"],
    ) as client:
        start_epoch = _restore(model, optimizer, client)
        steps = total = stale = epochs = 0
        decided = client.mode  # (a loaded state's, if resumed)
        stopped = False
        for epoch in range(start_epoch, config["epochs"]):
            client.set_epoch(epoch)
            epochs += 1
            for batch in client:
                stale += batch.mode != decided
                loss, ratio = model(batch.images, batch.targets)
                optimizer.zero_grad(set_to_none=True)
                loss.backward()
                optimizer.step()
                decided = client.feedback(ratio)  # NaN (no positives) keeps the mode
                total += batch.num_samples
                steps += 1
                if record is not None:
                    seen = {"epoch": epoch, "step": batch.step, "mode": batch.mode}
                    seen["indices"] = [[int(i) for i in image] for image in batch.indices]
                    record.write(json.dumps(seen) + "\n")
                    record.flush()
                if rank == 0 and batch.step % 10 == 0:
                    print(
                        f"epoch {epoch} step {batch.step:4d} {batch.mode:<7} "
                        f"loss {loss.item():.3f} ratio {ratio:.3f} next {decided}",
                        flush=True,
                    )
                stopped = bool(config["steps"]) and steps >= config["steps"]
                every = config["checkpoint_every"]
                if stopped:
                    break
                if every and steps % every == 0:
                    metrics = {"epoch": epoch, "step": batch.step, "samples": total}
                    _report({**metrics, "stale": stale}, model, optimizer, client)
            if stopped:
                break
            client.set_epoch(epoch + 1)  # the state after a whole epoch starts the next one
            if epoch + 1 < config["epochs"]:
                metrics = {"epoch": epoch, "samples": total, "stale": stale}
                _report(metrics, model, optimizer, client)
        counts = torch.tensor([total, stale], dtype=torch.int64, device=device)
        if dist.is_initialized():
            dist.all_reduce(counts)
        n, s = (int(v) for v in counts.tolist())
        line = f"trained {epochs} epochs, {n} samples on {world} ranks, {s} stale"
        if rank == 0:
            print(line, flush=True)
        # The last checkpoint: where this run stopped (a whole run: the next epoch's start).
        summary = {"summary": line, "samples_all": n, "stale_all": s, "epochs_run": epochs}
        _report({"samples": total, "stale": stale, **summary}, model, optimizer, client)
    if record is not None:
        record.close()


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument("--address", default=None, help="Ray cluster (default: ray.init's own)")
    p.add_argument("--tier", default="dataserver", help="the data tier's name")
    p.add_argument("--servers", type=int, default=2, help="servers, when the tier is started")
    p.add_argument("--server-workers", type=int, default=2, help="worker processes per server")
    p.add_argument("--dataset", default="synthetic:images=512,seed=0")
    p.add_argument("--dataset-args", default=None, help="JSON, for a package.module:factory")
    p.add_argument("--resources", default=None, help='per server, JSON: {"data": 1}')
    p.add_argument("--serve-arg", action="append", default=[], help="more `serve` flags")
    p.add_argument("--trainers", type=int, default=2, help="Ray Train workers")
    p.add_argument("--gpu", action="store_true")
    p.add_argument("--epochs", type=int, default=1)
    p.add_argument("--steps", type=int, default=0, help="stop after this many steps (0: none)")
    p.add_argument("--batch-size", type=int, default=8)
    p.add_argument("--image-size", type=int, default=128)
    p.add_argument("--lr", type=float, default=1e-3)
    p.add_argument("--threshold", type=float, default=0.1, help="Stitcher's tau")
    p.add_argument("--checkpoint-every", type=int, default=50, help="steps (0: epochs only)")
    p.add_argument("--discovery-interval", type=float, default=5.0)
    p.add_argument("--timeout", type=float, default=60.0)
    p.add_argument("--storage", default=str(Path.home() / "ray_results"))
    p.add_argument("--name", default="dataserver-ray-train", help="the run's name")
    p.add_argument("--resume", action="store_true", help="continue the run --name")
    p.add_argument("--record", default=None, help="append each batch's indices here")
    return p.parse_args(argv)


def tier_for(args: argparse.Namespace) -> tuple[DataTier, bool]:
    """The running tier ``--tier``, or a new one (True: started here, to shut down)."""
    try:
        return DataTier.get(args.tier), False
    except ValueError:
        pass
    tier = DataTier.start(
        args.tier,
        servers=args.servers,
        workers=args.server_workers,
        dataset=args.dataset,
        dataset_args=json.loads(args.dataset_args) if args.dataset_args else None,
        resources=json.loads(args.resources) if args.resources else None,
        serve_args=args.serve_arg,
    )
    return tier, True


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    run_dir = Path(args.storage) / args.name
    if run_dir.exists() and not args.resume:
        print(f"{run_dir} exists: --resume continues it, --name starts another", file=sys.stderr)
        return 2
    if not ray.is_initialized():
        ray.init(address=args.address)
    tier, own = tier_for(args)
    print(f"data tier {tier.address}: {', '.join(tier.addresses())}", flush=True)
    config = {
        "address": tier.address,
        **{k: getattr(args, k) for k in ("epochs", "steps", "batch_size", "image_size", "lr")},
        "threshold": args.threshold,
        "checkpoint_every": args.checkpoint_every,
        "discovery_interval": args.discovery_interval,
        "timeout": args.timeout,
        "record": args.record,
    }
    trainer = TorchTrainer(
        train_loop,
        train_loop_config=config,
        scaling_config=ScalingConfig(num_workers=args.trainers, use_gpu=args.gpu),
        run_config=RunConfig(name=args.name, storage_path=os.path.abspath(args.storage)),
    )
    try:
        result = trainer.fit()
    finally:
        if own:
            tier.shutdown()
    if result.error is not None:
        print(f"training failed: {result.error}", file=sys.stderr)
        return 1
    print((result.metrics or {}).get("summary", "no summary reported"), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())

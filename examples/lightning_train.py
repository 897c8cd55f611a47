"""Train a small detector with PyTorch Lightning on batches from dataserver.

    pip install -e ".[lightning]"
    python examples/lightning_train.py --epochs 2                       # starts its own servers
    python examples/lightning_train.py --epochs 2 --devices 2           # DDP on CPU (gloo)
    python examples/lightning_train.py --servers tcp://127.0.0.1:5555 --val tcp://127.0.0.1:5557
    python examples/lightning_train.py --epochs 2 --ckpt-dir ckpts --save-every 5 --stop-after 5
    python examples/lightning_train.py --epochs 2 --ckpt ckpts/epoch=0-step=5.ckpt   # resume

``DataServerDataModule`` replaces the DataModule's DataLoaders (marked below); the rest is an
ordinary Lightning script. ``--devices N`` runs N ranks under Lightning's own DDP strategy
(on CPU: gloo), each rank training its shard. ``--save-every K`` saves a checkpoint every K
steps (``ModelCheckpoint``), ``--stop-after K`` stops the fit after K steps (an interrupted
run), ``--ckpt PATH`` resumes from a checkpoint: the interrupted epoch goes on with exactly
the samples it had not trained on. The optimizer's ``OneCycleLR`` reads
``trainer.estimated_stepping_batches`` (what drops a stateful loader's state in Lightning
issue #20550; not this DataModule's). ``--feedback`` steers stitching with Stitcher's rule
from each step's loss. ``--record PATH`` writes every batch's indices to
``PATH.rank<R>.jsonl``.

The run ends, on rank 0, with ``trained E epochs, N samples on R ranks, S stale``: the epochs
this run trained in, the samples all ranks trained on, and the batches whose mode was not the
one decided after the batch before (there must be none).
"""

from __future__ import annotations

import argparse
import json
import os
from typing import Any

import pytorch_lightning as pl
import torch

from dataserver_client.integrations.lightning import DataServerDataModule
from dataserver_client.tinydet import TinyDetector

TRAIN_ENV, VAL_ENV = "DATASERVER_LIGHTNING_TRAIN", "DATASERVER_LIGHTNING_VAL"


class TinyLightningDetector(pl.LightningModule):
    """``TinyDetector`` as a LightningModule: its ``training_step`` takes a ``Batch``."""

    def __init__(self, lr: float, feedback: bool, record: str | None) -> None:
        super().__init__()
        self.detector = TinyDetector()
        self.lr = lr
        self.feedback = feedback
        self.record = record
        self.decided = "regular"
        self.samples = self.stale = 0
        self.epochs_seen: set[int] = set()
        self.summary: list[int] = []

    def datamodule(self) -> DataServerDataModule:
        dm = getattr(self.trainer, "datamodule", None)  # (set by Lightning at fit)
        if not isinstance(dm, DataServerDataModule):
            raise TypeError("train with datamodule=DataServerDataModule(...)")
        return dm

    def _write(self, kind: str, batch: Any) -> None:
        if self.record:
            line = {"kind": kind, "epoch": batch.epoch, "step": batch.step, "mode": batch.mode}
            line["indices"] = batch.indices
            with open(f"{self.record}.rank{self.global_rank}.jsonl", "a") as f:
                f.write(json.dumps(line) + "\n")

    def on_train_start(self) -> None:
        client = self.datamodule().client
        if client is not None:
            self.decided = client.mode  # a resumed run goes on in the checkpoint's mode

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        self.stale += batch.mode != self.decided
        loss, ratio = TinyDetector.loss_of(self.detector(batch.images), batch.targets)
        client = self.datamodule().client
        if self.feedback and client is not None:
            self.decided = client.feedback(ratio)  # honoured by the very next batch
        self.samples += batch.num_samples
        self.epochs_seen.add(batch.epoch)
        self._write("train", batch)
        self.log("loss", loss, batch_size=len(batch), prog_bar=True)
        return loss

    def validation_step(self, batch: Any, batch_idx: int) -> None:
        loss, _ = TinyDetector.loss_of(self.detector(batch.images), batch.targets)
        self._write("sanity" if self.trainer.sanity_checking else "val", batch)
        self.log("val_loss", loss, batch_size=len(batch), sync_dist=True)

    def on_train_end(self) -> None:
        counts = torch.tensor([self.samples, self.stale], dtype=torch.int64)
        total = self.trainer.strategy.reduce(counts, reduce_op="sum")
        self.summary = [len(self.epochs_seen), *(int(v) for v in total.tolist())]

    def configure_optimizers(self) -> Any:
        optimizer = torch.optim.AdamW(self.parameters(), lr=self.lr)
        total = int(self.trainer.estimated_stepping_batches)
        schedule = torch.optim.lr_scheduler.OneCycleLR(optimizer, self.lr, total_steps=total)
        return {"optimizer": optimizer, "lr_scheduler": {"scheduler": schedule, "interval": "step"}}


class StopAfter(pl.Callback):
    """Stop the fit after ``steps`` optimizer steps (on every rank), as a job that is
    interrupted right after a checkpoint."""

    def __init__(self, steps: int) -> None:
        self.steps = steps

    def on_train_batch_end(self, trainer: pl.Trainer, *args: Any) -> None:
        if trainer.global_step >= self.steps:
            trainer.should_stop = True


def start_servers(args: argparse.Namespace) -> list[Any]:
    """Local servers for the train (and, with ``--val-images``, the val) set; their
    addresses go to the ranks Lightning starts through the environment."""
    from dataserver.demo import start_server

    procs = []
    spec = f"synthetic:images={args.images},seed=0"
    proc, address = start_server(["--dataset", spec, "--workers", str(args.workers)])
    procs.append(proc)
    os.environ[TRAIN_ENV] = address
    if args.val_images:
        spec = f"synthetic:images={args.val_images},seed=1"
        proc, address = start_server(["--dataset", spec, "--workers", "1"])
        procs.append(proc)
        os.environ[VAL_ENV] = address
    return procs


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--servers", help="train server addresses, comma-separated")
    parser.add_argument("--val", help="val server addresses, comma-separated")
    parser.add_argument("--epochs", type=int, default=1)
    parser.add_argument("--devices", type=int, default=1, help="ranks (DDP on CPU with >1)")
    parser.add_argument("--batch-size", type=int, default=8)
    parser.add_argument("--image-size", type=int, default=128)
    parser.add_argument("--images", type=int, default=256, help="local train server's images")
    parser.add_argument("--val-images", type=int, default=32, help="local val server's (0: none)")
    parser.add_argument("--workers", type=int, default=2, help="workers of the local server")
    parser.add_argument("--lr", type=float, default=1e-3)
    parser.add_argument("--feedback", action="store_true", help="Stitcher's feedback each step")
    parser.add_argument("--threshold", type=float, default=0.1, help="Stitcher's tau")
    parser.add_argument("--ckpt", help="resume from this checkpoint")
    parser.add_argument("--ckpt-dir", help="save checkpoints here (with --save-every)")
    parser.add_argument("--save-every", type=int, default=0, help="checkpoint every K steps")
    parser.add_argument("--stop-after", type=int, default=0, help="stop after K steps")
    parser.add_argument("--record", help="write each batch's indices to RECORD.rank<R>.jsonl")
    args = parser.parse_args()

    procs: list[Any] = []
    launched = "LOCAL_RANK" in os.environ  # a rank Lightning (or torchrun) started
    if not args.servers and not launched and TRAIN_ENV not in os.environ:
        print(f"starting local servers ({args.images} train, {args.val_images} val images)")
        procs = start_servers(args)
    train = args.servers or os.environ.get(TRAIN_ENV)
    val = args.val or os.environ.get(VAL_ENV)
    if not train:
        parser.error("--servers is required in a rank started by a launcher")
    try:
        run(args, train.split(","), val.split(",") if val else None)
    finally:
        from dataserver.demo import stop_server

        for proc in procs:
            stop_server(proc)


def run(args: argparse.Namespace, train: list[str], val: list[str] | None) -> None:
    torch.manual_seed(0)
    # The DataModule in place of DataLoaders: each rank's client is built in setup().
    dm = DataServerDataModule(
        train,
        val=val,
        batch_size=args.batch_size,
        image_size=(args.image_size,) * 2,
        stitch_threshold=args.threshold,
    )
    model = TinyLightningDetector(args.lr, args.feedback, args.record)
    callbacks: list[pl.Callback] = []
    if args.save_every:
        callbacks.append(
            pl.callbacks.ModelCheckpoint(
                dirpath=args.ckpt_dir, every_n_train_steps=args.save_every, save_top_k=-1
            )
        )
    if args.stop_after:
        callbacks.append(StopAfter(args.stop_after))
    trainer = pl.Trainer(
        accelerator="cpu",
        devices=args.devices,
        strategy="ddp" if args.devices > 1 else "auto",
        max_epochs=args.epochs,
        callbacks=callbacks,
        enable_checkpointing=bool(args.save_every),
        logger=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        log_every_n_steps=1,
    )
    trainer.fit(model, datamodule=dm, ckpt_path=args.ckpt)
    if trainer.global_rank == 0:
        epochs, samples, stale = model.summary
        ranks = trainer.world_size
        print(f"trained {epochs} epochs, {samples} samples on {ranks} ranks, {stale} stale")
        # Lightning's DDP launcher started the other ranks from this process: wait for them.
        for proc in getattr(trainer.strategy.launcher, "procs", []):
            proc.wait(120)


if __name__ == "__main__":
    main()

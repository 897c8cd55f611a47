"""Train RF-DETR with its own trainer on batches from dataserver.

    pip install -e ".[rfdetr]"
    python examples/rfdetr_train.py --epochs 2                  # starts its own servers
    python examples/rfdetr_train.py --train tcp://127.0.0.1:5555 --val tcp://127.0.0.1:5557
    python examples/rfdetr_train.py --epochs 4 --output runs/rfdetr --resume   # goes on
    python examples/rfdetr_train.py --checkpoint-every 5 ...   # also mid-epoch checkpoints

``train_rfdetr(model, train, val, **kwargs)`` in place of ``model.train(dataset_dir=...,
**kwargs)``: RF-DETR's Lightning module, trainer, callbacks (checkpoints, its COCO
evaluation) and post-fit steps, the batches made by the servers (stretched to its
resolution, ImageNet-normalized, normalized cxcywh boxes, class indices, original sizes).
A random-init ``RFDETRNano`` (``pretrain_weights=None``: no download). Without
``--train``/``--val`` it starts two pools on the built-in synthetic set.
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")  # build from a config, download nothing


def start_server(dataset: str, workers: int) -> tuple[subprocess.Popen[str], str]:
    """A ``dataserver serve`` on a free port; (process, data address) once it is ready."""
    from dataserver.server import parse_ready_line

    cmd = [sys.executable, "-m", "dataserver.cli", "serve", "--dataset", dataset]
    cmd += ["--workers", str(workers), "--bind", "tcp://127.0.0.1:0"]
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, text=True)
    assert proc.stdout is not None
    for line in proc.stdout:
        if line.startswith("dataserver ready"):
            return proc, parse_ready_line(line)["data"]
    raise SystemExit(f"dataserver serve --dataset {dataset} did not start")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--train", help="train pool address (default: start one)")
    parser.add_argument("--val", help="val pool address (default: start one)")
    parser.add_argument("--images", type=int, default=64, help="train images of own servers")
    parser.add_argument("--workers", type=int, default=2, help="worker processes a server")
    parser.add_argument("--epochs", type=int, default=2)
    parser.add_argument("--resolution", type=int, default=128, help="a multiple of 32")
    parser.add_argument("--batch", type=int, default=4)
    parser.add_argument("--accum", type=int, default=1, help="grad_accum_steps")
    parser.add_argument("--lr", type=float, default=1e-4)
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--output", default="runs/rfdetr")
    parser.add_argument("--resume", action="store_true", help="from OUTPUT/last.ckpt")
    parser.add_argument(
        "--checkpoint-every", type=int, default=0, help="also a mid-epoch checkpoint every N steps"
    )
    args = parser.parse_args()

    from pytorch_lightning.callbacks import ModelCheckpoint
    from rfdetr import RFDETRNano

    from dataserver_client.integrations.rfdetr import train_rfdetr

    servers: list[subprocess.Popen[str]] = []
    try:
        train, val = args.train, args.val
        if train is None:
            proc, train = start_server(f"synthetic:images={args.images},seed=0", args.workers)
            servers.append(proc)
        if val is None:
            proc, val = start_server(f"synthetic:images={max(8, args.images // 4)},seed=1", 1)
            servers.append(proc)
        model = RFDETRNano(pretrain_weights=None)
        # --resume: from the newer of RF-DETR's last.ckpt (epoch ends) and mid.ckpt
        saved = [Path(args.output) / name for name in ("last.ckpt", "mid.ckpt")]
        found = [path for path in saved if path.exists()]
        last = max(found, key=lambda path: path.stat().st_mtime) if found else None
        extra = []
        if args.checkpoint_every:  # mid-epoch checkpoints, with the client's position
            extra.append(
                ModelCheckpoint(
                    dirpath=args.output,
                    filename="mid",
                    every_n_train_steps=args.checkpoint_every,
                    enable_version_counter=False,
                )
            )
        train_rfdetr(  # <- the served data: every other argument is RF-DETR's own
            model,
            train,
            val=val,
            epochs=args.epochs,
            batch_size=args.batch,
            grad_accum_steps=args.accum,
            resolution=args.resolution,
            lr=args.lr,
            device=args.device,
            output_dir=args.output,
            resume=str(last) if args.resume and last is not None else None,
            run_test=False,
            trainer_callbacks=extra,
        )
        print("classes:", model.model.class_names)
    finally:
        for proc in servers:
            proc.terminate()
            proc.wait(30)


if __name__ == "__main__":
    main()

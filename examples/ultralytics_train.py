"""Train Ultralytics YOLO on served data: ``YOLO(cfg).train(trainer=DataServerTrainer, ...)``.

    pip install -e ".[ultralytics]"        # on the trainer host (the servers need no ultralytics)
    python examples/ultralytics_train.py                  # starts a train and a val server itself
    python examples/ultralytics_train.py --train tcp://data-0:5555 --val tcp://data-1:5555
    python examples/ultralytics_train.py --epochs 3 --close-mosaic 1 --imgsz 128 --batch 16

Without ``--train``/``--val`` it starts two ``dataserver serve`` pools on the built-in
synthetic set (``--images`` train images, a quarter as many for val), whose labels are
1..80: ``names`` in DATA gives their 80 classes (a dataset that announces its categories
needs none). The one line that replaces Ultralytics' data pipeline is marked below; the
rest is how Ultralytics users train. Mosaics until epoch ``epochs - close_mosaic``, regular
batches after; the run ends with ``trained E epochs, N samples on R ranks, S stale``: S
counts the batches whose mode was not their epoch's (mosaic before the close, regular from
it on: there must be none).

The synthetic set has no ``augment_composed``: to train with Ultralytics' augmentation,
serve a dataset whose ``augment_composed`` is ``dataserver.data.yolo.YoloAugment`` built from
``params["control"]`` (the hyperparameters this trainer sends; ``tests/plugins/ds_plugins.py``
``YoloSynthetic`` is one).
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
from typing import Any

os.environ.setdefault("YOLO_OFFLINE", "1")  # build from yaml, download nothing


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
    parser.add_argument("--images", type=int, default=256, help="train images of own servers")
    parser.add_argument("--workers", type=int, default=2, help="worker processes a server")
    parser.add_argument("--model", default="yolov8n.yaml")
    parser.add_argument("--epochs", type=int, default=3)
    parser.add_argument("--close-mosaic", type=int, default=1)
    parser.add_argument("--imgsz", type=int, default=128)
    parser.add_argument("--batch", type=int, default=16)
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--project", default="runs/dataserver")
    args = parser.parse_args()

    from ultralytics import YOLO

    from dataserver_client.integrations.ultralytics import DataServerTrainer

    servers: list[subprocess.Popen[str]] = []
    try:
        train, val = args.train, args.val
        if train is None:
            proc, train = start_server(f"synthetic:images={args.images},seed=0", args.workers)
            servers.append(proc)
        if val is None:
            proc, val = start_server(f"synthetic:images={max(8, args.images // 4)},seed=1", 1)
            servers.append(proc)
        data = {"train": train, "val": val, "names": [f"class{i}" for i in range(1, 81)]}

        counts = {"samples": 0, "stale": 0}
        epochs: set[int] = set()

        def on_batch_end(trainer: Any) -> None:
            batch = trainer.train_loader.last_batch
            closed = trainer.epoch >= trainer.epochs - trainer.args.close_mosaic
            counts["samples"] += batch.num_samples
            counts["stale"] += batch.mode != ("regular" if closed else "stitch")
            epochs.add(trainer.epoch)

        model = YOLO(args.model)
        model.add_callback("on_train_batch_end", on_batch_end)
        model.train(
            trainer=DataServerTrainer,  # <- the served data: everything else is Ultralytics'
            data=data,
            epochs=args.epochs,
            close_mosaic=args.close_mosaic,
            imgsz=args.imgsz,
            batch=args.batch,
            device=args.device,
            amp=args.device != "cpu",
            plots=False,
            project=os.path.abspath(args.project),
            name="train",
            exist_ok=True,
        )
        world = int(os.environ.get("WORLD_SIZE", "1"))
        print(
            f"trained {len(epochs)} epochs, {counts['samples']} samples on {world} "
            f"ranks, {counts['stale']} stale",
            flush=True,
        )
    finally:
        for proc in servers:
            proc.terminate()
            proc.wait(10)


if __name__ == "__main__":
    main()

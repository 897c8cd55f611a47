"""Train RT-DETR with Hugging Face's ``Trainer`` on batches from dataserver.

    pip install -e ".[transformers]"
    python examples/transformers_train.py --epochs 2                  # starts its own servers
    python examples/transformers_train.py --train tcp://127.0.0.1:5555 --val tcp://127.0.0.1:5557
    python examples/transformers_train.py --epochs 2 --save-steps 5 --output runs/hf
    python examples/transformers_train.py --epochs 2 --output runs/hf --resume   # goes on

As the object-detection guide trains, with ``DataServerTrainer`` in place of ``Trainer`` and
pool addresses in place of datasets and collate: the image processor's resize runs on the
servers, its rescale/normalization on the device, labels come as the processor makes them,
``id2label`` from the dataset's categories, and ``evaluate()`` reports COCO mAP in original
pixels. A random-init RT-DETR (``RTDetrConfig``, a small ResNet backbone by default; no
download). Without ``--train``/``--val`` it starts two pools on the built-in synthetic set.
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
from typing import Any

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
    parser.add_argument("--images", type=int, default=128, help="train images of own servers")
    parser.add_argument("--workers", type=int, default=2, help="worker processes a server")
    parser.add_argument("--epochs", type=float, default=2)
    parser.add_argument("--size", type=int, default=320, help="the processor's square size")
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--lr", type=float, default=1e-4)
    parser.add_argument("--output", default="runs/transformers")
    parser.add_argument("--save-steps", type=int, default=0, help="checkpoint every N steps")
    parser.add_argument("--resume", action="store_true", help="from the last checkpoint")
    args = parser.parse_args()

    from transformers import (
        RTDetrConfig,
        RTDetrForObjectDetection,
        RTDetrImageProcessor,
        RTDetrResNetConfig,
        TrainingArguments,
    )

    from dataserver_client import DataServerClient
    from dataserver_client.integrations.transformers import DataServerTrainer

    servers: list[subprocess.Popen[str]] = []
    try:
        train, val = args.train, args.val
        if train is None:
            proc, train = start_server(f"synthetic:images={args.images},seed=0", args.workers)
            servers.append(proc)
        if val is None:
            proc, val = start_server(f"synthetic:images={max(8, args.images // 4)},seed=1", 1)
            servers.append(proc)
        with DataServerClient(train, batch_size=1, image_size=(32, 32)) as probe:
            classes = len(probe.categories) or 80  # the head's size: the dataset's categories
        backbone_kw: dict[str, Any] = dict(
            embedding_size=32,
            hidden_sizes=[32, 64, 128, 128],
            depths=[1, 1, 1, 1],
            layer_type="basic",
            out_features=["stage2", "stage3", "stage4"],
        )
        config_kw: dict[str, Any] = dict(
            backbone_config=RTDetrResNetConfig(**backbone_kw),
            use_pretrained_backbone=False,
            encoder_in_channels=[64, 128, 128],
            encoder_hidden_dim=64,
            decoder_in_channels=[64, 64, 64],
            d_model=64,
            encoder_ffn_dim=128,
            decoder_ffn_dim=128,
            decoder_layers=2,
            num_queries=50,
            num_labels=classes,
        )
        model = RTDetrForObjectDetection(RTDetrConfig(**config_kw))
        processor = RTDetrImageProcessor(size={"height": args.size, "width": args.size})
        training = TrainingArguments(
            output_dir=args.output,
            num_train_epochs=args.epochs,
            per_device_train_batch_size=args.batch,
            per_device_eval_batch_size=args.batch,
            learning_rate=args.lr,
            logging_steps=5,
            eval_strategy="epoch",
            save_strategy="steps" if args.save_steps else "no",
            save_steps=args.save_steps or 500,
            report_to=[],
        )
        trainer = DataServerTrainer(  # <- the served data: everything else is the guide's
            model=model, args=training, train=train, val=val, image_processor=processor
        )
        try:
            trainer.train(resume_from_checkpoint=True if args.resume else None)
            print(trainer.evaluate())
        finally:
            trainer.close()
    finally:
        for proc in servers:
            proc.terminate()
            proc.wait(30)


if __name__ == "__main__":
    main()

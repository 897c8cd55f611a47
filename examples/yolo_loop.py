"""A YOLO-style training loop: mosaic from the first epoch, closed for the last N epochs
(Ultralytics' ``close_mosaic``), optionally multi-scale, on batches from dataserver.

    python examples/yolo_loop.py --epochs 4 --close-mosaic 1            # starts its own server
    python examples/yolo_loop.py --servers tcp://127.0.0.1:5555 --epochs 300 --close-mosaic 10 \\
        --image-size 640 --multiscale

The client is built with ``stitch_layout="mosaic"``: in ``"stitch"`` mode every image is a
YOLO mosaic of 4 samples around a random centre, each randomly scaled, cropped to the image
size, boxes clipped and degenerate ones dropped (made on the servers, randomness from
(seed, epoch, indices)). The loop turns it on with ``client.set_mode("stitch")`` before the
first epoch and off with ``client.set_mode("regular")`` before epoch E - N: the very next
batch is regular, on every worker, with no loader to rebuild (the switch that does not reach
persistent DataLoader workers). A mosaic epoch holds each sample once, 4 to an image, so it
has a quarter of a regular epoch's batches.

Each epoch prints the share of its batches that were mosaics (100 % before the close, 0 %
after); the run ends with ``trained E epochs, N samples on R ranks, S stale``, S counting the
batches not in their epoch's mode or not at their step's scheduled size (there must be none).
The model is ``TinyDetector`` (CPU-sized, any input size), in one process.
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from pathlib import Path

import torch

from dataserver_client import DataServerClient, MultiScale
from dataserver_client.tinydet import TinyDetector

sys.path.insert(0, str(Path(__file__).resolve().parent))
from train_detector import multiscale_sizes


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument(
        "--servers",
        default=os.environ.get("DATASERVER_ADDRESS"),
        help="comma-separated server addresses (default: start a local server)",
    )
    parser.add_argument("--workers", type=int, default=2, help="workers of the local server")
    parser.add_argument("--images", type=int, default=128, help="synthetic images, local server")
    parser.add_argument("--epochs", type=int, default=4)
    parser.add_argument(
        "--close-mosaic",
        type=int,
        default=1,
        help="regular batches for the last N epochs (Ultralytics' close_mosaic; 0: never)",
    )
    parser.add_argument("--batch-size", type=int, default=8)
    parser.add_argument("--image-size", type=int, default=128)
    parser.add_argument(
        "--multiscale",
        action="store_true",
        help="YOLOX-style sizes 0.75x..1.25x --image-size, a new one every 10 steps",
    )
    parser.add_argument("--lr", type=float, default=2e-3)
    args = parser.parse_args()
    if not 0 <= args.close_mosaic <= args.epochs:
        parser.error("--close-mosaic must be between 0 and --epochs")
    return args


def main() -> int:
    args = parse_args()
    proc = None
    if args.servers:
        addresses = args.servers.split(",")
    else:
        from dataserver.demo import start_server

        print(f"starting `dataserver serve --workers {args.workers}` on {args.images} images ...")
        dataset = f"synthetic:images={args.images},seed=0"
        proc, address = start_server(["--dataset", dataset, "--workers", str(args.workers)])
        addresses = [address]
    try:
        return train(args, addresses)
    finally:
        if proc is not None:
            from dataserver.demo import stop_server

            stop_server(proc)


def train(args: argparse.Namespace, addresses: list[str]) -> int:
    torch.manual_seed(0)
    size = (args.image_size, args.image_size)
    schedule = MultiScale(multiscale_sizes(args.image_size), every=10) if args.multiscale else None
    model = TinyDetector()
    optimizer = torch.optim.AdamW(model.parameters(), lr=args.lr)
    close_at = args.epochs - args.close_mosaic
    print(
        f"mosaic for epochs 0..{close_at - 1}, regular from epoch {close_at}; "
        f"image_size={schedule or size}",
        flush=True,
    )
    total = stale = 0
    with DataServerClient(
        addresses,
        batch_size=args.batch_size,
        image_size=schedule or size,
        device="cpu",
        stitch_layout="mosaic",  # "stitch" mode = YOLO mosaic of stitch_k = 4 samples
    ) as client:
        for epoch in range(args.epochs):
            mode = "stitch" if epoch < close_at else "regular"
            client.set_mode(mode)  # close-mosaic at epoch E - N: the next batch is regular
            client.set_epoch(epoch)
            t0 = time.perf_counter()
            batches = mosaics = samples = 0
            losses = []
            shapes = set()
            for batch in client:
                planned = (
                    schedule.size_at(client.config.seed, epoch, batch.step) if schedule else size
                )
                stale += batch.mode != mode or tuple(batch.image_size) != planned
                loss, _ratio = model.loss(batch.images, batch.targets)
                optimizer.zero_grad(set_to_none=True)
                loss.backward()
                optimizer.step()
                batches += 1
                mosaics += batch.mode == "stitch"
                samples += batch.num_samples
                losses.append(loss.item())
                shapes.add(batch.image_size[0])
            total += samples
            print(
                f"epoch {epoch}: {mosaics}/{batches} batches mosaic ({mosaics / max(1, batches):.0%}), "
                f"{samples} samples, loss {sum(losses) / max(1, len(losses)):.3f}, "
                f"sizes {sorted(shapes)}, {time.perf_counter() - t0:.1f} s",
                flush=True,
            )
        world = client.config.world_size
    print(f"trained {args.epochs} epochs, {total} samples on {world} ranks, {stale} stale")
    return 0 if stale == 0 else 1


if __name__ == "__main__":
    sys.exit(main())

"""One side of a bench comparison, run in its own process so that neither side shares
interpreter state (threads, OpenCV pools, allocators) with the other.

    python -m dataserver.bench.side dataloader --spec coco:... --workers 2 --batches 30
    python -m dataserver.bench.side dataserver --address tcp://... --batches 30
    python -m dataserver.bench.side single --spec coco:...    (one process, one thread)

Prints one JSON line: {"images_per_s": ...}.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from collections.abc import Iterator
from typing import Any

WARMUP = 3


def timed_rate(batches: Iterator[int], count: int) -> float:
    """Images/s over ``count`` batches after ``WARMUP`` untimed ones."""
    for _ in range(WARMUP):
        next(batches)
    start = time.perf_counter()
    images = sum(next(batches) for _ in range(count))
    return images / (time.perf_counter() - start)


def endless_loader(loader: Any) -> Iterator[int]:
    while True:
        for images, _ in loader:
            yield len(images)


def dataloader_side(args: argparse.Namespace) -> float:
    from dataserver.bench.baselines import make_dataloader

    size = (args.image_size, args.image_size)
    loader = make_dataloader(args.spec, size, args.batch_size, args.workers)
    return timed_rate(endless_loader(loader), args.batches)


def dataserver_side(args: argparse.Namespace) -> float:
    from dataserver_client import DataServerClient, iterate_epochs

    size = (args.image_size, args.image_size)
    extra = json.loads(args.client_args)
    with DataServerClient(
        args.address.split(","), batch_size=args.batch_size, image_size=size, device="cpu", **extra
    ) as client:
        return timed_rate((len(b) for b in iterate_epochs(client)), args.batches)


def feedback_side(args: argparse.Namespace) -> dict[str, float]:
    """Samples/s with the mode flipped after a random ~``flip_rate`` of steps (seeded), as
    Stitcher's feedback does; flip_rate 0 keeps ``--mode`` throughout."""
    import random

    from dataserver_client import DataServerClient, iterate_epochs

    rng = random.Random(args.seed)
    size = (args.image_size, args.image_size)
    with DataServerClient(
        args.address, batch_size=args.batch_size, image_size=size, device="cpu"
    ) as client:
        client.set_mode(args.mode)
        mode = args.mode
        batches = iterate_epochs(client)
        samples = images = flips = total_samples = total_flips = 0
        per_mode = {"regular": 0, "stitch": 0}
        start = 0.0
        for step in range(WARMUP + args.batches):
            if step == WARMUP:
                start = time.perf_counter()
                samples = images = flips = 0
                per_mode = {"regular": 0, "stitch": 0}
            batch = next(batches)
            samples += batch.num_samples
            per_mode[batch.mode] += 1
            total_samples += batch.num_samples
            images += len(batch)
            if rng.random() < args.flip_rate:
                mode = "stitch" if mode == "regular" else "regular"
                client.set_mode(mode)
                flips += 1
                total_flips += 1
        elapsed = time.perf_counter() - start
    return {
        "samples_per_s": samples / elapsed,
        "elapsed": elapsed,
        "regular_batches": per_mode["regular"],
        "stitch_batches": per_mode["stitch"],
        "samples": samples,
        "images": images,
        "flips": flips,
        "total_samples": total_samples,  # warm-up included, to compare with server decodes
        "total_flips": total_flips,
    }


def first_batch_side(args: argparse.Namespace) -> dict[str, float]:
    """Milliseconds from constructing a client (handshake included) to its first batch."""
    from dataserver_client import DataServerClient

    size = (args.image_size, args.image_size)
    start = time.perf_counter()
    with DataServerClient(
        args.address, batch_size=args.batch_size, image_size=size, device="cpu"
    ) as client:
        connected = time.perf_counter()
        client.set_epoch(0)
        next(iter(client))
        first = time.perf_counter()
    return {"handshake_ms": 1000 * (connected - start), "first_batch_ms": 1000 * (first - start)}


RAW_SENDER = """
import sys, zmq
ctx = zmq.Context()
s = ctx.socket(zmq.PUSH)
s.setsockopt(zmq.SNDHWM, 8)
s.connect(sys.argv[1])
frame = bytes(int(sys.argv[2]))
while True:
    s.send(frame, copy=False)
"""


def rawzmq_side(args: argparse.Namespace) -> float:
    """Bytes/s that ``workers`` processes pushing image-sized frames as fast as they can
    deliver to one PULL over TCP loopback: the transport's own ceiling."""
    import subprocess

    import zmq

    nbytes = 3 * args.image_size * args.image_size
    ctx: zmq.Context[Any] = zmq.Context()
    pull = ctx.socket(zmq.PULL)
    pull.setsockopt(zmq.RCVHWM, 8)
    port = pull.bind_to_random_port("tcp://127.0.0.1")
    senders = [
        subprocess.Popen([sys.executable, "-c", RAW_SENDER, f"tcp://127.0.0.1:{port}", str(nbytes)])
        for _ in range(args.workers)
    ]
    try:
        count = args.batches * args.batch_size
        for _ in range(WARMUP * args.batch_size):
            pull.recv(copy=False)
        start = time.perf_counter()
        for _ in range(count):
            pull.recv(copy=False)
        return count * nbytes / (time.perf_counter() - start)
    finally:
        for p in senders:
            p.kill()
            p.wait()
        pull.close(linger=0)
        ctx.term()


def single_side(args: argparse.Namespace) -> float:
    from dataserver.bench.baselines import single_process_rate

    return single_process_rate(args.spec, (args.image_size, args.image_size))


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument(
        "side",
        choices=["dataloader", "dataserver", "single", "feedback", "first_batch", "rawzmq"],
    )
    parser.add_argument("--spec", default="")
    parser.add_argument("--address", default="")
    parser.add_argument("--workers", type=int, default=2)
    parser.add_argument("--batch-size", type=int, default=16)
    parser.add_argument("--image-size", type=int, default=512)
    parser.add_argument("--batches", type=int, default=30)
    parser.add_argument("--client-args", default="{}")
    parser.add_argument("--flip-rate", type=float, default=0.0)
    parser.add_argument("--mode", default="regular")
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args(argv)
    if args.side in ("feedback", "first_batch"):
        side = feedback_side if args.side == "feedback" else first_batch_side
        print(json.dumps(side(args)), flush=True)
        os._exit(0)
    sides = {
        "dataloader": dataloader_side,
        "dataserver": dataserver_side,
        "single": single_side,
        "rawzmq": rawzmq_side,
    }
    rate = sides[args.side](args)
    print(json.dumps({"images_per_s": rate}), flush=True)
    sys.stdout.flush()
    os._exit(0)  # skip interpreter teardown: worker pools are not what is measured


if __name__ == "__main__":
    sys.exit(main())

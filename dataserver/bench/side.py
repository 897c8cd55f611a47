"""One side of a bench comparison, run in its own process so that neither side shares
interpreter state (threads, OpenCV pools, allocators) with the other.

    python -m dataserver.bench.side dataloader --spec coco:... --workers 2 --batches 30
    python -m dataserver.bench.side dataserver --address tcp://... --server-pids 1,2,3
    python -m dataserver.bench.side spdl --spec coco:... --workers 2 --batches 30
    python -m dataserver.bench.side single --spec coco:... --rank 0 --workers 2
        (one of the physical limit's W pipelines: prints ``ready``, then waits on stdin
        for the instant to start; ``baselines.physical_limit`` runs them)

Prints one JSON line: images/s, and the CPU seconds each process spent in the timed window
(this process; the server's front and workers, the DataLoader's workers or SPDL's pool).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from collections.abc import Iterator
from typing import Any

from dataserver.bench.cpu import WARMUP, timed
from dataserver.bench.multiscale import multiscale_side
from dataserver.bench.remote import dataloader_side as dataloader_s3_side
from dataserver.bench.remote import epochs_side
from dataserver.bench.slowserver import slow_server_side


def endless_loader(loader: Any) -> Iterator[int]:
    from dataserver.bench.baselines import targets_of

    while True:
        for images, pairs in loader:
            targets_of(pairs)  # what the trainer would use, as the client hands it over
            yield len(images)


def dataloader_side(args: argparse.Namespace) -> dict[str, Any]:
    from dataserver.bench.baselines import PREFETCH_FACTOR, make_dataloader

    size = (args.image_size, args.image_size)
    loader = make_dataloader(args.spec, size, args.batch_size, args.workers, args.spec_args)
    batches = endless_loader(loader)
    next(batches)  # the workers exist from here on
    pids = [w.pid for w in loader._iterator._workers]  # type: ignore[union-attr]
    # The workers hold up to PREFETCH_FACTOR batches each, made before the clock starts:
    # taken in the warm-up, so that the timed batches are made in the window.
    return timed(batches, args.batches, pids, warmup=WARMUP + PREFETCH_FACTOR * args.workers)


def _client(args: argparse.Namespace) -> Any:
    from dataserver_client import DataServerClient

    extra = json.loads(args.client_args)
    size = (args.image_size, args.image_size)
    return DataServerClient(
        args.address.split(","), batch_size=args.batch_size, image_size=size, device="cpu", **extra
    )


def _server_pids(args: argparse.Namespace) -> list[int]:
    return [int(p) for p in args.server_pids.split(",") if p]


def dataserver_side(args: argparse.Namespace) -> dict[str, Any]:
    from dataserver_client import iterate_epochs

    with _client(args) as client:
        if args.steer == "close":  # mosaic from the start, closed after the warm-up epochs
            client.set_mode("stitch")
        if args.warm_epochs:  # epochs untimed first (to fill the server's store)
            for epoch in range(args.warm_epochs):
                client.set_epoch(epoch)
                for _ in client:
                    pass
        if args.steer == "close":
            client.set_mode("regular")
        composed_before = _images_composed(args.address) if args.steer != "none" else 0
        count = args.batches
        if args.first_epoch:  # all of epoch 0 after the warm-up (a fresh server's first lap)
            client.set_epoch(0)
            count = len(client) - WARMUP
            if count < 1:
                raise SystemExit(f"epoch 0 has {len(client)} batches: too few to time")
            batches: Iterator[int] = (len(b) for b in client)
        else:
            batches = (len(b) for b in iterate_epochs(client, args.warm_epochs))
        delivered = [0]
        batches = _counted(batches, delivered)
        out = timed(batches, count, _server_pids(args))
        if args.steer != "none":  # images the server composed per image delivered
            composed = _images_composed(args.address) - composed_before
            out["composed_per_delivered"] = composed / max(1, delivered[0])
        out["client_stats"] = {
            k: v for k, v in client.stats().items() if isinstance(v, (int, float))
        }
        return out


def _counted(batches: Iterator[int], total: list[int]) -> Iterator[int]:
    for n in batches:
        total[0] += n
        yield n


def _images_composed(address: str) -> int:
    """The server's count of images composed (every task answered), once it stops moving:
    a worker's DONE reaches the front after its result reached the client."""
    from dataserver.admin import fetch_stats

    last = -1
    for _ in range(50):
        now = int(
            fetch_stats(address.split(",", maxsplit=1)[0], 10)["counters"].get("images_done", 0)
        )
        if now == last:
            return now
        last = now
        time.sleep(0.05)
    return last


def feedback_side(args: argparse.Namespace) -> dict[str, float]:
    """Samples/s with the mode flipped after a random ~``flip_rate`` of steps (seeded), as
    Stitcher's feedback does; flip_rate 0 keeps ``--mode`` throughout."""
    import random

    from dataserver_client import iterate_epochs

    rng = random.Random(args.seed)
    with _client(args) as client:
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


def flip_stall_side(args: argparse.Namespace) -> dict[str, Any]:
    """A trainer whose step leaves the CPU free for ``--step-ms`` (a GPU-bound step), then
    sets the mode (every step, as ``feedback()`` would), flipping it on a random
    ~``flip_rate`` of steps (seeded), over one whole epoch (so
    the server's decode count compares with the samples delivered). Reports the wait in
    ``next()`` after each step, split by whether the mode was flipped before it."""
    import random

    rng = random.Random(args.seed)
    waits: dict[str, list[float]] = {"flip": [], "no_flip": []}
    samples = flips = 0
    with _client(args) as client:
        client.set_epoch(0)
        it = iter(client)
        flipped = False
        step = 0
        mode = client.mode
        while True:
            start = time.perf_counter()
            try:
                batch = next(it)
            except StopIteration:
                break
            wait = time.perf_counter() - start
            if step >= WARMUP:
                waits["flip" if flipped else "no_flip"].append(wait * 1e3)
            samples += batch.num_samples
            step += 1
            time.sleep(args.step_ms / 1e3)
            flipped = rng.random() < args.flip_rate
            if flipped:
                mode = "stitch" if mode == "regular" else "regular"
                flips += 1
            client.set_mode(mode)  # every step, as a trainer calling feedback() does
        stats = client.stats()
    return {
        "waits_ms": waits,
        "samples": samples,
        "steps": step,
        "flips": flips,
        "flips_promoted_ready": stats["flips"]["promoted_ready"],
    }


def first_batch_side(args: argparse.Namespace) -> dict[str, float]:
    """Milliseconds from constructing a client (handshake included) to its first batch."""
    import dataserver_client  # noqa: F401  (imported before the clock starts, as a trainer has it)

    start = time.perf_counter()
    with _client(args) as client:
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


def rawzmq_side(args: argparse.Namespace) -> dict[str, Any]:
    """Bytes/s that ``workers`` processes pushing image-sized frames as fast as they can
    deliver to one PULL over TCP loopback: the transport's own ceiling."""
    import subprocess
    import tempfile

    import zmq

    nbytes = 3 * args.image_size * args.image_size
    ctx: zmq.Context[Any] = zmq.Context()
    pull = ctx.socket(zmq.PULL)
    pull.setsockopt(zmq.RCVHWM, 8)
    if args.transport == "ipc":
        endpoint = f"ipc://{tempfile.mkdtemp(prefix='ds-raw-')}/pull"
        pull.bind(endpoint)
    else:
        endpoint = f"tcp://127.0.0.1:{pull.bind_to_random_port('tcp://127.0.0.1')}"
    senders = [
        subprocess.Popen([sys.executable, "-c", RAW_SENDER, endpoint, str(nbytes)])
        for _ in range(args.workers)
    ]
    try:

        def frames() -> Iterator[int]:
            while True:
                for _ in range(args.batch_size):
                    pull.recv(copy=False)
                yield args.batch_size

        return timed(frames(), args.batches, [p.pid for p in senders])
    finally:
        for p in senders:
            p.kill()
            p.wait()
        pull.close(linger=0)
        ctx.term()


def single_side(args: argparse.Namespace) -> dict[str, Any]:
    """One of the W single-process pipelines of the physical limit (``physical_limit``
    starts them and tells them when to begin, on stdin)."""
    from dataserver.bench.baselines import single_run

    size = (args.image_size, args.image_size)
    return single_run(args.spec, size, args.spec_args, args.seconds, args.rank, args.workers)


def yolo_ultralytics_side(args: argparse.Namespace) -> dict[str, Any]:
    from dataserver.bench.ultralytics import ultralytics_side

    return ultralytics_side(args)


def yolo_service_side(args: argparse.Namespace) -> dict[str, Any]:
    from dataserver.bench.ultralytics import service_side

    return service_side(args)


def hf_guide_side(args: argparse.Namespace) -> dict[str, Any]:
    from dataserver.bench.transformers import guide_side

    return guide_side(args)


def hf_service_side(args: argparse.Namespace) -> dict[str, Any]:
    from dataserver.bench.transformers import service_side

    return service_side(args)


def rfdetr_own_side(args: argparse.Namespace) -> dict[str, Any]:
    from dataserver.bench.rfdetr import rfdetr_side

    return rfdetr_side(args)


def rfdetr_service_side(args: argparse.Namespace) -> dict[str, Any]:
    from dataserver.bench.rfdetr import service_side

    return service_side(args)


def webdataset_s3_side(args: argparse.Namespace) -> dict[str, Any]:
    from dataserver.bench.wdspeer import wds_side

    return wds_side(args)


def spdl_side(args: argparse.Namespace) -> dict[str, Any]:
    from dataserver.bench.spdl_side import spdl_side as side

    return side(args)


SIDES = {
    "dataloader": dataloader_side,
    "dataserver": dataserver_side,
    "single": single_side,
    "spdl": spdl_side,
    "rawzmq": rawzmq_side,
    "feedback": feedback_side,
    "first_batch": first_batch_side,
    "epochs": epochs_side,
    "dataloader_s3": dataloader_s3_side,
    "webdataset_s3": webdataset_s3_side,
    "flip_stall": flip_stall_side,
    "multiscale": multiscale_side,
    "slow_server": slow_server_side,
    "ultralytics": yolo_ultralytics_side,
    "yolo_service": yolo_service_side,
    "hf_guide": hf_guide_side,
    "hf_service": hf_service_side,
    "rfdetr_own": rfdetr_own_side,
    "rfdetr_service": rfdetr_service_side,
}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("side", choices=sorted(SIDES))
    parser.add_argument("--spec", default="")
    parser.add_argument("--spec-args", default=None)
    parser.add_argument("--address", default="")
    parser.add_argument("--server-pids", default="")
    parser.add_argument("--workers", type=int, default=2)
    parser.add_argument("--batch-size", type=int, default=16)
    parser.add_argument("--image-size", type=int, default=512)
    parser.add_argument("--batches", type=int, default=30)
    parser.add_argument("--warm-epochs", type=int, default=0)
    parser.add_argument("--epochs", type=int, default=2)
    parser.add_argument("--first-epoch", type=int, default=0)
    # "close": set_mode("stitch") before the warm-up epochs, set_mode("regular") after them
    # (mosaic, then close-mosaic); "count": no steer, the composed images counted the same.
    parser.add_argument("--steer", default="none", choices=["none", "close", "count"])
    parser.add_argument("--client-args", default="{}")
    parser.add_argument("--flip-rate", type=float, default=0.0)
    parser.add_argument("--mode", default="regular")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--transport", default="tcp", choices=["tcp", "ipc"])
    parser.add_argument("--step-ms", type=float, default=150.0)
    parser.add_argument("--seconds", type=float, default=3.0)
    parser.add_argument("--rank", type=int, default=0)
    parser.add_argument("--spdl-executor", default="thread", choices=["thread", "process"])
    args = parser.parse_args(argv)
    print(json.dumps(SIDES[args.side](args)), flush=True)
    os._exit(0)  # skip interpreter teardown: worker pools are not what is measured


if __name__ == "__main__":
    sys.exit(main())

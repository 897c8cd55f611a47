"""``dataserver bench``: the project measured against its anchors, side by side in one run.

Every figure is a ratio of two measurements taken in the same run, alternating the two
sides several times and keeping each side's median, because the machines these run on
are shared and noisy. Absolute rates are printed too, for context only.
"""

from __future__ import annotations

import argparse
import json
import statistics
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from dataserver.data.coco import write_synthetic_coco
from dataserver.demo import start_server, stop_server

ROUNDS = 3


def _client_rate(address: str, args: argparse.Namespace, batches: int, **kw: Any) -> float:
    """Steady-state images/s a DataServerClient gets: warm-up batches are not timed."""
    from dataserver_client import DataServerClient

    size = (args.image_size, args.image_size)
    with DataServerClient(
        address, batch_size=args.batch_size, image_size=size, device="cpu", **kw
    ) as client:
        epoch = 0
        client.set_epoch(epoch)
        it = iter(client)

        def take() -> int:
            nonlocal it, epoch
            try:
                return len(next(it))
            except StopIteration:
                epoch += 1
                client.set_epoch(epoch)
                it = iter(client)
                return len(next(it))

        for _ in range(3):
            take()
        start = time.perf_counter()
        images = sum(take() for _ in range(batches))
        return images / (time.perf_counter() - start)


def _dataloader_rate(loader: Any, batches: int) -> float:
    it = iter(loader)

    def take() -> int:
        nonlocal it
        try:
            return len(next(it)[0])
        except StopIteration:
            it = iter(loader)
            return len(next(it)[0])

    for _ in range(3):
        take()
    start = time.perf_counter()
    images = sum(take() for _ in range(batches))
    return images / (time.perf_counter() - start)


def fig_dataloader(args: argparse.Namespace, spec: str) -> dict[str, Any]:
    """images/s vs DataLoader(num_workers=W), and vs W x the single-process rate."""
    from dataserver.bench.baselines import make_dataloader, single_process_rate

    size = (args.image_size, args.image_size)
    proc, address = start_server(["--dataset", spec, "--workers", str(args.workers)])
    loader = make_dataloader(spec, size, args.batch_size, args.workers)
    ours: list[float] = []
    theirs: list[float] = []
    try:
        for _ in range(ROUNDS):
            ours.append(_client_rate(address, args, args.batches))
            theirs.append(_dataloader_rate(loader, args.batches))
    finally:
        del loader
        stop_server(proc)
    single = single_process_rate(spec, size)
    ds, dl = statistics.median(ours), statistics.median(theirs)
    return {
        "dataserver_images_per_s": round(ds, 1),
        "dataloader_images_per_s": round(dl, 1),
        "single_process_images_per_s": round(single, 1),
        "vs_dataloader": round(ds / dl, 3),
        "vs_physical_limit": round(ds / (args.workers * single), 3),
        "rounds": {
            "dataserver": [round(x, 1) for x in ours],
            "dataloader": [round(x, 1) for x in theirs],
        },
    }


FIGURES: dict[str, Callable[[argparse.Namespace, str], dict[str, Any]]] = {
    "dataloader": fig_dataloader,
}


def run_bench(args: argparse.Namespace) -> int:
    wanted = args.only.split(",") if args.only else list(FIGURES)
    unknown = [w for w in wanted if w not in FIGURES]
    if unknown:
        print(f"dataserver bench: unknown figure(s) {unknown}; known: {', '.join(FIGURES)}")
        return 2
    with tempfile.TemporaryDirectory(prefix="ds-bench-") as tmp:
        if args.data:
            ann = Path(args.data) / "annotations.json"
        else:
            print(f"writing {args.images} synthetic JPEGs ...", flush=True)
            ann = write_synthetic_coco(tmp, args.images, seed=0)
        spec = f"coco:{ann}"
        print(
            f"bench: {spec}, {args.workers} workers, batch {args.batch_size}, "
            f"{args.image_size}x{args.image_size}, {args.batches} timed batches x {ROUNDS} rounds per side",
            flush=True,
        )
        results: dict[str, Any] = {"config": vars(args) | {"func": None}}
        for name in wanted:
            print(f"\n[{name}]", flush=True)
            out = FIGURES[name](args, spec)
            results[name] = out
            for key, value in out.items():
                print(f"  {key:<30} {value}")
    if args.json:
        Path(args.json).write_text(json.dumps(results, indent=2, default=str))
    return 0

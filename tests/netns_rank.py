"""One gloo rank of the multi-node rehearsal (tests/test_netns.py), run as a script in the
trainer node's network namespace:

    RANK=r WORLD_SIZE=2 MASTER_ADDR=127.0.0.1 MASTER_PORT=P GLOO_SOCKET_IFNAME=lo \\
        python tests/netns_rank.py ADDRESS --go FILE [--reference ADDRESS] [--interval S]

One epoch from a ``DataServerClient`` with this rank's rank and world size; with
``--reference``, first the same epoch from a fresh client there (the undisturbed run, done
by the same processes to spare two more imports of torch on a busy machine). After each
batch it feeds back a ratio that differs by rank; averaged over the ranks (an all-reduce on
gloo) it stitches the batch after every fourth one, so both ranks flip modes together.

Prints one JSON line per batch (run, rank, step, mode, indices, a digest of pixels and
boxes), then one with the client's stats. In the epoch from ADDRESS it waits before its
batch of step ``s`` while ``s`` is not below the number the go file holds: the test holds
both ranks at a step of its choosing.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import sys
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent / "plugins"))  # clients, when run by hand

import torch.distributed as dist
from clients import make_client


def digest(batch: Any) -> str:
    h = hashlib.blake2b(digest_size=12)
    h.update(batch.images.numpy().tobytes())
    for target in batch.targets:
        h.update(target["boxes"].numpy().tobytes())
        h.update(target["labels"].numpy().tobytes())
    return h.hexdigest()


def held(go: Path, step: int) -> bool:
    try:
        return step >= int(go.read_text().strip() or "0")
    except ValueError:  # caught mid-rewrite: ask again
        return True


def emit(item: dict[str, Any]) -> None:
    print(json.dumps(item, default=str), flush=True)


def epoch(address: str, args: argparse.Namespace, run: str, go: Path | None) -> None:
    """One epoch from a fresh client; a record per batch, then the client's stats."""
    rank, world = dist.get_rank(), dist.get_world_size()
    client = make_client(
        address,
        batch_size=args.batch_size,
        image_size=(32, 32),
        seed=11,
        rank=rank,
        world_size=world,
        timeout=60.0,
        discovery_interval=args.interval,
    )
    with client:
        client.set_epoch(0)
        for batch in client:
            step = batch.step
            emit(
                {
                    "run": run,
                    "rank": rank,
                    "step": step,
                    "mode": batch.mode,
                    "indices": [[int(i) for i in image] for image in batch.indices],
                    "digest": digest(batch),
                }
            )
            # The ranks' mean is 0.075 (< 0.1: stitch) after every fourth step, else 0.15.
            client.feedback(0.0 if rank == 0 else (0.15 if step % 4 == 3 else 0.3))
            while go is not None and held(go, step + 1):
                time.sleep(0.02)
        emit({"run": run, "rank": rank, "stats": client.stats()})


def main() -> int:
    p = argparse.ArgumentParser()
    p.add_argument("address")
    p.add_argument("--go", type=Path, required=True)
    p.add_argument("--reference", default=None, help="first an undisturbed epoch from here")
    p.add_argument("--interval", type=float, default=0.2)
    p.add_argument("--batch-size", type=int, default=8)
    args = p.parse_args()
    dist.init_process_group("gloo")
    if args.reference:
        epoch(args.reference, args, "reference", None)
    epoch(args.address, args, "rehearsal", args.go)
    dist.destroy_process_group()
    sys.stdout.flush()
    os._exit(0)  # (gloo's threads can hold a plain exit)


if __name__ == "__main__":
    sys.exit(main())

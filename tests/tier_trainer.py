"""A trainer for the elastic-tier tests, run as its own process (inside a private mount
namespace when the test rewrites /etc/hosts): one epoch from ``DataServerClient``, one JSON
line per batch on stdout (step, time, indices, a digest of its pixels and boxes), then a
line with the client's stats.

    python tests/tier_trainer.py ADDRESS [--interval S] [--batch-size N] [--step-ms MS]

With ``--go FILE``, it waits before each batch while FILE holds "pause" (the test holds it
at a point of its choosing).
"""

from __future__ import annotations

import argparse
import hashlib
import json
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent / "plugins"))  # clients, when run by hand

from clients import make_client


def digest(batch: object) -> str:
    h = hashlib.blake2b(digest_size=12)
    h.update(batch.images.numpy().tobytes())  # type: ignore[attr-defined]
    for target in batch.targets:  # type: ignore[attr-defined]
        h.update(target["boxes"].numpy().tobytes())
        h.update(target["labels"].numpy().tobytes())
    return h.hexdigest()


def main() -> int:
    p = argparse.ArgumentParser()
    p.add_argument("address")
    p.add_argument("--interval", type=float, default=0.2)
    p.add_argument("--batch-size", type=int, default=8)
    p.add_argument("--image-size", type=int, default=32)
    p.add_argument("--step-ms", type=float, default=0.0)
    p.add_argument("--mode-every", type=int, default=0, help="flip the mode every N steps")
    p.add_argument("--go", default=None)
    args = p.parse_args()
    client = make_client(
        args.address.split(","),
        batch_size=args.batch_size,
        image_size=(args.image_size, args.image_size),
        seed=7,
        rank=0,
        world_size=1,
        timeout=60.0,
        discovery_interval=args.interval,
    )
    with client:
        client.set_epoch(0)
        start = time.monotonic()
        mode = "regular"
        for step, batch in enumerate(client):
            record = {
                "step": step,
                "t": round(time.monotonic() - start, 4),
                "mode": batch.mode,
                "indices": [[int(i) for i in image] for image in batch.indices],
                "digest": digest(batch),
            }
            print(json.dumps(record), flush=True)
            if args.step_ms:
                time.sleep(args.step_ms / 1000)
            if args.mode_every and (step + 1) % args.mode_every == 0:
                mode = "stitch" if mode == "regular" else "regular"
                client.set_mode(mode)
            while args.go and Path(args.go).read_text().strip() == "pause":
                time.sleep(0.02)
        stats = client.stats()
        print(json.dumps({"stats": stats}, default=str), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())

"""A one-node job of several ranks in one process, for tests/test_peers.py:

    python tests/peers_job.py ADDRESS --ranks 4 --go FILE

Each rank (a thread with a ``DataServerClient`` of its rank) takes one batch of epoch 0;
when every rank has, it prints ``working``, and the ranks wait for FILE to exist before
they take the rest. Then one JSON line: each rank's indices delivered and the errors it
met (``run_epoch``-style: an error is recorded and the epoch goes on)."""

from __future__ import annotations

import argparse
import json
import sys
import threading
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent / "plugins"))

from clients import make_client

from dataserver_client import DataServerError


def main() -> int:
    p = argparse.ArgumentParser()
    p.add_argument("address")
    p.add_argument("--ranks", type=int, default=4)
    p.add_argument("--go", required=True)
    args = p.parse_args()
    started = threading.Barrier(args.ranks + 1)
    out: dict[int, dict[str, Any]] = {}

    def rank(r: int) -> None:
        got: list[int] = []
        errors: list[str] = []
        first = True
        with make_client(
            args.address,
            batch_size=4,
            image_size=(32, 32),
            timeout=60,
            rank=r,
            world_size=args.ranks,
        ) as client:
            client.set_epoch(0)
            it = iter(client)
            while True:
                try:
                    batch = next(it)
                except StopIteration:
                    break
                except DataServerError as exc:
                    errors.append(str(exc))
                    continue
                got.extend(i for idx in batch.indices for i in idx)
                if first:
                    first = False
                    started.wait(120)
                    while not Path(args.go).exists():
                        time.sleep(0.1)
        out[r] = {"indices": sorted(got), "errors": errors}

    threads = [threading.Thread(target=rank, args=(r,)) for r in range(args.ranks)]
    for t in threads:
        t.start()
    started.wait(120)
    print("working", flush=True)
    for t in threads:
        t.join()
    print(json.dumps({str(r): out.get(r) for r in range(args.ranks)}), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())

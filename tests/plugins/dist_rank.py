"""One rank of the torch.distributed feedback test (run as a script by tests/test_distributed.py).

Each rank feeds back its own, different ratio; with sync=True the client averages them over
ranks, so every rank must take the same decisions and end the epoch on the same step.
Prints one JSON line: the modes of the batches it got, their steps and its indices.
"""

from __future__ import annotations

import json
import os
import sys

import torch.distributed as dist
from clients import make_client


def main() -> None:
    address = sys.argv[1]
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    modes: list[str] = []
    steps: list[int] = []
    indices: list[int] = []
    decisions: list[str] = []
    with make_client(address, batch_size=4, image_size=(32, 32), prefetch=3) as c:
        assert (c.config.rank, c.config.world_size) == (rank, 2)
        c.set_epoch(0)
        for batch in c:
            modes.append(batch.mode)
            steps.append(batch.step)
            indices.extend(i for idx in batch.indices for i in idx)
            # Rank 0 alone would always stitch (0.0 < 0.1), rank 1 never (0.3); their mean
            # crosses the threshold on a pattern only the average knows.
            local = 0.0 if rank == 0 else (0.3 if batch.step % 3 else 0.15)
            decisions.append(c.feedback(local))
    print(
        json.dumps(
            {
                "rank": rank,
                "modes": modes,
                "steps": steps,
                "indices": indices,
                "decisions": decisions,
            }
        )
    )
    sys.stdout.flush()
    dist.destroy_process_group()
    os._exit(0)


if __name__ == "__main__":
    main()

"""One rank of the elastic-resume test (run as a script by tests/test_elastic.py), under
torch.distributed (gloo; RANK, WORLD_SIZE, MASTER_ADDR and MASTER_PORT from the test).

    elastic_rank.py ADDRESS old OUT.json STATE K LAG   take K batches (rank 0: K + LAG), then
                                                       state_dict() (collective) -> STATE
    elastic_rank.py ADDRESS new OUT.json STATE         load STATE, finish the epoch steering
                                                       by feedback(sync=True), then one
                                                       whole epoch more

The old job steers with set_mode by step (ranks need not be in lockstep); the new job with
feedback averaged over ranks, which hangs if one rank has a batch more than another.
Writes what it saw to OUT.json.
"""

from __future__ import annotations

import json
import os
import sys
from typing import Any

import torch
import torch.distributed as dist
from clients import make_client

from dataserver_client import Batch

SEED = 7


def policy(step: int) -> str:
    return "stitch" if step % 5 in (1, 2) else "regular"


def local_ratio(step: int, rank: int, world: int) -> float:
    """Ratios whose mean over the ranks is 0.05 (stitch) when step % 3 == 0, else 0.2."""
    base = 0.05 if step % 3 == 0 else 0.2
    return base + 0.02 * (rank - (world - 1) / 2)


def record(batch: Batch, decision: str | None) -> dict[str, Any]:
    return {
        "step": batch.step,
        "epoch": batch.epoch,
        "mode": batch.mode,
        "indices": batch.indices,
        "decision": decision,
    }


def main() -> None:
    address, role, out = sys.argv[1], sys.argv[2], sys.argv[3]
    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    result: dict[str, Any] = {"rank": rank, "world": world, "batches": [], "next_epoch": []}
    with make_client(address, batch_size=3, image_size=(32, 32), seed=SEED, prefetch=3) as c:
        if role == "old":
            take = int(sys.argv[5]) + (int(sys.argv[6]) if rank == 0 else 0)
            c.set_epoch(1)
            it = iter(c)
            for _ in range(take):
                batch = next(it)
                mode = policy(batch.step)
                c.set_mode(mode)
                result["batches"].append(record(batch, mode))
            state = c.state_dict()  # every rank calls it: it gathers the ranks' positions
            torch.save(state, sys.argv[4])
            result["mode"] = c.mode
        else:
            c.load_state_dict(torch.load(sys.argv[4], weights_only=False))
            result["mode_loaded"] = c.mode
            for batch in c:
                decision = c.feedback(local_ratio(batch.step, rank, world))
                result["batches"].append(record(batch, decision))
            c.set_epoch(2)
            for batch in c:
                result["next_epoch"].append(record(batch, None))
    with open(out, "w") as f:
        json.dump(result, f)
    dist.barrier()
    dist.destroy_process_group()
    os._exit(0)


if __name__ == "__main__":
    main()

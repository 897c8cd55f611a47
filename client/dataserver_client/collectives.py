"""The torch.distributed collectives the client uses, each a plain function of values: the
rank and world size a client defaults to, whether the process group is this client's ranks,
the feedback ratio's mean over ranks, and the ranks' positions gathered for a job-wide
state. ``DataServerClient`` (client.py) is the only caller, in the trainer's thread; every
rank calls a collective at the same point, as for DDP. ``torch.distributed`` is imported
where it is used: a client without it never loads it.
"""

from __future__ import annotations

import os
import zlib
from typing import Any

import msgpack
import torch

from dataserver_client.errors import DataServerError
from dataserver_client.plan.resume import RANK_KEYS


def default_rank_world() -> tuple[int, int]:
    """(rank, world_size) from torch.distributed when initialised, else env RANK and
    WORLD_SIZE (as torchrun sets them), else (0, 1)."""
    import torch.distributed as dist

    if dist.is_available() and dist.is_initialized():
        return dist.get_rank(), dist.get_world_size()
    try:
        return int(os.environ.get("RANK", "0")), int(os.environ.get("WORLD_SIZE", "1"))
    except ValueError:
        raise ValueError("environment RANK and WORLD_SIZE must be integers") from None


def in_process_group(rank: int, world_size: int) -> bool:
    """Whether torch.distributed is initialised with ``rank`` of ``world_size``."""
    import torch.distributed as dist

    ready = dist.is_available() and dist.is_initialized()
    return ready and dist.get_world_size() == world_size and dist.get_rank() == rank


def all_reduce_mean(value: float, device: torch.device) -> float:
    """``value`` averaged over the process group's ranks (a collective); as it is without
    one, or alone in it."""
    import torch.distributed as dist

    if not (dist.is_available() and dist.is_initialized()) or dist.get_world_size() == 1:
        return value
    on = device if dist.get_backend() == "nccl" else torch.device("cpu")
    t = torch.tensor([value], dtype=torch.float64, device=on)
    dist.all_reduce(t)
    return float(t.item()) / dist.get_world_size()


def gather_ranks(state: dict[str, Any], device: torch.device) -> list[dict[str, Any]]:
    """Every rank's ``RANK_KEYS`` of its state, by rank (a collective). Sent as msgpack in
    uint8 tensors: nothing is pickled, not even between the trainer's own ranks."""
    import torch.distributed as dist

    deal = state["deal"]  # ranks compare a checksum of it, not its bytes
    plan = None if deal is None else zlib.crc32(msgpack.packb(deal))
    mine = {**{k: state[k] for k in RANK_KEYS}, "epoch": state["epoch"], "plan": plan}
    payload = msgpack.packb(mine)
    on = device if dist.get_backend() == "nccl" else torch.device("cpu")
    world = dist.get_world_size()
    size = torch.tensor([len(payload)], dtype=torch.int64, device=on)
    sizes = [torch.zeros_like(size) for _ in range(world)]
    dist.all_gather(sizes, size)
    lengths = [int(s.item()) for s in sizes]
    buf = torch.zeros(max(lengths), dtype=torch.uint8, device=on)
    buf[: len(payload)] = torch.frombuffer(bytearray(payload), dtype=torch.uint8).to(on)
    bufs = [torch.empty_like(buf) for _ in range(world)]
    dist.all_gather(bufs, buf)
    entries = [
        msgpack.unpackb(b[:n].cpu().numpy().tobytes()) for b, n in zip(bufs, lengths, strict=True)
    ]
    if any(e["epoch"] != mine["epoch"] or e["plan"] != mine["plan"] for e in entries):
        raise DataServerError(
            "state_dict: the ranks are in different epochs (or plans); a job-wide state "
            "needs every rank in one epoch"
        )
    return [{k: e[k] for k in RANK_KEYS} for e in entries]

"""``dataserver bench --only multiscale``: what a size change costs the trainer.

A trainer whose step leaves the CPU free (``--step-ms``, a GPU-bound step) takes batches
whose size changes: on a ``MultiScale`` schedule (planned ahead: the batch after a change
was prepared at its size already) and by unscheduled ``set_image_size`` calls (the batches
prepared at the old size are planned again). Reported: the wait in ``next()`` for the
batch right after a change against the wait for a batch after none (the scheduled target:
within 5 ms), over rounds that alternate the two cases on one server.
"""

from __future__ import annotations

import argparse
import json
import random
import time
from typing import Any

WARMUP = 3


def _sizes(image_size: int) -> list[list[int]]:
    """The schedule's sizes: 0.75x .. 1.25x of the image size in steps of 32 (YOLOX's
    multiscale range, scaled), at least two."""
    lo, hi = max(32, int(image_size * 0.75) // 32 * 32), int(image_size * 1.25) // 32 * 32
    sides = list(range(lo, max(hi, lo + 32) + 1, 32))
    return [[s, s] for s in sides]


def multiscale_side(args: argparse.Namespace) -> dict[str, Any]:
    """The trainer's side: waits in ``next()`` split by whether the size changed."""
    from dataserver_client import DataServerClient, MultiScale, iterate_epochs

    cfg = json.loads(args.client_args)
    sizes = [tuple(s) for s in cfg["sizes"]]
    unscheduled = bool(cfg["unscheduled"])
    # (unscheduled: a client built at the largest size, whose sources the store holds)
    image_size: Any = sizes[-1] if unscheduled else MultiScale(sizes, every=cfg["every"])
    rng = random.Random(args.seed)
    waits: dict[str, list[float]] = {"change": [], "no_change": []}
    changes = 0
    with DataServerClient(
        args.address, batch_size=args.batch_size, image_size=image_size, device="cpu"
    ) as client:
        batches = iterate_epochs(client)
        previous: tuple[int, int] | None = None
        asked = False  # set_image_size was called before this next()
        current = sizes[-1]
        for step in range(WARMUP + args.batches):
            start = time.perf_counter()
            batch = next(batches)
            wait = (time.perf_counter() - start) * 1e3
            changed = asked if unscheduled else previous not in (None, batch.image_size)
            if step >= WARMUP:
                waits["change" if changed else "no_change"].append(wait)
                changes += changed
            previous = batch.image_size
            time.sleep(args.step_ms / 1e3)
            asked = unscheduled and rng.random() < args.flip_rate
            if asked:
                current = rng.choice([s for s in sizes if s != current])
                client.set_image_size(current)
    return {"waits_ms": waits, "changes": changes}


def _quantile(values: list[float], q: float) -> float | None:
    if not values:
        return None
    ordered = sorted(values)
    return round(ordered[min(len(ordered) - 1, int(q * len(ordered)))], 1)


def fig_multiscale(args: argparse.Namespace, spec: str, progress: Any) -> dict[str, Any]:
    """Scheduled (``MultiScale(sizes, every=2)``) and unscheduled (``set_image_size`` on
    ~20% of steps) size changes, step 150 ms, on one server with its store; rounds
    alternate the two."""
    from dataserver.bench.common import run_side, server

    sizes = _sizes(args.image_size)
    cases = {
        "scheduled": {"sizes": sizes, "every": 2, "unscheduled": False},
        "unscheduled": {"sizes": sizes, "every": 1, "unscheduled": True},
    }
    runs: dict[str, list[dict[str, Any]]] = {name: [] for name in cases}
    with server(["--dataset", spec, "--workers", str(args.workers)]) as (address, _):
        for r in range(args.rounds):
            for name, cfg in cases.items():
                out = run_side(
                    "multiscale",
                    args,
                    address=address,
                    step_ms=150,
                    flip_rate=0.2,
                    seed=r,
                    client_args=json.dumps(cfg),
                )
                runs[name].append(out)
                change = out["waits_ms"]["change"]
                progress(
                    f"round {r + 1}/{args.rounds}: {name}: {out['changes']} size changes, "
                    f"median wait after one {_quantile(change, 0.5)} ms"
                )
    result: dict[str, Any] = {"sizes": [s[0] for s in sizes]}
    for name, outs in runs.items():
        change = [w for o in outs for w in o["waits_ms"]["change"]]
        calm = [w for o in outs for w in o["waits_ms"]["no_change"]]
        m_change, m_calm = _quantile(change, 0.5), _quantile(calm, 0.5)
        result[name] = {
            "stall_ms": None if m_change is None or m_calm is None else round(m_change - m_calm, 1),
            "wait_after_change_ms": {"median": m_change, "p90": _quantile(change, 0.9)},
            "wait_after_no_change_ms": {"median": m_calm, "p90": _quantile(calm, 0.9)},
            "changes": sum(o["changes"] for o in outs),
        }
    result["note"] = (
        "stall_ms = median wait in next() for the batch after a size change minus after none "
        "(scheduled target: <= 5 ms); unscheduled = set_image_size mid-epoch (reported)"
    )
    return result

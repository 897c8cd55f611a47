"""``dataserver bench``: the project measured against its anchors, side by side in one run.

Every figure is a ratio of two measurements taken in the same run, alternating the two
sides (``--rounds`` times) and keeping each side's median, because the machines these run
on are shared and noisy. Absolute rates and CPU costs are printed too, for context only.
Each figure prints a line as each of its runs ends; ``--only NAME`` runs one.
"""

from __future__ import annotations

import argparse
import json
import tempfile
import time
from pathlib import Path
from typing import Any

from dataserver.bench.figures import FIGURES, OPT_IN
from dataserver.data.coco import write_synthetic_coco

__all__ = ["FIGURES", "run_bench"]


def run_bench(args: argparse.Namespace) -> int:
    wanted = args.only.split(",") if args.only else [f for f in FIGURES if f not in OPT_IN]
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
            f"{args.image_size}x{args.image_size}, {args.batches} timed batches x "
            f"{args.rounds} rounds per side",
            flush=True,
        )
        results: dict[str, Any] = {"config": {k: v for k, v in vars(args).items() if k != "func"}}
        for name in wanted:
            print(f"\n[{name}]", flush=True)
            start = time.monotonic()

            def progress(line: str, name: str = name, start: float = start) -> None:
                print(f"  {name} {time.monotonic() - start:5.0f} s  {line}", flush=True)

            out = FIGURES[name](args, spec, progress)
            results[name] = out
            for key, value in out.items():
                print(f"  {key:<36} {value}")
    if args.json:
        Path(args.json).write_text(json.dumps(results, indent=2, default=str))
    return 0

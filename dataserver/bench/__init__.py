"""``dataserver bench``: the project measured against its anchors, side by side in one run.

Every figure is a ratio of two measurements taken in the same run, alternating the two
sides several times and keeping each side's median, because the machines these run on
are shared and noisy. Absolute rates are printed too, for context only.
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import tempfile
from collections.abc import Callable
from pathlib import Path
from typing import Any

from dataserver.data.coco import write_synthetic_coco
from dataserver.demo import start_server, stop_server

ROUNDS = 3


def run_side(side: str, args: argparse.Namespace, **opts: Any) -> float:
    """Run one side of a comparison in a fresh process; return its images/s."""
    return float(run_side_json(side, args, **opts)["images_per_s"])


def run_side_json(side: str, args: argparse.Namespace, **opts: Any) -> dict[str, Any]:
    """Run one side of a comparison in a fresh process; return what it printed."""
    cmd = [
        sys.executable,
        "-m",
        "dataserver.bench.side",
        side,
        "--workers",
        str(args.workers),
        "--batch-size",
        str(args.batch_size),
        "--image-size",
        str(args.image_size),
        "--batches",
        str(args.batches),
    ]
    for key, value in opts.items():
        cmd += [f"--{key.replace('_', '-')}", str(value)]
    out = subprocess.run(cmd, capture_output=True, text=True, timeout=600, check=False)
    lines = [line for line in out.stdout.splitlines() if line.startswith("{")]
    if out.returncode != 0 or not lines:
        raise RuntimeError(f"bench side {side} failed:\n{out.stderr[-2000:]}")
    return dict(json.loads(lines[-1]))


def fig_dataloader(args: argparse.Namespace, spec: str) -> dict[str, Any]:
    """images/s vs DataLoader(num_workers=W), and vs W x the single-process rate."""
    proc, address = start_server(["--dataset", spec, "--workers", str(args.workers)])
    ours: list[float] = []
    theirs: list[float] = []
    singles: list[float] = []
    try:
        for _ in range(ROUNDS):
            ours.append(run_side("dataserver", args, address=address))
            theirs.append(run_side("dataloader", args, spec=spec))
            singles.append(run_side("single", args, spec=spec))
    finally:
        stop_server(proc)
    ds, dl, single = (statistics.median(x) for x in (ours, theirs, singles))
    return {
        "dataserver_images_per_s": round(ds, 1),
        "dataloader_images_per_s": round(dl, 1),
        "single_process_images_per_s": round(single, 1),
        "vs_dataloader": round(ds / dl, 3),
        "vs_physical_limit": round(ds / (args.workers * single), 3),
        "rounds": {
            "dataserver": [round(x, 1) for x in ours],
            "dataloader": [round(x, 1) for x in theirs],
            "single_process": [round(x, 1) for x in singles],
        },
    }


def fig_feedback(args: argparse.Namespace, spec: str) -> dict[str, Any]:
    """samples/s with the mode flipping on ~20% of steps vs one constant mode, same server,
    and the source decodes the flips cost (decoded by the server minus samples delivered)."""
    from dataserver.admin import fetch_stats

    proc, address = start_server(["--dataset", spec, "--workers", str(args.workers)])
    runs: dict[str, list[dict[str, Any]]] = {"flips": [], "regular": [], "stitch": []}
    try:
        for r in range(ROUNDS):
            for name, flip, mode in (
                ("flips", 0.2, "regular"),
                ("regular", 0.0, "regular"),
                ("stitch", 0.0, "stitch"),
            ):
                before = fetch_stats(address, 10)["counters"].get("sources_decoded", 0)
                out = run_side_json(
                    "feedback", args, address=address, flip_rate=flip, mode=mode, seed=r
                )
                after = fetch_stats(address, 10)["counters"].get("sources_decoded", 0)
                out["decoded"] = after - before
                runs[name].append(out)
    finally:
        stop_server(proc)

    def med(name: str, key: str) -> float:
        return statistics.median(float(o[key]) for o in runs[name])

    # What the same batches would cost at each mode's constant-mode speed: the ratio
    # isolates the price of switching from the (large) difference between the modes.
    regular_bps = statistics.median(o["regular_batches"] / o["elapsed"] for o in runs["regular"])
    stitch_bps = statistics.median(o["stitch_batches"] / o["elapsed"] for o in runs["stitch"])
    vs_mix = [
        (o["regular_batches"] / regular_bps + o["stitch_batches"] / stitch_bps) / o["elapsed"]
        for o in runs["flips"]
    ]
    extra = [o["decoded"] / max(1, o["total_samples"]) - 1 for o in runs["flips"]]
    per_flip = [
        (o["decoded"] - o["total_samples"]) / max(1, o["total_flips"]) for o in runs["flips"]
    ]
    steady = [o["decoded"] / max(1, o["total_samples"]) - 1 for o in runs["regular"]]
    return {
        "flips_vs_constant_modes": round(statistics.median(vs_mix), 3),
        "flips_samples_per_s": round(med("flips", "samples_per_s"), 1),
        "regular_samples_per_s": round(med("regular", "samples_per_s"), 1),
        "stitch_samples_per_s": round(med("stitch", "samples_per_s"), 1),
        "flip_rate": round(statistics.median(o["flips"] / args.batches for o in runs["flips"]), 3),
        "stitched_share": round(
            statistics.median(o["stitch_batches"] / args.batches for o in runs["flips"]), 3
        ),
        "extra_decodes_per_sample_with_flips": round(statistics.median(extra), 3),
        "extra_decodes_per_flip": round(statistics.median(per_flip), 1),
        "extra_decodes_per_sample_without_flips": round(statistics.median(steady), 3),
        "note": "flips_vs_constant_modes = (time the flip run's batches take at constant-mode "
        "speed) / (time they took); samples/s counts dataset samples (a stitched image holds k)",
    }


def fig_first_batch(args: argparse.Namespace, spec: str) -> dict[str, Any]:
    """Time from a new client to its first batch, against a running, idle server."""
    proc, address = start_server(["--dataset", spec, "--workers", str(args.workers)])
    try:
        runs = [run_side_json("first_batch", args, address=address) for _ in range(5)]
    finally:
        stop_server(proc)
    return {
        "first_batch_ms": round(statistics.median(r["first_batch_ms"] for r in runs), 1),
        "handshake_ms": round(statistics.median(r["handshake_ms"] for r in runs), 1),
        "runs_ms": [round(r["first_batch_ms"], 1) for r in runs],
    }


def fig_coordination(args: argparse.Namespace, spec: str) -> dict[str, Any]:
    """4 servers x 8 workers, samples that take 10 ms each (sleeping, not computing): the
    samples/s one client gets vs the ideal 32 x 100 = 3,200/s."""
    servers, workers, ms = 4, 8, 10.0
    dataset_args = json.dumps({"n": 8192, "ms": ms, "size": 32})
    started = []
    try:
        for _ in range(servers):
            started.append(
                start_server(
                    [
                        "--dataset",
                        "dataserver.data.simulated:simulated",
                        "--dataset-args",
                        dataset_args,
                        "--workers",
                        str(workers),
                    ],
                    timeout=120,
                )
            )
        addresses = ",".join(address for _, address in started)
        coord = argparse.Namespace(**{**vars(args), "batch_size": 64, "image_size": 32})
        rates = [
            run_side(
                "dataserver", coord, address=addresses, client_args=json.dumps({"prefetch": 2})
            )
            for _ in range(ROUNDS)
        ]
    finally:
        for proc, _ in started:
            stop_server(proc)
    ideal = servers * workers * 1000.0 / ms
    rate = statistics.median(rates)
    return {
        "samples_per_s": round(rate, 1),
        "ideal_samples_per_s": ideal,
        "vs_ideal": round(rate / ideal, 3),
        "rounds": [round(r, 1) for r in rates],
    }


def fig_transport(args: argparse.Namespace, spec: str) -> dict[str, Any]:
    """Delivered GB/s of pre-decoded samples (no decode: pixels in memory, letterboxed at
    their own size) vs raw ZeroMQ PUSH/PULL of same-sized frames from as many processes."""
    nbytes = 3 * args.image_size * args.image_size
    dataset_args = json.dumps({"n": 32, "size": args.image_size})
    proc, address = start_server(
        [
            "--dataset",
            "dataserver.data.simulated:predecoded",
            "--dataset-args",
            dataset_args,
            "--workers",
            str(args.workers),
        ]
    )
    ours: list[float] = []
    raw: list[float] = []
    try:
        for _ in range(ROUNDS):
            ours.append(run_side("dataserver", args, address=address) * nbytes)
            raw.append(run_side("rawzmq", args))
    finally:
        stop_server(proc)
    o, r = statistics.median(ours), statistics.median(raw)
    return {
        "dataserver_gb_per_s": round(o / 1e9, 3),
        "raw_zmq_gb_per_s": round(r / 1e9, 3),
        "vs_raw_zmq": round(o / r, 3),
        "rounds_gb_per_s": {
            "dataserver": [round(x / 1e9, 3) for x in ours],
            "raw_zmq": [round(x / 1e9, 3) for x in raw],
        },
    }


FIGURES: dict[str, Callable[[argparse.Namespace, str], dict[str, Any]]] = {
    "dataloader": fig_dataloader,
    "feedback": fig_feedback,
    "first_batch": fig_first_batch,
    "coordination": fig_coordination,
    "transport": fig_transport,
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

"""``dataserver demo``: a server on the embedded synthetic set and a short training loop of
a small real detector against it, steering stitching by Stitcher's feedback rule.

This module runs on the trainer side, so it may import torch (via dataserver_client); the
server it starts is a separate ``dataserver serve`` process that never does.
"""

from __future__ import annotations

import argparse
import math
import subprocess
import sys
import threading
import time
from typing import Any

from dataserver.server import parse_ready_line


def start_server(args: list[str], timeout: float = 60.0) -> tuple[subprocess.Popen[str], str]:
    """Start ``dataserver serve`` with ``args`` on a free port; return it and its address."""
    proc = subprocess.Popen(
        [sys.executable, "-m", "dataserver.cli", "serve", "--bind", "tcp://127.0.0.1:0", *args],
        stdout=subprocess.PIPE,
        text=True,
    )
    found: list[str] = []
    ready = threading.Event()

    def read() -> None:
        assert proc.stdout is not None
        for line in proc.stdout:
            if line.startswith("dataserver ready"):
                found.append(line.strip())
                ready.set()
        ready.set()

    threading.Thread(target=read, daemon=True).start()
    if not ready.wait(timeout) or not found:
        stop_server(proc)
        raise RuntimeError("the demo server did not start (see its messages above)")
    return proc, parse_ready_line(found[0])["data"]


def stop_server(proc: subprocess.Popen[str]) -> None:
    if proc.poll() is None:
        proc.terminate()
        try:
            proc.wait(15)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


def run_demo(args: argparse.Namespace) -> int:
    import torch

    from dataserver_client import DataServerClient
    from dataserver_client.tinydet import TinyDetector

    plot = getattr(args, "plot", None)
    if plot:
        try:
            import matplotlib  # noqa: F401
        except ImportError:
            print(
                'dataserver demo --plot needs matplotlib: pip install "dataserver[plot]" '
                "(or pip install matplotlib)",
                file=sys.stderr,
            )
            return 2
    torch.manual_seed(0)
    print(
        f"starting `dataserver serve --workers {args.workers}` on 1024 synthetic images ...",
        flush=True,
    )
    proc, address = start_server(
        ["--dataset", "synthetic:images=1024,seed=0", "--workers", str(args.workers)]
    )
    try:
        return _train(args, address, torch, DataServerClient, TinyDetector)
    finally:
        stop_server(proc)
        print("server stopped.")


def _train(
    args: argparse.Namespace, address: str, torch: Any, client_cls: Any, model_cls: Any
) -> int:
    from dataserver_client import iterate_epochs

    size = (args.image_size, args.image_size)
    model = model_cls()
    optimizer = torch.optim.Adam(model.parameters(), lr=2e-3)
    print(
        f"server ready at {address}; training TinyDetector on CPU, batch {args.batch_size}, {size[0]}x{size[1]}"
    )
    print(
        f"Stitcher rule: stitch the next batch when the small-object loss ratio < tau = {args.threshold}"
    )
    print(
        "(the paper uses tau = 0.1 on COCO; this synthetic set is mostly small objects, so its ratio\n"
        " sits near 0.8 and a higher tau shows the rule at work)\n"
    )
    print(" step  mode     imgs  samples  loss    ratio  -> next     img/s")
    stale = 0
    counts = {"regular": 0, "stitch": 0}
    switches = 0
    samples = 0
    decided: str | None = None
    ratios: list[float] = []
    modes: list[str] = []
    t0 = time.perf_counter()
    with client_cls(
        address,
        batch_size=args.batch_size,
        image_size=size,
        device="cpu",
        stitch_threshold=args.threshold,
    ) as client:
        batches = iterate_epochs(client)
        for step in range(args.steps):
            batch = next(batches)
            if decided is not None and batch.mode != decided:
                stale += 1
            loss, ratio = model.loss(batch.images, batch.targets)
            optimizer.zero_grad()
            loss.backward()
            optimizer.step()
            nxt = client.feedback(ratio)
            switches += nxt != batch.mode
            counts[batch.mode] += 1
            samples += batch.num_samples
            decided = nxt
            ratios.append(ratio)
            modes.append(batch.mode)
            rate = samples / (time.perf_counter() - t0)
            shown = "  n/a" if math.isnan(ratio) else f"{ratio:5.3f}"
            print(
                f"{step:5d}  {batch.mode:<8} {len(batch):4d}  {batch.num_samples:7d}  {loss.item():6.3f}  {shown}"
                f"  -> {nxt:<8} {rate:6.0f}",
                flush=True,
            )
    elapsed = time.perf_counter() - t0
    print(
        f"\n{args.steps} batches in {elapsed:.1f} s: {counts['regular']} regular, {counts['stitch']} stitched, "
        f"{switches} mode switches; {samples} samples ({samples / elapsed:.0f} samples/s with training)."
    )
    print(f"every batch had the mode decided by the feedback before it: {stale} stale batches.")
    plot = getattr(args, "plot", None)
    if plot:
        plot_timeline(plot, ratios, modes, args.threshold)
        print(f"timeline: {plot}")
    return 0 if stale == 0 else 1


def plot_timeline(path: Any, ratios: list[float], modes: list[str], threshold: float) -> None:
    """Draw the demo's steps into ``path`` (any format matplotlib writes): the small-object
    loss ratio of each step against the threshold, and the mode each batch had. A step
    whose ratio is under the threshold is followed by a stitched one."""
    if len(ratios) != len(modes):
        raise ValueError(f"one mode per ratio: {len(ratios)} ratios, {len(modes)} modes")
    import matplotlib

    matplotlib.use("Agg")  # files only, no display
    import matplotlib.pyplot as plt

    steps = list(range(len(ratios)))
    stitched = [1 if m == "stitch" else 0 for m in modes]
    fig, (top, bottom) = plt.subplots(
        2, 1, sharex=True, figsize=(10, 4.8), gridspec_kw={"height_ratios": [3, 1]}
    )
    for step, s in zip(steps, stitched, strict=True):
        if s:
            top.axvspan(step - 0.5, step + 0.5, color="tab:orange", alpha=0.15, lw=0)
    top.plot(steps, ratios, marker=".", color="tab:blue", label="small-object loss ratio")
    top.axhline(threshold, color="tab:red", ls="--", label=f"threshold tau = {threshold:g}")
    top.set_ylabel("ratio")
    top.set_title("dataserver demo: below tau at step t, stitched at step t + 1 (shaded)")
    top.legend(loc="best")
    bottom.step(steps, stitched, where="mid", color="tab:orange")
    bottom.set_yticks([0, 1], ["regular", "stitch"])
    bottom.set_ylim(-0.3, 1.3)
    bottom.set_xlabel("step")
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)

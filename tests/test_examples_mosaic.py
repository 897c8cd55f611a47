"""The examples' multi-scale and mosaic modes, run for real against a server:
``train_detector.py --multiscale``, ``yolo_loop.py`` (mosaic, then close-mosaic) and
``mmengine_train.py --close-mosaic N --multiscale``."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

pytestmark = pytest.mark.timeout(300)

EXAMPLES = Path(__file__).resolve().parent.parent / "examples"
N_IMAGES = 32


def run_example(name: str, *args: str) -> str:
    proc = subprocess.run(
        [sys.executable, str(EXAMPLES / name), *args],
        capture_output=True,
        text=True,
        timeout=240,
    )
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    return proc.stdout


def test_train_detector_multiscale_trains_on_changing_sizes(start_server: Any) -> None:
    server = start_server("--dataset", f"synthetic:images={2 * N_IMAGES},seed=0", workers=2)
    out = run_example(
        "train_detector.py",
        *("--servers", server.address, "--model", "tiny", "--epochs", "2"),
        *("--batch-size", "4", "--image-size", "64", "--threshold", "0.9", "--multiscale"),
    )
    assert "multi-scale: image_size=MultiScale([[48, 48], [56, 56], [64, 64]" in out
    sizes = set(re.findall(r"^epoch \d+ step +\d+ \w+ +(\d+x\d+) ", out, re.M))
    assert sizes <= {f"{s}x{s}" for s in (48, 56, 64, 72, 80)} and len(sizes) >= 2, out
    assert out.rstrip().splitlines()[-1] == (
        f"trained 2 epochs, {4 * N_IMAGES} samples on 1 ranks, 0 stale"
    )


def test_yolo_loop_mosaic_then_close_mosaic(start_server: Any) -> None:
    server = start_server("--dataset", f"synthetic:images={N_IMAGES},seed=0", workers=2)
    out = run_example(
        "yolo_loop.py",
        *("--servers", server.address, "--epochs", "3", "--close-mosaic", "1"),
        *("--batch-size", "4", "--image-size", "64", "--multiscale"),
    )
    epochs = re.findall(
        r"^epoch (\d+): (\d+)/(\d+) batches mosaic \((\d+)%\), (\d+) samples", out, re.M
    )
    # Mosaic (4 samples an image: a quarter of the batches) until epoch 3 - 1, then regular.
    assert epochs == [
        ("0", "2", "2", "100", str(N_IMAGES)),
        ("1", "2", "2", "100", str(N_IMAGES)),
        ("2", "0", "8", "0", str(N_IMAGES)),
    ], out
    assert out.rstrip().splitlines()[-1] == (
        f"trained 3 epochs, {3 * N_IMAGES} samples on 1 ranks, 0 stale"
    )


def test_mmengine_example_closes_mosaic_at_its_epoch(start_server: Any) -> None:
    pytest.importorskip("mmengine")
    server = start_server("--dataset", f"synthetic:images={N_IMAGES},seed=2", workers=2)
    out = run_example(
        "mmengine_train.py",
        *("--servers", server.address, "--epochs", "3", "--close-mosaic", "1"),
        *("--batch-size", "4", "--image-size", "64", "--multiscale"),
    )
    iters = re.findall(
        r"^iter +\d+ +epoch (\d+) +(\w+) +(\d+)x(\d+) +4 imgs +(\d+) samples", out, re.M
    )
    assert [(e, m, n) for e, m, _, _, n in iters] == (
        [("0", "stitch", "16")] * 2 + [("1", "stitch", "16")] * 2 + [("2", "regular", "4")] * 8
    ), out
    assert {int(h) for _, _, h, _, _ in iters} <= {48, 56, 64, 72, 80}
    assert "12 iterations: 8 regular, 4 mosaic batches" in out
    assert "0 stale batches" in out

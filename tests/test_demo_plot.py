"""``dataserver demo --plot FILE``: the ratio, the threshold and the mode of every step in
one picture when matplotlib is installed, and one clear line when it is not."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from dataserver.demo import plot_timeline

pytestmark = pytest.mark.timeout(300)

PNG = b"\x89PNG\r\n\x1a\n"


def test_plot_timeline_draws_ratio_threshold_and_mode(tmp_path: Path) -> None:
    pytest.importorskip("matplotlib")
    out = tmp_path / "timeline.png"
    ratios = [0.9, 0.7, float("nan"), 0.8, 0.6, 0.9]
    modes = ["regular", "regular", "stitch", "regular", "regular", "stitch"]
    plot_timeline(out, ratios, modes, threshold=0.75)
    assert out.read_bytes().startswith(PNG)
    with pytest.raises(ValueError, match="one mode per ratio"):
        plot_timeline(out, ratios, modes[:-1], threshold=0.75)


def test_demo_plot_writes_the_timeline(tmp_path: Path) -> None:
    pytest.importorskip("matplotlib")
    out = tmp_path / "timeline.png"
    proc = subprocess.run(
        [sys.executable, "-m", "dataserver.cli", "demo", "--steps", "8", "--plot", str(out)],
        capture_output=True,
        text=True,
        timeout=240,
    )
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-2000:]
    assert "0 stale batches" in proc.stdout
    assert f"timeline: {out}" in proc.stdout
    assert out.read_bytes().startswith(PNG) and out.stat().st_size > 10_000


def test_demo_plot_without_matplotlib_says_what_to_install(tmp_path: Path) -> None:
    # A matplotlib that cannot be imported, ahead of any installed one.
    fake = tmp_path / "site" / "matplotlib"
    fake.mkdir(parents=True)
    (fake / "__init__.py").write_text("raise ImportError('No module named matplotlib')\n")
    out = tmp_path / "timeline.png"
    proc = subprocess.run(
        [sys.executable, "-m", "dataserver.cli", "demo", "--plot", str(out)],
        capture_output=True,
        text=True,
        timeout=60,
        env={"PYTHONPATH": str(tmp_path / "site"), "PATH": "/usr/bin:/bin"},
    )
    assert proc.returncode == 2
    assert "matplotlib" in proc.stderr and 'pip install "dataserver[plot]"' in proc.stderr
    assert len(proc.stderr.strip().splitlines()) == 1
    assert "starting" not in proc.stdout and not out.exists()

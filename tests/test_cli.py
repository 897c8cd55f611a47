"""The command line: every command has --help; synth writes a COCO set; stats reads counters."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
from clients import make_client

pytestmark = pytest.mark.timeout(120)


def run(*args: str, timeout: float = 60) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "dataserver.cli", *args],
        capture_output=True,
        text=True,
        timeout=timeout,
    )


@pytest.mark.parametrize(
    "command", ["serve", "synth", "shards", "demo", "stats", "bench", "keygen"]
)
def test_every_command_prints_help(command: str) -> None:
    proc = run(command, "--help")
    assert proc.returncode == 0 and "usage: dataserver " + command in proc.stdout


def test_synth_writes_coco_jpegs_with_small_and_large_objects(tmp_path: Path) -> None:
    proc = run("synth", str(tmp_path), "--images", "12", "--seed", "4")
    assert proc.returncode == 0, proc.stderr
    doc = json.loads((tmp_path / "annotations.json").read_text())
    assert len(doc["images"]) == 12
    assert "12/12" in proc.stderr  # progress, as it writes
    assert all((tmp_path / im["file_name"]).read_bytes()[:2] == b"\xff\xd8" for im in doc["images"])
    areas = [a["area"] for a in doc["annotations"]]
    assert min(areas) < 32 * 32 and max(areas) > 96 * 96  # COCO's small and large
    assert {"bbox", "category_id", "image_id", "iscrowd"} <= set(doc["annotations"][0])
    # Deterministic in the seed.
    again = tmp_path / "again"
    run("synth", str(again), "--images", "12", "--seed", "4")
    assert json.loads((again / "annotations.json").read_text())["annotations"] == doc["annotations"]


def test_coco_drops_crowd_and_empty_boxes(start_server: Any, tmp_path: Path) -> None:
    run("synth", str(tmp_path), "--images", "2", "--seed", "0")
    doc = json.loads((tmp_path / "annotations.json").read_text())
    doc["annotations"] = [
        {"id": 1, "image_id": 1, "category_id": 3, "bbox": [10, 10, 20, 30], "iscrowd": 0},
        {"id": 2, "image_id": 1, "category_id": 4, "bbox": [50, 50, 100, 100], "iscrowd": 1},
        {"id": 3, "image_id": 1, "category_id": 5, "bbox": [5, 5, 0, 10], "iscrowd": 0},
    ]
    (tmp_path / "annotations.json").write_text(json.dumps(doc))
    server = start_server(
        "--dataset", f"coco:{tmp_path / 'annotations.json'}:{tmp_path}", workers=1
    )
    with make_client(server.address, batch_size=2, image_size=(480, 640), shuffle=False) as c:
        c.set_epoch(0)
        batch = next(iter(c))
    first = batch.targets[0]
    assert first["labels"].tolist() == [3]
    box = first["boxes"][0].tolist()
    w = doc["images"][0]["width"]
    scale = min(480 / doc["images"][0]["height"], 640 / w)
    plain = [v * scale for v in (10, 10, 30, 40)]
    flipped = [v * scale for v in (w - 30, 10, w - 10, 40)]  # the flip may have drawn it
    assert box == pytest.approx(plain, rel=1e-3) or box == pytest.approx(flipped, rel=1e-3)
    assert len(batch.targets[1]["boxes"]) == 0


def test_stats_prints_a_live_servers_counters(synthetic_server: Any) -> None:
    with make_client(synthetic_server.address, batch_size=8, image_size=(32, 32)) as c:
        c.set_epoch(0)
        list(c)
    proc = run("stats", synthetic_server.address, "--json")
    assert proc.returncode == 0, proc.stderr
    stats = json.loads(proc.stdout)
    assert stats["workers_alive"] == 2 and stats["counters"]["images_done"] >= 96
    text = run("stats", synthetic_server.address).stdout
    assert "workers        2/2 alive" in text and "images_done" in text and "queue depth" in text


def test_stats_of_a_dead_address_fails_clearly() -> None:
    from conftest import free_port

    proc = run("stats", f"tcp://127.0.0.1:{free_port()}", "--timeout", "0.5")
    assert proc.returncode == 1 and "no answer from" in proc.stderr


def test_demo_exits_cleanly_and_shows_both_modes() -> None:
    proc = run("demo", "--steps", "40", timeout=110)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-2000:]
    timeline = [line.split() for line in proc.stdout.splitlines() if line[:5].strip().isdigit()]
    assert len(timeline) == 40
    modes = [row[1] for row in timeline]
    assert {"regular", "stitch"} <= set(modes)
    # Zero stale: each batch has the mode the previous step's feedback decided.
    decided = [row[row.index("->") + 1] for row in timeline]
    assert modes[1:] == decided[:-1]
    assert "0 stale batches" in proc.stdout and "server stopped." in proc.stdout


def test_serve_control_bind_is_deprecated_warns_and_still_serves(start_server: Any) -> None:
    """``--control-bind`` (in the contract's ``serve`` synopsis) is accepted, says on stderr
    that it is deprecated and ignored (CONTROL travels on each data connection), binds
    nothing, and the server serves and is steered as without it."""
    import socket

    from conftest import free_port

    port = free_port()
    server = start_server(
        "--dataset",
        "synthetic:images=16,seed=1",
        "--control-bind",
        f"tcp://127.0.0.1:{port}",
        workers=1,
    )
    err = server.read_stderr()
    assert "--control-bind is deprecated and ignored" in err, err
    assert "CONTROL on each data connection" in err, err
    with pytest.raises(ConnectionRefusedError), socket.create_connection(("127.0.0.1", port), 2):
        pass  # nothing listens where the control endpoint was
    with make_client(server.address, batch_size=8, image_size=(32, 32)) as c:
        c.set_epoch(0)
        it = iter(c)
        first = next(it)
        c.feedback(0.0)  # steered on the data connection
        c.control(flag=1)
        got = [first, *it]
    assert sorted(i for b in got for idx in b.indices for i in idx) == list(range(16))
    assert server.stats()["counters"]["controls"] >= 1

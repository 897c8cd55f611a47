"""``dataserver bench`` runs end to end on a tiny configuration and reports its ratios
(the figures themselves are measured by hand, never asserted)."""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest


@pytest.mark.timeout(420)
def test_bench_reports_every_figure(tmp_path: Path) -> None:
    out = tmp_path / "bench.json"
    cmd = [sys.executable, "-m", "dataserver.cli", "bench", "--images", "24", "--batches", "3"]
    cmd += ["--image-size", "64", "--batch-size", "4", "--workers", "1", "--json", str(out)]
    cmd += ["--rounds", "1", "--flip-images", "64", "--first-epoch-images", "64"]
    cmd += ["--only", "dataloader,overhead,cache,feedback,flip_stall,first_batch"]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=400)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-2000:]
    results = json.loads(out.read_text())
    assert results["dataloader"]["vs_dataloader"] > 0
    assert results["dataloader"]["vs_physical_limit"] > 0
    assert results["dataloader"]["client_cpu_us_per_image"] >= 0  # (10 ms CPU clock ticks)
    peers = results["dataloader"]
    assert peers["physical_limit_images_per_s"] > 0 and peers["dataloader_vs_physical_limit"] > 0
    assert peers["cpu_ms_per_image_single_process"] > 0  # (its own CPU clock: no ticks)
    assert isinstance(peers["sanity"], (str, list)) and "limit" in peers["others_cpu_share"]
    # A fresh server with default flags, all of its epoch 0 (64 images, 4 a batch, less
    # the warm-up), and the store's first-lap cost against the same without a store.
    assert peers["default_first_epoch_vs_physical_limit"] > 0
    assert peers["first_epoch_timed_images"] == 64 - 3 * 4
    assert "store_first_lap_cpu_ms_per_image" in peers
    if importlib.util.find_spec("spdl") is None:
        assert "spdl is not installed" in peers["spdl_skipped"]
    else:  # the first batch of every run checked against compose_one, pixel for pixel
        assert peers["spdl_images_per_s"] > 0 and peers["spdl_pixels_checked"] == 4
    assert results["overhead"]["front_us_per_sample"] >= 0
    assert results["overhead"]["dataloader_us_per_sample"] > 0
    assert results["cache"]["cached_vs_dataloader"] > 0
    assert 0 < results["cache"]["store_hit_rate"] <= 1
    assert "store_hit_rate_after_epoch_1" in results["cache"]
    assert results["feedback"]["flips_vs_constant_modes"] > 0
    # the same on a store of a quarter of the set (the lookahead on)
    assert results["feedback"]["quarter_store"]["flips_vs_constant_modes"] > 0
    assert results["flip_stall"]["step_150ms_lookahead_on_quarter_store"]["flips"] >= 0
    assert results["first_batch"]["first_batch_ms"] > 0
    stall = results["flip_stall"]["step_150ms_lookahead_on"]
    assert stall["flips"] >= 0 and stall["wait_after_no_flip_ms"]["median"] is not None
    assert "vs_dataloader" in proc.stdout and "round 1/1: dataloader" in proc.stdout


@pytest.mark.timeout(180)
def test_bench_augment_figure(tmp_path: Path) -> None:
    """The Albumentations figure, on its own (it starts two servers): both rates, or the
    reason it was skipped when albumentations is not installed."""
    out = tmp_path / "bench.json"
    cmd = [sys.executable, "-m", "dataserver.cli", "bench", "--images", "24", "--batches", "3"]
    cmd += ["--image-size", "64", "--batch-size", "4", "--workers", "1", "--json", str(out)]
    cmd += ["--rounds", "1", "--only", "augment"]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=170)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-2000:]
    figure = json.loads(out.read_text())["augment"]
    if importlib.util.find_spec("albumentations") is None:
        assert "albumentations is not installed" in figure["skipped"]
        return
    assert figure["vs_dataloader"] > 0 and figure["stored_vs_dataloader"] > 0
    assert "round 1/1: dataloader" in proc.stdout


def test_unknown_figure_is_refused() -> None:
    proc = subprocess.run(
        [sys.executable, "-m", "dataserver.cli", "bench", "--only", "nope"],
        capture_output=True,
        text=True,
    )
    assert proc.returncode == 2 and "unknown figure" in proc.stdout


@pytest.mark.timeout(180)
def test_bench_multiscale_figure(tmp_path: Path) -> None:
    """The size-change figure on a tiny configuration: both cases report their waits."""
    out = tmp_path / "bench.json"
    cmd = [sys.executable, "-m", "dataserver.cli", "bench", "--images", "24", "--batches", "6"]
    cmd += ["--image-size", "64", "--batch-size", "4", "--workers", "1", "--json", str(out)]
    cmd += ["--rounds", "1", "--only", "multiscale"]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=170)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-2000:]
    figure = json.loads(out.read_text())["multiscale"]
    assert len(figure["sizes"]) >= 2
    for case in ("scheduled", "unscheduled"):
        assert figure[case]["wait_after_no_change_ms"]["median"] is not None
    # (the schedule is a pure function of seed 0: its draws over these steps change size)
    assert figure["scheduled"]["changes"] >= 1


@pytest.mark.timeout(150)
def test_bench_scale_figure(tmp_path: Path) -> None:
    """The scale figure on a tiny configuration: (a) a front's CPU per task, (b) the real
    client's CPU per task against fake servers, (c) fds and memory per session."""
    out = tmp_path / "bench.json"
    cmd = [sys.executable, "-m", "dataserver.cli", "bench", "--only", "scale", "--json", str(out)]
    cmd += ["--images", "8", "--scale-sessions", "40", "--scale-servers", "1,4"]
    cmd += ["--scale-clients", "8"]
    cmd += ["--scale-workers", "1", "--scale-seconds", "1", "--scale-batches", "20"]
    cmd += ["--scale-rate-servers", "2", "--scale-rate", "100"]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=140)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-2000:]
    figure = json.loads(out.read_text())["scale"]
    assert figure["a_direct_tasks_per_s"] > 0 and figure["a_forwarded_tasks_per_s"] > 0
    assert figure["a_direct_results_sent_direct"] > 0.5  # the swarm reaches the worker
    assert figure["a_forwarded_results_sent_direct"] == 0
    assert set(figure["b_client_us_per_task"]) == {"1", "4"}
    assert all(v > 0 for v in figure["b_client_us_per_task"].values())
    # At a fixed rate: CPU per task net of the idle CPU, idle CPU per server, fds a server.
    assert set(figure["b_rate_us_per_task"]) == {"2"} and figure["b_rate_fds_per_server"]["2"] > 0
    assert figure["b_rate_idle_us_per_s_per_server"]["2"] >= 0  # (1 s: may be under a tick)
    assert figure["b_rate_tasks_per_s"]["2"] > 0
    assert figure["b_check_client_us_per_task_real"] > 0
    assert figure["c_sessions"] == 40 == figure["c_sessions_on_server"]
    # Each session holds its data connection on the front (CONTROL rides it), and one on
    # each worker: a connection each, not the two on the front a client with a PUB held.
    assert 0.9 <= figure["c_front_fds_per_session"] < 1.5, figure["c_front_fds_per_session"]
    assert figure["c_worker_fds_per_session"] >= 0.9
    assert figure["c_heartbeats_handled_per_s"] > 0
    assert "c_front_us_per_heartbeat" in proc.stdout and "b_client_us_per_task" in proc.stdout


def test_sanity_flags_what_cannot_be() -> None:
    """A system above the physical limit is a broken reference (or, with other processes
    busy, a noisy run); one spending less CPU per image than a single process misses one of
    its processes in the count."""
    from dataserver.bench.peers import sanity

    rates = {"limit": 900.0, "dataserver": 850.0, "dataloader": 700.0}
    cpu = {"dataserver": 2.3, "dataloader": 3.0}
    quiet = {"limit": 0.01, "dataserver": 0.02, "dataloader": 0.0}
    assert sanity(rates, cpu, 2.1, quiet) == []
    [above] = sanity({**rates, "dataserver": 1000.0}, cpu, 2.1, quiet)
    assert above.startswith("dataserver at 1.111 of the physical limit") and "broken" in above
    [noisy] = sanity({**rates, "dataserver": 1000.0}, cpu, 2.1, {**quiet, "limit": 0.5})
    assert "limit 50%" in noisy and "quiet machine" in noisy
    [cheap] = sanity(rates, {**cpu, "dataloader": 1.5}, 2.1, quiet)
    assert cheap.startswith("dataloader spends 1.50 CPU ms") and "not counted" in cheap


@pytest.mark.timeout(180)
def test_bench_close_mosaic_figure(tmp_path: Path) -> None:
    """A trainer that steered the mode once against one that never did: both rates, and
    the images composed per image delivered for each."""
    out = tmp_path / "bench.json"
    cmd = [sys.executable, "-m", "dataserver.cli", "bench", "--images", "48", "--batches", "3"]
    cmd += ["--image-size", "64", "--batch-size", "4", "--workers", "1", "--json", str(out)]
    cmd += ["--rounds", "1", "--only", "close_mosaic"]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=170)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-2000:]
    figure = json.loads(out.read_text())["close_mosaic"]
    assert figure["steered_once_vs_never"] > 0
    assert figure["composed_per_delivered_steered_once"] > 0
    assert figure["composed_per_delivered_never_steered"] > 0


@pytest.mark.timeout(420)
def test_bench_ultralytics_figure(tmp_path: Path) -> None:
    """Ultralytics' own loader against DataServerTrainer's, mosaic and regular, first epoch
    and epoch 2: both rates and both CPU costs in each case."""
    pytest.importorskip("ultralytics")
    out = tmp_path / "bench.json"
    cmd = [sys.executable, "-m", "dataserver.cli", "bench", "--images", "48", "--batches", "3"]
    cmd += ["--image-size", "64", "--batch-size", "4", "--workers", "1", "--json", str(out)]
    cmd += ["--rounds", "1", "--only", "ultralytics"]
    env = {**os.environ, "YOLO_OFFLINE": "1"}
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=400, env=env)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-2000:]
    figure = json.loads(out.read_text())["ultralytics"]
    assert set(figure) == {
        "mosaic_first_epoch",
        "regular_first_epoch",
        "mosaic_epoch2",
        "regular_epoch2",
    }
    for case in figure.values():
        assert case["ultralytics_images_per_s"] > 0 and case["dataserver_images_per_s"] > 0
        # (CPU is read in clock ticks, 10 ms: a window of a few 64x64 images may hold none)
        assert (
            case["ultralytics_cpu_ms_per_image"] >= 0 and case["dataserver_cpu_ms_per_image"] >= 0
        )
        assert case["vs_ultralytics"] > 0


@pytest.mark.timeout(300)
def test_bench_remote_figure(tmp_path: Path) -> None:
    """The object-store figure on a tiny configuration: loose objects and shards in a real
    S3 API behind 30 ms, against local disk; epoch 2 read from the fetch cache."""
    out = tmp_path / "bench.json"
    cmd = [sys.executable, "-m", "dataserver.cli", "bench", "--images", "16", "--batches", "3"]
    cmd += ["--image-size", "64", "--batch-size", "4", "--workers", "1", "--json", str(out)]
    cmd += ["--rounds", "1", "--only", "remote"]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=280)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-2000:]
    figure = json.loads(out.read_text())["remote"]
    assert figure["images"] == 16
    for side in ("loose", "shards"):
        assert figure[f"{side}_epoch1_vs_local"] > 0 and figure[f"{side}_epoch2_vs_local"] > 0
        assert figure[f"{side}_epoch1_requests"] >= (16 if side == "loose" else 1)
        assert figure[f"{side}_epoch2_requests"] == 0  # (the fetch cache holds the set)
        assert 0 < figure[f"{side}_peak_bytes_in_flight"] <= figure["max_bytes_in_flight"]
        assert 0 < figure[f"{side}_peak_fetches_in_flight"] <= figure["max_fetches"]
    assert figure["shards_epoch1_requests"] <= 16  # (by the block: never more than one a sample)
    assert figure["dataloader_obstore_images_per_s"] > 0  # (the peer: obstore in a DataLoader)
    assert figure["webdataset_images_per_s"] > 0  # (WebDataset's pipeline on the shards)
    assert figure["shards_epoch1_vs_webdataset"] > 0


@pytest.mark.timeout(300)
def test_bench_slow_server_figure(tmp_path: Path) -> None:
    """The slow-server figure on a tiny configuration: every case reports both sides (hedging
    on and off) against the healthy server alone (run in the same rounds as the case) and a
    healthy pair."""
    out = tmp_path / "bench.json"
    cmd = [sys.executable, "-m", "dataserver.cli", "bench", "--images", "8", "--batch-size", "8"]
    cmd += ["--rounds", "1", "--slow-seconds", "0.5", "--json", str(out), "--only", "slow_server"]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=280)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-2000:]
    figure = json.loads(out.read_text())["slow_server"]
    assert figure["healthy_alone_images_per_s"] > 0
    assert 0 <= figure["extra_work_no_slow_server"] <= 1
    for case in ("healthy_pair", "hold_0.9s", "hold_3s", "tail_5pct_2s", "throttled_10pct"):
        assert figure[case]["healthy_alone_images_per_s"] > 0, case
        for side in ("hedge_on", "hedge_off"):
            assert figure[case][side]["vs_healthy_alone"] > 0, (case, side)
            assert figure[case][side]["p99_wait_ms"] > 0, (case, side)
        assert figure[case]["hedge_off"]["hedged_share"] == 0


@pytest.mark.timeout(200)
def test_bench_index_figure(tmp_path: Path) -> None:
    """The index figure on a tiny configuration: first and cached starts, PSS at 2 and 8
    workers, the first batch, and Ultralytics' label cache beside our index."""
    out = tmp_path / "bench.json"
    cmd = [sys.executable, "-m", "dataserver.cli", "bench", "--only", "index", "--images", "4"]
    cmd += ["--index-images", "2000", "--index-peer-images", "100", "--json", str(out)]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=190)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-2000:]
    figure = json.loads(out.read_text())["index"]
    assert figure["images"] == 2000 and figure["index_mb"] > 0
    for key in (
        "first_start_ready_s",
        "cached_start_ready_s_workers_2",
        "first_batch_after_ready_s",
    ):
        assert figure[key] > 0
    assert figure["pss_all_mb_workers_8"] > figure["pss_all_mb_workers_2"] > 0
    for side in ("ultralytics_cache_build", "ultralytics_cache_load", "dataserver_index_build"):
        assert figure[f"{side}_s"] > 0 and figure[f"{side}_rss_mb"] > 0


@pytest.mark.timeout(420)
def test_bench_transformers_figure(tmp_path: Path) -> None:
    """The Hugging Face guide's DataLoader (Albumentations and the image processor in its
    workers) against DataServerTrainer's loader: both rates, both CPU costs."""
    pytest.importorskip("transformers")
    pytest.importorskip("albumentations")
    out = tmp_path / "bench.json"
    cmd = [sys.executable, "-m", "dataserver.cli", "bench", "--images", "24", "--batches", "3"]
    cmd += ["--image-size", "64", "--batch-size", "4", "--workers", "1", "--json", str(out)]
    cmd += ["--rounds", "1", "--only", "transformers"]
    env = {**os.environ, "HF_HUB_OFFLINE": "1"}
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=400, env=env)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-2000:]
    figure = json.loads(out.read_text())["transformers"]
    assert figure["guide_images_per_s"] > 0 and figure["dataserver_images_per_s"] > 0
    assert figure["guide_cpu_ms_per_image"] >= 0 and figure["dataserver_cpu_ms_per_image"] >= 0
    assert figure["vs_guide"] > 0


@pytest.mark.timeout(420)
def test_bench_rfdetr_figure(tmp_path: Path) -> None:
    """RF-DETR's own training on its RFDETRDataModule (its COCO folder on disk) against
    train_rfdetr on a server of the same images: both training rates, the ratio, the CPU
    split, and what was compared."""
    pytest.importorskip("rfdetr")
    pytest.importorskip("pytorch_lightning")
    out = tmp_path / "bench.json"
    cmd = [sys.executable, "-m", "dataserver.cli", "bench", "--images", "8", "--batches", "2"]
    cmd += ["--image-size", "32", "--batch-size", "4", "--workers", "1", "--json", str(out)]
    cmd += ["--rounds", "1", "--only", "rfdetr"]
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "YOLO_OFFLINE": "1"}
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=400, env=env)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-2000:]
    figure = json.loads(out.read_text())["rfdetr"]
    assert figure["rfdetr_images_per_s"] > 0 and figure["dataserver_images_per_s"] > 0
    assert figure["vs_rfdetr"] > 0
    for side in ("rfdetr", "dataserver"):
        assert figure[f"{side}_trainer_cpu_ms_per_image"] > 0
        assert figure[f"{side}_loader_cpu_ms_per_image"] >= 0
    assert "aug_config={}" in figure["compared"] and "resolution 32" in figure["compared"]

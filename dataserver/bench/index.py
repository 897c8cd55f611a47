"""``dataserver bench --only index``: a large annotation set served from one index per
server (issue 35), side by side with Ultralytics' own label loading of the same boxes.

On a COCO file of ``--index-images`` images x ``--index-boxes`` boxes (``dataserver synth
--annotations-only``: no JPEGs but the first batch's): seconds to the ready line on a first
start (the index built) and from the cached index; all processes' PSS at ``--workers 2``
and ``8``; the PSS a worker adds beyond a worker serving a 1-image set; the first batch
after the ready line. The peer: Ultralytics' ``YOLODataset`` building its ``labels.cache``
and loading it, against ``dataserver index yolo:...``, building and loading its index, on
the first ``--index-peer-images`` images of the same set in YOLO layout (tiny JPEGs:
Ultralytics opens each image), time and peak RSS of each in a process of its own.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import cv2
import numpy as np

from dataserver.admin import child_pids
from dataserver.data.coco import write_coco_annotations
from dataserver.data.cocoindex import coco_columns
from dataserver.data.index import DetectionIndex, SharedIndex, file_source

Progress = Callable[[str], None]
FIRST_BATCH_IMAGES = 64  # JPEGs written for the first batches (the rest are skipped)


def fig_index(args: argparse.Namespace, spec: str, progress: Progress) -> dict[str, Any]:
    out: dict[str, Any] = {"images": args.index_images, "boxes_per_image": args.index_boxes}
    with tempfile.TemporaryDirectory(prefix="ds-bench-index-") as tmp:
        root = Path(tmp)
        t0 = time.monotonic()
        ann = write_coco_annotations(root / "set", args.index_images, 0, args.index_boxes)
        progress(
            f"wrote {ann.stat().st_size / 1e6:.0f} MB of annotations in {time.monotonic() - t0:.0f} s"
        )
        out["annotation_mb"] = round(ann.stat().st_size / 1e6, 1)
        _first_images(root / "set")
        tiny = write_coco_annotations(root / "tiny", 1, 0, args.index_boxes)
        _first_images(root / "tiny", 1)
        cache = root / "cache"
        dataset = f"coco:{ann}"
        first = _start(dataset, 2, cache, measure_batch=True)
        progress(f"first start: ready in {first['ready_s']:.1f} s")
        out["first_start_ready_s"] = first["ready_s"]
        out["first_batch_after_ready_s"] = first["first_batch_s"]
        for workers in (2, 8):
            run = _start(dataset, workers, cache)
            empty = _start(f"coco:{tiny}", workers, cache)
            progress(
                f"cached start, {workers} workers: ready in {run['ready_s']:.2f} s, "
                f"PSS {run['pss_mb']:.0f} MB"
            )
            out[f"cached_start_ready_s_workers_{workers}"] = run["ready_s"]
            # (context: the same server on a 1-image set, the start's floor on this host)
            out[f"one_image_ready_s_workers_{workers}"] = empty["ready_s"]
            out[f"pss_all_mb_workers_{workers}"] = run["pss_mb"]
            out[f"pss_front_mb_workers_{workers}"] = run["front_pss_mb"]
            out[f"pss_worker_mb_workers_{workers}"] = run["worker_pss_mb"]
            out[f"pss_worker_beyond_empty_mb_workers_{workers}"] = round(
                run["worker_pss_mb"] - empty["worker_pss_mb"], 1
            )
        out["index_mb"] = round(sum(p.stat().st_size for p in cache.glob("*.idx")) / 1e6, 1)
        out.update(_peer(args, ann, root, progress))
    return out


def _first_images(folder: Path, count: int = FIRST_BATCH_IMAGES) -> None:
    """JPEGs for the first images (the first batches of an unshuffled client)."""
    _, jpeg = cv2.imencode(".jpg", np.full((64, 64, 3), 127, np.uint8))
    for i in range(count):
        (folder / f"{i:012d}.jpg").write_bytes(jpeg.tobytes())


def _pss(pid: int) -> int:
    for line in Path(f"/proc/{pid}/smaps_rollup").read_text().splitlines():
        if line.startswith("Pss:"):
            return int(line.split()[1]) * 1024
    return 0


def _start(dataset: str, workers: int, cache: Path, measure_batch: bool = False) -> dict[str, Any]:
    """A server started; seconds to its ready line, its processes' PSS, and (asked) the
    seconds from the ready line to a new client's first batch."""
    cmd = [sys.executable, "-m", "dataserver.cli", "serve", "--dataset", dataset]
    cmd += ["--workers", str(workers), "--cache-gb", "0", "--bind", "tcp://127.0.0.1:0"]
    cmd += ["--index-cache", str(cache)]
    start = time.monotonic()
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True)
    try:
        assert proc.stdout is not None
        line = ""
        for line in proc.stdout:
            if line.startswith("dataserver ready"):
                break
        else:
            raise RuntimeError(f"{dataset}: the server exited before its ready line")
        ready_s = time.monotonic() - start
        fields = dict(part.split("=", 1) for part in line.split()[2:])
        result: dict[str, Any] = {"ready_s": round(ready_s, 2)}
        if measure_batch:
            result["first_batch_s"] = _first_batch(fields["data"])
        time.sleep(1.0)  # (the workers' last start-up pages settle)
        workers_pss = [_pss(pid) for pid in child_pids(proc.pid)]
        front = _pss(proc.pid)
        result["front_pss_mb"] = round(front / 1e6, 1)
        result["worker_pss_mb"] = round(max(workers_pss) / 1e6, 1)
        result["pss_mb"] = round((front + sum(workers_pss)) / 1e6, 1)
        return result
    finally:
        proc.send_signal(2)
        try:
            proc.wait(30)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


def _first_batch(address: str) -> float:
    from dataserver_client import DataServerClient

    start = time.monotonic()
    with DataServerClient(
        [address], batch_size=8, image_size=(64, 64), shuffle=False, device="cpu", timeout=60.0
    ) as client:
        next(iter(client))
    return round(time.monotonic() - start, 3)


# A process of its own; the time from after the imports, the peak RSS its own (VmHWM:
# ru_maxrss would count the bench process it was forked from).
_MEASURE = """
import json, time
{setup}
start = time.monotonic()
{body}
took = time.monotonic() - start
hwm = [l for l in open("/proc/self/status") if l.startswith("VmHWM:")][0].split()[1]
print(json.dumps({{"s": took, "rss_mb": int(hwm) / 1024}}))
"""

_ULTRALYTICS_SETUP = "from ultralytics.data.dataset import YOLODataset"
_ULTRALYTICS = """
names = {names!r}
ds = YOLODataset(img_path={images!r}, data={{"names": names, "nc": len(names), "channels": 3}},
                 task="detect", augment=False, imgsz=64)
assert len(ds.labels) == {count}
"""

_OURS_SETUP = "from dataserver.cli import main"
_OURS = """
assert main(["index", {spec!r}, "--index-cache", {cache!r}]) == 0
"""


def _measured(setup: str, body: str) -> dict[str, float]:
    code = _MEASURE.format(setup=setup, body=body)
    env = dict(os.environ, YOLO_VERBOSE="False")
    done = subprocess.run(
        [sys.executable, "-c", code],
        capture_output=True,
        text=True,
        env=env,
        timeout=3600,
        check=False,
    )
    if done.returncode != 0:
        raise RuntimeError(done.stderr[-2000:])
    result = json.loads(done.stdout.strip().splitlines()[-1])
    return {"s": round(result["s"], 4), "rss_mb": round(result["rss_mb"], 1)}


def _peer(args: argparse.Namespace, ann: Path, root: Path, progress: Progress) -> dict[str, Any]:
    """The first ``--index-peer-images`` images in YOLO layout: Ultralytics' labels cache
    built and loaded, our index built and loaded."""
    count = min(args.index_peer_images, args.index_images)
    shared = SharedIndex.from_columns(coco_columns(ann), file_source("coco", ann))
    index = DetectionIndex(shared.mapped)
    yolo = root / "yolo"
    (yolo / "images").mkdir(parents=True)
    (yolo / "labels").mkdir()
    _, jpeg = cv2.imencode(".jpg", np.full((32, 32, 3), 127, np.uint8))
    names = {c - 1: f"class{c}" for c, _ in index.categories}
    for i in range(count):
        (yolo / "images" / f"{i:012d}.jpg").write_bytes(jpeg.tobytes())
        h, w = (int(v) for v in index.hw[i])
        b = index.boxes(i) / np.array([w, h, w, h], np.float32)
        xywh = np.concatenate([(b[:, :2] + b[:, 2:]) / 2, b[:, 2:] - b[:, :2]], 1)
        rows = [
            f"{lb - 1} {x:.6f} {y:.6f} {bw:.6f} {bh:.6f}"
            for lb, (x, y, bw, bh) in zip(index.labels(i).tolist(), xywh.tolist(), strict=True)
        ]
        (yolo / "labels" / f"{i:012d}.txt").write_text("\n".join(rows) + "\n")
    data = yolo / "data.yaml"
    data.write_text(
        json.dumps({"path": str(yolo), "train": "images", "val": "images", "names": names})
    )
    progress(f"peer: {count} images in YOLO layout")
    theirs = _ULTRALYTICS.format(names=names, images=str(yolo / "images"), count=count)
    ours = _OURS.format(spec=f"yolo:{data}", cache=str(root / "peer-cache"))
    out: dict[str, Any] = {"peer_images": count}
    for what, setup, body in (
        ("ultralytics_cache_build", _ULTRALYTICS_SETUP, theirs),
        ("ultralytics_cache_load", _ULTRALYTICS_SETUP, theirs),
        ("dataserver_index_build", _OURS_SETUP, ours),
        ("dataserver_index_load", _OURS_SETUP, ours),
    ):
        run = _measured(setup, body)
        progress(f"{what}: {run['s']:.2f} s, peak RSS {run['rss_mb']:.0f} MB")
        out[f"{what}_s"] = run["s"]
        out[f"{what}_rss_mb"] = run["rss_mb"]
    return out

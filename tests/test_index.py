"""The annotation index (issue 35): one columnar index per server, cached by the source's
identity, mapped read-only by the workers (a sealed memfd); ``dataserver index``; bad
annotation files refused in one line naming the file and where."""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from clients import make_client
from conftest import open_files, server_env

from dataserver.data.index import DetectionIndex, IndexCache, file_source, map_index

pytestmark = pytest.mark.timeout(300)


def dataserver(*args: str, env: dict[str, str] | None = None) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "dataserver.cli", *args],
        capture_output=True,
        text=True,
        env=server_env(env),
        timeout=240,
    )


def coco_doc() -> dict[str, Any]:
    """Images with every case the index must get right: no boxes, a crowd box, a box
    without area, a box across the image's edge (clipped), sizes missing, string ids."""
    return {
        "images": [
            {"id": 7, "file_name": "a.jpg", "height": 100, "width": 200},
            {"id": "x", "file_name": "sub/b é.jpg", "height": 50, "width": 60},
            {"id": 3, "file_name": "c.jpg"},
            {"id": 4, "file_name": "d.jpg", "height": 10, "width": 10},
        ],
        "annotations": [
            {"image_id": "x", "bbox": [1, 2, 3, 4], "category_id": 5},
            {"image_id": 7, "bbox": [10.5, 20, 30, 40], "category_id": 1, "iscrowd": 0},
            {"image_id": 7, "bbox": [0, 0, 5, 5], "category_id": 2, "iscrowd": 1},
            {"image_id": 7, "bbox": [190, 90, 20, 20], "category_id": 3},
            {"image_id": 3, "bbox": [5, 5, 0, 4], "category_id": 1},
            {"image_id": 3, "bbox": [500, 600, 7, 8], "category_id": 90},
            {"image_id": 99, "bbox": [1, 1, 1, 1], "category_id": 1},
            {"image_id": "x", "bbox": [10, 10, 5, 5], "category_id": 0, "segmentation": [[1]]},
        ],
        "categories": [{"id": 1, "name": "one"}, {"id": 5, "name": "five"}],
    }


def expected(
    doc: dict[str, Any],
) -> list[tuple[str, tuple[int, int], list[list[float]], list[int]]]:
    """What the index must hold, computed from the JSON with plain Python."""
    out = []
    for im in doc["images"]:
        h, w = im.get("height", 0), im.get("width", 0)
        boxes, labels = [], []
        for a in doc["annotations"]:
            if (
                a["image_id"] != im["id"]
                or a.get("iscrowd")
                or a["bbox"][2] <= 0
                or a["bbox"][3] <= 0
            ):
                continue
            x, y, bw, bh = a["bbox"]
            box = [x, y, x + bw, y + bh]
            if h and w:
                box = [
                    min(max(box[0], 0), w),
                    min(max(box[1], 0), h),
                    min(max(box[2], 0), w),
                    min(max(box[3], 0), h),
                ]
            boxes.append(box)
            labels.append(a["category_id"])
        out.append((im["file_name"], (h, w), boxes, labels))
    return out


def read_cached(cache: Path, annotations: Path) -> DetectionIndex:
    path = IndexCache(cache).path_for(file_source("coco", annotations))
    fd = os.open(path, os.O_RDONLY)
    try:
        return DetectionIndex(map_index(fd, os.fstat(fd).st_size, str(path)))
    finally:
        os.close(fd)


def test_index_equals_the_json(tmp_path: Path) -> None:
    doc = coco_doc()
    ann = tmp_path / "ann.json"
    ann.write_text(json.dumps(doc))
    cache = tmp_path / "cache"
    done = dataserver("index", f"coco:{ann}", "--index-cache", str(cache))
    assert done.returncode == 0, done.stderr
    assert "built (4 images, 5 boxes" in done.stdout
    index = read_cached(cache, ann)
    want = expected(doc)
    assert len(index) == len(want)
    for i, (file, hw, boxes, labels) in enumerate(want):
        assert index.file(i) == file
        assert tuple(index.hw[i]) == hw
        np.testing.assert_allclose(index.boxes(i), np.array(boxes, np.float32).reshape(-1, 4))
        assert index.labels(i).tolist() == labels
    assert index.categories == ((1, "one"), (5, "five"))
    assert index.mapped.meta["clipped"] == 1


def test_cache_used_invalidated_and_rebuilt_from_damage(tmp_path: Path) -> None:
    ann = tmp_path / "ann.json"
    ann.write_text(json.dumps(coco_doc()))
    cache = tmp_path / "cache"
    args = ("index", f"coco:{ann}", "--index-cache", str(cache))
    assert "built" in dataserver(*args).stdout
    again = dataserver(*args)
    assert ": cached (" in again.stdout and "rebuilding" not in again.stderr
    (entry,) = cache.iterdir()
    # The source changed (one box moved): a new identity, a new index.
    doc = coco_doc()
    doc["annotations"][1]["bbox"] = [11.5, 20, 30, 40]
    ann.write_text(json.dumps(doc))
    changed = dataserver(*args)
    assert ": rebuilt: " in changed.stdout and "source mtime_ns is" in changed.stdout, (
        changed.stdout
    )
    assert read_cached(cache, ann).boxes(0)[0, 0] == 11.5
    # The cache file truncated: rebuilt, with one line saying why.
    path = IndexCache(cache).path_for(file_source("coco", ann))
    path.write_bytes(path.read_bytes()[:-100])
    damaged = dataserver(*args)
    assert "rebuilt" in damaged.stdout
    (line,) = [x for x in damaged.stderr.splitlines() if "rebuilding" in x]
    assert "truncated" in line and str(path) in line
    # Another format version (a byte of the prefix): rebuilt, never trusted.
    raw = bytearray(path.read_bytes())
    raw[8] += 1
    path.write_bytes(bytes(raw))
    assert "format version" in dataserver(*args).stderr
    assert entry.exists() and read_cached(cache, ann).labels(0).tolist() == [1, 3]


def test_a_cache_other_users_can_write_is_refused(tmp_path: Path) -> None:
    ann = tmp_path / "ann.json"
    ann.write_text(json.dumps(coco_doc()))
    cache = tmp_path / "cache"
    cache.mkdir()
    cache.chmod(0o777)
    done = dataserver("index", f"coco:{ann}", "--index-cache", str(cache))
    assert done.returncode == 2
    assert "other users can write it" in done.stderr and str(cache) in done.stderr


BAD_AT = json.dumps(coco_doc()).index('"annotations": [') + len('"annotations": [')


@pytest.mark.parametrize(
    ("mutate", "says"),
    [
        (lambda text: text.replace('"annotations": [', '"annotations": [#'), f"byte {BAD_AT}: "),
        (
            lambda text: text.replace('"id": 3', '"id": 7'),
            "$.images[2]: image id 7 is listed twice",
        ),
        (
            lambda text: text.replace('"category_id": 90', '"category_id": "90"'),
            "$.annotations[5].category_id",
        ),
    ],
    ids=["malformed", "image-twice", "label-type"],
)
def test_bad_annotations_are_one_line_exit_2(tmp_path: Path, mutate: Any, says: str) -> None:
    ann = tmp_path / "ann.json"
    ann.write_text(mutate(json.dumps(coco_doc())))
    cache = str(tmp_path / "cache")
    for args in (("index", f"coco:{ann}"), ("serve", "--dataset", f"coco:{ann}", "--workers", "1")):
        done = dataserver(*args, "--index-cache", cache)
        assert done.returncode == 2, done.stderr
        lines = done.stderr.strip().splitlines()
        assert len(lines) == 1 and f"{ann}: {says}" in lines[0], lines


def worker_memory(pid: int) -> tuple[int, int]:
    """(PSS, USS) of a process, bytes (``smaps_rollup``)."""
    fields = {}
    for line in Path(f"/proc/{pid}/smaps_rollup").read_text().splitlines()[1:]:
        key, value = line.split(":", 1)
        fields[key] = int(value.split()[0]) * 1024
    return fields["Pss"], fields["Private_Clean"] + fields["Private_Dirty"]


def test_workers_map_the_index_and_do_not_grow_with_the_dataset(
    start_server: Any, tmp_path: Path
) -> None:
    """A 200,000-image set: each worker's own memory (USS) is within a bound of one
    serving 2,000 images (parsing the annotations per worker costs hundreds of MB), and
    the index they read is one sealed memfd the front passed down."""
    sizes: dict[int, list[tuple[int, int]]] = {}
    for images in (2_000, 200_000):
        out = tmp_path / str(images)
        done = dataserver("synth", str(out), "--images", str(images), "--annotations-only")
        assert done.returncode == 0, done.stderr
        server = start_server(
            "--dataset",
            f"coco:{out / 'annotations.json'}",
            "--cache-gb",
            "0",
            "--index-cache",
            str(tmp_path / "cache"),
            workers=2,
            ready_timeout=200,
        )
        assert server.samples == images
        pids = server.worker_pids()
        assert len(pids) == 2
        for pid in pids:
            links = open_files(pid)
            assert any(link.startswith("/memfd:dataserver-index") for link in links), links
        sizes[images] = [worker_memory(pid) for pid in pids]
        server.stop()
    small = max(uss for _, uss in sizes[2_000])
    large = max(uss for _, uss in sizes[200_000])
    assert large - small < 24 << 20, (sizes, "a worker's own memory grew with the dataset")


def test_served_boxes_come_from_the_index(
    start_server: Any, coco_dir: Path, tmp_path: Path
) -> None:
    """A COCO set served through the index: the boxes and labels a batch carries are the
    JSON's (scaled to the output), for every image of an epoch."""
    ann = coco_dir / "annotations.json"
    doc = json.loads(ann.read_text())
    server = start_server("--dataset", f"coco:{ann}", "--index-cache", str(tmp_path), workers=2)
    assert any(line.endswith(f"index_cache={tmp_path}") for line in server.lines)
    by_image: dict[int, list[int]] = {}
    for a in doc["annotations"]:
        by_image.setdefault(a["image_id"], []).append(a["category_id"])
    with make_client(server.address, batch_size=8, image_size=(64, 64), timeout=30.0) as client:
        seen = 0
        for batch in client:
            for idx, target in zip(batch.indices, batch.targets, strict=True):
                image_id = doc["images"][idx[0] if isinstance(idx, list) else idx]["id"]
                assert sorted(int(x) for x in target["labels"]) == sorted(
                    by_image.get(image_id, [])
                )
                seen += 1
        assert seen == len(doc["images"])


def test_ports_first_and_readiness_while_indexing(tmp_path: Path) -> None:
    """A first build binds first: STATS answers ``indexing N%`` (``--check`` fails,
    liveness holds) until the ready line; then ``--check`` passes. A busy port is an
    error before the index is built (the cache stays empty)."""
    out = tmp_path / "set"
    assert dataserver("synth", str(out), "--images", "300000", "--annotations-only").returncode == 0
    cache = tmp_path / "cache"
    ann = f"coco:{out / 'annotations.json'}"
    with socket.socket() as busy:
        busy.bind(("127.0.0.1", 0))
        busy.listen()
        port = busy.getsockname()[1]
        done = dataserver(
            "serve",
            "--dataset",
            ann,
            "--workers",
            "1",
            "--bind",
            f"tcp://127.0.0.1:{port}",
            "--index-cache",
            str(cache),
        )
        assert done.returncode == 1 and "cannot bind" in done.stderr, done.stderr
        assert not any(cache.glob("*.idx")), "the index was built before the bind"
    proc = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "dataserver.cli",
            "serve",
            "--dataset",
            ann,
            "--workers",
            "1",
            "--bind",
            "tcp://127.0.0.1:0",
            "--cache-gb",
            "0",
            "--index-cache",
            str(cache),
        ],
        stdout=subprocess.PIPE,
        stderr=subprocess.DEVNULL,
        text=True,
        env=server_env(),
    )
    try:
        assert proc.stdout is not None
        first = proc.stdout.readline()
        assert first.startswith("dataserver indexing data="), first
        address = first.split()[2].split("=", 1)[1]
        probe = dataserver("stats", address, "--check", "--timeout", "10")
        assert probe.returncode == 1 and "indexing" in probe.stdout, probe
        ready = proc.stdout.readline()
        assert ready.startswith("dataserver ready") and f"data={address}" in ready, ready
        assert dataserver("stats", address, "--check").returncode == 0
    finally:
        proc.send_signal(signal.SIGINT)
        proc.wait(30)

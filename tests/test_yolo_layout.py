"""Ultralytics' YOLO layout as a dataset (issue 35): ``yolo:DATA.yaml[:SPLIT]`` and
``yolo_set``'s ``{"data": ..., "split": ...}``, indexed once, checked against Ultralytics'
own label loading (``YOLODataset``: the labels cache it builds) on the same files."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path
from typing import Any

import cv2
import numpy as np
import pytest
from clients import make_client
from conftest import server_env

from dataserver.data.yololayout import yolo_dataset

pytestmark = pytest.mark.timeout(300)

NAMES = {0: "cat", 1: "dog", 2: "bird"}


def write_layout(root: Path, images: int = 12, seed: int = 0) -> Path:
    """images/{train,val}, labels/{train,val}: boxes, a duplicate row, an empty label file,
    an image without one, a segment row; val listed in a text file with ./ paths."""
    rng = np.random.default_rng(seed)
    for split in ("train", "val"):
        (root / "images" / split).mkdir(parents=True)
        (root / "labels" / split).mkdir(parents=True)
        for i in range(images):
            h, w = int(rng.integers(40, 120)), int(rng.integers(40, 120))
            name = f"{split}{i:03d}"
            image = rng.integers(0, 255, (h, w, 3), dtype=np.uint8)
            cv2.imwrite(str(root / "images" / split / f"{name}.jpg"), image)
            if i == 1:
                continue  # no label file: a background image
            rows = [
                f"{rng.integers(0, 3)} {rng.uniform(0.2, 0.8):.5f} {rng.uniform(0.2, 0.8):.5f} "
                f"{rng.uniform(0.05, 0.3):.5f} {rng.uniform(0.05, 0.3):.5f}"
                for _ in range(i % 5)
            ]
            if i == 3:
                rows.append(rows[0])  # a duplicate, removed as Ultralytics removes it
            (root / "labels" / split / f"{name}.txt").write_text("\n".join(rows) + "\n")
    (root / "segments").mkdir()
    listed = [f"./images/val/val{i:03d}.jpg" for i in range(images)]
    (root / "val.txt").write_text("\n".join(listed) + "\n")
    names = "\n".join(f"  {k}: {v}" for k, v in NAMES.items())
    data = root / "data.yaml"
    data.write_text(f"path: {root}\ntrain: images/train\nval: val.txt\nnames:\n{names}\n")
    return data


def ultralytics_labels(image_path: str) -> list[dict[str, Any]]:
    """Ultralytics' own labels for the images at ``image_path`` (its cache, built)."""
    from ultralytics.data.dataset import YOLODataset

    data = {"names": NAMES, "nc": len(NAMES), "channels": 3}
    ds = YOLODataset(img_path=image_path, data=data, task="detect", augment=False, imgsz=64)
    return list(ds.labels)


@pytest.mark.parametrize("split", ["train", "val"])
def test_same_boxes_and_classes_as_ultralytics(tmp_path: Path, split: str) -> None:
    data = write_layout(tmp_path / "ds")
    ours = yolo_dataset(str(data), split)
    where = tmp_path / "ds" / ("images/train" if split == "train" else "val.txt")
    theirs = ultralytics_labels(str(where))
    assert len(ours) == len(theirs) == 12
    assert ours.categories == tuple(NAMES.items())
    for i, lb in enumerate(theirs):
        assert str(ours.path(i)) == lb["im_file"]
        assert tuple(ours.hw[i]) == tuple(lb["shape"])
        assert ours.index.labels(i).tolist() == lb["cls"].ravel().astype(int).tolist()
        xyxy = ours.index.boxes(i)
        xywh = np.concatenate([(xyxy[:, :2] + xyxy[:, 2:]) / 2, xyxy[:, 2:] - xyxy[:, :2]], 1)
        np.testing.assert_allclose(xywh, lb["bboxes"].reshape(-1, 4), atol=1e-6)
    # Pixels on access: the normalized boxes scaled by the image as decoded.
    sample = ours[4]
    h, w = sample.image.shape[:2]
    np.testing.assert_allclose(sample.boxes, ours.index.boxes(4) * [w, h, w, h], rtol=1e-6)


def test_served_as_a_spec_and_by_yolo_set(start_server: Any, tmp_path: Path) -> None:
    data = write_layout(tmp_path / "ds")
    cache = str(tmp_path / "cache")
    ours = yolo_dataset(str(data), "val")
    want = {i: sorted(ours.index.labels(i).tolist()) for i in range(len(ours))}
    for args in (
        ("--dataset", f"yolo:{data}:val"),
        (
            "--dataset",
            "dataserver.data.yolo_set:yolo_set",
            "--dataset-args",
            json.dumps({"data": str(data), "split": "val", "mode": "val", "imgsz": 64}),
        ),
    ):
        server = start_server(*args, "--index-cache", cache, workers=2)
        assert server.samples == 12
        with make_client(server.address, batch_size=4, image_size=(64, 64), timeout=30.0) as client:
            assert client.categories == list(NAMES.items())
            seen = 0
            for batch in client:
                for idx, target in zip(batch.indices, batch.targets, strict=True):
                    labels = sorted(int(x) for x in target["labels"])
                    if "yolo_set" not in args[1]:
                        assert labels == want[idx[0]]
                    seen += 1
            assert seen == 12


def test_a_label_line_of_4_fields_is_refused_naming_file_and_line(tmp_path: Path) -> None:
    data = write_layout(tmp_path / "ds")
    bad = tmp_path / "ds" / "labels" / "train" / "train002.txt"
    bad.write_text("0 0.5 0.5 0.1 0.1\n1 0.5 0.5 0.2\n")
    done = subprocess.run(
        [
            sys.executable,
            "-m",
            "dataserver.cli",
            "index",
            f"yolo:{data}",
            "--index-cache",
            str(tmp_path / "c"),
        ],
        capture_output=True,
        text=True,
        env=server_env(),
        timeout=120,
    )
    assert done.returncode == 2
    assert f"{bad}: line 2: 4 fields" in done.stderr and len(done.stderr.strip().splitlines()) == 1

"""Served rect validation against Ultralytics' own val loader (issue 24, "Validation
served"): the val pool is ``dataserver.data.yolo_set:yolo_set`` in mode "val" on real JPEG
files of mixed aspects (wide, tall, square, small ones that are enlarged); Ultralytics'
``build_yolo_dataset(..., mode="val")`` (rect, pad 0.5, stride 32) reads the same files as a
YOLO dataset. The batches are the same (count, shapes, ratio_pad, ori_shape, cls, boxes,
114 in the same places, never mirrored, pixels within interpolation) and so are a
``DetectionValidator``'s statistics for one model; a val set without sizes falls back to
square batches with a warning naming why."""

from __future__ import annotations

import itertools
import json
import os
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch

pytest.importorskip("ultralytics")
os.environ.setdefault("YOLO_OFFLINE", "1")  # never download weights, fonts or datasets

from conftest import Server

from dataserver_client.integrations import ultralytics as served
from dataserver_client.integrations.ultralytics import (
    DataServerValidator,
    served_data,
    val_loader,
)
from dataserver_client.integrations.ultralytics_val import batch_shapes, load_size

pytestmark = pytest.mark.timeout(240)

IMGSZ, BATCH, STRIDE = 160, 4, 32
NAMES = ["a", "b", "c"]
# (h, w): wide, tall, square, and small ones (enlarged to IMGSZ), a few of each aspect,
# so that batches of 4 in aspect order have several distinct shapes.
SHAPES = [
    (90, 200), (60, 160), (100, 180), (48, 120), (75, 100), (120, 160), (30, 40),
    (200, 90), (160, 60), (180, 100), (120, 48), (100, 75), (40, 22), (64, 64),
    (160, 160), (24, 24), (150, 150), (333, 500), (500, 375), (37, 50),
]  # fmt: skip


@pytest.fixture(scope="module")
def files(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    """The JPEGs, their COCO annotation file (with each image's height and width) and the
    same labels as a YOLO dataset (images/, labels/, data.yaml)."""
    import cv2

    root = tmp_path_factory.mktemp("rect")
    (root / "images").mkdir()
    (root / "labels").mkdir()
    rng = np.random.default_rng(5)
    doc: dict[str, Any] = {
        "images": [],
        "annotations": [],
        "categories": [{"id": c + 1, "name": n} for c, n in enumerate(NAMES)],
    }
    for i, (h, w) in enumerate(SHAPES):
        noise = rng.integers(0, 256, (max(2, h // 8), max(2, w // 8), 3), dtype=np.uint8)
        image = cv2.resize(noise, (w, h), interpolation=cv2.INTER_CUBIC)
        name = f"{i:04d}.jpg"
        assert cv2.imwrite(str(root / "images" / name), image, [cv2.IMWRITE_JPEG_QUALITY, 92])
        doc["images"].append({"id": i + 1, "file_name": name, "height": h, "width": w})
        lines = []
        for _ in range(int(rng.integers(1, 4))):
            x1, y1 = float(rng.integers(0, w // 2)), float(rng.integers(0, h // 2))
            bw, bh = float(rng.integers(4, w - int(x1))), float(rng.integers(4, h - int(y1)))
            label = int(rng.integers(1, len(NAMES) + 1))
            doc["annotations"].append(
                {
                    "id": len(doc["annotations"]) + 1,
                    "image_id": i + 1,
                    "category_id": label,
                    "bbox": [x1, y1, bw, bh],
                    "area": bw * bh,
                    "iscrowd": 0,
                }
            )
            cx, cy = (x1 + bw / 2) / w, (y1 + bh / 2) / h
            lines.append(f"{label - 1} {cx:.12f} {cy:.12f} {bw / w:.12f} {bh / h:.12f}")
        (root / "labels" / f"{i:04d}.txt").write_text("\n".join(lines) + "\n")
    (root / "annotations.json").write_text(json.dumps(doc))
    yaml_path = root / "data.yaml"
    yaml_path.write_text(
        f"path: {root}\ntrain: images\nval: images\nnames:\n"
        + "".join(f"  {i}: {n}\n" for i, n in enumerate(NAMES))
    )
    return {"root": root, "annotations": root / "annotations.json", "yaml": yaml_path}


def val_args(files: dict[str, Path]) -> dict[str, Any]:
    """yolo_set's dataset args for the val pool on the COCO file of ``files``."""
    return {
        "annotations": str(files["annotations"]),
        "image_dir": str(files["root"] / "images"),
        "mode": "val",
        "imgsz": IMGSZ,
    }


@pytest.fixture(scope="module")
def pool(files: dict[str, Path]) -> Any:
    """The val pool: yolo_set in mode "val" on the COCO file, one worker; DATA for it."""
    args = val_args(files)
    server = Server(
        "--dataset", "dataserver.data.yolo_set:yolo_set", "--dataset-args", json.dumps(args),
        workers=1,
    )  # fmt: skip
    try:
        yield {"train": server.address, "val": server.address}
    finally:
        server.stop()


def _theirs(files: dict[str, Path], data: dict[str, Any], batch: int) -> list[dict[str, Any]]:
    from ultralytics.cfg import get_cfg
    from ultralytics.data import build_dataloader, build_yolo_dataset

    args: Any = get_cfg(overrides={"imgsz": IMGSZ, "rect": True})
    dataset = build_yolo_dataset(
        args, str(files["root"] / "images"), batch, data, mode="val", rect=True, stride=STRIDE
    )
    return list(build_dataloader(dataset, batch, 0, shuffle=False, rank=-1))


def _ours(address: dict[str, Any], data: dict[str, Any], batch: int) -> list[dict[str, Any]]:
    from ultralytics.cfg import get_cfg

    args: Any = get_cfg(overrides={"imgsz": IMGSZ, "data": address})
    loader: Any = val_loader(address["val"], data, args, batch, rank=-1, stride=STRIDE)
    try:
        assert loader.rect is not None
        first = list(loader)
        again = list(loader)  # (every validation serves the same batches)
        assert len(loader) == len(first) == len(again)
        for a, b in zip(first, again, strict=True):
            assert torch.equal(a["img"], b["img"]) and a["im_file"] == b["im_file"]
        return first
    finally:
        loader.close()


def _rows(batch: dict[str, Any], i: int) -> np.ndarray:
    at = batch["batch_idx"] == i
    rows = torch.cat([batch["cls"][at], batch["bboxes"][at]], 1).numpy().astype(np.float64)
    return rows[np.lexsort(rows.T[::-1])]


@pytest.mark.parametrize("batch", [BATCH, 3])
def test_rect_val_batches_equal_ultralytics_own(
    files: dict[str, Path], pool: dict[str, Any], batch: int
) -> None:
    """The same batches as Ultralytics' rect val loader: count, shapes (several distinct),
    resized_shape, ori_shape, ratio_pad exactly; cls exactly and normalised boxes to 1e-5
    (ours come from the COCO file's pixels, theirs from the label files' 12-decimal
    normalised values, both in float32); 114 exactly outside each picture, nowhere else
    needed; no mirroring; the pixels equal (bound: mean absolute difference <= 1)."""
    data = served_data(pool)
    theirs, ours = _theirs(files, data, batch), _ours(pool, data, batch)
    assert len(ours) == len(theirs) == -(-len(SHAPES) // batch)
    shapes = [tuple(b["img"].shape[2:]) for b in ours]
    assert len(set(shapes)) >= 4, shapes
    assert shapes == [tuple(b["img"].shape[2:]) for b in theirs]
    for mine, their in zip(ours, theirs, strict=True):
        assert mine["img"].shape == their["img"].shape
        assert [Path(f).name for f in mine["im_file"]] == [Path(f).name for f in their["im_file"]]
        assert mine["ori_shape"] == tuple(tuple(s) for s in their["ori_shape"])
        assert mine["resized_shape"] == tuple(
            tuple(int(v) for v in s) for s in their["resized_shape"]
        )
        want_pads = tuple(
            ((float(g[0]), float(g[1])), (int(p[0]), int(p[1]))) for g, p in their["ratio_pad"]
        )
        assert mine["ratio_pad"] == want_pads
        _, _, height, width = mine["img"].shape
        for i, (h0, w0) in enumerate(mine["ori_shape"]):
            got, want = _rows(mine, i), _rows(their, i)
            assert got.shape == want.shape and np.array_equal(got[:, 0], want[:, 0])
            assert np.allclose(got[:, 1:], want[:, 1:], atol=1e-5, rtol=0), (got, want)
            new_h, new_w = load_size(h0, w0, IMGSZ)
            left, top = mine["ratio_pad"][i][1]
            outside = torch.ones(height, width, dtype=torch.bool)
            outside[top : top + new_h, left : left + new_w] = False
            a, b = mine["img"][i].to(torch.int16), their["img"][i].to(torch.int16)
            assert bool((a[:, outside] == 114).all()) and bool((b[:, outside] == 114).all())
            difference = float((a - b).abs().float().mean())
            assert difference <= 1.0, difference  # (0.0: the same decode and resize)


def test_rect_val_sharded_across_ranks(pool: dict[str, Any], monkeypatch: Any) -> None:
    """On 2 ranks each rank's batches are rect (each batch's shape Ultralytics' rule on its
    own images) and together they cover the val set exactly once."""
    from ultralytics.cfg import get_cfg

    data = served_data(pool)
    args: Any = get_cfg(overrides={"imgsz": IMGSZ, "data": pool})
    seen: list[str] = []
    for rank in (0, 1):
        monkeypatch.setattr(served, "rank_world", lambda _r, rank=rank: (rank, 2))
        loader: Any = val_loader(pool["val"], data, args, BATCH, rank=rank, stride=STRIDE)
        try:
            batches = list(loader)
            assert len(loader) == len(batches) == -(-len(SHAPES) // 2 // BATCH)
            for b in batches:
                sizes = [tuple(s) for s in b["ori_shape"]]
                assert tuple(b["img"].shape[2:]) == batch_shapes(sizes, BATCH, IMGSZ, STRIDE)[0]
                seen += [Path(f).name for f in b["im_file"]]
        finally:
            loader.close()
    assert sorted(seen) == [f"{i:04d}.jpg" for i in range(len(SHAPES))]


def _settled(server: Server) -> int:
    """Images the server has composed (its STATS ``images_done``) once the count stops
    moving (a worker's DONE reaches the front after its result reached the client)."""
    import time

    last, same = -1, 0
    deadline = time.monotonic() + 30
    while same < 3 and time.monotonic() < deadline:
        now = int(server.stats()["counters"].get("images_done", 0))
        same = same + 1 if now == last else 0
        last = now
        time.sleep(0.1)
    return last


def test_rect_val_composes_no_batch_twice(
    files: dict[str, Path], start_server: Any, monkeypatch: Any
) -> None:
    """Batch 2 (10 batches, the shape changing at most of them), prefetch 4: the client
    follows the plan as a ``StepSizes`` schedule set once before the epoch, so no shape
    change plans the prefetch again and the server composes each image once per
    validation (composed / delivered <= 1.02, as test_lookahead measures twins); the
    batches are still at the plan's shapes. (Setting each batch's shape with
    ``set_image_size`` before it, as the loader did, plans the prefetch again at each
    change and fails this.)"""
    from ultralytics.cfg import get_cfg

    from dataserver_client import DataServerClient, StepSizes

    args = val_args(files)
    server = start_server(
        "--dataset", "dataserver.data.yolo_set:yolo_set", "--dataset-args", json.dumps(args),
        workers=1,
    )  # fmt: skip
    calls: list[Any] = []
    original = DataServerClient.set_image_size

    def counted(self: Any, size: Any) -> None:
        calls.append(size)
        original(self, size)

    monkeypatch.setattr(DataServerClient, "set_image_size", counted)
    address = {"train": server.address, "val": server.address}
    data = served_data(address)
    cfg: Any = get_cfg(overrides={"imgsz": IMGSZ, "data": address})
    loader: Any = val_loader(server.address, data, cfg, 2, rank=-1, stride=STRIDE)
    try:
        shapes = loader.rect[0]
        changes = sum(a != b for a, b in itertools.pairwise(shapes))
        assert len(shapes) == 10 and changes >= 5, shapes
        assert calls == [StepSizes(shapes)]  # once, before any epoch started
        assert loader.client.image_size == StepSizes(shapes).stored_at((IMGSZ, IMGSZ))
        before = _settled(server)
        runs = [list(loader), list(loader)]  # two validations
        after = _settled(server)
        stats = loader.client.stats()
    finally:
        loader.close()
    assert len(calls) == 1
    for run in runs:
        assert [tuple(b["img"].shape[2:]) for b in run] == shapes
    delivered = sum(len(b["im_file"]) for run in runs for b in run)
    assert delivered == 2 * len(SHAPES)
    assert after - before <= 1.02 * delivered, (after - before, delivered, stats["plan_version"])


def _model(nc: int) -> Any:
    """yolov8n from its yaml, fixed seed, its class biases at 0 so that random weights
    give detections (sigmoid 0.5) for the statistics to compare."""
    from ultralytics import YOLO
    from ultralytics.nn.tasks import DetectionModel

    torch.manual_seed(0)
    yolo: Any = YOLO("yolov8n.yaml")
    model: Any = DetectionModel("yolov8n.yaml", nc=nc, verbose=False)
    model.names = dict(enumerate(NAMES))
    yolo.model = model
    head: Any = model.model[-1]
    with torch.no_grad():
        for branch in head.cv3:
            branch[-1].bias.zero_()
    return yolo


def test_validator_statistics_equal_from_both_loaders(
    files: dict[str, Path], pool: dict[str, Any]
) -> None:
    """``model.val`` with Ultralytics' own loader (the YOLO files, rect) and with
    ``DataServerValidator`` (the served pool): the same metrics, exactly (the same model,
    the same input tensors, the same batches: CPU inference is deterministic)."""
    common = {"imgsz": IMGSZ, "batch": BATCH, "plots": False, "device": "cpu", "workers": 0}
    theirs = _model(len(NAMES)).val(data=str(files["yaml"]), **common)
    ours = _model(len(NAMES)).val(data=pool, validator=DataServerValidator, **common)
    assert int(theirs.nt_per_class.sum()) > 0 and theirs.box.all_ap.size
    assert float(theirs.box.map50) > 0, theirs.results_dict  # (detections to compare)
    assert ours.results_dict == theirs.results_dict
    assert np.array_equal(ours.nt_per_class, theirs.nt_per_class)
    assert np.array_equal(ours.box.all_ap, theirs.box.all_ap)


def test_val_without_sizes_falls_back_with_a_warning(start_server: Any) -> None:
    """A val pool whose dataset announces no sizes (the plain ds_plugins:blocks set) gives
    square imgsz batches and a warning saying why."""
    from ultralytics.cfg import get_cfg

    args = {"images": 6, "seed": 1, "categories": True}
    server = start_server(
        "--dataset", "ds_plugins:blocks", "--dataset-args", json.dumps(args), workers=1
    )
    pool = {"train": server.address, "val": server.address, "names": ["r", "g", "b", "y"]}
    data = served_data(pool)
    warnings: list[str] = []
    cfg: Any = get_cfg(overrides={"imgsz": 64, "data": pool})
    loader: Any = val_loader(server.address, data, cfg, 4, rank=-1, warn=warnings.append)
    try:
        assert loader.rect is None
        assert [tuple(b["img"].shape[2:]) for b in loader] == [(64, 64), (64, 64)]
    finally:
        loader.close()
    assert any("square" in w and "announces no image sizes" in w for w in warnings), warnings


def test_trainer_validates_on_rect_batches(
    files: dict[str, Path], pool: dict[str, Any], tmp_path: Path
) -> None:
    """``YOLO(...).train(trainer=DataServerTrainer)`` with this val pool: its val loader is
    rect (batch 2 x 4, several shapes, Ultralytics' rule), used for each validation and
    the final evaluation, which report metrics."""
    from ultralytics import YOLO

    from dataserver_client.integrations.ultralytics import DataServerTrainer

    args = {"annotations": str(files["annotations"]), "image_dir": str(files["root"] / "images")}
    train = Server(
        "--dataset", "dataserver.data.yolo_set:yolo_set", "--dataset-args", json.dumps(args),
        workers=1,
    )  # fmt: skip
    shapes: list[tuple[int, int]] = []
    lengths: list[int] = []

    def on_val_end(validator: Any) -> None:
        shapes.append(tuple(validator.dataloader.last_batch.images.shape[2:]))
        lengths.append(len(validator.dataloader))

    try:
        yolo: Any = YOLO("yolov8n.yaml")
        yolo.add_callback("on_val_end", on_val_end)
        yolo.train(
            trainer=DataServerTrainer, data={"train": train.address, "val": pool["val"]},
            epochs=1, imgsz=IMGSZ, batch=BATCH, device="cpu", amp=False, plots=False,
            warmup_epochs=0, project=str(tmp_path), name="run", exist_ok=True, verbose=False,
        )  # fmt: skip
        trainer = yolo.trainer
        plan = trainer.test_loader.rect
        assert plan is not None and plan[1] == IMGSZ
        order = sorted(SHAPES, key=lambda hw: hw[0] / hw[1])
        assert plan[0] == batch_shapes(order, 2 * BATCH, IMGSZ, STRIDE)
        assert len(set(plan[0])) >= 2 and set(lengths) == {len(plan[0])}
        assert len(shapes) == 2 and set(shapes) == {plan[0][-1]}, shapes  # (epoch 1, final)
        assert "metrics/mAP50(B)" in trainer.metrics
    finally:
        train.stop()

"""A dataset's optional ``sizes`` (per-sample (h, w): their count and digest announced in
WELCOME, the table asked for in chunks, ``client.sizes``; test_announce.py: beyond 65,536)
and ``scaleup = False`` (sources only shrunk, placed unscaled in a larger canvas), and
``yolo_set`` in mode "val", which has both (issue 24, "Validation served")."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import cv2
import msgpack
import numpy as np
import pytest
from clients import make_client
from fuzzing import VALID

from dataserver.data.pipeline import compose_one
from dataserver.data.spec import SpecError, dataset_sizes
from dataserver.data.yolo_set import YoloVal, yolo_set
from dataserver.protocol import MAGIC, BatchSizes, MsgType, ProtocolError, Welcome, decode
from dataserver.protocol.messages import MAX_ANNOUNCED_SIZES

pytestmark = pytest.mark.timeout(120)


def _welcome(**change: Any) -> Any:
    header = {**VALID[MsgType.WELCOME], **change}
    return decode([MAGIC, bytes([MsgType.WELCOME]), msgpack.packb(header, use_bin_type=True)])


def test_welcome_announces_the_sizes_count_and_digest() -> None:
    got = _welcome(sizes_count=10, sizes_digest=b"d" * 16)
    assert isinstance(got, Welcome) and (got.sizes_count, got.sizes_digest) == (10, b"d" * 16)
    assert _welcome().sizes_count == 0  # (announces none)
    with pytest.raises(ProtocolError, match="9 sizes for 10 samples"):
        _welcome(sizes_count=9, sizes_digest=b"d" * 16)
    with pytest.raises(ProtocolError, match="sizes_digest"):
        _welcome(sizes_count=10)
    with pytest.raises(ProtocolError, match="sizes_digest"):
        _welcome(sizes_digest=b"d" * 16)
    with pytest.raises(ProtocolError, match="sizes_count"):
        _welcome(dataset_len=MAX_ANNOUNCED_SIZES + 1, sizes_count=MAX_ANNOUNCED_SIZES + 1)


class _Sized:
    def __init__(self, sizes: Any, n: int = 3) -> None:
        self.sizes, self.n = sizes, n

    def __len__(self) -> int:
        return self.n


@pytest.mark.parametrize(
    ("sizes", "n", "problem"),
    [
        ([(1, 2)] * 2, 3, "2 sizes for 3 samples"),
        ([(1, 2), (0, 2), (1, 1)], 3, r"size 1 \(0, 2\)"),
        ([(1, 2, 3)] * 3, 3, "pairs"),
        (np.ones((MAX_ANNOUNCED_SIZES + 1, 2)), MAX_ANNOUNCED_SIZES + 1, "at most 16777216"),
        ([(1, "a")] * 3, 3, "pairs"),
    ],
)
def test_bad_sizes_are_a_spec_error(sizes: Any, n: int, problem: str) -> None:
    with pytest.raises(SpecError, match=problem):
        dataset_sizes(_Sized(sizes, n), n)


def test_no_sizes_announce_none() -> None:
    assert dataset_sizes(object(), 5) is None
    table = dataset_sizes(_Sized([(2, 3)] * 3), 3)
    assert table is not None and table.dtype == np.int32 and table.tolist() == [[2, 3]] * 3


class _Small:
    """One 20 x 30 image, one box; ``scaleup`` as given."""

    deterministic = True

    def __init__(self, scaleup: bool) -> None:
        self.scaleup = scaleup

    def __len__(self) -> int:
        return 1

    def __getitem__(self, index: int) -> dict[str, Any]:
        image = np.full((20, 30, 3), 200, np.uint8)
        return {"image": image, "boxes": np.array([[3, 4, 9, 10]], np.float32), "labels": [1]}


def test_scaleup_false_places_sources_unscaled_in_a_larger_canvas() -> None:
    """With ``scaleup = False`` a source smaller than the batch's size is placed as it is
    (centred on the padding, boxes moved by the offset); with the default it is enlarged."""
    kept, composed = compose_one(
        _Small(False), [0], 1, BatchSizes.of((64, 96)), 0, 0, pad_value=114, letterbox="center"
    )
    top, left = round((64 - 20) / 2 - 0.1), round((96 - 30) / 2 - 0.1)
    assert (kept[:, top : top + 20, left : left + 30] == 200).all()
    assert (kept == 200).sum() == 3 * 20 * 30 and (kept == 114).sum() == kept.size - 3 * 600
    assert composed.boxes.tolist() == [[3 + left, 4 + top, 9 + left, 10 + top]]
    grown, _ = compose_one(
        _Small(True), [0], 1, BatchSizes.of((64, 96)), 0, 0, pad_value=114, letterbox="center"
    )
    assert (grown == 200).sum() == 3 * 64 * 96


def _coco(root: Path, shapes: list[tuple[int, int]], sizes: bool = True) -> Path:
    doc: dict[str, Any] = {"images": [], "annotations": [], "categories": [{"id": 1, "name": "x"}]}
    for i, (h, w) in enumerate(shapes):
        cv2.imwrite(str(root / f"{i}.png"), np.full((h, w, 3), 10 * i, np.uint8))
        entry = {"id": i, "file_name": f"{i}.png", **({"height": h, "width": w} if sizes else {})}
        doc["images"].append(entry)
        box = [1.0, 2.0, w / 2, h / 2]
        doc["annotations"].append({"id": i, "image_id": i, "category_id": 1, "bbox": box})
    path = root / "annotations.json"
    path.write_text(json.dumps(doc))
    return path


def test_yolo_set_val_mode(tmp_path: Path) -> None:
    """Aspect order, sizes as the file gives them, long side to imgsz (ceil), orig_size,
    an augment_composed that changes nothing and refuses another imgsz; bad arguments
    refused by name."""
    shapes = [(50, 100), (100, 50), (30, 40), (64, 64)]
    dataset = yolo_set(str(_coco(tmp_path, shapes)), mode="val", imgsz=64)
    assert isinstance(dataset, YoloVal) and dataset.scaleup is False
    assert dataset.order.tolist() == [0, 2, 3, 1]  # h/w: 0.5, 0.75, 1, 2
    assert dataset.sizes == [(50, 100), (30, 40), (64, 64), (100, 50)]
    sample = dataset[1]  # 30 x 40: enlarged to 48 x 64
    assert sample.image.shape == (48, 64, 3) and sample.orig_size == (30, 40)
    assert np.allclose(sample.boxes, [[1.6, 3.2, 1.6 + 32, 3.2 + 24]])
    out = {"image": sample.image, "boxes": sample.boxes, "labels": sample.labels}
    rng = np.random.default_rng(0)
    assert dataset.augment_composed(out, rng, {"control": {"yolo": {"imgsz": 64}}}) is out
    with pytest.raises(ValueError, match="imgsz=64"):
        dataset.augment_composed(out, rng, {"control": {"yolo": {"imgsz": 640}}})
    with pytest.raises(ValueError, match="'height' and 'width'"):
        yolo_set(str(_coco(tmp_path, shapes, sizes=False)), mode="val")
    with pytest.raises(ValueError, match="annotations"):
        yolo_set(mode="val")
    with pytest.raises(ValueError, match="mode"):
        yolo_set(mode="test")


def test_client_reads_the_sizes(start_server: Any, tmp_path: Path) -> None:
    """``client.sizes``: a val set's, index by index; [] for plain coco."""
    path = _coco(tmp_path, [(50, 100), (100, 50), (30, 40)])
    args = json.dumps({"annotations": str(path), "mode": "val", "imgsz": 64})
    val = start_server("--dataset", "dataserver.data.yolo_set:yolo_set", "--dataset-args", args)
    plain = start_server("--dataset", f"coco:{path}")
    kw: dict[str, Any] = {"batch_size": 2, "image_size": (96, 96)}
    with make_client(val.address, **kw) as client:
        assert client.sizes == [(50, 100), (30, 40), (100, 50)]
    with make_client(plain.address, **kw) as client:
        assert client.sizes == []

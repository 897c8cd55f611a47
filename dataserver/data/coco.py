"""COCO-format detection datasets: ``coco:ANNOTATIONS.json[:IMAGE_DIR]``, and the writer
behind ``dataserver synth``."""

from __future__ import annotations

import hashlib
import json
import os
from collections.abc import Callable
from pathlib import Path
from typing import Any

import cv2
import numpy as np

from dataserver.data.remote import is_remote, join, parent, prefetch, read_bytes, read_shared
from dataserver.data.sample import Sample, SampleError
from dataserver.data.synthetic import NUM_CLASSES, generate
from dataserver.data.transforms import decode_image


class CocoDataset:
    """Images listed in a COCO ``annotations.json``, read and decoded on each access.

    ``bbox`` (xywh) becomes xyxy; crowd annotations (``iscrowd``) and boxes without area are
    dropped; labels are the raw ``category_id``. Images without annotations are kept (they
    are valid negatives). ``image_dir`` defaults to the annotation file's folder.
    ``categories``: the file's ``categories`` as (id, name) pairs, in its order, ids
    unchanged. Either path may be a URL (``s3://``, ``gs://``, ``az://``, ``http(s)://``:
    ``dataserver.data.remote``), the images then read as objects under the prefix.
    """

    deterministic = True  # __getitem__ is a pure function of the index

    def __init__(self, annotations: str | os.PathLike[str], image_dir: str | None = None) -> None:
        path = str(annotations)
        raw = read_shared(path)
        self.fingerprint = hashlib.sha1(raw).hexdigest()[:16]
        doc = json.loads(raw)
        if not isinstance(doc, dict) or not isinstance(doc.get("images"), list):
            raise ValueError(f"{path}: not a COCO annotation file (no 'images' list)")
        self.image_dir = image_dir if image_dir else parent(path)
        if not is_remote(self.image_dir) and not os.path.isdir(self.image_dir):
            raise ValueError(f"image directory {self.image_dir} does not exist")
        self.files: list[str] = []
        # (height, width) as the file's images list them (None: not given)
        self.image_hw: list[tuple[int, int] | None] = []
        by_id: dict[Any, int] = {}
        for entry in doc["images"]:
            by_id[entry["id"]] = len(self.files)
            self.files.append(str(entry["file_name"]))
            h, w = entry.get("height"), entry.get("width")
            ok = all(isinstance(v, int) and not isinstance(v, bool) and v > 0 for v in (h, w))
            self.image_hw.append((h, w) if ok else None)
        boxes: list[list[list[float]]] = [[] for _ in self.files]
        labels: list[list[int]] = [[] for _ in self.files]
        for ann in doc.get("annotations", []):
            slot = by_id.get(ann.get("image_id"))
            if slot is None or ann.get("iscrowd", 0):
                continue
            x, y, w, h = (float(v) for v in ann["bbox"])
            if w <= 0 or h <= 0:
                continue
            boxes[slot].append([x, y, x + w, y + h])
            labels[slot].append(int(ann["category_id"]))
        self.categories = _categories(path, doc.get("categories", []))
        self.boxes = [np.asarray(b, dtype=np.float32).reshape(-1, 4) for b in boxes]
        self.labels = [np.asarray(lb, dtype=np.int64) for lb in labels]

    def __len__(self) -> int:
        return len(self.files)

    def path(self, index: int) -> str:
        return join(self.image_dir, self.files[index])

    def prefetch(self, indices: list[int]) -> None:
        """Start fetching these samples' images (remote ones; a server's worker calls it
        with a task's store misses, so that they are read together)."""
        prefetch([(self.path(i), None, None) for i in indices])

    def __getitem__(self, index: int) -> Sample:
        path = self.path(index)
        try:
            data = np.frombuffer(read_bytes(path), dtype=np.uint8)
        except OSError as exc:
            raise SampleError(index, f"cannot read: {exc.strerror or exc}", str(path)) from None
        image = decode_image(data)
        if image is None:
            raise SampleError(index, "not a decodable image (corrupt or truncated)", str(path))
        return Sample(image, self.boxes[index], self.labels[index], str(path))


def _categories(path: str | Path, raw: Any) -> tuple[tuple[int, str], ...]:
    """A COCO file's ``categories`` list as (id, name) pairs; ValueError naming the file."""
    if not isinstance(raw, list):
        raise ValueError(f"{path}: 'categories' is not a list")
    out = []
    for entry in raw:
        cid = entry.get("id") if isinstance(entry, dict) else None
        name = entry.get("name", "") if isinstance(entry, dict) else None
        if not isinstance(cid, int) or isinstance(cid, bool) or not isinstance(name, str):
            raise ValueError(f"{path}: category {entry!r} has no integer 'id' and string 'name'")
        out.append((cid, name))
    return tuple(out)


def write_synthetic_coco(
    out_dir: str | os.PathLike[str],
    images: int,
    seed: int,
    progress: Callable[[int], None] | None = None,
) -> Path:
    """Write ``images`` synthetic JPEGs and their COCO ``annotations.json`` into ``out_dir``.
    ``progress(n)`` is called after each image written.

    Returns the annotation file's path; ``coco:<that path>`` serves the set.
    """
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    doc: dict[str, Any] = {
        "info": {"description": f"dataserver synthetic set, seed {seed}"},
        "images": [],
        "annotations": [],
        "categories": [{"id": c, "name": f"class{c}"} for c in range(1, NUM_CLASSES + 1)],
    }
    ann_id = 1
    for index in range(images):
        sample = generate(seed, index)
        name = f"{index:012d}.jpg"
        bgr = cv2.cvtColor(sample.image, cv2.COLOR_RGB2BGR)
        if not cv2.imwrite(str(out / name), bgr, [cv2.IMWRITE_JPEG_QUALITY, 90]):
            raise OSError(f"could not write {out / name}")
        height, width = sample.image.shape[:2]
        doc["images"].append({"id": index + 1, "file_name": name, "height": height, "width": width})
        for box, label in zip(sample.boxes.tolist(), sample.labels.tolist(), strict=True):
            x1, y1, x2, y2 = box
            doc["annotations"].append(
                {
                    "id": ann_id,
                    "image_id": index + 1,
                    "category_id": label,
                    "bbox": [x1, y1, x2 - x1, y2 - y1],
                    "area": (x2 - x1) * (y2 - y1),
                    "iscrowd": 0,
                }
            )
            ann_id += 1
        if progress is not None:
            progress(1)
    path = out / "annotations.json"
    path.write_text(json.dumps(doc))
    return path

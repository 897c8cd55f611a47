"""COCO-format detection datasets: ``coco:ANNOTATIONS.json[:IMAGE_DIR]``, and the writer
behind ``dataserver synth``."""

from __future__ import annotations

import json
import os
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any, overload

import cv2
import numpy as np

from dataserver.data.cocoindex import coco_columns
from dataserver.data.index import DetectionIndex, MappedIndex, SharedIndex, source_of
from dataserver.data.remote import is_remote, join, parent, prefetch, read_bytes
from dataserver.data.sample import Sample, SampleError
from dataserver.data.synthetic import NUM_CLASSES, generate
from dataserver.data.transforms import decode_image


class CocoDataset:
    """Images listed in a COCO ``annotations.json``, read and decoded on each access.

    Its annotations come from a detection index (``dataserver.data.index``): the one the
    server built once and shares (``index``), else one built here (``coco_columns``).
    ``bbox`` (xywh) becomes xyxy, clipped to the image; crowd annotations and boxes without
    area are dropped; labels are the raw ``category_id``. Images without annotations are
    kept (they are valid negatives). ``image_dir`` defaults to the annotation file's
    folder. ``categories``: the file's ``categories`` as (id, name) pairs, in its order,
    ids unchanged. ``hw``: each image's (height, width) as the file gives them (0: not
    given). Either path may be a URL (``s3://``, ``gs://``, ``az://``, ``http(s)://``:
    ``dataserver.data.remote``), the images then read as objects under the prefix.
    """

    deterministic = True  # __getitem__ is a pure function of the index

    def __init__(
        self,
        annotations: str | os.PathLike[str],
        image_dir: str | None = None,
        index: MappedIndex | None = None,
    ) -> None:
        path = str(annotations)
        if index is None:
            shared = SharedIndex.from_columns(coco_columns(path), source_of("coco", path))
            shared.close()  # (the mapping stays)
            index = shared.mapped
        self.index = DetectionIndex(index)
        self.fingerprint = index.source.digest[:16]
        self.image_dir = str(image_dir) if image_dir else parent(path)
        if not is_remote(self.image_dir) and not os.path.isdir(self.image_dir):
            raise ValueError(f"image directory {self.image_dir} does not exist")
        self.files = _Files(self.index)
        self.hw = self.index.hw
        self.categories = self.index.categories

    def __len__(self) -> int:
        return len(self.index)

    def path(self, index: int) -> str:
        return join(self.image_dir, self.index.file(index))

    def locations(self, indices: list[int]) -> list[tuple[str, int | None, int | None]]:
        """Where these samples' bytes are: (path or URL, start, length), whole files here
        (what a server's front fetches ahead, ``server/front/prefetch.py``)."""
        return [(self.path(i), None, None) for i in indices]

    def prefetch(self, indices: list[int]) -> None:
        """Start fetching these samples' images (remote ones; a server's worker calls it
        with a task's store misses, so that they are read together)."""
        prefetch(self.locations(indices))

    def __getitem__(self, index: int) -> Sample:
        path = self.path(index)
        try:
            data = np.frombuffer(read_bytes(path), dtype=np.uint8)
        except OSError as exc:
            raise SampleError(index, f"cannot read: {exc.strerror or exc}", str(path)) from None
        image = decode_image(data)
        if image is None:
            raise SampleError(index, "not a decodable image (corrupt or truncated)", str(path))
        boxes = self.index.boxes(index)
        if self.index.normalized:  # (YOLO's labels: scaled by the image as decoded)
            h, w = image.shape[:2]
            boxes = boxes * np.array([w, h, w, h], dtype=np.float32)
        else:
            boxes = boxes.copy()
        labels = self.index.labels(index).astype(np.int64)
        return Sample(image, boxes, labels, str(path))


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


class _Files(Sequence[str]):
    """Each image's file name, read from the index on demand (no list of N strings)."""

    def __init__(self, index: DetectionIndex) -> None:
        self._index = index

    def __len__(self) -> int:
        return len(self._index)

    @overload
    def __getitem__(self, i: int) -> str: ...
    @overload
    def __getitem__(self, i: slice) -> list[str]: ...
    def __getitem__(self, i: int | slice) -> str | list[str]:
        if isinstance(i, slice):
            return [self._index.file(j) for j in range(*i.indices(len(self)))]
        if not -len(self) <= i < len(self):
            raise IndexError(i)
        return self._index.file(i % len(self))


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


def write_coco_annotations(
    out_dir: str | os.PathLike[str],
    images: int,
    seed: int,
    boxes: int = 7,
    progress: Callable[[int], None] | None = None,
) -> Path:
    """Write a COCO ``annotations.json`` of ``images`` images (no image files) with
    ``boxes`` random boxes each, written as it is generated (memory flat in ``images``):
    a large set to index, for benchmarks. Returns its path."""
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    rng = np.random.default_rng(seed)
    path = out / "annotations.json"
    chunk = 8192
    with open(path, "w") as f:
        cats = [{"id": c, "name": f"class{c}"} for c in range(1, NUM_CLASSES + 1)]
        f.write('{"info": {"description": "dataserver synthetic annotations"}, "categories": ')
        f.write(json.dumps(cats))
        f.write(', "images": [')
        for start in range(0, images, chunk):
            n = min(chunk, images - start)
            hw = rng.integers(240, 1024, size=(n, 2))
            f.write(", " if start else "")
            f.write(
                ", ".join(
                    f'{{"id": {start + i + 1}, "file_name": "{start + i:012d}.jpg", '
                    f'"height": {h}, "width": {w}}}'
                    for i, (h, w) in enumerate(hw.tolist())
                )
            )
        f.write('], "annotations": [')
        rng = np.random.default_rng(seed + 1)
        ann_id = 1
        for start in range(0, images, chunk):
            n = min(chunk, images - start)
            xy = rng.uniform(0, 200, size=(n, boxes, 2)).round(2)
            wh = rng.uniform(4, 200, size=(n, boxes, 2)).round(2)
            cls = rng.integers(1, NUM_CLASSES + 1, size=(n, boxes))
            parts = []
            for i in range(n):
                for b in range(boxes):
                    x, y = xy[i, b]
                    w, h = wh[i, b]
                    parts.append(
                        f'{{"id": {ann_id}, "image_id": {start + i + 1}, "category_id": '
                        f'{cls[i, b]}, "bbox": [{x}, {y}, {w}, {h}], "area": {w * h:.2f}, '
                        '"iscrowd": 0}'
                    )
                    ann_id += 1
            f.write((", " if start else "") + ", ".join(parts))
            if progress is not None:
                progress(n)
        f.write("]}")
    return path

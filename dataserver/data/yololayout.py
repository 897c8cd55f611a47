"""Ultralytics' YOLO layout as a detection index: ``yolo:DATA.yaml[:SPLIT]``.

``DATA.yaml`` names the dataset root (``path``: absolute, or relative to the YAML's folder;
the YAML's folder when absent), each split (``train``, ``val``, ``test``: a directory of
images, searched recursively, or a text file listing one image a line, ``./`` meaning the
list's folder; a list of these), and ``names`` (a list, or a dict of id -> name) or ``nc``.
Each image's labels are found as Ultralytics finds them: the last ``/images/`` of its path
replaced by ``/labels/`` and its extension by ``.txt``; one ``cls cx cy w h`` line per box,
normalized. Missing label files mean no boxes; duplicate rows are removed as Ultralytics
removes them (``np.unique``, which sorts them). The index holds normalized x1, y1, x2, y2
(``meta["normalized"]``; scaled by each image as decoded) and each image's (h, w) from its
header where PIL can read it (0 otherwise). Refused, naming the file and line: a line
without 5 fields (segments of more than 6 fields are taken as Ultralytics takes them, by
their bounding box), a class that is not an integer in 0..nc-1, coordinates outside 0..1
(1% tolerance, as Ultralytics').
"""

from __future__ import annotations

import glob
import hashlib
import os
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from dataserver.data.coco import CocoDataset
from dataserver.data.cocoindex import AnnotationError
from dataserver.data.index import (
    Columns,
    MappedIndex,
    SharedIndex,
    SourceId,
    detection_columns,
)

# Ultralytics' IMG_FORMATS (ultralytics.data.utils).
IMG_FORMATS = frozenset(
    {
        "avif",
        "bmp",
        "dng",
        "heic",
        "heif",
        "jp2",
        "jpeg",
        "jpeg2000",
        "jpg",
        "mpo",
        "png",
        "tif",
        "tiff",
        "webp",
    }
)


@dataclass(frozen=True)
class YoloLayout:
    """A split of a YOLO ``data.yaml``: its image files (sorted, as Ultralytics sorts
    them), their label files, the root, the class names."""

    yaml: Path
    split: str
    root: Path
    images: tuple[str, ...]
    names: tuple[str, ...]

    @classmethod
    def read(cls, data: str | os.PathLike[str], split: str = "train") -> YoloLayout:
        """``ValueError`` naming the file and key when the YAML is not a YOLO layout."""
        import yaml as pyyaml

        path = Path(data).resolve()
        try:
            doc = pyyaml.safe_load(path.read_text(encoding="utf-8-sig"))
        except pyyaml.YAMLError as exc:
            raise ValueError(f"{path}: not YAML: {exc}") from None
        if not isinstance(doc, dict):
            raise ValueError(f"{path}: not a YOLO data.yaml (a mapping)")
        names = _names(path, doc)
        root = Path(doc.get("path") or path.parent)
        if not root.is_absolute():
            root = (path.parent / root).resolve()
        entry = doc.get(split)
        if not entry:
            raise ValueError(f"{path}: no {split!r} split (known: train, val, test)")
        images: list[str] = []
        for item in entry if isinstance(entry, list) else [entry]:
            p = Path(item) if Path(item).is_absolute() else (root / item).resolve()
            if not p.exists() and str(item).startswith("../"):
                p = (root / str(item)[3:]).resolve()
            if p.is_dir():
                images += glob.glob(str(Path(glob.escape(str(p))) / "**" / "*.*"), recursive=True)
            elif p.is_file():
                parent = str(p.parent) + os.sep
                lines = p.read_text(encoding="utf-8-sig").strip().splitlines()
                images += [x.replace("./", parent, 1) if x.startswith("./") else x for x in lines]
            else:
                raise ValueError(f"{path}: {split}: {p} does not exist")
        files = sorted(x for x in images if x.rpartition(".")[-1].lower() in IMG_FORMATS)
        if not files:
            raise ValueError(f"{path}: {split}: no images found")
        return cls(path, split, root, tuple(files), names)

    def label_file(self, image: str) -> str:
        """Ultralytics' ``img2label_paths`` for one image."""
        sa, sb = f"{os.sep}images{os.sep}", f"{os.sep}labels{os.sep}"
        return sb.join(image.rsplit(sa, 1)).rsplit(".", 1)[0] + ".txt"

    def source(self) -> SourceId:
        """The identity: the YAML's bytes and a digest of the listing (every image and
        label file's name, size and mtime)."""
        h = hashlib.blake2b(digest_size=16)
        h.update(self.yaml.read_bytes())
        size, newest = 0, 0
        for image in self.images:
            for f in (image, self.label_file(image)):
                try:
                    st = os.stat(f)
                except OSError:
                    h.update(f"{f}\0-\n".encode())
                    continue
                size += st.st_size
                newest = max(newest, st.st_mtime_ns)
                h.update(f"{f}\0{st.st_size}\0{st.st_mtime_ns}\n".encode())
        return SourceId("yolo", str(self.yaml), size, newest, h.hexdigest(), self.split)

    def columns(self, progress: Callable[[float], None] | None = None) -> Columns:
        """The split's detection index (files relative to the root where under it)."""
        tick = progress or (lambda f: None)
        nc = len(self.names)
        n = len(self.images)
        hw = np.zeros((n, 2), dtype=np.int32)
        parts: list[np.ndarray] = []
        counts = np.zeros(n, dtype=np.int64)
        try:
            from PIL import Image
        except ImportError:  # sizes stay unknown
            Image = None  # type: ignore[assignment]
        for i, image in enumerate(self.images):
            rows = read_label_file(self.label_file(image), nc)
            parts.append(rows)
            counts[i] = len(rows)
            if Image is not None:
                try:
                    with Image.open(image) as im:
                        w, h = im.size
                    hw[i] = h, w
                except (OSError, ValueError):
                    pass
            if i % 4096 == 0:
                tick(i / n)
        rows = np.concatenate(parts) if parts else np.zeros((0, 5), np.float32)
        xyxy = np.concatenate([rows[:, 1:3] - rows[:, 3:5] / 2, rows[:, 1:3] + rows[:, 3:5] / 2], 1)
        offsets = np.zeros(n + 1, dtype=np.int64)
        np.cumsum(counts, out=offsets[1:])
        root = str(self.root) + os.sep
        files = [f[len(root) :] if f.startswith(root) else f for f in self.images]
        meta: dict[str, Any] = {
            "images": n,
            "boxes": len(rows),
            "normalized": 1,
            "root": str(self.root),
        }
        columns = detection_columns(
            files, hw, xyxy, rows[:, 0].astype(np.int32), offsets, list(enumerate(self.names)), meta
        )
        tick(1.0)
        return columns


def read_label_file(path: str, nc: int) -> np.ndarray:
    """One label file's rows (cls, cx, cy, w, h) as float32 (K, 5), as Ultralytics'
    ``verify_image_label`` reads them; ``AnnotationError`` naming the file and line."""
    try:
        with open(path, encoding="utf-8-sig") as f:
            text = f.read()
    except FileNotFoundError:
        return np.zeros((0, 5), np.float32)
    lines = [(no, x.split()) for no, x in enumerate(text.strip().splitlines(), 1) if x.strip()]
    rows = _rows(path, lines)
    if not len(rows):
        return rows
    bad_class = (rows[:, 0] % 1 != 0) | (rows[:, 0] < 0) | (rows[:, 0] >= nc)
    low = rows.min(axis=1)
    bad_xy = (rows[:, 1:].max(axis=1) > 1.01) | (
        (low < 0) & ((low < -0.01) | (rows[:, 3:5].min(axis=1) < 0))
    )
    for k in np.flatnonzero(bad_class | bad_xy)[:1]:
        no, r = lines[k][0], rows[k]
        if bad_class[k]:
            raise AnnotationError(
                f"{path}: line {no}: class {r[0]:g} is not an integer 0..{nc - 1}"
            )
        raise AnnotationError(
            f"{path}: line {no}: coordinates {r[1:].tolist()} are not normalized 0..1"
        )
    _, keep = np.unique(rows, axis=0, return_index=True)
    if len(keep) < len(rows):  # Ultralytics' duplicate removal (sorted rows)
        rows = rows[keep]
    return rows


def _rows(path: str, lines: list[tuple[int, list[str]]]) -> np.ndarray:
    """(cls, cx, cy, w, h) rows; segment rows (more than 6 fields) by their bounding box."""
    if not any(len(x) > 6 for _, x in lines):
        for no, x in lines:
            if len(x) != 5:
                raise AnnotationError(f"{path}: line {no}: {len(x)} fields, a box is cls cx cy w h")
        return np.array([_floats(path, no, x) for no, x in lines], dtype=np.float32).reshape(-1, 5)
    out = []
    for no, x in lines:
        if len(x) < 7 or len(x) % 2 == 0:
            raise AnnotationError(
                f"{path}: line {no}: {len(x)} fields; a segment row is cls x1 y1 x2 y2 ..."
            )
        xy = _floats(path, no, x[1:]).reshape(-1, 2)
        lo, hi = xy.min(0), xy.max(0)
        out.append([_floats(path, no, x[:1])[0], *(lo + hi) / 2, *(hi - lo)])
    return np.array(out, dtype=np.float32).reshape(-1, 5)


def _floats(path: str, no: int, fields: list[str]) -> np.ndarray:
    try:
        return np.array([float(v) for v in fields], dtype=np.float32)
    except ValueError:
        raise AnnotationError(f"{path}: line {no}: {' '.join(fields)!r} are not numbers") from None


def _names(path: Path, doc: dict[str, Any]) -> tuple[str, ...]:
    names = doc.get("names")
    if isinstance(names, dict):
        try:
            keyed = {int(k): str(v) for k, v in names.items()}
        except (TypeError, ValueError):
            raise ValueError(f"{path}: names: keys must be class ids 0..nc-1") from None
        if sorted(keyed) != list(range(len(keyed))):
            raise ValueError(f"{path}: names: keys must be class ids 0..nc-1")
        return tuple(keyed[i] for i in range(len(keyed)))
    if isinstance(names, list):
        return tuple(str(v) for v in names)
    nc = doc.get("nc")
    if isinstance(nc, int) and not isinstance(nc, bool) and nc > 0:
        return tuple(f"class_{i}" for i in range(nc))
    raise ValueError(f"{path}: needs 'names' (a list or a dict) or 'nc'")


class YoloDataset(CocoDataset):
    """A YOLO split served as the COCO source serves its file (images under the root)."""

    def __repr__(self) -> str:
        return f"YoloDataset({self.image_dir}, {len(self)} images)"


def yolo_dataset(data: str, split: str = "train", index: MappedIndex | None = None) -> YoloDataset:
    """The split's dataset on the shared ``index`` (read and built here when none is
    given; a worker given one reads nothing but it: the root is in its meta)."""
    if index is None:
        layout = YoloLayout.read(data, split)
        shared = SharedIndex.from_columns(layout.columns(), layout.source())
        shared.close()
        index = shared.mapped
    root = str(index.meta.get("root", ""))
    return YoloDataset(Path(root) / Path(data).name, root, index)

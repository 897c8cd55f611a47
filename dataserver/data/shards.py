"""WebDataset tar shards, random access per sample: ``wds:URLS``.

    wds:/data/coco-train-{000000..000188}.tar
    wds:s3://bucket/coco-train-{000000..000188}.tar

``URLS`` is a brace pattern as WebDataset writes them (``braceexpand``, what WebDataset
uses), of local paths or URLs (``dataserver.data.remote``). Samples are numbered in brace
order, then tar order. A sample is the members sharing a key (the member name up to the
first dot of its base name, as WebDataset groups them): ``KEY.jpg`` (or ``.jpeg``/``.png``)
and ``KEY.json``, one COCO image entry with its annotations (``{"file_name", "width",
"height", "annotations": [{"bbox": [x, y, w, h], "category_id": c, "iscrowd": 0}, ...]}``,
pixels, raw ids: crowd and empty boxes dropped as ``coco:`` drops them), or ``KEY.txt`` in
YOLO form (``class cx cy w h`` per line, normalised). Categories: a ``categories.json``
(COCO's list) beside the first shard, or none.

The index (``build_index``: each shard read once, whole; every sample's image offset and
size, its boxes and labels) is built by the front and kept in a file beside the fetch
cache, where the workers read it (without a cache directory each process builds its own).
Then a sample is one byte-range read of its image: the client's global order,
exactly-once, determinism and resume hold as for loose files.
"""

from __future__ import annotations

import hashlib
import io
import json
import os
import posixpath
import tarfile
from dataclasses import dataclass
from typing import Any

import numpy as np
from braceexpand import braceexpand

from dataserver.data.coco import _categories
from dataserver.data.remote import (
    FetchError,
    fetcher,
    is_remote,
    join,
    parent,
    prefetch,
    read_bytes,
    read_shared,
)
from dataserver.data.sample import Sample, SampleError
from dataserver.data.transforms import decode_image

IMAGE_EXTS = ("jpg", "jpeg", "png")
INDEX_VERSION = 1
# A shard is fetched ahead in blocks of about this many bytes (``ShardDataset.block``): one
# byte-range GET brings every sample whose image starts in the block into the fetch cache,
# where the plan will want each of them this epoch. The size S3's guidance gives for range
# requests (8-16 MB) trades a request's latency against bytes fetched before they are
# needed; 4 MiB keeps the first batch near and a block within a session's share of
# ``--max-fetch-mb``.
BLOCK_BYTES = 4 << 20

# (url, start, length) of a block and the (start, length) of each sample's image in it
Block = tuple[str, int, int, tuple[tuple[int, int], ...]]


def expand(pattern: str) -> list[str]:
    """The shards a brace pattern names, in brace order; ValueError when none."""
    urls = [u for u in braceexpand(pattern) if u]
    if not urls:
        raise ValueError(f"wds: {pattern!r} names no shard")
    return urls


@dataclass(frozen=True)
class ShardIndex:
    """Every sample of a set of shards: where its image is (shard, offset, size) and its
    objects (boxes xyxy in pixels and labels, or YOLO rows to scale by the image's size).
    Built whole by ``build_index`` or ``ShardIndex.from_json``."""

    shards: tuple[str, ...]
    names: tuple[str, ...]  # each sample's image member name
    shard: np.ndarray  # int32 (N,)
    offset: np.ndarray  # int64 (N,)
    size: np.ndarray  # int64 (N,)
    boxes: tuple[np.ndarray, ...]  # float32 (M, 4): xyxy pixels, or YOLO cx cy w h (yolo)
    labels: tuple[np.ndarray, ...]  # int64 (M,)
    yolo: tuple[bool, ...]  # the boxes are YOLO's normalised rows
    hw: tuple[tuple[int, int] | None, ...]  # (height, width) as the JSON gives them

    def __len__(self) -> int:
        return len(self.names)

    def to_json(self) -> str:
        return json.dumps(
            {
                "version": INDEX_VERSION,
                "shards": list(self.shards),
                "names": list(self.names),
                "shard": self.shard.tolist(),
                "offset": self.offset.tolist(),
                "size": self.size.tolist(),
                "boxes": [b.tolist() for b in self.boxes],
                "labels": [lb.tolist() for lb in self.labels],
                "yolo": list(self.yolo),
                "hw": [list(hw) if hw else None for hw in self.hw],
            }
        )

    @classmethod
    def from_json(cls, text: str) -> ShardIndex:
        doc = json.loads(text)
        if doc.get("version") != INDEX_VERSION:
            raise ValueError("shard index of another version")
        return cls(
            tuple(doc["shards"]),
            tuple(doc["names"]),
            np.asarray(doc["shard"], dtype=np.int32),
            np.asarray(doc["offset"], dtype=np.int64),
            np.asarray(doc["size"], dtype=np.int64),
            tuple(np.asarray(b, dtype=np.float32).reshape(-1, 4) for b in doc["boxes"]),
            tuple(np.asarray(lb, dtype=np.int64) for lb in doc["labels"]),
            tuple(bool(y) for y in doc["yolo"]),
            tuple(tuple(hw) if hw else None for hw in doc["hw"]),
        )


def _key_ext(name: str) -> tuple[str, str]:
    """WebDataset's grouping: the key is the name up to the first dot of its base name."""
    folder, base = posixpath.split(name)
    stem, dot, ext = base.partition(".")
    return posixpath.join(folder, stem), ext.lower() if dot else ""


def _objects(where: str, ext: str, raw: bytes) -> tuple[list[list[float]], list[int], bool, Any]:
    """A label member's boxes, labels, whether they are YOLO rows, and (h, w) if given."""
    if ext == "json":
        doc = json.loads(raw)
        if not isinstance(doc, dict):
            raise ValueError(f"{where}: not a JSON object")
        boxes, labels = [], []
        for ann in doc.get("annotations", []):
            if ann.get("iscrowd", 0):
                continue
            x, y, w, h = (float(v) for v in ann["bbox"])
            if w <= 0 or h <= 0:
                continue
            boxes.append([x, y, x + w, y + h])
            labels.append(int(ann["category_id"]))
        side = doc.get("height"), doc.get("width")
        ok = all(isinstance(v, int) and not isinstance(v, bool) and v > 0 for v in side)
        return boxes, labels, False, side if ok else None
    rows = [line.split() for line in raw.decode().splitlines() if line.strip()]
    if any(len(r) != 5 for r in rows):
        raise ValueError(f"{where}: YOLO rows are 'class cx cy w h'")
    return [[float(v) for v in r[1:]] for r in rows], [int(r[0]) for r in rows], True, None


def _members(url: str) -> tuple[list[tarfile.TarInfo], Any]:
    """A shard's regular members and an open tar to read them from (a remote shard is
    read once, whole: one GET, not counted against a sample)."""
    if is_remote(url):
        data = fetcher().read_uncached(url)
        tar = tarfile.open(fileobj=io.BytesIO(data), mode="r:")  # noqa: SIM115 (the caller's with)
    else:
        tar = tarfile.open(url, mode="r:")  # noqa: SIM115 (the caller's with)
    return [m for m in tar.getmembers() if m.isfile()], tar


def build_index(urls: list[str]) -> ShardIndex:
    """Read every shard once and index its samples (see the module's docstring). Raises
    ``ValueError``/``OSError`` naming the shard and member that are wrong."""
    names: list[str] = []
    shard_of: list[int] = []
    offsets: list[int] = []
    sizes: list[int] = []
    boxes: list[np.ndarray] = []
    labels: list[np.ndarray] = []
    yolo: list[bool] = []
    hws: list[tuple[int, int] | None] = []
    for s, url in enumerate(urls):
        members, tar = _members(url)
        with tar:
            groups: dict[str, dict[str, tarfile.TarInfo]] = {}
            for m in members:
                key, ext = _key_ext(m.name)
                groups.setdefault(key, {})[ext] = m
            for group in groups.values():
                image = next((group[e] for e in IMAGE_EXTS if e in group), None)
                if image is None:
                    continue  # (not a sample: another file beside them)
                label = group.get("json") or group.get("txt")
                b: list[list[float]] = []
                lb: list[int] = []
                is_yolo, hw = False, None
                if label is not None:
                    f = tar.extractfile(label)
                    raw = f.read() if f is not None else b""
                    where = f"{url}: {label.name}"
                    try:
                        b, lb, is_yolo, hw = _objects(where, _key_ext(label.name)[1], raw)
                    except (ValueError, KeyError, TypeError) as exc:
                        raise ValueError(f"{where}: {exc}") from None
                names.append(image.name)
                shard_of.append(s)
                offsets.append(image.offset_data)
                sizes.append(image.size)
                boxes.append(np.asarray(b, dtype=np.float32).reshape(-1, 4))
                labels.append(np.asarray(lb, dtype=np.int64))
                yolo.append(is_yolo)
                hws.append(hw)
    return ShardIndex(
        tuple(urls),
        tuple(names),
        np.asarray(shard_of, dtype=np.int32),
        np.asarray(offsets, dtype=np.int64),
        np.asarray(sizes, dtype=np.int64),
        tuple(boxes),
        tuple(labels),
        tuple(yolo),
        tuple(hws),
    )


def load_or_build(urls: list[str], directory: str | None) -> ShardIndex:
    """The index of ``urls``: read from ``directory`` when a process built it there
    before (the front, at start), else built (and written there, whole, by rename)."""
    if directory is None:
        return build_index(urls)
    digest = hashlib.sha1("\n".join(urls).encode()).hexdigest()[:20]
    path = os.path.join(directory, f"shards-{digest}.idx")
    try:
        with open(path) as f:
            return ShardIndex.from_json(f.read())
    except (OSError, ValueError, KeyError):
        pass
    index = build_index(urls)
    tmp = f"{path}.{os.getpid()}"
    try:
        with open(tmp, "w") as f:
            f.write(index.to_json())
        os.replace(tmp, path)
    except OSError:
        pass  # (no room: each process builds its own)
    return index


class ShardDataset:
    """``wds:URLS``: the samples of tar shards (see the module's docstring)."""

    deterministic = True  # __getitem__ is a pure function of the index

    def __init__(self, pattern: str) -> None:
        self.pattern = pattern
        urls = expand(pattern)
        self.index = load_or_build(urls, fetcher().settings.cache_dir)
        if len(self.index) == 0:
            raise ValueError(f"wds: no samples (KEY.jpg/.png) in {urls[0]} ...")
        self.fingerprint = hashlib.sha1(self.index.to_json().encode()).hexdigest()[:16]
        self.categories: tuple[tuple[int, str], ...] = ()
        where = join(parent(urls[0]), "categories.json")
        try:
            raw = read_shared(where)
        except (FileNotFoundError, FetchError) as exc:
            if isinstance(exc, FetchError) and exc.kind != "not_found":
                raise
        else:
            self.categories = _categories(where, json.loads(raw))
        # each image's (height, width) as its JSON gives them (0: not given), as ``CocoDataset``
        self.hw = np.array([hw or (0, 0) for hw in self.index.hw], dtype=np.int32).reshape(-1, 2)
        # ``block``'s tables, made on first use (the front's: a worker never asks)
        self._block_of: np.ndarray | None = None
        self._members = self._first = np.zeros(0, dtype=np.int64)

    def __len__(self) -> int:
        return len(self.index)

    def _where(self, index: int) -> tuple[str, int, int]:
        i = self.index
        return i.shards[int(i.shard[index])], int(i.offset[index]), int(i.size[index])

    def locations(self, indices: list[int]) -> list[tuple[str, int | None, int | None]]:
        """Where these samples' image bytes are: (shard, offset, size) (what a server's
        front fetches ahead, ``server/front/prefetch.py``)."""
        return [self._where(i) for i in indices]

    def block(self, index: int) -> Block:
        """The block of its shard that holds this sample's image (``BLOCK_BYTES``): what
        the front fetches ahead with one byte-range GET, each sample kept in the fetch cache
        under its own range (as a worker reads it)."""
        if self._block_of is None:
            i = self.index
            key = (i.shard.astype(np.int64) << 32) | (i.offset // BLOCK_BYTES)
            _, inverse = np.unique(key, return_inverse=True)
            order = np.lexsort((i.offset, inverse))  # (by block, then offset)
            self._block_of = inverse.astype(np.int64)
            self._members = order
            self._first = np.searchsorted(inverse[order], np.arange(inverse.max() + 2))
        b = int(self._block_of[index])
        members = self._members[self._first[b] : self._first[b + 1]]
        offsets, sizes = self.index.offset[members], self.index.size[members]
        start = int(offsets[0])
        length = int((offsets + sizes).max()) - start
        url = self.index.shards[int(self.index.shard[index])]
        parts = tuple((int(o), int(n)) for o, n in zip(offsets, sizes, strict=True))
        return url, start, length, parts

    def prefetch(self, indices: list[int]) -> None:
        """Start fetching these samples' image bytes (remote shards)."""
        prefetch(self.locations(indices))

    def __getitem__(self, index: int) -> Sample:
        url, start, size = self._where(index)
        name = f"{url}#{self.index.names[index]}"
        try:
            data = np.frombuffer(read_bytes(url, start, size), dtype=np.uint8)
        except OSError as exc:
            raise SampleError(index, f"cannot read: {exc.strerror or exc}", name) from None
        image = decode_image(data)
        if image is None:
            raise SampleError(index, "not a decodable image (corrupt or truncated)", name)
        boxes = self.index.boxes[index]
        if self.index.yolo[index] and len(boxes):
            h, w = image.shape[:2]
            cx, cy, bw, bh = boxes.T
            boxes = np.stack(
                [(cx - bw / 2) * w, (cy - bh / 2) * h, (cx + bw / 2) * w, (cy + bh / 2) * h], 1
            ).astype(np.float32)
        return Sample(image, boxes, self.index.labels[index], name)


def write_shards(
    annotations: str, image_dir: str | None, out_dir: str, shard_mb: float = 100.0
) -> list[str]:
    """Write a local COCO set as WebDataset shards (``shard-000000.tar``, ... of about
    ``shard_mb`` each, images in the file's order) and ``categories.json`` into
    ``out_dir``; returns the shards' paths (``wds:OUT_DIR/shard-{000000..NNNNNN}.tar``
    serves them)."""
    doc = json.loads(read_bytes(annotations))
    folder = image_dir or parent(annotations)
    by_image: dict[Any, list[dict[str, Any]]] = {}
    for ann in doc.get("annotations", []):
        by_image.setdefault(ann.get("image_id"), []).append(
            {k: ann[k] for k in ("bbox", "category_id", "iscrowd") if k in ann}
        )
    os.makedirs(out_dir, exist_ok=True)
    limit = int(shard_mb * (1 << 20))
    paths: list[str] = []
    tar: tarfile.TarFile | None = None
    written = 0

    def add(name: str, data: bytes) -> None:
        info = tarfile.TarInfo(name)
        info.size = len(data)
        assert tar is not None
        tar.addfile(info, io.BytesIO(data))

    for n, entry in enumerate(doc["images"]):
        if tar is None or written >= limit:
            if tar is not None:
                tar.close()
            paths.append(os.path.join(out_dir, f"shard-{len(paths):06d}.tar"))
            tar = tarfile.open(paths[-1], "w", format=tarfile.USTAR_FORMAT)  # noqa: SIM115
            written = 0
        image = read_bytes(join(folder, str(entry["file_name"])))
        ext = posixpath.splitext(str(entry["file_name"]))[1].lower().lstrip(".") or "jpg"
        label = {k: entry[k] for k in ("file_name", "width", "height") if k in entry}
        label["annotations"] = by_image.get(entry["id"], [])
        add(f"{n:09d}.{ext}", image)
        add(f"{n:09d}.json", json.dumps(label).encode())
        written += len(image) + 1024
    if tar is not None:
        tar.close()
    with open(os.path.join(out_dir, "categories.json"), "w") as f:
        json.dump(doc.get("categories", []), f)
    return paths

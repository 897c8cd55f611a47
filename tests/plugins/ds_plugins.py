"""User datasets for the tests, served as ``ds_plugins:<factory>`` (tests/plugins is put on
the servers' PYTHONPATH by conftest)."""

from __future__ import annotations

import math
import os
import signal
import sys
import time
from typing import Any

import numpy as np

from dataserver.data.synthetic import generate


def colour_of(index: int) -> tuple[int, int, int]:
    """The flat colour that names ``index`` (unique for index < 65536)."""
    return (index & 255, (index >> 8) & 255, 77)


class FlatDataset:
    """Image i is one flat colour naming i, of size (h, w) varying with i; one box covering
    the middle half of the image, label i + 1."""

    deterministic = True  # __getitem__ is a pure function of the index

    def __init__(self, n: int = 64, h: int = 60, w: int = 80) -> None:
        self.n, self.h, self.w = n, h, w

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, index: int) -> dict[str, Any]:
        h = self.h + (index % 3) * 10
        w = self.w + (index % 2) * 20
        image = np.empty((h, w, 3), dtype=np.uint8)
        image[:] = colour_of(index)
        box = [w / 4, h / 4, 3 * w / 4, 3 * h / 4]
        return {
            "image": image,
            "boxes": np.array([box], np.float32),
            "labels": np.array([index + 1]),
        }


def flat(n: int = 64, h: int = 60, w: int = 80) -> FlatDataset:
    return FlatDataset(n, h, w)


class NoPickle:
    """A dataset that refuses to be pickled: served fine, because nothing pickles it."""

    deterministic = True  # __getitem__ is a pure function of the index

    def __init__(self, n: int) -> None:
        self.n = n

    def __reduce__(self) -> Any:
        raise RuntimeError("this dataset must never be pickled")

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, index: int) -> dict[str, Any]:
        s = generate(7, index)
        return {"image": s.image, "boxes": s.boxes, "labels": s.labels}


def no_pickle(n: int = 32) -> NoPickle:
    return NoPickle(n)


class Failing:
    """Samples in ``bad`` raise ValueError; the rest are flat images."""

    deterministic = True  # __getitem__ is a pure function of the index

    def __init__(self, n: int, bad: list[int]) -> None:
        self.inner = FlatDataset(n)
        self.bad = set(bad)

    def __len__(self) -> int:
        return len(self.inner)

    def __getitem__(self, index: int) -> dict[str, Any]:
        if index in self.bad:
            raise ValueError(f"sample {index} is broken on purpose")
        return self.inner[index]


def failing(n: int = 32, bad: list[int] | None = None) -> Failing:
    return Failing(n, bad or [5])


class Poison:
    """Reading sample ``poison`` kills the worker process (SIGKILL), every time."""

    deterministic = True  # __getitem__ is a pure function of the index

    def __init__(self, n: int, poison: int) -> None:
        self.inner = FlatDataset(n)
        self.poison = poison

    def __len__(self) -> int:
        return len(self.inner)

    def __getitem__(self, index: int) -> dict[str, Any]:
        if index == self.poison:
            os.kill(os.getpid(), signal.SIGKILL)
        return self.inner[index]


def poison(n: int = 32, index: int = 7) -> Poison:
    return Poison(n, index)


class Flag:
    """Reads ``active`` from set_control: image value and label say whether it was set."""

    deterministic = True  # __getitem__ is a pure function of the index

    def __init__(self, n: int) -> None:
        self.n = n
        self.active = 0

    def set_control(self, values: dict[str, Any]) -> None:
        self.active = int(values.get("active", 0))

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, index: int) -> dict[str, Any]:
        image = np.full((32, 32, 3), 200 if self.active else 10, dtype=np.uint8)
        box = np.array([[4, 4, 28, 28]], np.float32)
        return {"image": image, "boxes": box, "labels": np.array([1 + self.active])}


def flag(n: int = 256) -> Flag:
    return Flag(n)


class Slow:
    """Flat images that each take ``ms`` milliseconds (a stand-in for heavy decoding)."""

    deterministic = True  # __getitem__ is a pure function of the index

    def __init__(self, n: int, ms: float) -> None:
        self.inner = FlatDataset(n)
        self.seconds = ms / 1000.0

    def __len__(self) -> int:
        return len(self.inner)

    def __getitem__(self, index: int) -> dict[str, Any]:
        time.sleep(self.seconds)
        return self.inner[index]


def slow(n: int = 64, ms: float = 10.0) -> Slow:
    return Slow(n, ms)


class PoisonWhenStitched:
    """Sample ``index`` is fine alone, but kills the worker process when it is read for a
    stitched image (as a composition too large for memory would): its probes all pass,
    and the composed image itself is the poison."""

    deterministic = True  # __getitem__ is a pure function of the index

    def __init__(self, n: int, index: int) -> None:
        self.inner = FlatDataset(n)
        self.index = index

    def __len__(self) -> int:
        return len(self.inner)

    def __getitem__(self, index: int) -> dict[str, Any]:
        if index == self.index and _composing_grid() > 1:
            os.kill(os.getpid(), signal.SIGKILL)
        return self.inner[index]


def _composing_grid() -> int:
    """The grid of the output image being composed (read from the worker's call stack)."""
    frame = sys._getframe(1)
    while frame is not None:
        if frame.f_code.co_name == "compose_into":
            return int(frame.f_locals.get("grid", 1))
        frame = frame.f_back  # type: ignore[assignment]
    return 1


def poison_when_stitched(n: int = 32, index: int = 5) -> PoisonWhenStitched:
    return PoisonWhenStitched(n, index)


class FailsInWorker:
    """Builds in the front (which checks the spec), fails in every worker: as a dataset
    whose files are mounted only where the front runs would."""

    deterministic = True  # __getitem__ is a pure function of the index

    def __init__(self, n: int) -> None:
        if sys.argv[0].endswith(os.path.join("server", "worker", "worker.py")):
            raise FileNotFoundError("/data/shard-0.tar: no such file (mounted on the front only)")
        self.inner = FlatDataset(n)

    def __len__(self) -> int:
        return len(self.inner)

    def __getitem__(self, index: int) -> dict[str, Any]:
        return self.inner[index]


def fails_in_worker(n: int = 16) -> FailsInWorker:
    return FailsInWorker(n)


class Merge:
    """A dataset whose ``set_control`` merges values into its state, as trainers write them
    (``dataset.tint = ...``): image i's value is i's colour plus the state's ``tint``, its
    label 1 + ``label_shift``. A sample depends on every value ever merged in: what a worker
    shared by several sessions must not let one session's values reach another's samples."""

    deterministic = True  # __getitem__ is a pure function of the index

    def __init__(self, n: int = 64) -> None:
        self.n = n
        self.state: dict[str, Any] = {"tint": 0, "label_shift": 0}

    def set_control(self, values: dict[str, Any]) -> None:
        self.state.update(values)

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, index: int) -> dict[str, Any]:
        image = np.empty((40, 48, 3), dtype=np.uint8)
        r, g, b = colour_of(index)
        image[:] = ((r + int(self.state["tint"])) % 256, g, b)
        box = np.array([[4, 4, 30, 30]], np.float32)
        return {"image": image, "boxes": box, "labels": np.array([1 + self.state["label_shift"]])}


def merge(n: int = 64) -> Merge:
    return Merge(n)


class SyntheticFiles:
    """The synthetic set (labels 1..80) with what a YOLO set's samples carry: ``file`` and
    ``orig_size``; announcing its categories (``categories=False``: none)."""

    deterministic = True  # __getitem__ is a pure function of the index

    def __init__(self, images: int = 64, seed: int = 0, categories: bool = True) -> None:
        self.images, self.seed = images, seed
        if categories:
            self.categories = [(label, f"class{label}") for label in range(1, 81)]

    def __len__(self) -> int:
        return self.images

    def __getitem__(self, index: int) -> dict[str, Any]:
        s = generate(self.seed, index)
        h, w = s.image.shape[:2]
        return {
            "image": s.image,
            "boxes": s.boxes,
            "labels": s.labels,
            "file": f"synthetic/{index:06d}.jpg",
            "orig_size": (h, w),
        }


def yolo_synthetic(images: int = 64, seed: int = 0, categories: bool = True) -> Any:
    """``SyntheticFiles`` served with YOLO's augmentation after composition
    (``dataserver.data.yolo_set.YoloSet``: the hyperparameters the trainer sends under
    ``"yolo"``; a client that sends none gets Ultralytics' defaults: serve validation from
    ``synthetic_files``, unaugmented, as Ultralytics validates)."""
    from dataserver.data.yolo_set import YoloSet

    return YoloSet(SyntheticFiles(images, seed, categories))


def synthetic_files(images: int = 16, seed: int = 0, categories: bool = True) -> SyntheticFiles:
    return SyntheticFiles(images, seed, categories)


BLOCK_COLOURS = ((230, 40, 40), (40, 200, 40), (40, 60, 230), (230, 210, 40))


class Blocks:
    """Large flat blocks, 1 to 3 an image, label 1..4 by colour, on a dark noisy ground, of
    COCO-like sizes: a detection task a detector learns within a few dozen steps at tiny
    image sizes. Samples carry ``file`` and ``orig_size``; the dataset announces its four
    categories (``categories=False``: none)."""

    deterministic = True  # __getitem__ is a pure function of the index

    def __init__(self, images: int = 64, seed: int = 0, categories: bool = True) -> None:
        self.images, self.seed = images, seed
        if categories:
            names = ("red", "green", "blue", "yellow")
            self.categories = [(i + 1, name) for i, name in enumerate(names)]

    def __len__(self) -> int:
        return self.images

    def __getitem__(self, index: int) -> dict[str, Any]:
        rng = np.random.default_rng([self.seed, index, 0xB10C])
        h, w = ((480, 640), (640, 480), (512, 512), (360, 640))[int(rng.integers(4))]
        image = rng.integers(0, 60, size=(h, w, 3), dtype=np.uint8)
        boxes, labels = [], []
        for _ in range(int(rng.integers(1, 4))):
            bw, bh = int(rng.integers(w // 4, w // 2)), int(rng.integers(h // 4, h // 2))
            x1, y1 = int(rng.integers(0, w - bw)), int(rng.integers(0, h - bh))
            label = int(rng.integers(1, 5))
            image[y1 : y1 + bh, x1 : x1 + bw] = BLOCK_COLOURS[label - 1]
            boxes.append([x1, y1, x1 + bw, y1 + bh])
            labels.append(label)
        return {
            "image": image,
            "boxes": np.asarray(boxes, np.float32),
            "labels": np.asarray(labels, np.int64),
            "file": f"blocks/{index:06d}.jpg",
            "orig_size": (h, w),
        }


def blocks(images: int = 64, seed: int = 0, categories: bool = True) -> Blocks:
    return Blocks(images, seed, categories)


def yolo_blocks(images: int = 64, seed: int = 0, categories: bool = True) -> Any:
    """``Blocks`` with YOLO's augmentation after composition (as ``yolo_synthetic``)."""
    from dataserver.data.yolo_set import YoloSet

    return YoloSet(Blocks(images, seed, categories))


def sized_shapes(n: int, sort: bool = True) -> np.ndarray:
    """The (h, w) of ``sized(n)``'s images, index by index: 24..151 a side from a hash of
    the index, sorted by aspect (h / w) as a rect val set is unless ``sort`` is False
    (int32 (n, 2); about a second at 2^24 unsorted)."""
    i = np.arange(n, dtype=np.uint64)
    mixed = (i * np.uint64(0x9E3779B97F4A7C15)) >> np.uint64(40)
    h = (mixed & np.uint64(127)).astype(np.int32) + 24
    w = ((mixed >> np.uint64(8)) & np.uint64(127)).astype(np.int32) + 24
    if not sort:
        return np.stack([h, w], axis=1)
    order = np.argsort(h / w, kind="stable")
    return np.stack([h[order], w[order]], axis=1)


class Sized:
    """A rect val set of ``n`` images that announces ``sizes`` (``sized_shapes``, computed
    when first asked: a server of 2^24 that serves no sample builds it once): image i is read at
    that size (a flat colour naming i) and, as ``yolo_set``'s mode "val", resized so its
    long side is ``imgsz`` (never mirrored, ``scaleup = False``), with ``file`` and
    ``orig_size``; one box in its middle, label 0. No file is read; nothing is made until a
    sample is."""

    deterministic = True
    scaleup = False
    categories = [(0, "thing")]

    def __init__(self, n: int, imgsz: int, sort: bool) -> None:
        self.n, self.imgsz, self.sort = n, imgsz, sort
        self._sizes: np.ndarray | None = None

    def __len__(self) -> int:
        return self.n

    @property
    def sizes(self) -> np.ndarray:
        if self._sizes is None:
            self._sizes = sized_shapes(self.n, self.sort)
        return self._sizes

    def __getitem__(self, index: int) -> Any:
        from dataserver.data.sample import Sample

        h0, w0 = (int(v) for v in self.sizes[index])
        r = self.imgsz / max(h0, w0)
        h, w = h0, w0
        if r != 1:
            h, w = min(math.ceil(h0 * r), self.imgsz), min(math.ceil(w0 * r), self.imgsz)
        image = np.empty((h, w, 3), np.uint8)
        image[:] = colour_of(index)
        box = np.array([[w / 4, h / 4, 3 * w / 4, 3 * h / 4]], np.float32)
        return Sample(image, box, np.zeros(1, np.int64), f"{index:08d}.jpg", (h0, w0))


def sized(n: int = 80_000, imgsz: int = 64, sort: bool = True) -> Sized:
    return Sized(n, imgsz, sort)

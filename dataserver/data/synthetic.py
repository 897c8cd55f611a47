"""A generated COCO-style detection set: many small objects, a few large ones.

Every image is a pure function of (seed, index), made in memory, so the default dataset
works on a fresh machine with no files, and ``dataserver synth`` writes the same images
as JPEG files with a COCO ``annotations.json``.
"""

from __future__ import annotations

import cv2
import numpy as np

from dataserver.data.sample import Sample

# (H, W) of the generated images: the aspect ratios COCO images commonly have.
IMAGE_SIZES = ((480, 640), (427, 640), (640, 480), (512, 512), (360, 640), (640, 427))
NUM_CLASSES = 80
SMALL_SIDE = (6, 30)  # "small" in COCO terms: area under 32 x 32
LARGE_SIDE = (100, 300)


def _palette(label: int) -> tuple[int, int, int]:
    rng = np.random.default_rng(label)
    r, g, b = (int(v) for v in rng.integers(40, 256, size=3))
    return r, g, b


def generate(seed: int, index: int, file: str | None = None) -> Sample:
    """The synthetic image number ``index`` of the set seeded ``seed``, named ``file``."""
    rng = np.random.default_rng(np.random.SeedSequence([seed, index, 0x5EED]))
    height, width = IMAGE_SIZES[int(rng.integers(len(IMAGE_SIZES)))]
    # A smooth background with coarse texture, cheap to make and JPEG-realistic.
    coarse = rng.integers(0, 256, size=(height // 32 + 1, width // 32 + 1, 3), dtype=np.uint8)
    image = np.ascontiguousarray(cv2.resize(coarse, (width, height)) // 2, dtype=np.uint8)
    boxes: list[list[float]] = []
    labels: list[int] = []
    n_large = int(rng.integers(0, 4))
    n_small = int(rng.integers(8, 33))
    for size_range, count in ((LARGE_SIDE, n_large), (SMALL_SIDE, n_small)):
        for _ in range(count):
            bw = int(rng.integers(*size_range))
            bh = int(rng.integers(*size_range))
            bw, bh = min(bw, width - 1), min(bh, height - 1)
            x1 = int(rng.integers(0, width - bw))
            y1 = int(rng.integers(0, height - bh))
            label = int(rng.integers(1, NUM_CLASSES + 1))
            color = _palette(label)
            if rng.random() < 0.5:
                cv2.rectangle(image, (x1, y1), (x1 + bw - 1, y1 + bh - 1), color, thickness=-1)
            else:
                center = (x1 + bw // 2, y1 + bh // 2)
                cv2.ellipse(image, center, (bw // 2, bh // 2), 0, 0, 360, color, thickness=-1)
            boxes.append([x1, y1, x1 + bw, y1 + bh])
            labels.append(label)
    return Sample(
        image,
        np.asarray(boxes, dtype=np.float32).reshape(-1, 4),
        np.asarray(labels, dtype=np.int64),
        file,
    )


class SyntheticDataset:
    """``synthetic:images=N,seed=S``: N generated images, deterministic in (S, index).
    Its labels are 1..80 (``categories``: (c, "class{c}"), as ``dataserver synth`` writes
    them)."""

    deterministic = True  # __getitem__ is a pure function of the index
    categories = tuple((c, f"class{c}") for c in range(1, NUM_CLASSES + 1))

    def __init__(self, images: int = 2048, seed: int = 0) -> None:
        if images < 1:
            raise ValueError(f"images must be >= 1, got {images}")
        self.images = images
        self.seed = seed

    def __len__(self) -> int:
        return self.images

    def __getitem__(self, index: int) -> Sample:
        if not 0 <= index < self.images:
            raise IndexError(f"index {index} out of range 0..{self.images - 1}")
        # (named as ``dataserver synth`` writes it)
        return generate(self.seed, index, file=f"{index:012d}.jpg")

    def __repr__(self) -> str:
        return f"SyntheticDataset(images={self.images}, seed={self.seed})"

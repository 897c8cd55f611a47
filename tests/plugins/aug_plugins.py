"""Test datasets for the two stages: sources that are not pure functions of the index, and
``augment`` methods (seeded, checking what they are told, misbehaving)."""

from __future__ import annotations

import os
from typing import Any

import numpy as np


class Painted:
    """Each ``__getitem__`` call paints the image a random colour (its own randomness, as a
    user's augmenting ``__getitem__`` has): not a pure function of the index, and it does
    not say it is one (no ``deterministic``)."""

    def __init__(self, n: int) -> None:
        self.n = n
        self.rng = np.random.default_rng(int.from_bytes(os.urandom(8), "little"))

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, index: int) -> dict[str, Any]:
        colour = self.rng.integers(0, 256, size=3, dtype=np.uint8)
        image = np.empty((24, 32, 3), np.uint8)
        image[:] = colour
        box = np.array([[4, 4, 20, 16]], np.float32)
        return {"image": image, "boxes": box, "labels": np.array([1 + index % 7])}


def painted(n: int = 32) -> Painted:
    return Painted(n)


class Jitter:
    """Flat, deterministic sources; ``augment`` crops a random border and shifts the
    brightness by amounts drawn from ``rng``, and writes what it was told into the label of
    the one box (``told``), so tests read ``params`` back from any layout."""

    deterministic = True

    def __init__(self, n: int) -> None:
        self.n = n

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, index: int) -> dict[str, Any]:
        image = np.full((48, 64, 3), 40 + index % 100, np.uint8)
        image[::7] = 200  # stripes: a crop changes the pixels, not only the brightness
        box = np.array([[8, 8, 56, 40]], np.float32)
        return {"image": image, "boxes": box, "labels": np.array([1 + index])}

    def augment(
        self, sample: dict[str, Any], rng: np.random.Generator, params: dict[str, Any]
    ) -> dict[str, Any]:
        image = sample["image"]
        top, left = (int(v) for v in rng.integers(0, 4, size=2))
        shift = int(rng.integers(0, 60))
        out = np.clip(image[top:, left:].astype(np.int16) + shift, 0, 255).astype(np.uint8)
        boxes = sample["boxes"] - np.array([left, top, left, top], np.float32)
        labels = np.full(len(boxes), told(params), np.int64)
        return {"image": np.ascontiguousarray(out), "boxes": boxes, "labels": labels}


def told(params: dict[str, Any]) -> int:
    """(epoch, step, mode, image height, control "gain", index) packed into one label."""
    return (
        params["epoch"] % 8
        | (params["step"] % 256) << 3
        | int(params["mode"] == "stitch") << 11
        | (params["image_size"][0] % 1024) << 12
        | (int(params["control"].get("gain", 0)) % 64) << 22
        | 1 << 28
    )


def untold(label: int) -> dict[str, int]:
    """What ``told`` packed."""
    return {
        "epoch": label & 7,
        "step": (label >> 3) & 255,
        "stitch": (label >> 11) & 1,
        "height": (label >> 12) & 1023,
        "gain": (label >> 22) & 63,
    }


def jitter(n: int = 32) -> Jitter:
    return Jitter(n)


class BadAugment(Jitter):
    """``augment`` misbehaves for chosen indices: 3 returns an image larger than the
    batch's size, 5 raises, 6 returns a list; the others are fine."""

    def augment(
        self, sample: dict[str, Any], rng: np.random.Generator, params: dict[str, Any]
    ) -> Any:
        index = params["index"]
        if index == 3:
            h, w = params["image_size"]
            return {"image": np.zeros((h + 1, w, 3), np.uint8), "boxes": [], "labels": []}
        if index == 5:
            raise RuntimeError("colour space exploded")
        if index == 6:
            return [sample["image"]]
        return super().augment(sample, rng, params)


def bad_augment(n: int = 16) -> BadAugment:
    return BadAugment(n)

"""Test datasets for what happens after composition: ``augment_composed`` hooks (seeded,
checking what they are told, misbehaving), categories, and samples that name their file
and original size."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import numpy as np
from ds_plugins import FlatDataset


class Composed(FlatDataset):
    """``ds_plugins:flat`` with an ``augment_composed`` that checks what it is given (a
    mosaic's 2H x 2W canvas with border (-H // 2, -W // 2), anything else H x W with border
    0), crops a mosaic to H x W at an offset drawn from ``rng`` (a RandomPerspective with
    only a translation), and inverts a regular image when ``rng`` says so. ``bad``: answers
    an image one row short. ``seen``: the params of every call (in this process)."""

    def __init__(self, n: int = 64, bad: bool = False) -> None:
        super().__init__(n)
        self.bad = bad
        self.seen: list[dict[str, Any]] = []

    def augment_composed(
        self, sample: dict[str, Any], rng: np.random.Generator, params: Mapping[str, Any]
    ) -> dict[str, Any]:
        self.seen.append(dict(params))
        image, boxes = sample["image"], sample["boxes"]
        h, w = params["image_size"]
        mosaic, border = params["mosaic"], tuple(params["border"])
        want = ((2 * h, 2 * w), (-h // 2, -w // 2)) if mosaic else ((h, w), (0, 0))
        if (image.shape[:2], border) != want:
            raise ValueError(f"given {image.shape[:2]} border {border}, expected {want}")
        if self.bad:
            return {**sample, "image": image[1:]}
        if mosaic:
            top, left = int(rng.integers(0, h + 1)), int(rng.integers(0, w + 1))
            image = image[top : top + h, left : left + w]
            boxes = boxes - np.array([left, top, left, top], np.float32)
        elif rng.random() < 0.5:
            image = 255 - image
        return {"image": np.ascontiguousarray(image), "boxes": boxes, "labels": sample["labels"]}


def composed(n: int = 64, bad: bool = False) -> Composed:
    return Composed(n, bad)


class Named(FlatDataset):
    """``ds_plugins:flat`` announcing ``categories`` (given as [label, name] lists)."""

    def __init__(self, n: int, categories: list[list[Any]]) -> None:
        super().__init__(n)
        self.categories = [tuple(pair) for pair in categories]
        self.fingerprint = f"named-{n}"  # (the same data whatever the categories say)


def named(n: int = 16, categories: list[list[Any]] | None = None) -> Named:
    return Named(n, categories if categories is not None else [[0, "zero"], [7, "seven"]])


class Meta(FlatDataset):
    """``ds_plugins:flat`` whose samples name a file ("flat/{i}.png") and, for even
    indices, an original size twice the image's (for odd ones the image's own applies)."""

    def __getitem__(self, index: int) -> dict[str, Any]:
        sample = super().__getitem__(index)
        sample["file"] = f"flat/{index}.png"
        if index % 2 == 0:
            h, w = sample["image"].shape[:2]
            sample["orig_size"] = (2 * h, 2 * w)
        return sample


def meta(n: int = 32) -> Meta:
    return Meta(n)

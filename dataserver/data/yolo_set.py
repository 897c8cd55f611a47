"""A dataset served with Ultralytics' YOLO augmentation after composition: a COCO set (or
the synthetic one) whose ``augment_composed`` is ``dataserver.data.yolo.YoloAugment``.

    dataserver serve --dataset dataserver.data.yolo_set:yolo_set \\
        --dataset-args '{"annotations": "train/annotations.json"}'

The hyperparameters are Ultralytics' defaults, then those given in the dataset arguments
(``{"hyp": {"degrees": 5.0}}``), then those the trainer sends as control values under
``"yolo"`` (``client.control(yolo={...})``: what ``DataServerTrainer`` does with its own
arguments), read per call from ``params["control"]``: no ``set_control``, so the store of
sources is shared whatever the hyperparameters. numpy and cv2 only, as every server module.
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Mapping
from functools import lru_cache
from typing import Any

import numpy as np

from dataserver.data.coco import CocoDataset
from dataserver.data.synthetic import SyntheticDataset
from dataserver.data.yolo import HYPERPARAMETERS, YoloAugment, yolo_hyp

CONTROL_KEY = "yolo"


@lru_cache(maxsize=16)
def _augment(values: tuple[tuple[str, Any], ...]) -> YoloAugment:
    return yolo_hyp(dict(values))


class YoloSet:
    """``base`` (a COCO set, or the synthetic one) with ``augment_composed`` = YOLO's
    augmentation; ``categories``, ``file`` and the rest as ``base`` gives them."""

    deterministic = True  # __getitem__ is a pure function of the index (the base's)

    def __init__(self, base: Any, hyp: Mapping[str, Any] | None = None) -> None:
        unknown = sorted(set(hyp or {}) - set(HYPERPARAMETERS))
        if unknown:
            raise ValueError(
                f"unknown YOLO hyperparameters {unknown}; known: {', '.join(HYPERPARAMETERS)}"
            )
        self.base = base
        self.hyp = dict(hyp or {})
        _augment(_key(self.hyp))  # (a bad value fails here, when the server starts)
        own = getattr(base, "fingerprint", repr(base))
        text = f"{own}|{json.dumps(self.hyp, sort_keys=True)}"
        self.fingerprint = hashlib.sha1(text.encode()).hexdigest()[:16]
        categories = getattr(base, "categories", None)
        if categories is not None:
            self.categories = categories

    def __len__(self) -> int:
        return len(self.base)

    def __getitem__(self, index: int) -> Any:
        return self.base[index]

    def augment_composed(
        self, sample: dict[str, Any], rng: np.random.Generator, params: Mapping[str, Any]
    ) -> dict[str, Any]:
        sent = params.get("control", {}).get(CONTROL_KEY) or {}
        values = {**self.hyp, **{k: v for k, v in sent.items() if k in HYPERPARAMETERS}}
        return _augment(_key(values))(sample, rng, params)

    def __repr__(self) -> str:
        return f"YoloSet({self.base!r}, hyp={self.hyp})"


def _key(values: Mapping[str, Any]) -> tuple[tuple[str, Any], ...]:
    return tuple(
        sorted((k, tuple(v) if isinstance(v, (list, tuple)) else v) for k, v in values.items())
    )


def yolo_set(
    annotations: str | None = None,
    image_dir: str | None = None,
    images: int = 2048,
    seed: int = 0,
    hyp: Mapping[str, Any] | None = None,
) -> YoloSet:
    """The plugin factory: a COCO set at ``annotations`` (``image_dir`` defaulting to its
    folder), else the synthetic set of ``images`` from ``seed``; ``hyp`` overrides
    Ultralytics' default hyperparameters."""
    base = (
        CocoDataset(annotations, image_dir)
        if annotations
        else SyntheticDataset(images=images, seed=seed)
    )
    return YoloSet(base, hyp)

"""A dataset served with Ultralytics' YOLO augmentation after composition: a COCO set (or
the synthetic one) whose ``augment_composed`` is ``dataserver.data.yolo.YoloAugment``.

    dataserver serve --dataset dataserver.data.yolo_set:yolo_set \\
        --dataset-args '{"annotations": "train/annotations.json"}'

Validation (``"mode": "val"``): the COCO set served as Ultralytics' val loader reads it
(``YoloVal``): in aspect order, each image's long side resized to ``imgsz`` (default 640,
the trainer's ``imgsz``), never mirrored, never enlarged by the pipeline, with its
per-sample sizes announced for rect batches (``DataServerTrainer`` builds them)::

    dataserver serve --dataset dataserver.data.yolo_set:yolo_set \\
        --dataset-args '{"annotations": "val/annotations.json", "mode": "val"}'

The hyperparameters are Ultralytics' defaults, then those given in the dataset arguments
(``{"hyp": {"degrees": 5.0}}``), then those the trainer sends as control values under
``"yolo"`` (``client.control(yolo={...})``: what ``DataServerTrainer`` does with its own
arguments), read per call from ``params["control"]``: no ``set_control``, so the store of
sources is shared whatever the hyperparameters. numpy and cv2 only, as every server module.
"""

from __future__ import annotations

import hashlib
import json
import math
from collections.abc import Mapping
from functools import lru_cache
from typing import Any

import cv2
import numpy as np

from dataserver.data.coco import CocoDataset
from dataserver.data.cocoindex import coco_columns
from dataserver.data.index import IndexCache, MappedIndex, SharedIndex, file_source
from dataserver.data.sample import Sample, SampleError
from dataserver.data.synthetic import SyntheticDataset
from dataserver.data.yolo import HYPERPARAMETERS, YoloAugment, yolo_hyp
from dataserver.data.yololayout import YoloLayout, yolo_dataset

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
        return self._hook(params)(sample, rng, params)

    def mosaic_region(
        self, rng: np.random.Generator, params: Mapping[str, Any]
    ) -> tuple[int, int, int, int] | None:
        """``YoloAugment.mosaic_region`` of the hyperparameters ``augment_composed`` uses."""
        return self._hook(params).mosaic_region(rng, params)

    def _hook(self, params: Mapping[str, Any]) -> YoloAugment:
        sent = params.get("control", {}).get(CONTROL_KEY) or {}
        values = {**self.hyp, **{k: v for k, v in sent.items() if k in HYPERPARAMETERS}}
        return _augment(_key(values))

    def __repr__(self) -> str:
        return f"YoloSet({self.base!r}, hyp={self.hyp})"


def _key(values: Mapping[str, Any]) -> tuple[tuple[str, Any], ...]:
    return tuple(
        sorted((k, tuple(v) if isinstance(v, (list, tuple)) else v) for k, v in values.items())
    )


class YoloVal:
    """A COCO set served as Ultralytics' val loader (``YOLODataset`` with ``rect``) reads
    it: index i is the i-th image in aspect order (height / width, ``argsort`` of the
    file's images, as ``set_rectangle`` sorts them); ``sizes`` announces their (h, w) as
    the annotation file gives them, in that order, so a trainer plans rect batches (each
    batch's shape from its images' aspects, Ultralytics' rule); each image is resized as
    ``load_image`` does (long side to ``imgsz``: ``ceil``, ``INTER_LINEAR``, small images
    enlarged too) with ``orig_size`` its size as read. ``scaleup = False``: the pipeline
    never enlarges it (``LetterBox(scaleup=False)``: placed unscaled in a batch shape
    larger than ``imgsz``); ``augment_composed`` changes nothing (so the servers' own
    mirror flip is off) and checks the trainer's ``imgsz`` (control ``yolo.imgsz``) is
    this set's."""

    deterministic = True
    scaleup = False

    def __init__(self, base: Any, imgsz: int = 640) -> None:
        if not isinstance(imgsz, int) or isinstance(imgsz, bool) or imgsz < 1:
            raise ValueError(f"imgsz must be a positive int, got {imgsz!r}")
        sizes = getattr(base, "hw", None)
        if sizes is None:
            raise ValueError("mode 'val' serves annotations ('annotations' or 'data')")
        shapes = np.asarray(sizes, dtype=np.int64).reshape(-1, 2)
        unknown = np.flatnonzero((shapes <= 0).any(axis=1))
        if len(unknown):
            i = int(unknown[0])
            raise ValueError(
                f"mode 'val' needs each image's 'height' and 'width' (in the annotations, or "
                f"readable from the image); image {i} ({base.files[i]}) has none"
            )
        self.base = base
        self.imgsz = imgsz
        self.order = (shapes[:, 0] / shapes[:, 1]).argsort()
        self.sizes = [(int(h), int(w)) for h, w in shapes[self.order]]
        own = getattr(base, "fingerprint", repr(base))
        self.fingerprint = hashlib.sha1(f"{own}|val|{imgsz}".encode()).hexdigest()[:16]
        categories = getattr(base, "categories", None)
        if categories is not None:
            self.categories = categories

    def __len__(self) -> int:
        return len(self.base)

    def __getitem__(self, index: int) -> Sample:
        j = int(self.order[index])
        try:
            sample = self.base[j]
        except SampleError as exc:
            raise SampleError(index, str(exc).split(": ", 1)[-1], self.base.files[j]) from None
        image = sample.image
        h0, w0 = image.shape[:2]
        r = self.imgsz / max(h0, w0)
        boxes = sample.boxes
        if r != 1:  # Ultralytics' load_image, rect_mode
            w, h = min(math.ceil(w0 * r), self.imgsz), min(math.ceil(h0 * r), self.imgsz)
            image = cv2.resize(image, (w, h), interpolation=cv2.INTER_LINEAR)
            scale = np.array([w / w0, h / h0, w / w0, h / h0], dtype=np.float32)
            boxes = boxes * scale
        return Sample(image, boxes, sample.labels, sample.file, (h0, w0))

    def augment_composed(
        self, sample: dict[str, Any], rng: np.random.Generator, params: Mapping[str, Any]
    ) -> dict[str, Any]:
        sent = (params.get("control") or {}).get(CONTROL_KEY) or {}
        wanted = sent.get("imgsz")
        if wanted is not None and int(wanted) != self.imgsz:
            raise ValueError(
                f"the trainer's imgsz is {wanted}; this val set resizes to imgsz={self.imgsz} "
                "(its dataset args: serve it with the trainer's imgsz)"
            )
        return sample

    def __repr__(self) -> str:
        return f"YoloVal({self.base!r}, imgsz={self.imgsz})"


def _yolo_set(
    annotations: str | None = None,
    image_dir: str | None = None,
    images: int = 2048,
    seed: int = 0,
    hyp: Mapping[str, Any] | None = None,
    mode: str = "train",
    imgsz: int = 640,
    data: str | None = None,
    split: str = "train",
    index: MappedIndex | None = None,
) -> YoloSet | YoloVal:
    """The plugin factory: a COCO set at ``annotations`` (``image_dir`` defaulting to its
    folder), or the ``split`` of Ultralytics' YOLO layout ``data`` (a ``data.yaml``), else
    the synthetic set of ``images`` from ``seed``; ``hyp`` overrides Ultralytics' default
    hyperparameters. ``mode="val"``: the annotated set for validation (``YoloVal``,
    resized to ``imgsz``; no ``hyp``). ``index``: the server's shared index of the
    annotations (``yolo_set_index``, built once per server), else they are indexed here."""
    if mode not in ("train", "val"):
        raise ValueError(f"mode must be 'train' or 'val', got {mode!r}")
    if annotations and data:
        raise ValueError("give 'annotations' (COCO) or 'data' (a YOLO data.yaml), not both")
    if annotations:
        base: Any = CocoDataset(annotations, image_dir, index)
    elif data:
        base = yolo_dataset(data, split, index)
    elif mode == "val":
        raise ValueError("mode 'val' serves annotations: give 'annotations' or 'data'")
    else:
        base = SyntheticDataset(images=images, seed=seed)
    if mode == "val":
        if hyp:
            raise ValueError("mode 'val' takes no 'hyp': validation images are not augmented")
        return YoloVal(base, imgsz)
    return YoloSet(base, hyp)


def yolo_set_index(
    annotations: str | None = None,
    data: str | None = None,
    split: str = "train",
    index_cache: IndexCache | None = None,
    **_: Any,
) -> SharedIndex | None:
    """``yolo_set``'s shared index (its ``shared_index``): the annotations indexed once
    per server, through the index cache; None for the synthetic set."""
    cache = index_cache or IndexCache()
    if annotations:
        return cache.load_or_build(
            file_source("coco", annotations), lambda: coco_columns(annotations)
        )[0]
    if data:
        layout = YoloLayout.read(data, split)
        return cache.load_or_build(layout.source(), layout.columns)[0]
    return None


class YoloSetFactory:
    """``yolo_set``: the plugin factory (``_yolo_set``'s arguments), with its
    ``shared_index`` (``yolo_set_index``): the server indexes the annotations once."""

    def __call__(self, *args: Any, **kwargs: Any) -> YoloSet | YoloVal:
        return _yolo_set(*args, **kwargs)

    shared_index = staticmethod(yolo_set_index)


yolo_set = YoloSetFactory()

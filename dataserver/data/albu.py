"""An Albumentations detection pipeline as a dataset's ``augment``: the supported way to
put a trainer's own random augmentation on the servers.

    pip install "dataserver[augment]"        # albumentations 2.0.x (MIT), never for servers
    dataserver serve --dataset dataserver.data.albu:augmented \\
        --dataset-args '{"base": "coco:annotations.json:images"}'

``augmented(base=SPEC)`` wraps a deterministic dataset (``synthetic``, ``coco:...`` or a
``package.module:factory`` whose class says ``deterministic = True``): its ``__getitem__`` is
the base's, so the server's store may keep the fitted sources, and ``augment`` runs an
``A.Compose`` with ``bbox_params`` on every sample after its source is fitted, each epoch
anew (never stored). The image keeps its fitted size (``A.Affine`` without ``fit_output``),
so it stays within the batch's ``image_size``.

Seeding: albumentations 2.0 draws every random number from two generators each transform
holds (``random_generator``, a ``numpy.random.Generator``, and ``py_random``, a
``random.Random``). ``Compose(seed=S)`` and ``Compose.set_random_seed(S)`` give *every*
transform its own generators seeded with the same ``S`` (albumentations/core/composition.py,
``BaseCompose.set_random_seed``; core/transforms_interface.py, ``BasicTransform.set_random_seed``),
so transforms with the same ``p`` would fire together. ``Compose.set_random_state(generator,
py_random)`` hands one pair to all of them, drawn from in turn: ``seed_compose`` gives it the
server's ``rng`` (from (seed, epoch, index) only) and a ``random.Random`` seeded from it, so
the output is a function of (seed, epoch, index) alone, on any worker of any server.
"""

from __future__ import annotations

import hashlib
import importlib.metadata
import importlib.util
import json
import os
import random
import sys
from typing import Any

import cv2
import numpy as np

MISSING = (
    'this dataset needs albumentations 2.0.x: pip install "dataserver[augment]" '
    '(or pip install "albumentations>=2.0,<2.1")'
)
_TORCH_GLUE = "albumentations.pytorch"  # ToTensorV2: imports torch, which servers never load


def import_albumentations() -> Any:
    """``albumentations``, imported without its update check (a request to PyPI that waits
    up to 2 s on hosts without internet access, in every worker) and, in a process without
    torch (a server's), without ``albumentations.pytorch``, which would load torch."""
    os.environ.setdefault("NO_ALBUMENTATIONS_UPDATE", "1")
    block = "torch" not in sys.modules and "albumentations" not in sys.modules
    if block:
        sys.modules[_TORCH_GLUE] = None  # type: ignore[assignment]  # its import fails, skipped
    try:
        import albumentations
    except ImportError:
        raise ImportError(MISSING) from None
    finally:
        if block and sys.modules.get(_TORCH_GLUE, 0) is None:
            del sys.modules[_TORCH_GLUE]  # an explicit import of it later still works
    return albumentations


def seed_compose(compose: Any, rng: np.random.Generator) -> None:
    """Make ``compose``'s next call draw from ``rng`` only: all its transforms share ``rng``
    and one ``random.Random`` seeded from it (``Compose.set_random_state``)."""
    compose.set_random_state(rng, random.Random(int(rng.integers(1 << 63))))


def detection_pipeline(
    scale: tuple[float, float] = (0.75, 1.25), translate: float = 0.1, fill: int = 0
) -> Any:
    """The detection pipeline ``augment`` runs: a random affine (scale, translation, the
    image keeping its size, the border filled with ``fill``), photometric jitter
    (brightness and contrast, hue, saturation and value), now and then a slight blur or
    grey; boxes in pascal_voc (xyxy pixels), clipped, the ones mostly pushed out dropped."""
    A = import_albumentations()
    return A.Compose(
        [
            A.Affine(
                scale=tuple(scale),
                translate_percent=(-translate, translate),
                border_mode=cv2.BORDER_CONSTANT,
                fill=fill,
                p=0.8,
            ),
            A.RandomBrightnessContrast(brightness_limit=0.2, contrast_limit=0.2, p=0.5),
            A.HueSaturationValue(hue_shift_limit=10, sat_shift_limit=30, val_shift_limit=20, p=0.5),
            A.OneOf([A.Blur(blur_limit=3), A.MedianBlur(blur_limit=3)], p=0.1),
            A.ToGray(p=0.02),
        ],
        bbox_params=A.BboxParams(
            format="pascal_voc",
            label_fields=["labels"],
            clip=True,
            min_area=4.0,
            min_visibility=0.25,
        ),
    )


def run_pipeline(compose: Any, sample: dict[str, Any], rng: np.random.Generator) -> dict[str, Any]:
    """``sample`` ({"image": HWC uint8, "boxes": (M, 4) xyxy, "labels": (M,)}) through
    ``compose``, seeded from ``rng``; the same form back."""
    seed_compose(compose, rng)
    boxes = np.asarray(sample["boxes"], dtype=np.float32).reshape(-1, 4)
    labels = np.asarray(sample["labels"], dtype=np.int64).reshape(-1)
    out = compose(image=sample["image"], bboxes=boxes, labels=labels)
    return {
        "image": out["image"],
        "boxes": np.asarray(out["bboxes"], dtype=np.float32).reshape(-1, 4),
        "labels": np.asarray(out["labels"], dtype=np.int64).reshape(-1),
    }


class AugmentedDataset:
    """A deterministic dataset with ``detection_pipeline`` as its ``augment``."""

    deterministic = True  # __getitem__ is the base's: a pure function of the index

    def __init__(
        self,
        base: str = "synthetic",
        base_args: dict[str, Any] | None = None,
        scale: tuple[float, float] = (0.75, 1.25),
        translate: float = 0.1,
        fill: int = 0,
    ) -> None:
        from dataserver.data.spec import build_dataset, dataset_fingerprint, parse_spec

        spec = parse_spec(base, None if base_args is None else json.dumps(base_args))
        self.base = build_dataset(spec)
        if getattr(self.base, "deterministic", False) is not True:
            raise ValueError(
                f"base {base!r} is not marked deterministic = True: its samples could not be "
                "stored, and what its __getitem__ draws belongs in augment"
            )
        self.options: dict[str, Any] = {
            "scale": tuple(scale),
            "translate": float(translate),
            "fill": int(fill),
        }
        self._compose: Any = None
        if importlib.util.find_spec("albumentations") is None:  # fail at start, not per sample
            raise ImportError(MISSING)
        # Equal on two servers only if they serve the same bytes: the same base data, the
        # same pipeline options, the same albumentations release.
        what = json.dumps([self.options, importlib.metadata.version("albumentations")])
        digest = hashlib.sha1(what.encode()).hexdigest()[:12]
        self.fingerprint = f"albu-{dataset_fingerprint(spec, self.base)}-{digest}"

    def __len__(self) -> int:
        return len(self.base)

    def __getitem__(self, index: int) -> Any:
        return self.base[index]

    def pipeline(self) -> Any:
        """The ``A.Compose``, built on first use, once per process (only a server's workers
        augment: its front never imports albumentations)."""
        if self._compose is None:
            self._compose = detection_pipeline(**self.options)
        return self._compose

    def augment(
        self, sample: dict[str, Any], rng: np.random.Generator, params: dict[str, Any]
    ) -> dict[str, Any]:
        """``sample`` through the pipeline, its randomness from ``rng`` only."""
        return run_pipeline(self.pipeline(), sample, rng)


def augmented(
    base: str = "synthetic",
    base_args: dict[str, Any] | None = None,
    scale: tuple[float, float] = (0.75, 1.25),
    translate: float = 0.1,
    fill: int = 0,
) -> AugmentedDataset:
    """``--dataset dataserver.data.albu:augmented --dataset-args '{"base": SPEC, ...}'``."""
    return AugmentedDataset(base, base_args, scale, translate, fill)

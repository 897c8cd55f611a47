"""The anchors ``dataserver bench`` measures against, built from the same image code.

``PipelineDataset`` is what a careful user writes for ``torch.utils.data.DataLoader``:
each item read, fitted, flipped and placed with OpenCV on one thread straight into a zero
(3, H, W) uint8 canvas (``dataserver.data.pipeline``: no whole-image transpose), returned
as a tensor; workers started with spawn and kept across epochs; batches collated by
``torch.stack`` into shared memory in the worker (as DataLoader's default collate does), so
the images reach the trainer without being pickled. Targets travel as small numpy arrays
and become tensors in the trainer. Both sides of a comparison do identical work per image.
"""

from __future__ import annotations

import time
from typing import Any

import cv2
import numpy as np
import torch
from torch.utils.data import DataLoader, Dataset, get_worker_info

from dataserver.data.pipeline import compose_one
from dataserver.data.spec import build_dataset, parse_spec

Item = tuple[torch.Tensor, np.ndarray, np.ndarray]


class PipelineDataset(Dataset[Item]):
    """A map-style Dataset doing dataserver's regular-mode work for one sample."""

    def __init__(
        self,
        spec: str,
        image_size: tuple[int, int],
        seed: int = 0,
        epoch: int = 0,
        spec_args: str | None = None,
    ) -> None:
        self.spec = spec
        self.spec_args = spec_args
        self.image_size = image_size
        self.seed = seed
        self.epoch = epoch
        self._dataset: Any = None
        self._len = len(build_dataset(parse_spec(spec, spec_args)))

    def __len__(self) -> int:
        return self._len

    def _ds(self) -> Any:
        if self._dataset is None:
            self._dataset = build_dataset(parse_spec(self.spec, self.spec_args))
        return self._dataset

    def __getitem__(self, index: int) -> Item:
        size = self.image_size
        canvas, out = compose_one(self._ds(), [index], 1, size, size, self.seed, self.epoch)
        return torch.from_numpy(canvas), out.boxes, out.labels


def collate(items: list[Item]) -> tuple[torch.Tensor, list[tuple[np.ndarray, np.ndarray]]]:
    """``torch.stack`` of the images, into shared memory when in a worker (what
    DataLoader's default collate does, sparing the copy into shared memory on the way out)."""
    images = [item[0] for item in items]
    out = None
    if get_worker_info() is not None:
        numel = sum(x.numel() for x in images)
        storage = images[0].untyped_storage()._new_shared(numel)
        out = images[0].new(storage).resize_(len(images), *images[0].shape)
    return torch.stack(images, 0, out=out), [(item[1], item[2]) for item in items]


def _one_thread(_: int) -> None:
    cv2.setNumThreads(1)
    torch.set_num_threads(1)


def make_dataloader(
    spec: str,
    image_size: tuple[int, int],
    batch_size: int,
    workers: int,
    spec_args: str | None = None,
    seed: int = 0,
) -> DataLoader[Any]:
    generator = torch.Generator()
    generator.manual_seed(seed)
    return DataLoader(
        PipelineDataset(spec, image_size, seed, spec_args=spec_args),
        batch_size=batch_size,
        shuffle=True,
        num_workers=workers,
        collate_fn=collate,
        worker_init_fn=_one_thread,
        persistent_workers=workers > 0,
        # fork would copy OpenCV's thread pool mid-use from this process (it wrote the
        # JPEGs) and can deadlock the workers; spawn is what PyTorch advises with threads.
        multiprocessing_context="spawn" if workers > 0 else None,
        prefetch_factor=2 if workers > 0 else None,
        generator=generator,
    )


def targets_of(pairs: list[tuple[np.ndarray, np.ndarray]]) -> list[dict[str, torch.Tensor]]:
    """The torchvision-style targets, made in the trainer from the workers' arrays."""
    return [{"boxes": torch.from_numpy(b), "labels": torch.from_numpy(lb)} for b, lb in pairs]


def single_process_rate(
    spec: str, image_size: tuple[int, int], spec_args: str | None = None, seconds: float = 3.0
) -> float:
    """Images/s of the read+fit+flip+place pipeline in this one process, one thread."""
    previous = cv2.getNumThreads()
    cv2.setNumThreads(1)
    try:
        ds = build_dataset(parse_spec(spec, spec_args))
        n = len(ds)
        done = 0
        start = time.perf_counter()
        while time.perf_counter() - start < seconds:
            compose_one(ds, [done % n], 1, image_size, image_size, 0, 0)
            done += 1
        return done / (time.perf_counter() - start)
    finally:
        cv2.setNumThreads(previous)

"""The anchors ``dataserver bench`` measures against, built from the same image code.

``PipelineDataset`` is what a user would write for ``torch.utils.data.DataLoader``: read,
flip, letterbox (``dataserver.data.pipeline``), one sample per item, collated into the
same uint8 (N, 3, H, W) tensor and torchvision-style targets. Workers run OpenCV with one
thread, as dataserver's workers do, so both sides do identical work per image.
"""

from __future__ import annotations

import time
from typing import Any

import cv2
import numpy as np
import torch
from torch.utils.data import DataLoader, Dataset

from dataserver.data.pipeline import Output, build_output, prepare
from dataserver.data.spec import build_dataset, parse_spec


class PipelineDataset(Dataset[Output]):
    """A map-style Dataset doing dataserver's regular-mode work for one sample."""

    def __init__(
        self, spec: str, image_size: tuple[int, int], seed: int = 0, epoch: int = 0
    ) -> None:
        self.spec = spec
        self.image_size = image_size
        self.seed = seed
        self.epoch = epoch
        self._dataset: Any = None
        self._len = len(build_dataset(parse_spec(spec)))

    def __len__(self) -> int:
        return self._len

    def _ds(self) -> Any:
        if self._dataset is None:
            self._dataset = build_dataset(parse_spec(self.spec))
        return self._dataset

    def __getitem__(self, index: int) -> Output:
        ds = self._ds()
        return build_output(
            lambda i: prepare(ds, i, self.seed, self.epoch), [index], 1, self.image_size, False
        )


def collate(outputs: list[Output]) -> tuple[torch.Tensor, list[dict[str, torch.Tensor]]]:
    images = torch.from_numpy(np.stack([o.image for o in outputs]))
    targets = [
        {"boxes": torch.from_numpy(o.boxes), "labels": torch.from_numpy(o.labels)} for o in outputs
    ]
    return images, targets


def _one_thread(_: int) -> None:
    cv2.setNumThreads(1)


def make_dataloader(
    spec: str, image_size: tuple[int, int], batch_size: int, workers: int, seed: int = 0
) -> DataLoader[Any]:
    generator = torch.Generator()
    generator.manual_seed(seed)
    return DataLoader(
        PipelineDataset(spec, image_size, seed),
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


def single_process_rate(spec: str, image_size: tuple[int, int], seconds: float = 3.0) -> float:
    """Images/s of the decode+augment+letterbox pipeline in this one process, one thread."""
    previous = cv2.getNumThreads()
    cv2.setNumThreads(1)
    try:
        ds = build_dataset(parse_spec(spec))
        n = len(ds)
        done = 0
        start = time.perf_counter()
        while time.perf_counter() - start < seconds:
            i = done % n
            build_output(lambda j: prepare(ds, j, 0, 0), [i], 1, image_size, False)
            done += 1
        return done / (time.perf_counter() - start)
    finally:
        cv2.setNumThreads(previous)

"""The anchors ``dataserver bench`` measures against, built from the same image code.

``PipelineDataset`` is what a careful user writes for ``torch.utils.data.DataLoader``:
each item read, fitted, flipped and placed with OpenCV on one thread straight into a zero
(3, H, W) uint8 canvas (``dataserver.data.pipeline``: no whole-image transpose), returned
as a tensor; workers started with spawn and kept across epochs; batches collated by
``torch.stack`` into shared memory in the worker (as DataLoader's default collate does), so
the images reach the trainer without being pickled. Targets travel as small numpy arrays
and become tensors in the trainer. Both sides of a comparison do identical work per image.

Every process that runs the pipeline (a DataLoader worker, a single-process reference, an
SPDL stage's process) is set up by ``tuned_process``: OpenCV and torch on one thread, and
glibc asked to keep large freed blocks for reuse (``keep_large_blocks``, what the server's
own processes do). Without the last, every 768 KiB canvas and decoded JPEG is served from
fresh ``mmap`` pages: ~480 page faults per image, 2 ms of system time on the development
VM, more than half of a decode; a comparison would then measure glibc's defaults.

The physical limit (``physical_limit``) is W such single-process pipelines running at the
same time in W processes: their images over the union of their timed windows. Any system
running this pipeline with W-way parallelism does at least this work per image, so no
system can exceed it.
"""

from __future__ import annotations

import json
import subprocess
import sys
import time
from typing import Any

import cv2
import numpy as np
import torch
from torch.utils.data import DataLoader, Dataset, get_worker_info

from dataserver.bench.cpu import machine_cpu, others_share
from dataserver.data.pipeline import compose_one
from dataserver.data.spec import build_dataset, parse_spec
from dataserver.protocol import BatchSizes
from dataserver.server.memory import keep_large_blocks

Item = tuple[torch.Tensor, np.ndarray, np.ndarray]
PREFETCH_FACTOR = 2  # DataLoader's default: batches each worker keeps ready


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
        canvas, out = compose_one(
            self._ds(), [index], 1, BatchSizes.of(size), self.seed, self.epoch
        )
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


def tuned_process(_: int = 0) -> None:
    """A pipeline process's settings (a DataLoader's ``worker_init_fn``): OpenCV and torch on
    one thread; glibc keeps large freed blocks for reuse (the server's own processes do)."""
    cv2.setNumThreads(1)
    torch.set_num_threads(1)
    keep_large_blocks()


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
        worker_init_fn=tuned_process,
        persistent_workers=workers > 0,
        # fork would copy OpenCV's thread pool mid-use from this process (it wrote the
        # JPEGs) and can deadlock the workers; spawn is what PyTorch advises with threads.
        multiprocessing_context="spawn" if workers > 0 else None,
        prefetch_factor=PREFETCH_FACTOR if workers > 0 else None,
        generator=generator,
    )


def targets_of(pairs: list[tuple[np.ndarray, np.ndarray]]) -> list[dict[str, torch.Tensor]]:
    """The torchvision-style targets, made in the trainer from the workers' arrays."""
    return [{"boxes": torch.from_numpy(b), "labels": torch.from_numpy(lb)} for b, lb in pairs]


WARMUP_IMAGES = 8


def single_run(
    spec: str,
    image_size: tuple[int, int],
    spec_args: str | None,
    seconds: float,
    rank: int = 0,
    ranks: int = 1,
) -> dict[str, Any]:
    """One single-process pipeline of the physical limit, in this process on one thread:
    warm up, print ``ready``, read the start instant (``time.monotonic``, one clock for every
    process of this host) from stdin, run ``compose_one`` over indices rank, rank + ranks,
    ... until ``seconds`` after it. Returns the images, the window and its CPU seconds."""
    tuned_process()
    ds = build_dataset(parse_spec(spec, spec_args))
    n = len(ds)
    for i in range(WARMUP_IMAGES):
        compose_one(ds, [(rank + i * ranks) % n], 1, BatchSizes.of(image_size), 0, 0)
    print("ready", flush=True)
    start_at = float(sys.stdin.readline())
    time.sleep(max(0.0, start_at - time.monotonic()))
    cpu0, start = time.process_time(), time.monotonic()
    done = 0
    while time.monotonic() - start < seconds:
        compose_one(ds, [(rank + done * ranks) % n], 1, BatchSizes.of(image_size), 0, 0)
        done += 1
    end, cpu1 = time.monotonic(), time.process_time()
    return {"images": done, "start": start, "end": end, "cpu_s": cpu1 - cpu0}


def physical_limit(
    spec: str,
    image_size: tuple[int, int],
    workers: int,
    spec_args: str | None = None,
    seconds: float = 3.0,
) -> dict[str, Any]:
    """W single-process pipelines (``single_run``) started together in W fresh processes:
    their images over the union of their windows (start of the first to end of the last),
    and their CPU per image (each process's own CPU clock over its window)."""
    cmd = [sys.executable, "-m", "dataserver.bench.side", "single", "--spec", spec]
    cmd += ["--image-size", str(image_size[0]), "--workers", str(workers)]
    cmd += ["--seconds", str(seconds)]
    if spec_args is not None:
        cmd += ["--spec-args", spec_args]
    procs = [
        subprocess.Popen(
            [*cmd, "--rank", str(k)], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True
        )
        for k in range(workers)
    ]
    try:
        for p in procs:
            line = p.stdout.readline() if p.stdout else ""
            if line.strip() != "ready":
                raise RuntimeError(f"single-process pipeline did not start: {line!r}")
        machine = machine_cpu()
        start_at = time.monotonic() + 0.05
        for p in procs:
            assert p.stdin is not None
            p.stdin.write(f"{start_at}\n")
            p.stdin.flush()
        runs = [json.loads(p.communicate(timeout=300 + seconds)[0].splitlines()[-1]) for p in procs]
        after = machine_cpu()
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.wait()
    images = sum(r["images"] for r in runs)
    window = max(r["end"] for r in runs) - min(r["start"] for r in runs)
    return {
        "images_per_s": images / window,
        "images": images,
        "seconds": window,
        "cpu_self_s": 0.0,
        "cpu_others_s": [r["cpu_s"] for r in runs],
        "per_process_images_per_s": [r["images"] / (r["end"] - r["start"]) for r in runs],
        "others_cpu_share": others_share(machine, after, sum(r["cpu_s"] for r in runs)),
    }

"""SPDL (Meta's Scalable and Performant Data Loading, ``pip install "dataserver[spdl]"``) as a
second peer of the DataLoader: the same read+fit+flip+place per image (``compose_one``)
in an ``spdl.pipeline`` pipeline, ``concurrency=W``, batched by ``aggregate`` and collated
by ``torch.stack``, as SPDL's documentation builds an image pipeline.

Two executors for the per-image stage (``--spdl-executor``):

- ``thread`` (SPDL's default and its recommendation): W threads of this one process. OpenCV
  releases the GIL while it decodes and resizes; the Python around it does not.
- ``process``: a ``ProcessPoolExecutor`` of W spawned processes, each set up as a
  DataLoader worker is (``tuned_process``); the images come back pickled.

Every process running the pipeline is set up by ``tuned_process`` (OpenCV on one thread,
glibc keeping large blocks), as for the other systems. The first batch (untimed) is checked
pixel for pixel against ``compose_one`` for its indices.
"""

from __future__ import annotations

import argparse
import contextlib
import multiprocessing
import os
import signal
from collections.abc import Iterator
from concurrent.futures import Executor, ProcessPoolExecutor
from typing import Any

import numpy as np

from dataserver.data.pipeline import compose_one
from dataserver.data.spec import build_dataset, parse_spec
from dataserver.protocol import BatchSizes

Item = tuple[int, np.ndarray, np.ndarray, np.ndarray]

SINK = 2  # batches the pipeline's sink keeps ready (add_sink's buffer_size)
_DATASET: Any = None
_SIZE: tuple[int, int] = (0, 0)


def _init(spec: str, spec_args: str | None, size: tuple[int, int]) -> None:
    """This process's dataset and settings (once per process of the pool, or this one)."""
    global _DATASET, _SIZE
    from dataserver.bench.baselines import tuned_process

    tuned_process()
    _DATASET = build_dataset(parse_spec(spec, spec_args))
    _SIZE = size


def load(index: int) -> Item:
    """One image: read, fit, flip, place into a zero (3, H, W) canvas."""
    canvas, out = compose_one(_DATASET, [index], 1, BatchSizes.of(_SIZE), 0, 0)
    return index, canvas, out.boxes, out.labels


def collate(items: list[Item]) -> tuple[Any, list[int], list[tuple[np.ndarray, np.ndarray]]]:
    """``torch.stack`` of the images; the indices and targets beside them."""
    import torch

    images = torch.stack([torch.from_numpy(item[1]) for item in items], 0)
    return images, [item[0] for item in items], [(item[2], item[3]) for item in items]


def indices(n: int, seed: int) -> Iterator[int]:
    """Endless shuffled epochs of ``range(n)``, as the DataLoader's sampler gives them."""
    epoch = 0
    while True:
        yield from np.random.default_rng((seed, epoch)).permutation(n).tolist()
        epoch += 1


def _executor(args: argparse.Namespace, size: tuple[int, int]) -> Executor | None:
    if args.spdl_executor == "thread":
        return None
    return ProcessPoolExecutor(
        args.workers,
        mp_context=multiprocessing.get_context("spawn"),
        initializer=_init,
        initargs=(args.spec, args.spec_args, size),
    )


def check_pixels(images: Any, order: list[int]) -> int:
    """How many images of a batch equal ``compose_one``'s for their index (all, or raise)."""
    for row, index in enumerate(order):
        canvas, _ = compose_one(_DATASET, [index], 1, BatchSizes.of(_SIZE), 0, 0)
        if not np.array_equal(images[row].numpy(), canvas):
            raise AssertionError(f"spdl: image {index} differs from compose_one's")
    return len(order)


def _pool(executor: Executor | None) -> list[int]:
    """The pids of a process pool's processes (started on demand: ask after a batch)."""
    return list(getattr(executor, "_processes", None) or {})


def _batches(it: Iterator[Any]) -> Iterator[int]:
    from dataserver.bench.baselines import targets_of

    for images, _, pairs in it:
        targets_of(pairs)  # what the trainer would use, as for the DataLoader
        yield len(images)


def spdl_side(args: argparse.Namespace) -> dict[str, Any]:
    from spdl.pipeline import PipelineBuilder

    from dataserver.bench.cpu import WARMUP, timed

    size = (args.image_size, args.image_size)
    _init(args.spec, args.spec_args, size)
    executor = _executor(args, size)
    builder: Any = PipelineBuilder()  # (its stubs type each stage from Never on)
    pipeline = (
        builder.add_source(indices(len(_DATASET), args.seed))
        .pipe(load, concurrency=args.workers, executor=executor)
        .aggregate(args.batch_size)
        .pipe(collate)
        .add_sink(SINK)
        .build(num_threads=args.workers)
    )
    try:
        with pipeline.auto_stop():
            it = pipeline.get_iterator(timeout=300)
            images, order, _ = next(it)
            checked = check_pixels(images, order)
            # the sink's batches and the stages' queues, made before the clock starts
            warmup = WARMUP + SINK
            out = timed(_batches(it), args.batches, _pool(executor), warmup=warmup)
    finally:
        if executor is not None:  # the side ends with os._exit: no pool may outlive it
            pool = _pool(executor)
            executor.shutdown(wait=False, cancel_futures=True)
            for pid in pool:
                with contextlib.suppress(OSError):
                    os.kill(pid, signal.SIGKILL)
    out["pixels_checked"] = checked
    out["executor"] = args.spdl_executor
    return out

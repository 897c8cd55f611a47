"""From a task's parameters to one output image: read, augment, compose.

Used by server workers and, unchanged, by the DataLoader baseline in ``dataserver bench``,
so both sides of every comparison run the same image code.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from dataserver.data.sample import Sample, SampleError, as_sample
from dataserver.data.stitch import compose
from dataserver.data.transforms import augment, augment_rng


@dataclass(slots=True)
class Output:
    """One composed output image (CHW uint8), its boxes and labels, the indices it holds
    (in cell order) and the failures left out under on_error="skip" as (index, message)."""

    image: np.ndarray
    boxes: np.ndarray
    labels: np.ndarray
    indices: list[int]
    failed: list[tuple[int, str]]


def prepare(dataset: Any, index: int, seed: int, epoch: int) -> Sample:
    """Read sample ``index`` and apply the mode-independent augmentation.

    Raises ``SampleError`` naming the index (and file, when the dataset names one).
    """
    try:
        raw = dataset[index]
    except SampleError:
        raise
    except Exception as exc:
        raise SampleError(index, f"{type(exc).__name__}: {exc}") from None
    return augment(as_sample(index, raw), augment_rng(seed, epoch, index))


def build_output(
    get_source: Callable[[int], Sample],
    indices: Sequence[int],
    grid: int,
    out_hw: tuple[int, int],
    skip_errors: bool,
) -> Output:
    """Compose one output image from ``indices``.

    With ``skip_errors`` a failing source leaves its cell empty and is reported in
    ``failed``; if every source fails, or without ``skip_errors``, the first
    ``SampleError`` propagates.
    """
    sources: list[Sample | None] = []
    kept: list[int] = []
    failed: list[tuple[int, str]] = []
    first_error: SampleError | None = None
    for index in indices:
        try:
            sources.append(get_source(index))
            kept.append(index)
        except SampleError as exc:
            if not skip_errors:
                raise
            first_error = first_error or exc
            failed.append((index, str(exc)))
            sources.append(None)
    if not kept and first_error is not None:
        raise first_error
    out = compose(sources, grid, *out_hw, chw=True)
    return Output(out.image, out.boxes, out.labels, kept, failed)

"""Composition of a task, in a worker: its sources from the server's store (made and stored on
a miss), then every output image composed straight into its canvas (the client's landing
buffer, or a new array), and the RESULT that says what came out.

``Composer`` is the worker's (``worker.py``), which owns the task's messages, its landing
destination and what an error becomes; nothing here touches a socket.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from dataserver.data.pipeline import (
    Draw,
    PlanesFor,
    Recipe,
    Source,
    SourceOf,
    compose_image,
    content_of,
    finished,
    layout_of,
    prepare,
)
from dataserver.data.sample import SampleError
from dataserver.protocol import MAX_TASK_IMAGES, MAX_TILES, Result, Task
from dataserver.server.running import RunningSlot
from dataserver.server.store import Store, index_keys, store_key


@dataclass
class TaskClock:
    """What one task spent, for the server's metrics (its RESULT's ``task_us``, ``decoded``
    and ``decode_us``): started with the task, told of each source made for it."""

    start_ns: int = field(default_factory=time.perf_counter_ns)
    _made_us: list[int] = field(default_factory=list)  # microseconds each source made took

    def made(self, us: int) -> None:
        self._made_us.append(us)

    @property
    def decoded(self) -> int:
        """Sources read and fitted for the task (store misses)."""
        return len(self._made_us)

    def task_us(self) -> int:
        return (time.perf_counter_ns() - self.start_ns) // 1000

    def decode_us(self) -> tuple[int, ...] | None:
        return tuple(self._made_us[: MAX_TASK_IMAGES * MAX_TILES]) or None


class Composer:
    """Composes one worker's tasks. ``fingerprint``: the dataset's (its sources' store
    key); ``store``: the server's (None: none, or unusable); ``running``: where the worker
    says which image it reads, so that a death is blamed on that image."""

    def __init__(self, fingerprint: str, store: Store | None, running: RunningSlot | None) -> None:
        self.fingerprint = fingerprint
        self.store = store
        self.running = running

    def compose(
        self,
        task: Task,
        dataset: Any,
        ckey: str,
        recipe: Recipe,
        ids: dict[str, Any],
        dest: np.ndarray | None,
        clock: TaskClock,
    ) -> Result:
        """Compose ``task`` into ``dest`` (the client's landing buffer) or a new canvas:
        sources from the store (fitted to the stored size; made and stored on a miss, for
        a deterministic dataset), then ``finished`` (refit, augment: never stored)."""
        stored = recipe.sizes.stored
        excluded = set(task.exclude)
        wanted = list(dict.fromkeys(i for i in task.indices if i not in excluded))
        image_of: dict[int, int] = {}  # the first image each source is in (running slot)
        for n, indices in enumerate(task.images):
            for i in indices:
                image_of.setdefault(i, n)

        def make(index: int, planes_for: PlanesFor | None = None) -> Source:
            if self.running is not None:  # a death now is blamed on the image it is read for
                self.running.image(image_of.get(index, 0))
            start = time.perf_counter_ns()
            try:
                return prepare(dataset, index, stored, planes_for, recipe.stretch)
            finally:
                clock.made((time.perf_counter_ns() - start) // 1000)

        got: dict[int, Source | None] = {}
        oldest = -1
        ahead = _prefetcher(dataset, wanted, now=self.store is None)
        if self.store is not None:
            hwc = layout_of(dataset) == "hwc"
            keys = index_keys(store_key(*self._key_parts(hwc, stored, ckey, recipe)), wanted)
            population = len(dataset)  # (the store keeps a subset of a larger dataset)
            # read again soon (a window mosaic's partners, the lookahead's twin batch): all
            # kept; else the subset of a dataset larger than the store. Misses fitted in place.
            fetch = (
                self.store.fetch_recent if task.partners or task.recent else self.store.fetch_into
            )
            sources, oldest = fetch(
                keys, lambda k, into: make(wanted[k], into), population, misses=ahead
            )
            if hwc:  # (the store's views are (3, h, w) bytes)
                sources = [None if s is None else s.as_hwc() for s in sources]
            got = dict(zip(wanted, sources, strict=True))

        def source(index: int, draw: Draw = None) -> Source:
            if index in excluded:  # the client found it kills workers: leave its cell empty
                raise SampleError(index, "killed worker processes when read; left out")
            src = got.get(index)
            kept = src if src is not None else make(index)  # (a failed one raises again)
            return finished(dataset, index, kept, recipe, draw)

        result = self._compose_with(task, dataset, source, recipe, ids, dest, clock)
        if self.store is not None and not self.store.intact(oldest):
            got.clear()  # the store wrote over a source as we read it: compose from scratch
            result = self._compose_with(task, dataset, source, recipe, ids, dest, clock)
        return result

    def _key_parts(
        self, hwc: bool, stored: tuple[int, int], ckey: str, recipe: Recipe
    ) -> tuple[object, ...]:
        """What determines a stored source besides its index: the dataset, the stored size,
        the control state, and whatever changes its bytes: HWC sources, a stretch fit
        (each a key of its own; a letterboxed CHW source keeps the keys it always had)."""
        parts: tuple[object, ...] = (self.fingerprint, stored, ckey)
        if hwc:
            parts = (*parts, "hwc")
        if recipe.stretch:
            parts = (*parts, "stretch")
        return parts

    def _compose_with(
        self,
        task: Task,
        dataset: Any,
        source: SourceOf,
        recipe: Recipe,
        ids: dict[str, Any],
        dest: np.ndarray | None,
        clock: TaskClock,
    ) -> Result:
        out_h, out_w = recipe.sizes.out
        # Each image is filled with the padding as it is composed (compose_image).
        # A landing task is composed aside and copied into the client's buffer whole: each
        # byte there then goes straight to its final value. Composed in place, a second copy
        # of the task (a hedge's loser, a task asked again) wrote transient bytes (padding
        # before the image, an image before its mirror) over the winner's pixels, which a
        # batch copied out of that buffer meanwhile could catch (``PlanBook``'s raced copy).
        canvas = np.empty((len(task.images), 3, out_h, out_w), np.uint8)
        skip = task.on_error == "skip"
        kept: list[tuple[int, ...]] = []
        failed: list[tuple[int, str]] = []
        boxes: list[np.ndarray] = []
        labels: list[np.ndarray] = []
        meta: dict[int, tuple[str, tuple[int, int]]] = {}  # index -> (file, orig_hw)

        def seen(index: int, draw: Draw = None) -> Source:
            made = source(index, draw)
            meta.setdefault(index, (made.file, made.orig_hw))
            return made

        files: list[str] = []
        origs: list[tuple[int, int]] = []
        content: list[tuple[int, int, int, int]] = []
        for n, indices in enumerate(task.images):
            if self.running is not None:
                self.running.image(n)
            done = compose_image(
                canvas[n], seen, indices, task.grid, task.layout, recipe, skip, dataset
            )
            # (under on_error="skip" an image whose every source failed holds no index)
            kept.append(tuple(done.indices))
            failed.extend((i, m[:4000]) for i, m in done.failed)
            boxes.append(done.boxes)
            labels.append(done.labels)
            # its anchor's (first source's) file and original size
            file, orig = meta.get(done.indices[0], ("", (0, 0))) if done.indices else ("", (0, 0))
            files.append(file)
            origs.append(orig)
            content.append(content_of(done, (out_h, out_w)))
        if dest is not None:
            np.copyto(dest, canvas)
        return Result(
            images=tuple(kept),
            box_counts=tuple(len(b) for b in boxes),
            failed=tuple(failed),
            pixels=canvas if dest is None else None,
            landed=True if dest is not None else None,
            boxes=np.concatenate(boxes),
            labels=np.concatenate(labels),
            files=tuple(files) if any(files) else None,
            orig_sizes=tuple(origs),
            content=tuple(content),
            decoded=clock.decoded,
            decode_us=clock.decode_us(),
            task_us=clock.task_us(),
            **ids,
        )


def _prefetcher(
    dataset: Any, wanted: list[int], now: bool
) -> Callable[[Iterable[int]], None] | None:
    """What starts fetching the sources ``wanted[k]`` for the keys k given (a dataset in
    object storage: its ``prefetch``, ``dataserver.data.remote``), or None. ``now``: start
    them all at once (no store: every one is read)."""
    prefetch = getattr(dataset, "prefetch", None)
    if prefetch is None:
        return None
    if now:
        prefetch(wanted)
    return lambda ks: prefetch([wanted[k] for k in ks])

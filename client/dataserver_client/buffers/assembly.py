"""Batch assembly on the trainer side: results are written straight into preallocated
host buffers, then handed over (CPU) or copied to the device on a side stream (CUDA).

On CUDA the host buffers are pinned and recycled once the copy that read them has
finished (its event), so steady-state training allocates no host memory. On CPU the
trainer gets a view of a pooled buffer, and the buffer is reused only once no tensor or
array sharing its memory is left (its storage's use count says so): no copy, no page
faults on fresh memory, and a batch the trainer keeps is never overwritten.
"""

from __future__ import annotations

import logging
from typing import Any, cast

import numpy as np
import torch

from dataserver.landing import LandingArea
from dataserver_client.batch import Batch
from dataserver_client.config import ClientConfig
from dataserver_client.session.inflight import Delivery, InflightBatch

log = logging.getLogger("dataserver_client")


class HostBuffers:
    """Host memory for batch images, recycled: pinned for CUDA (free again once the device
    copy that read it is done), plain for CPU (free again once the trainer let go of it).

    With a ``landing`` area (``dataserver.landing``: shared memory that workers on this host
    write results into), buffers are its regions while any is free. A region's generation
    is bumped (sealed) when its batch is complete, before the trainer sees it, and before
    it serves another batch, so no late writer can touch it."""

    def __init__(self, device: torch.device, keep: int, landing: LandingArea | None = None) -> None:
        self.pinned = device.type == "cuda"
        self.keep = keep
        self.landing = landing
        self._free: dict[tuple[int, ...], list[tuple[torch.Tensor, torch.cuda.Event | None]]] = {}
        self._lent: list[torch.Tensor] = []
        self._region: dict[int, int] = {}  # storage data_ptr -> landing region
        self._unsealed: list[
            tuple[torch.Tensor, torch.cuda.Event | None]
        ] = []  # regions to seal before reuse
        self.allocated = 0
        # Private but long-steering torch API; without it CPU buffers are simply not reused.
        self._use_count = getattr(torch._C, "_storage_Use_Count", None)
        self._alone: dict[int, int] = {}  # storage data_ptr -> use count when alone
        self._registered = False
        if landing is not None and self.pinned:
            self._registered = _register(landing)

    def take(self, shape: tuple[int, ...], land: bool = True) -> torch.Tensor:
        """A buffer of ``shape``: a landing region while one is free (never with ``land``
        False), else host memory (pinned for CUDA)."""
        if not self.pinned:
            self._reclaim()
        self._seal_given()
        free = self._free.get(shape) if land else None  # (a free one may be a region)
        if free:
            tensor, event = free.pop()
            if event is not None:
                event.synchronize()  # the device copy that read it is done
            return tensor
        nbytes = int(np.prod(shape))
        landing = self.landing if land else None
        region = landing.take() if landing is not None and nbytes <= landing.region_bytes else None
        if landing is not None and region is not None:
            base = torch.from_numpy(landing.buffer(region)[:nbytes])
            tensor = base.view(shape)
            self._region[tensor.untyped_storage().data_ptr()] = region
        else:
            pin = self.pinned and not self._registered
            tensor = torch.empty(shape, dtype=torch.uint8, pin_memory=pin)
        self.allocated += 1
        if self._use_count is not None:
            self._alone[tensor.untyped_storage().data_ptr()] = self._count(tensor)
        return tensor

    def fresh(self) -> bool:
        """Whether the next landing buffer would be fresh memory (no reserved region is
        free): ``take`` would reserve one first (``fallocate``, ~5 ms for 12 MB here)."""
        if self.landing is None or any(self._free.values()):
            return False
        return not self.landing.reserved_free()

    def landing_of(self, tensor: torch.Tensor) -> tuple[int, int, int] | None:
        """(region, generation, file offset of the tensor's first byte) for a buffer that
        is a landing region; None for one that is not."""
        region = self._region.get(tensor.untyped_storage().data_ptr())
        if region is None or self.landing is None:
            return None
        return region, self.landing.generation(region), self.landing.offset(region)

    def seal(self, tensor: torch.Tensor) -> bool:
        """Seal a landing buffer whose batch is complete (no writer may touch it now);
        False: a worker is writing it this moment, try again. True for other buffers."""
        region = self._region.get(tensor.untyped_storage().data_ptr())
        if region is None or self.landing is None:
            return True
        return self.landing.seal(region)

    def give(self, tensor: torch.Tensor, event: torch.cuda.Event | None = None) -> None:
        """Return a buffer nobody else holds (pinned: once ``event``, the copy reading it,
        is done). A landing buffer is sealed before it serves again."""
        if tensor.untyped_storage().data_ptr() in self._region:
            self._unsealed.append((tensor, event))
            self._seal_given()
            return
        free = self._free.setdefault(tuple(tensor.shape), [])
        if len(free) < self.keep:
            free.append((tensor, event))

    def _seal_given(self) -> None:
        if not self._unsealed or self.landing is None:
            return
        waiting = []
        for tensor, event in self._unsealed:
            region = self._region[tensor.untyped_storage().data_ptr()]
            if self.landing.seal(region):
                free = self._free.setdefault(tuple(tensor.shape), [])
                if len(free) < self.keep:
                    free.append((tensor, event))
                else:  # the region itself goes back, to be viewed in another shape
                    del self._region[tensor.untyped_storage().data_ptr()]
                    self.landing.give(region)
            else:
                waiting.append((tensor, event))
        self._unsealed = waiting

    def lend(self, tensor: torch.Tensor) -> torch.Tensor:
        """CPU: the tensor to hand the trainer, a view of ``tensor``; ``tensor`` comes back
        to the pool when no view of it, and nothing made from one, is alive any more."""
        if self._use_count is None:
            return tensor
        self._lent.append(tensor)
        if len(self._lent) > 4 * self.keep:
            self._lent.pop(0)  # the trainer keeps many batches: let those go to the GC
        return tensor.view(tensor.shape)

    def _count(self, tensor: torch.Tensor) -> int:
        assert self._use_count is not None
        return int(self._use_count(tensor.untyped_storage()._cdata))

    def _reclaim(self) -> None:
        if not self._lent:
            return
        held = []
        for tensor in self._lent:
            alone = self._alone.get(tensor.untyped_storage().data_ptr(), 1)
            if self._count(tensor) <= alone:
                self.give(tensor)
            else:
                held.append(tensor)
        self._lent = held

    def close(self) -> None:
        if self._registered and self.landing is not None:
            _unregister(self.landing)
            self._registered = False


def _register(landing: LandingArea) -> bool:
    """Pin the landing buffer's pages for CUDA (so copies from it are asynchronous)."""
    try:
        ptr = np.frombuffer(landing.map, np.uint8).ctypes.data
        return int(torch.cuda.cudart().cudaHostRegister(ptr, len(landing.map), 0)) == 0
    except Exception:
        return False


def _unregister(landing: LandingArea) -> None:
    try:
        ptr = np.frombuffer(landing.map, np.uint8).ctypes.data
        torch.cuda.cudart().cudaHostUnregister(ptr)
    except Exception:
        pass


_NO_BOXES = np.zeros((0, 4), np.float32)
_NO_LABELS = np.zeros((0,), np.int64)


class DeviceMover:
    """Turns finished host batches into ``Batch`` objects on the client's device."""

    def __init__(self, device: torch.device) -> None:
        self.device = device
        self.cuda = device.type == "cuda"
        self.stream = torch.cuda.Stream(device) if self.cuda else None

    def deliver(
        self,
        inflight: InflightBatch,
        epoch: int,
        buffers: HostBuffers,
        manifest: dict[str, Any] | None = None,
    ) -> Delivery:
        plan = inflight.plan
        images = inflight.host
        if inflight.dropped:
            keep = [s for s in range(len(plan.images)) if s not in inflight.dropped]
            images = images[keep] if keep else images[:0]
            boxes = [b for s in keep if (b := inflight.boxes[s]) is not None]
            labels = [lb for s in keep if (lb := inflight.labels[s]) is not None]
            indices = [list(inflight.indices[s] or []) for s in keep]
            files = [inflight.files[s] for s in keep]
            orig_sizes = [inflight.orig_sizes[s] for s in keep]
            content = [inflight.content[s] for s in keep]
        else:  # (every slot answered: its lists as they are, each made for this batch)
            boxes = cast("list[np.ndarray]", inflight.boxes)
            labels = cast("list[np.ndarray]", inflight.labels)
            indices = cast("list[list[int]]", inflight.indices)
            files, orig_sizes, content = inflight.files, inflight.orig_sizes, inflight.content
        counts = [len(b) for b in boxes]
        all_boxes = torch.from_numpy(np.concatenate([_NO_BOXES, *boxes], dtype=np.float32))
        all_labels = torch.from_numpy(np.concatenate([_NO_LABELS, *labels], dtype=np.int64))
        event: torch.cuda.Event | None = None
        if not self.cuda:
            if inflight.dropped:
                buffers.give(inflight.host)  # the batch got a compacted copy
            else:
                images = buffers.lend(images)
        if self.cuda:
            assert self.stream is not None
            with torch.cuda.stream(self.stream):
                images = images.to(self.device, non_blocking=True)
                all_boxes = all_boxes.pin_memory().to(self.device, non_blocking=True)
                all_labels = all_labels.pin_memory().to(self.device, non_blocking=True)
                event = torch.cuda.Event()
                event.record(self.stream)
            buffers.give(inflight.host, event)
        targets = [
            {"boxes": b, "labels": lb}
            for b, lb in zip(
                torch.split_with_sizes(all_boxes, counts),
                torch.split_with_sizes(all_labels, counts),
                strict=True,
            )
        ]
        batch = Batch(
            images=images,
            targets=targets,
            indices=indices,
            mode=plan.mode,
            epoch=epoch,
            step=plan.step,
            feedback_seq=0,
            skipped=len(inflight.skipped),
            skipped_indices=list(inflight.skipped),
            image_size=plan.sizes.fit,
            partners=plan.partners,
            manifest=manifest if manifest is not None else {},
            files=files,
            orig_sizes=orig_sizes,
            content=content,
        )
        return Delivery(batch, event)

    def hand_over(self, delivery: Delivery) -> Batch:
        """Called in the trainer's thread: make its current stream wait for the copy."""
        batch = delivery.batch
        if self.cuda and delivery.event is not None:
            current = torch.cuda.current_stream(self.device)
            current.wait_event(delivery.event)
            batch.images.record_stream(current)
            for t in batch.targets:
                t["boxes"].record_stream(current)
                t["labels"].record_stream(current)
        return batch


def landing_area(config: ClientConfig) -> LandingArea | None:
    """The shared-memory buffers workers on this host may write results into (a sealed
    memfd: no name on the file system), unless ``shared_memory`` is off."""
    if not config.shared_memory:
        return None
    h, w = config.sizes.stored  # the largest size of the schedule
    try:
        return LandingArea(config.prefetch + 5, config.batch_size * 3 * h * w, config.batch_size)
    except (OSError, ValueError) as exc:
        log.info("no landing buffers (%s): results come over the socket", exc)
        return None

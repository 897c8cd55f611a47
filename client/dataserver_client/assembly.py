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
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any, cast

import numpy as np
import torch

from dataserver.landing import LandingArea
from dataserver.protocol import Result, wire_control_digest
from dataserver_client.batch import Batch
from dataserver_client.config import ClientConfig
from dataserver_client.epoch import BatchPlan
from dataserver_client.errors import DataServerError

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
        self._free: dict[tuple[int, ...], list[tuple[torch.Tensor, Any]]] = {}
        self._lent: list[torch.Tensor] = []
        self._region: dict[int, int] = {}  # storage data_ptr -> landing region
        self._unsealed: list[tuple[torch.Tensor, Any]] = []  # regions to seal before reuse
        self.allocated = 0
        # Private but long-standing torch API; without it CPU buffers are simply not reused.
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

    def give(self, tensor: torch.Tensor, event: Any = None) -> None:
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


class InflightBatch:
    """A planned batch whose tasks are being answered, slot by slot. ``control_seq`` and
    ``control``: the control values it is planned under; ``inline``: its tasks carry those
    values themselves (a rebuilt batch), with its own ``on_error`` (None: the client's)."""

    def __init__(
        self,
        plan: BatchPlan,
        host: torch.Tensor,
        control_seq: int = 0,
        control: dict[str, Any] | None = None,
        *,
        inline: bool = False,
        on_error: str | None = None,
    ) -> None:
        self.plan = plan
        self.host = host
        self.control_seq = control_seq
        self.control = control if control is not None else {}
        self.inline = inline
        self.on_error = on_error
        # The digest of the values its tasks are composed with (``Task.control_digest``):
        # its own (inline), else the session's, none before the first (control_seq 0).
        used = self.control if inline or control_seq else {}
        self.control_digest = wire_control_digest(used)
        self.array = host.numpy()  # a view: writes land in the (pinned) tensor
        n = len(plan.images)
        self.boxes: list[np.ndarray | None] = [None] * n
        self.labels: list[np.ndarray | None] = [None] * n
        self.indices: list[list[int] | None] = [None] * n
        self.files: list[str] = [""] * n  # each image's anchor's file ("" unknown)
        self.orig_sizes: list[tuple[int, int]] = [(0, 0)] * n  # and its original (h, w)
        out_h, out_w = plan.sizes.out  # where its picture lies (the whole canvas: unsaid)
        self.content: list[tuple[int, int, int, int]] = [(0, 0, out_h, out_w)] * n
        self.pending = n
        self.dropped: set[int] = set()
        self.skipped: list[int] = []
        self.error: DataServerError | None = None
        self.raced = False  # a task of it was hedged, and answered by one copy of two

    def race_settled(self) -> None:
        """A hedged task of it was answered: the other copy, if it landed, may still be
        writing the same bytes into its slots (``moved``)."""
        self.raced = True

    def moved(self, host: torch.Tensor) -> torch.Tensor:
        """Its pixels copied into ``host``, which it uses from now on (a hedged task's
        losing copy holds a lock on its landing buffer, writing the very bytes the winner
        gave: the copy is whole, and the buffer is sealed before it serves again). Returns
        the buffer it left, for the caller to give back."""
        old = self.host
        host.copy_(old)
        self.host, self.array = host, host.numpy()
        return old

    @property
    def complete(self) -> bool:
        return self.pending == 0

    def again(self, plan: BatchPlan, host: torch.Tensor, control_seq: int) -> InflightBatch:
        """A fresh batch of the same recipe under ``plan`` (a rebuild planned again)."""
        return InflightBatch(
            plan, host, control_seq, self.control, inline=self.inline, on_error=self.on_error
        )

    def answer(self, slots: tuple[int, ...], result: Result) -> None:
        """The RESULT for ``slots`` is in: its pixels in place (received straight into the
        buffer, else copied here: slots that are not consecutive); its images' indices,
        and their boxes and labels in slot order, ``box_counts`` of them a slot (kept as
        views: ``deliver`` copies them all once). ``failed``: the sources the answer left
        out (on_error="skip"), counted as skipped. ``files``, ``orig_sizes``: each image's
        anchor's file and original (h, w), and where its picture lies in its canvas
        (``content``), when the server said.
        A slot with no indices (every source failed) is left out. In a window mosaic
        (``plan.partners``) only anchors count: a slot whose anchor failed is left out and
        its anchor skipped; a partner that failed leaves its mosaic a tile short, and is
        not skipped (it was not consumed: it fails again where it is an anchor)."""
        assert result.boxes is not None and result.labels is not None
        self._place(slots, result.pixels)
        images, counts, boxes, labels = (
            result.images,
            result.box_counts,
            result.boxes,
            result.labels,
        )
        failed = result.failed
        window = self.plan.partners
        if not window:
            self.skipped.extend(i for i, _ in failed)
        start = 0
        for slot, got, count in zip(slots, images, counts, strict=True):
            stop = start + count
            kept = got
            if window and tuple(got[:1]) != self.plan.images[slot].indices[:1]:
                kept = ()  # cell 0, the anchor, failed
                self.skipped.append(self.plan.images[slot].indices[0])
            if kept:
                self.boxes[slot] = boxes[start:stop]
                self.labels[slot] = labels[start:stop]
                self.indices[slot] = list(kept)
            else:
                self.dropped.add(slot)
            start = stop
        self._describe(slots, result)
        self.pending -= len(slots)

    def _describe(self, slots: tuple[int, ...], result: Result) -> None:
        """Each slot's file, original size and content box, where the server said."""
        if result.files is not None:
            for slot, file in zip(slots, result.files, strict=True):
                self.files[slot] = file
        if result.orig_sizes is not None:
            for slot, (h, w) in zip(slots, result.orig_sizes, strict=True):
                self.orig_sizes[slot] = (int(h), int(w))
        if result.content is not None:
            for slot, (top, left, h, w) in zip(slots, result.content, strict=True):
                self.content[slot] = (int(top), int(left), int(h), int(w))

    def _place(self, slots: tuple[int, ...], pixels: np.ndarray | None) -> None:
        """Copy an answer's pixels into its slots, unless received there already."""
        if pixels is not None and not np.shares_memory(pixels, self.array):
            for j, slot in enumerate(slots):
                self.array[slot] = pixels[j]

    def drop(self, slots: tuple[int, ...], images: tuple[tuple[int, ...], ...]) -> None:
        """Leave ``slots`` out (on_error="skip"): ``images``, their samples, are counted as
        skipped (in a window mosaic each anchor alone: the partners were not consumed)."""
        for slot, indices in zip(slots, images, strict=True):
            self.dropped.add(slot)
            self.skipped.extend(indices[:1] if self.plan.partners else indices)
            self.pending -= 1


class Sealing:
    """Complete batches waiting for their landing buffer's seal: a late writer (a worker
    of a task asked again) is in it this moment, and no batch is delivered while one may
    be. Each leaves once its buffer seals (``sealed``); the plan book delivers it then."""

    def __init__(self, buffers: HostBuffers) -> None:
        self._buffers = buffers
        self._waiting: list[InflightBatch] = []

    def __contains__(self, batch: object) -> bool:
        return any(each is batch for each in self._waiting)

    def __iter__(self) -> Iterator[InflightBatch]:
        return iter(list(self._waiting))

    def seal(self, batch: InflightBatch) -> bool:
        """Seal ``batch``'s buffer: True when sealed (deliver it now); else it waits here."""
        if self._buffers.seal(batch.host):
            return True
        self._waiting.append(batch)
        return False

    def sealed(self) -> list[InflightBatch]:
        """The waiting batches whose buffers seal now, in the order they came (they leave)."""
        return self.drop(lambda batch: self._buffers.seal(batch.host))

    def drop(self, which: Callable[[InflightBatch], bool]) -> list[InflightBatch]:
        """Forget the waiting batches ``which`` picks, and return them (their buffers are
        the caller's to give back)."""
        kept: list[InflightBatch] = []
        gone: list[InflightBatch] = []
        for batch in self._waiting:
            (gone if which(batch) else kept).append(batch)
        self._waiting = kept
        return gone


@dataclass
class Delivery:
    """A finished batch and, on CUDA, the event its device copy records."""

    batch: Batch
    event: Any = None


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
        event = None
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

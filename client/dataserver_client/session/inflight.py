"""The in-flight batch record and what follows it, torch-free: ``InflightBatch`` (a planned
batch whose tasks are being answered, slot by slot), ``Sealing`` (complete batches waiting
for their landing buffer's seal) and ``Delivery`` (a finished batch handed on).

The planning side (ledger, lookahead, rebuild, the plan book) names these without importing
torch: a batch's host buffer is a ``torch.Tensor`` made by ``assembly.HostBuffers``, used
here only through its methods (``numpy``, ``copy_``), and ``Batch`` is named as a type.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import numpy as np

from dataserver.protocol import Result, wire_control_digest
from dataserver_client.errors import DataServerError
from dataserver_client.plan.epoch import BatchPlan

if TYPE_CHECKING:
    import torch

    from dataserver_client.batch import Batch
    from dataserver_client.buffers.assembly import HostBuffers


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
    event: torch.cuda.Event | None = None

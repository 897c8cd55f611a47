"""The plan book: which batches of the epoch are planned, which tasks they are waiting for,
and the commands that move the plan. No sockets and no threads of its own; the engine's
I/O thread is its only caller, and tests drive it directly.

Task accounting: a ``TaskRecord`` is in ``tasks`` while its answer is still wanted. Which
server it was last sent to (``rec.link``) is the engine's business. An answer is taken when
its task is still wanted under the same plan_version, from whichever server it comes:
results are deterministic, so a second answer (after a task was asked again) is dropped.

Zero-stale steering lives in ``steer``: it bumps ``plan_version``, clears every batch the
trainer has not taken, and rewinds the cursor to the first of them.
"""

from __future__ import annotations

import threading
from collections import deque
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Any

from dataserver.protocol import MAX_TASK_IMAGES, Result
from dataserver_client.assembly import Delivery, DeviceMover, HostBuffers, InflightBatch
from dataserver_client.config import ClientConfig
from dataserver_client.epoch import REGULAR, Cursor, epoch_order, shard_of, split_runs
from dataserver_client.errors import DataServerError

PROBE_HW = (8, 8)  # a probe composes one source into a tiny image: it only asks "does it kill?"


class Handoff:
    """Finished batches waiting for the trainer, by step, and the epoch's end when known.

    Shared by both threads under ``cond``. Only batches of the current plan are ever in
    ``ready``: a steer clears it before the trainer can look again.
    """

    def __init__(self) -> None:
        self.cond = threading.Condition()
        self.ready: dict[int, Delivery | DataServerError] = {}
        self.taken = 0  # steps handed to the trainer in this epoch
        self.end_step: int | None = None
        self.fatal: BaseException | None = None


@dataclass(eq=False)
class TaskRecord:
    """A task the client wants answered: a run of images of one batch (their slots in it),
    and which server has it."""

    task_id: int
    step: int
    slots: tuple[int, ...]  # the batch slots of its images, in order (-1: a probe's)
    images: tuple[tuple[int, ...], ...]  # each image's source indices, in cell order
    grid: int
    out_hw: tuple[int, int]
    plan_version: int
    link: Any = None  # the server it was last sent to (the engine's ServerLink), or None
    land_gen: int | None = None  # the landing generation it was last sent with
    exclude: tuple[int, ...] = ()  # sources to leave out (found to kill workers)
    probe_of: TaskRecord | None = None  # a one-source probe run for this stitched task
    probes_left: int = 0
    poisoned: list[int] = field(default_factory=list)

    @property
    def indices(self) -> tuple[int, ...]:
        return tuple(i for image in self.images for i in image)


class PlanBook:
    """Planned batches, their tasks, and the commands that change the plan."""

    def __init__(
        self, config: ClientConfig, handoff: Handoff, mover: DeviceMover, buffers: HostBuffers
    ) -> None:
        self.config = config
        self.handoff = handoff
        self.mover = mover
        self.buffers = buffers
        self.layout = config.layout()
        self.epoch = 0
        self.mode = REGULAR
        self.plan_version = 0
        self.control: dict[str, Any] = {}
        self.control_seq = 0
        self.cursor: Cursor | None = None
        self.inflight: dict[int, InflightBatch] = {}
        self.plan_starts: dict[int, int] = {}
        self.tasks: dict[int, TaskRecord] = {}
        self.pending: deque[TaskRecord] = deque()
        self.next_task_id = 1
        self.skipped_poison = 0
        self.sealing: list[InflightBatch] = []  # complete, waiting for their buffer's seal
        self.parallelism = 2  # worker slots over every ready server (the engine keeps it)

    # ------------------------------------------------------------ tasks

    def wanted(self, task_id: int, plan_version: int | None) -> TaskRecord | None:
        """The record an answer is for, if it is still wanted under that plan."""
        rec = self.tasks.get(task_id)
        if rec is None or rec.plan_version != plan_version:
            return None
        return rec

    def pop_pending(self) -> TaskRecord | None:
        """The next task to send, skipping those no longer wanted."""
        while self.pending:
            rec = self.pending.popleft()
            if self.tasks.get(rec.task_id) is rec:
                return rec
        return None

    def ask_again(self, recs: list[TaskRecord]) -> int:
        """Put still-wanted tasks at the head of the queue, in plan order; how many."""
        again = sorted(
            (r for r in recs if self.tasks.get(r.task_id) is r), key=lambda r: (r.step, r.slots[0])
        )
        for rec in reversed(again):
            rec.link = None
            self.pending.appendleft(rec)
        return len(again)

    def records(self, task_ids: list[int]) -> list[TaskRecord]:
        return [self.tasks[t] for t in task_ids if t in self.tasks]

    def _new_task(
        self,
        step: int,
        slots: tuple[int, ...],
        images: tuple[tuple[int, ...], ...],
        grid: int,
        out_hw: tuple[int, int],
        **extra: Any,
    ) -> TaskRecord:
        rec = TaskRecord(
            self.next_task_id, step, slots, images, grid, out_hw, self.plan_version, **extra
        )
        self.next_task_id += 1
        self.tasks[rec.task_id] = rec
        return rec

    def tasks_per_batch(self, images: int) -> int:
        """Tasks to cut a batch of ``images`` output images into: enough that every worker
        of every server has its pipeline full with ``prefetch`` batches in flight, and no
        more (each task costs a message each way and some Python on every side)."""
        want = -(-self.parallelism // self.config.prefetch)
        return max(1, min(images, max(want, -(-images // MAX_TASK_IMAGES))))

    # ------------------------------------------------------------ answers

    def on_result(self, rec: TaskRecord, result: Result) -> None:
        """A wanted task's RESULT (checked by the engine: one image per slot, the indices
        asked); its pixels are already in the batch buffer."""
        del self.tasks[rec.task_id]
        if rec.probe_of is not None:
            self._probe_done(rec, bad=False)
            return
        batch = self.inflight.get(rec.step)
        if batch is None:
            return
        assert result.boxes is not None and result.labels is not None
        start = 0
        for slot, kept, count in zip(rec.slots, result.images, result.box_counts, strict=True):
            stop = start + count
            if kept:
                batch.fill(
                    slot, result.boxes[start:stop], result.labels[start:stop], list(kept), []
                )
            else:  # every source of this image failed (on_error="skip")
                batch.drop(slot, [])
            start = stop
        batch.skipped.extend(i for i, _ in result.failed)
        self._maybe_finish(batch)

    def on_failure(
        self, rec: TaskRecord, kind: str, error: DataServerError, image: int | None = None
    ) -> None:
        """A wanted task's ERROR (a bad sample, a poison sample, a refused request).
        ``image``: for poison, which of the task's images was being composed."""
        skip = self.config.on_error == "skip"
        if kind == "poison" and rec.probe_of is None and len(rec.images) > 1:
            # One image of the run kills workers: the rest of the run is asked again, the
            # blame (or the skip) falls on that image alone. Without its number, every
            # image is run on its own.
            del self.tasks[rec.task_id]
            pairs = list(zip(rec.slots, rec.images, strict=True))
            if image is None or not 0 <= image < len(pairs):
                for slot, one in reversed(pairs):
                    single = self._new_task(rec.step, (slot,), (one,), rec.grid, rec.out_hw)
                    single.plan_version = rec.plan_version
                    self.pending.appendleft(single)
                return
            rest = pairs[:image] + pairs[image + 1 :]
            if rest:
                again = self._new_task(
                    rec.step,
                    tuple(slot for slot, _ in rest),
                    tuple(one for _, one in rest),
                    rec.grid,
                    rec.out_hw,
                )
                again.plan_version = rec.plan_version
                self.pending.appendleft(again)
            slot, one = pairs[image]
            bad = self._new_task(rec.step, (slot,), (one,), rec.grid, rec.out_hw)
            bad.plan_version = rec.plan_version
            self.on_failure(bad, kind, error)
            return
        if skip and kind == "poison" and rec.probe_of is None and len(rec.indices) > 1:
            self._probe(rec)  # still wanted: composed again once the probes say how
            return
        del self.tasks[rec.task_id]
        if rec.probe_of is not None:
            self._probe_done(rec, bad=kind in ("sample", "poison"))
            return
        batch = self.inflight.get(rec.step)
        if batch is None:
            return
        if skip and kind in ("sample", "poison"):
            for slot, indices in zip(rec.slots, rec.images, strict=True):
                batch.drop(slot, list(indices))
            self._maybe_finish(batch)
            return
        self.fail_batch(batch, error)

    def _probe(self, rec: TaskRecord) -> None:
        """A stitched task killed two workers and on_error is "skip": find which of its
        sources does it, one small probe task each, then compose it without them, so only
        the bad samples are left out (not their k - 1 neighbours)."""
        rec.probes_left = len(rec.indices)
        rec.poisoned.clear()
        for index in rec.indices:
            probe = self._new_task(rec.step, (-1,), ((index,),), 1, PROBE_HW, probe_of=rec)
            probe.plan_version = rec.plan_version
            self.pending.appendleft(probe)

    def _probe_done(self, probe: TaskRecord, bad: bool) -> None:
        parent = probe.probe_of
        if parent is None:
            return
        if bad:
            parent.poisoned.extend(probe.indices)
        parent.probes_left -= 1
        if parent.probes_left > 0 or self.tasks.get(parent.task_id) is not parent:
            return
        if parent.poisoned:
            parent.exclude = tuple(parent.poisoned)
            parent.link = None
            self.pending.appendleft(parent)
            return
        # Every source is fine alone, yet together they kill workers: the composed image
        # itself is the poison. Leave all of it out (counted), rather than kill more workers.
        del self.tasks[parent.task_id]
        self.skipped_poison += 1
        batch = self.inflight.get(parent.step)
        if batch is not None:
            for slot, indices in zip(parent.slots, parent.images, strict=True):
                batch.drop(slot, list(indices))
            self._maybe_finish(batch)

    # ------------------------------------------------------------ batches

    def _maybe_finish(self, batch: InflightBatch) -> None:
        if not batch.complete:
            return
        step = batch.plan.step
        del self.inflight[step]
        if not self.buffers.seal(batch.host):  # a late writer is in it: deliver once out
            self.sealing.append(batch)
            return
        self._deliver(batch)

    def _deliver(self, batch: InflightBatch) -> None:
        step = batch.plan.step
        delivery = self.mover.deliver(batch, self.epoch, self.buffers)
        with self.handoff.cond:
            self.handoff.ready[step] = delivery
            self.handoff.cond.notify_all()

    def retry_seals(self) -> None:
        """Deliver the complete batches whose buffers could not be sealed before."""
        if not self.sealing:
            return
        waiting = []
        for batch in self.sealing:
            if self.buffers.seal(batch.host):
                self._deliver(batch)
            else:
                waiting.append(batch)
        self.sealing = waiting

    def fail_batch(self, batch: InflightBatch, error: DataServerError) -> None:
        step = batch.plan.step
        self.inflight.pop(step, None)
        self._forget(lambda r: r.step == step)
        self.buffers.give(batch.host)
        with self.handoff.cond:
            self.handoff.ready[step] = error
            self.handoff.cond.notify_all()

    def _forget(self, which: Callable[[TaskRecord], bool]) -> None:
        """Stop wanting some tasks; those already sent stay outstanding until answered."""
        for tid in [t for t, r in self.tasks.items() if which(r)]:
            del self.tasks[tid]
        self.pending = deque(r for r in self.pending if not which(r))

    def taken(self) -> int:
        with self.handoff.cond:
            return self.handoff.taken

    def fill(self) -> None:
        """Plan batches until ``prefetch`` are planned beyond what the trainer has taken."""
        cursor = self.cursor
        if cursor is None or self.handoff.end_step is not None:
            return
        taken = self.taken()
        for step in [s for s in self.plan_starts if s < taken]:
            del self.plan_starts[step]
        while cursor.step - taken < self.config.prefetch:
            plan = cursor.next_plan()
            if plan is None:
                with self.handoff.cond:
                    self.handoff.end_step = cursor.step
                    self.handoff.cond.notify_all()
                return
            self.plan_starts[plan.step] = plan.start
            host = self.buffers.take((len(plan.images), 3, *plan.out_hw))
            self.inflight[plan.step] = InflightBatch(plan, host)
            images = plan.images
            for run in split_runs(len(images), self.tasks_per_batch(len(images))):
                rec = self._new_task(
                    plan.step,
                    tuple(run),
                    tuple(images[j].indices for j in run),
                    images[0].grid,
                    plan.out_hw,
                )
                self.pending.append(rec)

    # ------------------------------------------------------------ commands

    def start_epoch(self, epoch: int, dataset_len: int, position: int = 0, step: int = 0) -> int:
        """Begin ``epoch`` at shard ``position`` (batch ``step``); return the shard size."""
        self.epoch = epoch
        self.plan_version += 1
        self._drop_plans()
        cfg = self.config
        order = epoch_order(dataset_len, cfg.seed, epoch, cfg.shuffle)
        shard = shard_of(order, cfg.rank, cfg.world_size, cfg.drop_last)
        self.cursor = Cursor(shard, self.layout, self.mode, self.plan_version)
        self.cursor.position, self.cursor.step = position, step
        with self.handoff.cond:
            self.handoff.ready.clear()
            self.handoff.taken = step
            self.handoff.end_step = None
            self.handoff.fatal = None
        return len(shard)

    def steer(self, mode: str, control: dict[str, Any] | None) -> int:
        """Switch mode and/or control values from the next batch the trainer takes on.

        Returns the new plan_version. Every batch not yet taken is dropped and planned
        again from its first sample under the new plan.
        """
        self.plan_version += 1
        self.mode = mode
        if control is not None:
            self.control = {**self.control, **control}
            self.control_seq += 1
        if self.cursor is not None:
            with self.handoff.cond:
                taken = self.handoff.taken
                self.handoff.ready.clear()
                self.handoff.end_step = None
            position = self.plan_starts.get(taken, self.cursor.position)
            self._drop_plans()
            self.cursor.rewind(taken, position, mode, self.plan_version)
        return self.plan_version

    def _drop_plans(self) -> None:
        for batch in [*self.inflight.values(), *self.sealing]:
            self.buffers.give(batch.host)
        self.sealing.clear()
        self.inflight.clear()
        self.plan_starts.clear()
        self.tasks.clear()
        self.pending.clear()

    def snapshot(self) -> dict[str, Any]:
        """The resumable position: the first batch the trainer has not taken."""
        taken = self.taken()
        cursor = self.cursor
        position = self.plan_starts.get(taken, cursor.position) if cursor else 0
        return {
            "epoch": self.epoch,
            "position": position,
            "step": taken,
            "mode": self.mode,
            "control": dict(self.control),
            "control_seq": self.control_seq,
        }

    def restore(self, mode: str, control: dict[str, Any], control_seq: int) -> None:
        self.mode = mode
        self.control = dict(control)
        self.control_seq = control_seq

    def outstanding(self) -> Iterator[TaskRecord]:
        return iter(self.tasks.values())

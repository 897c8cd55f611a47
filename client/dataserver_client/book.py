"""The plan book: which batches of the epoch are planned, which tasks they are waiting for,
and the commands that move the plan. No sockets and no threads of its own; the engine's
I/O thread is its only caller, and tests drive it directly.

Task accounting: a ``TaskRecord`` is in ``tasks`` while its answer is still wanted. Which
server it was last sent to (``rec.link``) is the engine's business. An answer is taken when
its task is still wanted under the same plan_version, from whichever server it comes:
results are deterministic, so a second answer (after a task was asked again) is dropped.

Zero-stale steering lives in ``steer``: it bumps ``plan_version``, clears every batch the
trainer has not taken, and rewinds the cursor to the first of them.

Zero-stall mode flips live in ``flip``: beside the batches planned in the current mode, the
book plans the *next* batch in the other mode too (the lookahead batch: the same samples
from the same shard position, so its sources are the ones the servers' stores hold or are
decoding anyway). A mode flip promotes it to be the next batch (ready at once when it is
complete), keeps the batch it replaces as the new lookahead (a flip back promotes it
again), and drops the deeper batches of the old mode, cancelling their tasks by id.
"""

from __future__ import annotations

import threading
from collections import deque
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import numpy as np

from dataserver.protocol import MAX_TASK_IMAGES, Result
from dataserver_client.assembly import Delivery, DeviceMover, HostBuffers, InflightBatch
from dataserver_client.config import ClientConfig
from dataserver_client.epoch import (
    REGULAR,
    STITCH,
    BatchPlan,
    Cursor,
    epoch_order,
    global_order,
    shard_of,
    split_runs,
)
from dataserver_client.errors import DataServerError

if TYPE_CHECKING:
    from dataserver_client.resume import Deal

PROBE_HW = (8, 8)  # a probe composes one source into a tiny image: it only asks "does it kill?"


def epoch_shard(
    config: ClientConfig, dataset_len: int, epoch: int, deal: Deal | None = None
) -> tuple[np.ndarray, int]:
    """This rank's shard of ``epoch`` (its share of ``deal``, with one) and its spare (see
    ``epoch.Cursor``). The costliest step of starting an epoch (a permutation of the whole
    dataset: about 1 s for 2**24 samples), and pure: the client runs it in the trainer's
    thread, so the I/O thread never stops serving heartbeats and results for it. The shard
    holds no view of the whole order (with several ranks, only this rank's part is kept)."""
    order = epoch_order(dataset_len, config.seed, epoch, config.shuffle)
    if deal is None:
        shard = shard_of(order, config.rank, config.world_size, config.drop_last)
        return np.ascontiguousarray(shard), 0  # (a strided view would keep the order)
    whole = global_order(order, deal.plan_world, config.drop_last)
    return whole[deal.share(config.rank, config.world_size)], deal.spare(
        config.rank, config.world_size
    )


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
    batch: InflightBatch  # the batch its images go to
    slots: tuple[int, ...]  # the batch slots of its images, in order (-1: a probe's)
    images: tuple[tuple[int, ...], ...]  # each image's source indices, in cell order
    grid: int
    out_hw: tuple[int, int]
    plan_version: int
    link: Any = None  # the server it was last sent to (the engine's ServerLink), or None
    land_gen: int | None = None  # the landing generation it was last sent to land with
    exclude: tuple[int, ...] = ()  # sources to leave out (found to kill workers)
    prefer: Any = None  # the server whose store should hold its sources (several servers)
    keys: tuple[int, ...] = ()  # its images' affinity keys (several servers)
    probe_of: TaskRecord | None = None  # a one-source probe run for this stitched task
    probes_left: int = 0
    poisoned: list[int] = field(default_factory=list)

    @property
    def step(self) -> int:
        return self.batch.plan.step

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
        self.plans: dict[int, BatchPlan] = {}  # the current mode's plans, from step taken on
        self.tasks: dict[int, TaskRecord] = {}
        self.pending: deque[TaskRecord] = deque()
        self.next_task_id = 1
        self.skipped_poison = 0
        self.sealing: list[InflightBatch] = []  # complete, waiting for their buffer's seal
        self.parallelism = 2  # worker slots over every ready server (the engine keeps it)
        # With several servers: the server an affinity key goes to (rendezvous hashing over
        # the ready ones, kept by the engine), or None for "any".
        self.route: Callable[[int], Any] = lambda key: None
        self.owner: dict[int, Any] = {}  # affinity key -> the server its sources went to
        # The lookahead: batch ``taken`` planned in the other mode (see the module's doc).
        self.lookahead = config.lookahead and self.layout.stitch_k > 1
        self.armed = False  # set once the trainer steers the mode (feedback, set_mode)
        self.alt_plan: BatchPlan | None = None
        self.alt: InflightBatch | None = None  # its batch while being answered or sealed
        self.alt_ready: Delivery | DataServerError | None = None  # its batch once finished
        self._alt_tried: tuple[int, int, str] | None = None
        self.to_cancel: list[tuple[Any, int]] = []  # (link, task id) sent but not wanted now
        self.flips = {"promoted": 0, "promoted_ready": 0, "replanned": 0}
        # The epoch's deal (an elastic resume) as plain data for snapshots, or None.
        self.deal_state: dict[str, Any] | None = None

    # ------------------------------------------------------------ tasks

    def wanted(self, task_id: int, plan_version: int | None) -> TaskRecord | None:
        """The record an answer is for, if it is still wanted under that plan."""
        rec = self.tasks.get(task_id)
        if rec is None or rec.plan_version != plan_version:
            return None
        return rec

    def pop_pending(self, link: Any = None) -> TaskRecord | None:
        """The next task to send to ``link``, skipping those no longer wanted.

        With several servers: the first task that prefers ``link`` (its sources belong in
        that server's store); else the first whose sources no other server has begun on
        (it moves to ``link``, with every task sharing its samples: a server with free
        credit does not idle while such work waits). None: nothing ``link`` should take
        now: what is left belongs where its sources are (or are being decoded), and is
        composed there sooner than another server could decode them again."""
        pending = self.pending
        while pending and self.tasks.get(pending[0].task_id) is not pending[0]:
            pending.popleft()
        if not pending:
            return None
        head = pending[0]
        if link is None or head.prefer is None or head.prefer is link:
            return self._take(0, link)
        movable = None
        for j, rec in enumerate(pending):
            if self.tasks.get(rec.task_id) is not rec:
                continue
            if rec.prefer is None or rec.prefer is link:
                return self._take(j, link)
            if movable is None and all(self.owner.get(k, link) is link for k in rec.keys):
                movable = j
        if movable is not None:
            return self._take(movable, link)
        return None

    def _take(self, j: int, link: Any) -> TaskRecord:
        rec = self.pending[j]
        del self.pending[j]
        if rec.keys and link is not None:
            for key in rec.keys:
                self.owner[key] = link
            if rec.prefer is not link:  # it moved: so do the tasks that share its samples
                keys = set(rec.keys)
                for other in self.pending:
                    if other.prefer is not link and not keys.isdisjoint(other.keys):
                        other.prefer = link
                rec.prefer = link
        return rec

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
        batch: InflightBatch,
        slots: tuple[int, ...],
        images: tuple[tuple[int, ...], ...],
        grid: int,
        out_hw: tuple[int, int],
        plan_version: int | None = None,
        **extra: Any,
    ) -> TaskRecord:
        version = self.plan_version if plan_version is None else plan_version
        rec = TaskRecord(self.next_task_id, batch, slots, images, grid, out_hw, version, **extra)
        self.next_task_id += 1
        self.tasks[rec.task_id] = rec
        return rec

    def batch_of(self, rec: TaskRecord) -> InflightBatch | None:
        """The batch a wanted task's images go to, while that batch is still planned and
        being answered."""
        batch = rec.batch
        if batch is self.alt or self.inflight.get(batch.plan.step) is batch:
            return batch
        return None

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
        batch = self.batch_of(rec)
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
                    single = self._new_task(
                        rec.batch, (slot,), (one,), rec.grid, rec.out_hw, rec.plan_version
                    )
                    self.pending.appendleft(single)
                return
            rest = pairs[:image] + pairs[image + 1 :]
            if rest:
                again = self._new_task(
                    rec.batch,
                    tuple(slot for slot, _ in rest),
                    tuple(one for _, one in rest),
                    rec.grid,
                    rec.out_hw,
                    rec.plan_version,
                )
                self.pending.appendleft(again)
            slot, one = pairs[image]
            bad = self._new_task(rec.batch, (slot,), (one,), rec.grid, rec.out_hw, rec.plan_version)
            self.on_failure(bad, kind, error)
            return
        if skip and kind == "poison" and rec.probe_of is None and len(rec.indices) > 1:
            self._probe(rec)  # still wanted: composed again once the probes say how
            return
        del self.tasks[rec.task_id]
        if rec.probe_of is not None:
            self._probe_done(rec, bad=kind in ("sample", "poison"))
            return
        batch = self.batch_of(rec)
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
            probe = self._new_task(
                rec.batch, (-1,), ((index,),), 1, PROBE_HW, rec.plan_version, probe_of=rec
            )
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
        batch = self.batch_of(parent)
        if batch is not None:
            for slot, indices in zip(parent.slots, parent.images, strict=True):
                batch.drop(slot, list(indices))
            self._maybe_finish(batch)

    # ------------------------------------------------------------ batches

    def _maybe_finish(self, batch: InflightBatch) -> None:
        if not batch.complete:
            return
        if batch is not self.alt:
            del self.inflight[batch.plan.step]
        if not self.buffers.seal(batch.host):  # a late writer is in it: deliver once out
            self.sealing.append(batch)
            return
        self._deliver(batch)

    def _deliver(self, batch: InflightBatch) -> None:
        delivery = self.mover.deliver(batch, self.epoch, self.buffers)
        if batch is self.alt:  # finished, kept until a flip promotes it or the step passes
            self.alt, self.alt_ready = None, delivery
            return
        with self.handoff.cond:
            self.handoff.ready[batch.plan.step] = delivery
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
        self._forget(lambda r: r.batch is batch)
        self.buffers.give(batch.host)
        if batch is self.alt:  # the trainer gets the error if a flip promotes it
            self.alt, self.alt_ready = None, error
            return
        step = batch.plan.step
        self.inflight.pop(step, None)
        with self.handoff.cond:
            self.handoff.ready[step] = error
            self.handoff.cond.notify_all()

    def _forget(self, which: Callable[[TaskRecord], bool], cancel: bool = False) -> None:
        """Stop wanting some tasks; those already sent stay outstanding until answered
        (with ``cancel``, the servers are asked to drop them if still queued)."""
        for tid in [t for t, r in self.tasks.items() if which(r)]:
            rec = self.tasks.pop(tid)
            if cancel and rec.link is not None:
                self.to_cancel.append((rec.link, tid))
        self.pending = deque(r for r in self.pending if not which(r))

    def taken(self) -> int:
        with self.handoff.cond:
            return self.handoff.taken

    def fill(self) -> None:
        """Plan batches until ``prefetch`` are planned beyond what the trainer has taken;
        with lookahead, the next batch in the other mode right after the next batch."""
        cursor = self.cursor
        if cursor is None:
            return
        with self.handoff.cond:
            taken = self.handoff.taken
            ended = self.handoff.end_step is not None
        for step in [s for s in self.plans if s < taken]:
            del self.plans[step]
        if self.alt_plan is not None and self.alt_plan.step != taken:
            self._drop_alt()  # the trainer took that step in the current mode
        while not ended and cursor.step <= taken:  # the next batch first
            ended = not self._plan_next(cursor)
        if self.lookahead and self.armed and self.alt_plan is None:
            self._plan_alt(cursor, taken)
        while not ended and cursor.step - taken < self.config.prefetch:
            ended = not self._plan_next(cursor)

    def _plan_next(self, cursor: Cursor) -> bool:
        plan = cursor.next_plan()
        if plan is None:
            with self.handoff.cond:
                self.handoff.end_step = cursor.step
                self.handoff.cond.notify_all()
            return False
        self.plans[plan.step] = plan
        self.inflight[plan.step] = self._plan_tasks(plan)
        return True

    def _plan_tasks(self, plan: BatchPlan) -> InflightBatch:
        """The batch's buffer and tasks: runs of consecutive images, cut where the server
        their sources belong to changes (several servers), else evenly."""
        batch = InflightBatch(plan, self.buffers.take((len(plan.images), 3, *plan.out_hw)))
        images = plan.images
        n = len(images)
        keys = [self._affinity(plan, j) for j in range(n)]
        owner = self.owner
        servers = [owner.get(key) or self.route(key) for key in keys]
        segments: list[tuple[int, int]] = []  # [start, stop) of one preferred server
        for j in range(n):
            if j and servers[j] is servers[j - 1]:
                segments[-1] = (segments[-1][0], j + 1)
            else:
                segments.append((j, j + 1))
        parts = self.tasks_per_batch(n)
        for start, stop in segments:
            share = max(1, round(parts * (stop - start) / n))
            for run in split_runs(stop - start, share):
                slots = tuple(start + j for j in run)
                rec = self._new_task(
                    batch,
                    slots,
                    tuple(images[j].indices for j in slots),
                    images[0].grid,
                    plan.out_hw,
                    prefer=servers[start],
                    keys=tuple(keys[j] for j in slots) if servers[start] is not None else (),
                )
                self.pending.append(rec)
        return batch

    def _affinity(self, plan: BatchPlan, j: int) -> int:
        """The key that picks the server for image ``j`` of ``plan``: with lookahead, the
        first sample of its group of k shard positions (one stitched image's worth), so the
        samples that one flip may stitch together are decoded into one server's store; else
        its first sample (the same server every epoch: cross-epoch cache hits)."""
        first = plan.images[j].indices[0]
        if not (self.lookahead and self.armed) or self.cursor is None:
            return first
        k = self.layout.stitch_k
        per_image = k if plan.mode == STITCH and self.layout.stitch_layout == "spatial" else 1
        position = plan.start + j * per_image
        return int(self.cursor.shard[position - position % k])

    def _plan_alt(self, cursor: Cursor, taken: int) -> None:
        """Plan batch ``taken`` in the other mode, from the same shard position."""
        primary = self.plans.get(taken)
        if primary is not None:
            start = primary.start
        elif cursor.step == taken:  # the current mode has no batch left there; the other may
            start = cursor.position
        else:
            return
        other = STITCH if self.mode == REGULAR else REGULAR
        key = (taken, start, other)
        if self._alt_tried == key:
            return  # tried already: the shard has too few samples left for it
        self._alt_tried = key
        plan = cursor.plan_at(taken, start, other)
        if plan is None:
            return
        self.alt_plan = plan
        self.alt = self._plan_tasks(plan)

    def _drop_alt(self) -> None:
        """Forget the lookahead batch: its tasks (cancelled on the servers), its buffer."""
        alt = self.alt
        if alt is not None:
            self._forget(lambda r: r.batch is alt, cancel=True)
            if alt in self.sealing:
                self.sealing.remove(alt)
            self.buffers.give(alt.host)
        self.alt_plan, self.alt, self.alt_ready = None, None, None

    def set_lookahead(self, on: bool) -> None:
        self.lookahead = on
        if not on and self.alt_plan is not None:
            self._drop_alt()

    # ------------------------------------------------------------ commands

    def start_epoch(
        self,
        epoch: int,
        dataset_len: int,
        position: int = 0,
        step: int = 0,
        deal: Deal | None = None,
        planned: tuple[np.ndarray, int] | None = None,
    ) -> int:
        """Begin ``epoch`` at shard ``position`` (batch ``step``); return the shard size.
        With ``deal`` (an elastic resume), the shard is this rank's share of it.
        ``planned``: ``epoch_shard``'s answer for the same arguments, computed beforehand
        (by the client, in the trainer's thread); None: computed here."""
        self.epoch = epoch
        self.plan_version += 1
        self._drop_plans()
        self.owner.clear()
        shard, spare = planned or epoch_shard(self.config, dataset_len, epoch, deal)
        self.deal_state = None if deal is None else deal.to_state()
        self.cursor = Cursor(shard, self.layout, self.mode, self.plan_version, spare)
        self.cursor.position, self.cursor.step = position, step
        with self.handoff.cond:
            self.handoff.ready.clear()
            self.handoff.taken = step
            self.handoff.end_step = None
            self.handoff.fatal = None
        return len(shard)

    def flip(self, mode: str) -> bool:
        """Switch to ``mode`` from the next batch on by promoting the lookahead batch, which
        is that batch in that mode (ready at once when complete). False when there is no
        such batch: the caller then steers, planning everything again."""
        self.fill()  # the trainer may flip right after taking a batch: catch up first
        alt_plan, cursor = self.alt_plan, self.cursor
        if alt_plan is None or cursor is None or alt_plan.mode != mode or mode == self.mode:
            return False
        with self.handoff.cond:
            taken = self.handoff.taken
            primary = self.plans.get(taken)
            if alt_plan.step != taken or (primary is not None and primary.start != alt_plan.start):
                return False
            old_ready = self.handoff.ready.pop(taken, None)
            for step in [s for s in self.handoff.ready if s > taken]:
                del self.handoff.ready[step]  # deeper batches of the old mode
            self.handoff.end_step = None
        # The old mode's batch ``taken``, at whatever stage it is, becomes the lookahead.
        old = self.inflight.pop(taken, None)
        if old is None:
            old = next(
                (b for b in self.sealing if b.plan.step == taken and b is not self.alt), None
            )
        deeper = [b for s, b in self.inflight.items() if s > taken]
        deeper += [b for b in self.sealing if b.plan.step > taken]
        gone = set(map(id, deeper))
        self._forget(lambda r: id(r.batch) in gone, cancel=True)
        for batch in deeper:
            self.inflight.pop(batch.plan.step, None)
            self.buffers.give(batch.host)
        self.sealing = [b for b in self.sealing if id(b) not in gone]
        for step in [s for s in self.plans if s > taken]:
            del self.plans[step]
        new, new_ready = self.alt, self.alt_ready
        self.alt_plan, self.alt, self.alt_ready = primary, old, old_ready
        self.plans[taken] = alt_plan
        self.flips["promoted"] += 1
        if new_ready is not None:
            self.flips["promoted_ready"] += 1
            with self.handoff.cond:
                self.handoff.ready[taken] = new_ready
                self.handoff.cond.notify_all()
        elif new is not None and new not in self.sealing:
            self.inflight[taken] = new
        self.mode = mode
        cursor.jump(taken + 1, alt_plan.stop, mode)
        return True

    def steer(self, mode: str, control: dict[str, Any] | None) -> int:
        """Switch mode and/or control values from the next batch the trainer takes on.

        Returns the new plan_version. Every batch not yet taken is dropped and planned
        again from its first sample under the new plan.
        """
        self.plan_version += 1
        if control is None and mode != self.mode:
            self.flips["replanned"] += 1
        self.mode = mode
        if control is not None:
            self.control = {**self.control, **control}
            self.control_seq += 1
        if self.cursor is not None:
            with self.handoff.cond:
                taken = self.handoff.taken
                self.handoff.ready.clear()
                self.handoff.end_step = None
            first = self.plans.get(taken)
            position = first.start if first is not None else self.cursor.position
            self._drop_plans()
            self.cursor.rewind(taken, position, mode, self.plan_version)
        return self.plan_version

    def _drop_plans(self) -> None:
        for batch in [*self.inflight.values(), *self.sealing]:
            self.buffers.give(batch.host)
        if self.alt is not None and self.alt not in self.sealing:
            self.buffers.give(self.alt.host)
        self.alt_plan, self.alt, self.alt_ready, self._alt_tried = None, None, None, None
        self.sealing.clear()
        self.inflight.clear()
        self.plans.clear()
        self.tasks.clear()
        self.pending.clear()

    def snapshot(self) -> dict[str, Any]:
        """The resumable position: the first batch the trainer has not taken (its position
        in this rank's share of the epoch's deal, when the epoch has one)."""
        taken = self.taken()
        cursor = self.cursor
        first = self.plans.get(taken)
        position = first.start if first is not None else cursor.position if cursor else 0
        return {
            "epoch": self.epoch,
            "position": position,
            "step": taken,
            "mode": self.mode,
            "control": dict(self.control),
            "control_seq": self.control_seq,
            "deal": self.deal_state,
            "share": len(cursor.shard) - cursor.spare if cursor is not None else None,
        }

    def restore(self, mode: str, control: dict[str, Any], control_seq: int) -> None:
        self.mode = mode
        self.control = dict(control)
        self.control_seq = control_seq

    def outstanding(self) -> Iterator[TaskRecord]:
        return iter(self.tasks.values())

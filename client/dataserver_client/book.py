"""The plan book: which batches of the epoch are planned, the batches being answered, the
mode and control values they are planned under, and the commands that move the plan. No
sockets and no threads of its own; the engine's I/O thread is its only caller, and tests
drive it directly. It holds the session's mode: everyone else asks it.

It reaches its collaborators only through their methods: the ``TaskLedger`` (ledger.py:
the tasks a batch needs), the ``Affinity`` (affinity.py: which server a task's sources
belong to) and the ``Handoff`` (handoff.py: finished batches for the trainer).

Zero-stale steering lives in ``steer``: it bumps ``plan_version``, clears every batch the
trainer has not taken, and rewinds the cursor to the first of them.

Zero-stall mode flips live in lookahead.py (the ``Lookahead``: the *next* batch planned in
the other mode too, for a trainer that steers the mode often; its arming rule, the depth it
keeps, and ``flip``). The book calls it at each planning pass and hands it a flip; it asks
the book back only through the methods of ``lookahead.Plans`` (``planned``, ``plan_tasks``,
``discard``, ``withdraw``, ``drop_deeper``, ``adopt``, ``switch``).

A finished batch (delivered or failed) goes to one place, ``_route``: a rebuild's Future,
else the lookahead, else the trainer.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, replace
from typing import TYPE_CHECKING, Any

import numpy as np

from dataserver.protocol import MAX_TASK_IMAGES, BatchSizes, Result
from dataserver.protocol.messages import DEFAULT_TASK_BYTES
from dataserver_client.affinity import Affinity
from dataserver_client.assembly import Delivery, DeviceMover, HostBuffers, InflightBatch
from dataserver_client.config import ClientConfig
from dataserver_client.epoch import (
    REGULAR,
    BatchPlan,
    Cursor,
    epoch_order,
    global_order,
    shard_of,
    split_runs,
)
from dataserver_client.errors import DataServerError
from dataserver_client.handoff import Handoff
from dataserver_client.ledger import TaskLedger, TaskRecord
from dataserver_client.lookahead import Lookahead
from dataserver_client.rebuild import Rebuilds, manifest_of
from dataserver_client.sizes import SizeSchedule

if TYPE_CHECKING:
    from dataserver_client.links import ServerLink
    from dataserver_client.resume import Deal


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


@dataclass(frozen=True)
class Position:
    """Where the trainer stands: the first batch it has not taken (its position in this
    rank's share of the epoch's deal, when the epoch has one), and the plan's values."""

    epoch: int
    position: int
    step: int
    mode: str
    control: dict[str, Any]
    control_seq: int
    deal: dict[str, Any] | None
    share: int | None  # samples in this rank's share of the epoch (None: no epoch yet)
    image_size: list[int] | dict[str, Any]  # the size schedule, as a state holds it


class PlanBook:
    """Planned batches, the batches being answered, and the commands that change the plan."""

    def __init__(
        self,
        config: ClientConfig,
        handoff: Handoff[Delivery],
        mover: DeviceMover,
        buffers: HostBuffers,
        ledger: TaskLedger | None = None,
        affinity: Affinity[ServerLink] | None = None,
    ) -> None:
        self.config = config
        self._handoff = handoff
        self._mover = mover
        self._buffers = buffers
        self.ledger = ledger if ledger is not None else TaskLedger()
        self.affinity: Affinity[ServerLink] = affinity if affinity is not None else Affinity()
        self.layout = config.layout()
        self.epoch = 0
        self._mode = REGULAR
        self.plan_version = 0
        self.control: dict[str, Any] = {}
        self.control_seq = 0
        self.sizes: SizeSchedule = config.sizes  # the size schedule from the next batch on
        self.cursor: Cursor | None = None
        self.rebuilds = Rebuilds()  # batches rebuilt from a manifest (``client.rebuild``)
        self._inflight: dict[int, InflightBatch] = {}
        self._plans: dict[int, BatchPlan] = {}  # the current mode's plans, from step taken on
        self._sealing: list[InflightBatch] = []  # complete, waiting for their buffer's seal
        self._sealing_rebuilds: list[InflightBatch] = []  # the same, of rebuilt batches
        self._parallelism = 2  # worker slots over every ready server
        self._task_bytes = DEFAULT_TASK_BYTES  # the most output a task may ask of any of them
        self.lookahead = Lookahead(
            config.lookahead and self.layout.stitch_k > 1, self.layout, handoff, self
        )
        self.flips = self.lookahead.flips  # (what the flips did: the lookahead counts them)
        # The epoch's deal (an elastic resume) as plain data for snapshots, or None.
        self._deal_state: dict[str, Any] | None = None

    @property
    def mode(self) -> str:
        """The mode of the next batch the trainer takes (the session's one record of it)."""
        return self._mode

    def set_parallelism(self, slots: int) -> None:
        """Tasks the ready servers can work on at once (batches are cut to keep them busy)."""
        self._parallelism = max(1, slots)

    def set_task_bytes(self, nbytes: int) -> None:
        """The most output bytes one task may ask for (the least of the ready servers'
        ``--max-task-mb``): batches are cut into tasks that fit."""
        self._task_bytes = max(1, nbytes)

    def images_per_task(self, sizes: BatchSizes) -> int:
        """The most images of ``sizes.out`` one task may hold (at least one: a server that
        cannot take one image of that size is declined at its WELCOME)."""
        return max(1, min(MAX_TASK_IMAGES, self._task_bytes // sizes.image_bytes))

    # ------------------------------------------------------------ tasks

    def batch_of(self, rec: TaskRecord) -> InflightBatch | None:
        """The batch a wanted task's images go to, while that batch is still planned and
        being answered."""
        batch = rec.batch
        if batch is self.lookahead.batch or self._inflight.get(batch.plan.step) is batch:
            return batch
        return batch if batch in self.rebuilds else None

    def destination(self, rec: TaskRecord) -> np.ndarray:
        """Where the images of a wanted task's answer are received: its slots of the batch
        buffer, or a scratch array (a probe's, slots that are not consecutive, a batch no
        longer planned)."""
        batch = self.batch_of(rec)
        if batch is None or not rec.consecutive:
            return np.empty((len(rec.slots), 3, *rec.sizes.out), np.uint8)
        first = rec.slots[0]
        return batch.array[first : first + len(rec.slots)]

    def tasks_per_batch(self, images: int) -> int:
        """Tasks to cut a batch of ``images`` output images into: enough that this rank's
        share of every server's worker slots (the ranks of a job share them: 1 / world_size
        each) is full with ``depth()`` batches in flight, and no more. Each task costs a
        message each way and wakes the client, the front and a worker, whose caches the
        others then refill (2 cores, 512x512, batch 16: two tasks a batch instead of one
        cost the client ~180 us an image instead of ~120 and the front ~95 instead of ~55;
        cut by every slot, a job of 1,000 ranks made every image a task and its servers'
        fronts the bottleneck). With nothing in flight (an epoch's first batch, a trainer
        that let every batch finish), the batch is cut for the whole share: every worker
        works on it."""
        share = self.share()
        want = share if not len(self.ledger) else -(-share // self.depth())
        return max(1, min(images, max(want, -(-images // MAX_TASK_IMAGES))))

    def depth(self) -> int:
        """Batches planned beyond the trainer: ``prefetch``, less while the lookahead is
        armed (``Lookahead.depth``)."""
        return self.lookahead.depth(self.config.prefetch)

    def share(self) -> int:
        """This rank's share of the ready servers' worker slots."""
        return max(1, self._parallelism // self.config.world_size)

    # ------------------------------------------------------------ answers

    def on_result(self, rec: TaskRecord, result: Result) -> None:
        """A wanted task's RESULT (checked by the engine: one image per slot, the indices
        asked); its pixels are already in the batch buffer."""
        if rec.probe_of is not None:
            self._drop_poisoned(self.ledger.probe_done(rec, bad=False))
            return
        self.ledger.done(rec)
        batch = self.batch_of(rec)
        if batch is None:
            return
        assert result.boxes is not None and result.labels is not None
        pixels = result.pixels
        if pixels is not None and not np.shares_memory(pixels, batch.array):
            for j, slot in enumerate(rec.slots):  # received apart: slots not consecutive
                batch.array[slot] = pixels[j]
        batch.answer(
            rec.slots,
            result.images,
            result.box_counts,
            result.boxes,
            result.labels,
            result.failed,
            result.files,
            result.orig_sizes,
        )
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
            bad = self.ledger.split(rec, image)
            if bad is not None:
                self.on_failure(bad, kind, error)
            return
        if skip and kind == "poison" and rec.probe_of is None and len(rec.indices) > 1:
            self.ledger.probe(rec)  # still wanted: composed again once the probes say how
            return
        if rec.probe_of is not None:
            self._drop_poisoned(self.ledger.probe_done(rec, bad=kind in ("sample", "poison")))
            return
        self.ledger.done(rec)
        batch = self.batch_of(rec)
        if batch is None:
            return
        if skip and kind in ("sample", "poison"):
            for slot, indices in zip(rec.slots, rec.images, strict=True):
                batch.drop(slot, list(indices))
            self._maybe_finish(batch)
            return
        self.fail_batch(batch, error)

    def _drop_poisoned(self, parent: TaskRecord | None) -> None:
        """Leave out a composed image that kills workers though each source is fine alone."""
        batch = self.batch_of(parent) if parent is not None else None
        if parent is None or batch is None:
            return
        for slot, indices in zip(parent.slots, parent.images, strict=True):
            batch.drop(slot, list(indices))
        self._maybe_finish(batch)

    # ------------------------------------------------------------ batches

    def _maybe_finish(self, batch: InflightBatch) -> None:
        if not batch.complete:
            return
        if batch in self.rebuilds:  # (sealed apart: no plan of the epoch's may touch it)
            if self._buffers.seal(batch.host):
                self._deliver(batch)
            else:
                self._sealing_rebuilds.append(batch)
            return
        if batch is not self.lookahead.batch:
            del self._inflight[batch.plan.step]
        if not self._buffers.seal(batch.host):  # a late writer is in it: deliver once out
            self._sealing.append(batch)
            return
        self._deliver(batch)

    def _deliver(self, batch: InflightBatch) -> None:
        manifest = manifest_of(batch, self.layout, self.config.on_error)
        self._route(batch, self._mover.deliver(batch, batch.plan.epoch, self._buffers, manifest))

    def _route(self, batch: InflightBatch, item: Delivery | DataServerError) -> None:
        """Where a finished batch (delivered or failed) goes: a rebuild's Future; else the
        lookahead, kept until a flip promotes it (the trainer gets an error only then) or
        the step passes; else the trainer."""
        if batch in self.rebuilds:
            if isinstance(item, DataServerError):
                self.rebuilds.failed(batch, item)
            else:
                self.rebuilds.finished(batch, item)
            return
        if batch is self.lookahead.batch:
            self.lookahead.finished(item)
            return
        step = batch.plan.step
        if self._inflight.get(step) is batch:  # (a failed batch; a delivered one is out)
            del self._inflight[step]
        self._handoff.put(step, batch.plan.plan_version, item)

    def retry_seals(self) -> None:
        """Deliver the complete batches whose buffers could not be sealed before."""
        if self._sealing_rebuilds:
            waiting = [b for b in self._sealing_rebuilds if not self._buffers.seal(b.host)]
            for batch in self._sealing_rebuilds:
                if batch not in waiting:
                    self._deliver(batch)
            self._sealing_rebuilds = waiting
        if not self._sealing:
            return
        waiting = []
        for batch in self._sealing:
            if self._buffers.seal(batch.host):
                self._deliver(batch)
            else:
                waiting.append(batch)
        self._sealing = waiting

    def fail_batch(self, batch: InflightBatch, error: DataServerError) -> None:
        self.ledger.forget(lambda r: r.batch is batch)
        self._buffers.give(batch.host)
        self._route(batch, error)

    def fill(self, deeper: int | None = None) -> bool:
        """Plan batches until ``prefetch`` are planned beyond what the trainer has taken;
        with lookahead, the next batch in the other mode right after the next batch.
        ``deeper``: plan at most that many batches beyond the next one, and say whether
        more are due (the engine sends each batch's tasks before it plans the next: a new
        batch's buffer may take milliseconds to reserve, which the first batch of an epoch
        should not wait for)."""
        cursor = self.cursor
        if cursor is None:
            return False
        taken = self._handoff.taken()
        ended = self._handoff.ended()
        for step in [s for s in self._plans if s < taken]:
            del self._plans[step]
        self.lookahead.moved_on(taken)
        while not ended and cursor.step <= taken:  # the next batch first
            ended = not self._plan_next(cursor)
        self.lookahead.plan_next(cursor, taken)
        # While the landing buffers are still fresh memory (a client's first batches), a
        # deeper batch waits until its tasks would find a slot: reserving its 12 MB buffer
        # takes milliseconds of CPU that the first batch, cut for every slot, needs.
        budget = -1 if deeper is None else deeper
        depth = self.depth()
        slots = max(self.share(), depth)
        while not ended and cursor.step - taken < depth:
            if len(self.ledger) >= slots and self._buffers.fresh():
                return False
            if budget == 0:
                return True
            ended = not self._plan_next(cursor)
            budget -= 1
        return False

    def _plan_next(self, cursor: Cursor) -> bool:
        plan = cursor.next_plan()
        if plan is None:
            self._handoff.end_at(cursor.step)
            return False
        self._plans[plan.step] = plan
        self._inflight[plan.step] = self.plan_tasks(plan)
        return True

    def plan_tasks(self, plan: BatchPlan, batch: InflightBatch | None = None) -> InflightBatch:
        """The batch's buffer and tasks: runs of consecutive images, cut where the server
        their sources belong to changes (several servers), else evenly. ``batch``: one made
        already (a rebuild), else a new one under the current control values."""
        if batch is None:
            host = self._buffers.take((len(plan.images), 3, *plan.sizes.out))
            batch = InflightBatch(plan, host, self.control_seq, self.control)
        images = plan.images
        n = len(images)
        if self.affinity.routes():
            keys = [self.lookahead.key(plan, j, self.cursor) for j in range(n)]
            servers = [self.affinity.server_for(key) for key in keys]
        else:  # one server: no key goes anywhere in particular
            keys, servers = [], [None] * n
        segments: list[tuple[int, int]] = []  # [start, stop) of one preferred server
        for j in range(n):
            if j and servers[j] is servers[j - 1]:
                segments[-1] = (segments[-1][0], j + 1)
            else:
                segments.append((j, j + 1))
        parts = self.tasks_per_batch(n)
        most = self.images_per_task(plan.sizes)
        for start, stop in segments:
            share = max(1, round(parts * (stop - start) / n), -(-(stop - start) // most))
            for run in split_runs(stop - start, share):
                slots = tuple(start + j for j in run)
                self.ledger.add(
                    batch,
                    slots,
                    tuple(images[j].indices for j in slots),
                    images[0].grid,
                    plan.sizes,
                    self.plan_version,
                    prefer=servers[start],
                    keys=tuple(keys[j] for j in slots) if servers[start] is not None else (),
                )
        return batch

    def set_lookahead(self, on: bool) -> None:
        self.lookahead.enable(on)

    def mode_steered(self, changes: bool = True) -> bool:
        """The trainer steers the mode (``changes``: to another mode than the current one):
        whether the lookahead is armed now (lookahead.py)."""
        return self.lookahead.steered(changes)

    # ------------------------------------------------------------ asked by the lookahead

    def planned(self, step: int) -> BatchPlan | None:
        return self._plans.get(step)

    def discard(self, batch: InflightBatch) -> None:
        self.ledger.forget(_of_batch(batch), cancel=True)
        if batch in self._sealing:
            self._sealing.remove(batch)
        self._buffers.give(batch.host)

    def withdraw(self, step: int, keep: InflightBatch | None) -> InflightBatch | None:
        old = self._inflight.pop(step, None)
        if old is None:
            old = next((b for b in self._sealing if b.plan.step == step and b is not keep), None)
        return old

    def drop_deeper(self, step: int) -> None:
        deeper = [b for s, b in self._inflight.items() if s > step]
        deeper += [b for b in self._sealing if b.plan.step > step]
        gone = set(map(id, deeper))
        self.ledger.forget(lambda r: id(r.batch) in gone, cancel=True)
        for batch in deeper:
            self._inflight.pop(batch.plan.step, None)
            self._buffers.give(batch.host)
        self._sealing = [b for b in self._sealing if id(b) not in gone]
        for later in [s for s in self._plans if s > step]:
            del self._plans[later]

    def adopt(self, plan: BatchPlan, batch: InflightBatch | None) -> None:
        self._plans[plan.step] = plan
        if batch is not None and batch not in self._sealing:
            self._inflight[plan.step] = batch

    def switch(self, mode: str, step: int, position: int) -> None:
        assert self.cursor is not None
        self._mode = mode
        self.cursor.jump(step, position, mode)

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
        self.lookahead.epoch_began(step)
        self.plan_version += 1
        self._drop_plans()
        self.affinity.clear()
        shard, spare = planned or epoch_shard(self.config, dataset_len, epoch, deal)
        self._deal_state = None if deal is None else deal.to_state()
        self.cursor = Cursor(
            shard,
            self.layout,
            self._mode,
            self.plan_version,
            spare,
            epoch=epoch,
            seed=self.config.seed,
            sizes=self.sizes,
        )
        self.cursor.jump(step, position, self._mode)
        self._handoff.begin(step, self.plan_version)
        self._replan_rebuilds()
        return len(shard)

    def flip(self, mode: str) -> bool:
        """Switch to ``mode`` from the next batch on by promoting the lookahead batch
        (``Lookahead.flip``). False when there is none for it: the caller then steers."""
        self.fill()  # the trainer may flip right after taking a batch: catch up first
        return self.cursor is not None and self.lookahead.flip(mode)

    def steer(
        self, mode: str, control: dict[str, Any] | None, sizes: SizeSchedule | None = None
    ) -> int:
        """Switch mode, control values and/or the size schedule from the next batch the
        trainer takes on.

        Returns the new plan_version. Every batch not yet taken is dropped and planned
        again from its first sample under the new plan.
        """
        self.plan_version += 1
        if control is None and sizes is None and mode != self._mode:
            self.lookahead.replanned()
        self._mode = mode
        if control is not None:
            self.control = {**self.control, **control}
            self.control_seq += 1
        if sizes is not None:
            # Sources stay stored at the size the schedule so far stored them at (or
            # larger): a new size is composed from what the stores hold, not decoded anew.
            self.sizes = sizes.stored_at(self.sizes.stored)
        if self.cursor is not None:
            taken = self._handoff.taken()
            self._handoff.drop_from(taken, self.plan_version)
            first = self._plans.get(taken)
            position = first.start if first is not None else self.cursor.position
            self._drop_plans()
            self.cursor.rewind(taken, position, mode, self.plan_version, self.sizes)
        self._replan_rebuilds()
        return self.plan_version

    # ------------------------------------------------------------ rebuilds

    def rebuild(self, plan: BatchPlan, control: dict[str, Any], on_error: str) -> Any:
        """Plan a batch again from its manifest (``rebuild.plan_of``): composed with the
        manifest's control values, delivered to the Future this returns, never to the
        trainer's stream of batches."""
        plan = replace(plan, plan_version=self.plan_version)
        host = self._buffers.take((len(plan.images), 3, *plan.sizes.out))
        batch = InflightBatch(plan, host, self.control_seq, control, inline=True, on_error=on_error)
        future = self.rebuilds.add(batch)
        self.plan_tasks(plan, batch)
        return future

    def abandon_rebuild(self, future: Any) -> None:
        """The trainer stopped waiting for a rebuild: drop its tasks and buffer."""
        batch = self.rebuilds.abandon(future)
        if batch is not None:
            self.ledger.forget(lambda r: r.batch is batch, cancel=True)
            if batch in self._sealing_rebuilds:
                self._sealing_rebuilds.remove(batch)
            self._buffers.give(batch.host)

    def _replan_rebuilds(self) -> None:
        """The plan moved on (a steer, a new epoch): the servers drop tasks of older plans,
        so the batches being rebuilt are asked again under this one."""
        for old in self.rebuilds.pending():
            self.ledger.forget(_of_batch(old), cancel=True)
            self._buffers.give(old.host)
            plan = replace(old.plan, plan_version=self.plan_version)
            host = self._buffers.take((len(plan.images), 3, *plan.sizes.out))
            batch = old.again(plan, host, self.control_seq)
            self.rebuilds.replace(old, batch)
            self.plan_tasks(plan, batch)

    def _drop_plans(self) -> None:
        for batch in [*self._inflight.values(), *self._sealing]:
            self._buffers.give(batch.host)
        alt = self.lookahead.reset()
        if alt is not None and alt not in self._sealing:
            self._buffers.give(alt.host)
        self._sealing.clear()
        self._inflight.clear()
        self._plans.clear()
        self.ledger.clear()  # (batches being rebuilt are planned again by the caller)

    def position(self) -> Position:
        """The resumable position: the first batch the trainer has not taken (its position
        in this rank's share of the epoch's deal, when the epoch has one)."""
        taken = self._handoff.taken()
        cursor = self.cursor
        first = self._plans.get(taken)
        position = first.start if first is not None else cursor.position if cursor else 0
        return Position(
            epoch=self.epoch,
            position=position,
            step=taken,
            mode=self._mode,
            control=dict(self.control),
            control_seq=self.control_seq,
            deal=self._deal_state,
            share=len(cursor.shard) - cursor.spare if cursor is not None else None,
            image_size=self.sizes.to_state(),
        )

    def restore(
        self, mode: str, control: dict[str, Any], control_seq: int, sizes: SizeSchedule
    ) -> None:
        self._mode = mode
        self.control = dict(control)
        self.control_seq = control_seq
        self.sizes = sizes


def _of_batch(batch: InflightBatch) -> Callable[[TaskRecord], bool]:
    """Whether a record is of ``batch``."""
    return lambda rec: rec.batch is batch

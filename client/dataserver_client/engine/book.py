"""The plan book: the epoch's plan and the batches being answered. It owns the session's
mode, control values and size schedule (everyone else asks it), the current mode's plans
from the batch the trainer takes next on, the batches being answered or waiting for their
seal, what a task's answer does to its batch, and the commands that move the plan: a new
epoch, a steer, a flip, a rebuild. No sockets and no threads: the engine's I/O thread is its
only caller (engine.py: the trainer's commands and each loop pass; handlers.py: answers and
changes in the servers, ``servers_changed``; dispatch.py reads what a TASK and a CONTROL
carry), and tests drive it directly.

Its collaborators, each reached only through its methods: the engine's ``TaskLedger``
(ledger.py: the tasks a batch needs), given to it; the ``Handoff`` (handoff.py: finished
batches for the trainer); and its own ``Cutting`` (cutting.py: how finely a batch is cut
into tasks and for which server, by the engine's ``Affinity``) and ``Lookahead``
(lookahead.py: the next batch planned in the other mode, and mode flips, which asks the
book back only through ``lookahead.PlanBookView``).

``steer`` bumps ``plan_version``, drops every batch the trainer has not taken, and rewinds
the cursor to the first of them. A finished batch (delivered or failed) goes to one place,
``_route``: a rebuild's Future, else the lookahead, else the trainer.
"""

from __future__ import annotations

from collections.abc import Callable
from concurrent.futures import Future
from dataclasses import replace
from typing import TYPE_CHECKING, Any

import numpy as np

from dataserver.protocol import Result
from dataserver_client.buffers.assembly import DeviceMover, HostBuffers
from dataserver_client.buffers.handoff import Handoff
from dataserver_client.config import ClientConfig
from dataserver_client.errors import DataServerError
from dataserver_client.plan.affinity import Affinity
from dataserver_client.plan.epoch import REGULAR, BatchPlan, Cursor, ShardLike
from dataserver_client.plan.resume import Deal, Position, epoch_shard
from dataserver_client.plan.sizes import SizeSchedule
from dataserver_client.session.cutting import Cutting
from dataserver_client.session.inflight import Delivery, InflightBatch, Sealing
from dataserver_client.session.ledger import TaskLedger, TaskRecord
from dataserver_client.session.lookahead import Lookahead, LookaheadState
from dataserver_client.session.rebuild import Rebuilds, manifest_of

if TYPE_CHECKING:
    from dataserver_client.net.serverlink import ServerLink


class PlanBook:
    """Planned batches, the batches being answered, and the commands that change the plan."""

    def __init__(
        self,
        config: ClientConfig,
        handoff: Handoff[Delivery],
        mover: DeviceMover,
        buffers: HostBuffers,
        ledger: TaskLedger,
        affinity: Affinity[ServerLink],
    ) -> None:
        self._config = config
        self._handoff = handoff
        self._mover = mover
        self._buffers = buffers
        self._ledger = ledger
        self._layout = config.layout()
        self._epoch = 0
        self._mode = REGULAR
        self.plan_version = 0
        self.control: dict[str, Any] = {}
        self.control_seq = 0
        self.sizes: SizeSchedule = config.sizes  # the size schedule from the next batch on
        self._cursor: Cursor | None = None
        self._plans: dict[int, BatchPlan] = {}  # the current mode's plans, from step taken on
        self._inflight: dict[int, InflightBatch] = {}  # their batches being answered, by step
        self._sealing = Sealing(buffers)  # complete, waiting for their buffer's seal
        self._rebuilds = Rebuilds(buffers, ledger)  # batches rebuilt from a manifest
        self._cutting = Cutting(config.world_size, ledger, affinity)  # batches into tasks
        wanted = config.lookahead and self._layout.stitch_k > 1
        self._lookahead = Lookahead(wanted, self._layout, handoff, self)
        # The epoch's deal (an elastic resume) as plain data for snapshots, or None.
        self._deal_state: dict[str, Any] | None = None

    @property
    def mode(self) -> str:
        """The mode of the next batch the trainer takes (the session's one record of it)."""
        return self._mode

    def servers_changed(
        self,
        ready: list[ServerLink],
        slots: int,
        task_bytes: int | None,
        stores: bool | None,
    ) -> None:
        """The ready servers are ``ready`` now (handlers.py), on ``slots`` tasks at once, at
        most ``task_bytes`` a task: the cut of the batches planned from now on
        (``Cutting.servers``); ``stores`` (None: not judged again): whether every server
        keeps a store of sources, which the lookahead needs."""
        self._cutting.servers(ready, slots, task_bytes)
        if stores is not None:
            self._lookahead.stores_kept(stores)

    def flips(self) -> dict[str, int]:
        """What the mode flips did (``Lookahead.flips``)."""
        return self._lookahead.flips.snapshot()

    def lookahead_state(self) -> LookaheadState | None:
        """The lookahead batch, if one is planned."""
        return self._lookahead.state()

    # ------------------------------------------------------------ tasks

    def batch_of(self, rec: TaskRecord) -> InflightBatch | None:
        """The batch a wanted task's images go to, while that batch is still planned and
        being answered."""
        batch = rec.batch
        if batch is self._lookahead.batch or self._inflight.get(batch.plan.step) is batch:
            return batch
        return batch if batch in self._rebuilds else None

    def destination(self, rec: TaskRecord) -> np.ndarray:
        """Where the images of a wanted task's answer are received: its slots of the batch
        buffer, or a scratch array (a probe's, slots that are not consecutive, a batch no
        longer planned)."""
        batch = self.batch_of(rec)
        if batch is None or not rec.consecutive:
            return np.empty((len(rec.slots), 3, *rec.sizes.out), np.uint8)
        first = rec.slots[0]
        return batch.array[first : first + len(rec.slots)]

    @property
    def planning_both_modes(self) -> bool:
        """Whether batches are planned in both modes now (the lookahead is active): their
        tasks ask the stores to keep what they decode (``Task.recent``), so the batch's twin
        decodes nothing again where a store admits only a subset of the dataset."""
        return self._lookahead.active

    def upcoming(self, count: int) -> tuple[tuple[int, int, int], np.ndarray]:
        """This rank's next ``count`` samples after the batches planned, in the plan's
        order (what its next tasks ask, exactly: the servers fetch their bytes ahead,
        ``Task.ahead``), and a mark that changes when they do: (epoch, plan version,
        shard position). No epoch: an empty array."""
        cursor = self._cursor
        if cursor is None:
            return (-1, -1, -1), np.empty(0, np.int64)
        start = cursor.position
        stop = min(len(cursor.shard), start + count)
        mark = (cursor.epoch, cursor.plan_version, start)
        if stop <= start:
            return mark, np.empty(0, np.int64)
        return mark, np.asarray(cursor.shard[start:stop], dtype=np.int64)

    def depth(self) -> int:
        """Batches planned beyond the trainer: ``prefetch``, less while the lookahead is
        armed (``Lookahead.depth``)."""
        return self._lookahead.depth(self._config.prefetch)

    # ------------------------------------------------------------ answers

    def on_result(self, rec: TaskRecord, result: Result) -> None:
        """A wanted task's RESULT (checked by the engine: one image per slot, the indices
        asked); its pixels are already in the batch buffer."""
        if rec.probe_of is not None:
            self._drop_poisoned(self._ledger.probe_done(rec, bad=False))
            return
        self._ledger.done(rec)
        batch = self.batch_of(rec)
        if batch is None:
            return
        batch.answer(rec.slots, result)
        self._maybe_finish(batch)

    def on_failure(
        self, rec: TaskRecord, kind: str, error: DataServerError, image: int | None = None
    ) -> None:
        """A wanted task's ERROR (a bad sample, a poison sample, a refused request).
        ``image``: for poison, which of the task's images was being composed."""
        skip = self._config.on_error == "skip"
        if kind == "poison" and rec.probe_of is None and len(rec.images) > 1:
            # One image of the run kills workers: the rest of the run is asked again, the
            # blame (or the skip) falls on that image alone. Without its number, every
            # image is run on its own.
            bad = self._ledger.split(rec, image)
            if bad is not None:
                self.on_failure(bad, kind, error)
            return
        if skip and kind == "poison" and rec.probe_of is None and len(rec.indices) > 1:
            self._ledger.probe(rec)  # still wanted: composed again once the probes say how
            return
        if rec.probe_of is not None:
            self._drop_poisoned(self._ledger.probe_done(rec, bad=kind in ("sample", "poison")))
            return
        self._ledger.done(rec)
        batch = self.batch_of(rec)
        if batch is None:
            return
        if skip and kind in ("sample", "poison"):
            batch.drop(rec.slots, rec.images)
            self._maybe_finish(batch)
            return
        self.fail_batch(batch, error)

    def _drop_poisoned(self, parent: TaskRecord | None) -> None:
        """Leave out a composed image that kills workers though each source is fine alone."""
        batch = self.batch_of(parent) if parent is not None else None
        if parent is None or batch is None:
            return
        batch.drop(parent.slots, parent.images)
        self._maybe_finish(batch)

    # ------------------------------------------------------------ batches

    def _maybe_finish(self, batch: InflightBatch) -> None:
        """Deliver a complete batch once its buffer seals (a late writer may be in it)."""
        if not batch.complete:
            return
        if batch in self._rebuilds:
            sealed = self._rebuilds.seal(batch)
        else:
            if batch is not self._lookahead.batch:
                del self._inflight[batch.plan.step]
            sealed = self._sealing.seal(batch)
            if not sealed and batch.raced:
                # The writer is a hedge's losing copy (hedging.py), as slow as the reason it
                # was hedged: deliver a copy of the pixels, not wait for it to finish.
                self._sealing.drop(lambda b: b is batch)
                self._buffers.give(batch.moved(self._buffers.take(tuple(batch.host.shape), False)))
                sealed = True
        if sealed:
            self._deliver(batch)

    def _deliver(self, batch: InflightBatch) -> None:
        manifest = manifest_of(batch, self._layout, self._config.on_error)
        self._route(batch, self._mover.deliver(batch, batch.plan.epoch, self._buffers, manifest))

    def _route(self, batch: InflightBatch, item: Delivery | DataServerError) -> None:
        """Where a finished batch (delivered or failed) goes: a rebuild's Future; else the
        lookahead, kept until a flip promotes it (the trainer gets an error only then) or
        the step passes; else the trainer."""
        if batch in self._rebuilds:
            self._rebuilds.finished(batch, item)
            return
        if batch is self._lookahead.batch:
            self._lookahead.finished(item)
            return
        step = batch.plan.step
        if self._inflight.get(step) is batch:  # (a failed batch; a delivered one is out)
            del self._inflight[step]
        self._handoff.put(step, batch.plan.plan_version, item)

    def retry_seals(self) -> None:
        """Deliver the complete batches whose buffers could not be sealed before."""
        for batch in [*self._rebuilds.sealed(), *self._sealing.sealed()]:
            self._deliver(batch)

    def fail_batch(self, batch: InflightBatch, error: DataServerError) -> None:
        self._ledger.forget(_of_batch(batch))
        self._buffers.give(batch.host)
        self._route(batch, error)

    def fill(self, deeper: int | None = None) -> bool:
        """Plan batches until ``prefetch`` are planned beyond what the trainer has taken;
        with lookahead, the next batch in the other mode right after the next batch.
        ``deeper``: plan at most that many batches beyond the next one, and say whether
        more are due (the engine sends each batch's tasks before it plans the next: a new
        batch's buffer may take milliseconds to reserve, which the first batch of an epoch
        should not wait for)."""
        cursor = self._cursor
        if cursor is None:
            return False
        taken = self._handoff.taken()
        ended = self._handoff.ended()
        for step in [s for s in self._plans if s < taken]:
            del self._plans[step]
        self._lookahead.moved_on(taken)
        while not ended and cursor.step <= taken:  # the next batch first
            ended = not self._plan_next(cursor)
        self._lookahead.plan_next(cursor, taken)
        # While the landing buffers are still fresh memory (a client's first batches), a
        # deeper batch waits until its tasks would find a slot: reserving its 12 MB buffer
        # takes milliseconds of CPU that the first batch, cut for every slot, needs.
        budget = -1 if deeper is None else deeper
        depth = self.depth()
        slots = max(self._cutting.share(), depth)
        while not ended and cursor.step - taken < depth:
            if len(self._ledger) >= slots and self._buffers.fresh():
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
        """The batch's buffer and tasks (``Cutting.cut``). ``batch``: one made already (a
        rebuild), else a new one under the current control values."""
        if batch is None:
            host = self._buffers.take((len(plan.images), 3, *plan.sizes.out))
            batch = InflightBatch(plan, host, self.control_seq, self.control)

        def key(j: int) -> int:  # (which server image j is for: ``Lookahead.key``)
            return self._lookahead.key(plan, j, self._cursor)

        self._cutting.cut(batch, plan, key, self.depth(), self.plan_version)
        return batch

    def mode_steered(self, changes: bool = True) -> bool:
        """The trainer steers the mode (``changes``: to another mode than the current one):
        whether the lookahead is armed now (lookahead.py)."""
        return self._lookahead.steered(changes)

    # ------------------------------------------------------------ asked by the lookahead

    def planned(self, step: int) -> BatchPlan | None:
        return self._plans.get(step)

    def discard(self, batch: InflightBatch) -> None:
        self._ledger.forget(_of_batch(batch), cancel=True)
        self._sealing.drop(lambda b: b is batch)
        self._buffers.give(batch.host)

    def withdraw(self, step: int, keep: InflightBatch | None) -> InflightBatch | None:
        old = self._inflight.pop(step, None)
        if old is None:
            old = next((b for b in self._sealing if b.plan.step == step and b is not keep), None)
        return old

    def drop_deeper(self, step: int) -> None:
        deeper = [self._inflight.pop(s) for s in [s for s in self._inflight if s > step]]
        deeper += self._sealing.drop(lambda b: b.plan.step > step)
        gone = set(map(id, deeper))
        self._ledger.forget(lambda r: id(r.batch) in gone, cancel=True)
        for batch in deeper:
            self._buffers.give(batch.host)
        for later in [s for s in self._plans if s > step]:
            del self._plans[later]

    def adopt(self, plan: BatchPlan, batch: InflightBatch | None) -> None:
        self._plans[plan.step] = plan
        if batch is not None and batch not in self._sealing:
            self._inflight[plan.step] = batch

    def switch(self, mode: str, step: int, position: int) -> None:
        assert self._cursor is not None
        self._mode = mode
        self._cursor.jump(step, position, mode)

    # ------------------------------------------------------------ commands

    def start_epoch(
        self,
        epoch: int,
        dataset_len: int,
        position: int = 0,
        step: int = 0,
        deal: Deal | None = None,
        planned: tuple[ShardLike, int] | None = None,
    ) -> int:
        """Begin ``epoch`` at shard ``position`` (batch ``step``); return the shard size.
        With ``deal`` (an elastic resume), the shard is this rank's share of it.
        ``planned``: ``epoch_shard``'s answer for the same arguments, computed beforehand
        (by the client, in the trainer's thread); None: computed here."""
        self._epoch = epoch
        self._lookahead.epoch_began(step)
        self.plan_version += 1
        self._drop_plans()
        self._cutting.new_epoch()
        shard, spare = planned or epoch_shard(self._config, dataset_len, epoch, deal)
        self._deal_state = None if deal is None else deal.to_state()
        self._cursor = Cursor(
            shard,
            self._layout,
            self._mode,
            self.plan_version,
            spare,
            epoch=epoch,
            seed=self._config.seed,
            sizes=self.sizes,
        )
        self._cursor.jump(step, position, self._mode)
        self._handoff.begin(step, self.plan_version)
        self._rebuilds.replan(self.plan_version, self.control_seq, self.plan_tasks)
        return len(shard)

    def flip(self, mode: str) -> bool:
        """Switch to ``mode`` from the next batch on by promoting the lookahead batch
        (``Lookahead.flip``). False when there is none for it: the caller then steers."""
        self.fill()  # the trainer may flip right after taking a batch: catch up first
        return self._cursor is not None and self._lookahead.flip(mode)

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
            self._lookahead.replanned()
        self._mode = mode
        if control is not None:
            self.control = {**self.control, **control}
            self.control_seq += 1
        if sizes is not None:
            # Sources stay stored at the size the schedule so far stored them at (or
            # larger): a new size is composed from what the stores hold, not decoded anew.
            self.sizes = sizes.stored_at(self.sizes.stored)
        if self._cursor is not None:
            taken = self._handoff.taken()
            self._handoff.drop_from(taken, self.plan_version)
            first = self._plans.get(taken)
            position = first.start if first is not None else self._cursor.position
            self._drop_plans()
            self._cursor.rewind(taken, position, mode, self.plan_version, self.sizes)
        self._rebuilds.replan(self.plan_version, self.control_seq, self.plan_tasks)
        return self.plan_version

    # ------------------------------------------------------------ rebuilds

    def rebuild(self, plan: BatchPlan, control: dict[str, Any], on_error: str) -> Future[Delivery]:
        """Plan a batch again from its manifest (``rebuild.plan_of``): composed with the
        manifest's control values, delivered to the Future this returns, never to the
        trainer's stream of batches."""
        plan = replace(plan, plan_version=self.plan_version)
        return self._rebuilds.start(plan, self.control_seq, control, on_error, self.plan_tasks)

    def abandon_rebuild(self, future: Future[Delivery]) -> None:
        """The trainer stopped waiting for a rebuild: drop its tasks and buffer."""
        self._rebuilds.abandon(future)

    def _drop_plans(self) -> None:
        sealing = self._sealing.drop(lambda b: True)
        for batch in [*self._inflight.values(), *sealing]:
            self._buffers.give(batch.host)
        alt = self._lookahead.reset()
        if alt is not None and all(alt is not b for b in sealing):
            self._buffers.give(alt.host)
        self._inflight.clear()
        self._plans.clear()
        self._ledger.clear()  # (batches being rebuilt are planned again by the caller)

    def position(self) -> Position:
        """The resumable position: the first batch the trainer has not taken (its position
        in this rank's share of the epoch's deal, when the epoch has one)."""
        taken = self._handoff.taken()
        cursor = self._cursor
        first = self._plans.get(taken)
        position = first.start if first is not None else cursor.position if cursor else 0
        return Position(
            epoch=self._epoch,
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

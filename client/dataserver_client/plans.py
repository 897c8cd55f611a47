"""The epoch side of the client's I/O thread: planning batches, finishing them, and the
commands that move the plan (start an epoch, steer, snapshot, restore).

A mixin of ``Engine`` (engine.py): the methods share the engine's state and run only in
its thread. Zero-stale steering lives in ``steer``: it bumps ``plan_version``, clears every
batch the trainer has not taken, and rewinds the planner to the first of them.
"""

from __future__ import annotations

import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from dataserver import protocol
from dataserver.protocol import MsgType
from dataserver_client.assembly import InflightBatch
from dataserver_client.errors import DataServerError
from dataserver_client.planner import Planner, TaskPlan, epoch_order, shard_of

if TYPE_CHECKING:
    from dataserver_client.link import ServerLink


@dataclass(eq=False)
class TaskRecord:
    """A task the client wants answered: where its result goes, and which server has it."""

    task_id: int
    step: int
    slot: int
    plan_version: int
    task: TaskPlan
    link: ServerLink | None = None
    exclude: tuple[int, ...] = ()  # sources to leave out (found to kill workers)
    probe_of: TaskRecord | None = None  # a one-source probe run for this stitched task
    probes_left: int = 0
    poisoned: list[int] = field(default_factory=list)


class EpochPlans:
    """Planned batches, their tasks, and the commands that change the plan."""

    # Engine state used here (see Engine.__init__).
    if TYPE_CHECKING:
        from dataserver_client.assembly import DeviceMover, HostBuffers
        from dataserver_client.config import ClientConfig
        from dataserver_client.engine import Handoff
        from dataserver_client.planner import Layout

        config: ClientConfig
        handoff: Handoff
        layout: Layout
        mover: DeviceMover
        buffers: HostBuffers
        links: list[ServerLink]
        session: bytes
        epoch: int
        mode: str
        plan_version: int
        control: dict[str, Any]
        control_seq: int
        planner: Planner | None
        inflight: dict[int, InflightBatch]
        plan_starts: dict[int, int]
        tasks: dict[int, TaskRecord]
        pending: deque[TaskRecord]
        next_task_id: int
        last_progress: float
        pub: Any

    def _maybe_finish(self, batch: InflightBatch) -> None:
        if not batch.complete:
            return
        step = batch.plan.step
        del self.inflight[step]
        delivery = self.mover.deliver(batch, self.epoch, self.buffers)
        with self.handoff.cond:
            self.handoff.ready[step] = delivery
            self.handoff.cond.notify_all()

    def _fail_batch(self, batch: InflightBatch, error: DataServerError) -> None:
        step = batch.plan.step
        self.inflight.pop(step, None)
        self._forget_tasks(lambda r: r.step == step)
        with self.handoff.cond:
            self.handoff.ready[step] = error
            self.handoff.cond.notify_all()

    def _forget_tasks(self, which: Callable[[TaskRecord], bool]) -> None:
        """Stop wanting some tasks; those already sent stay outstanding until answered."""
        for tid in [t for t, r in self.tasks.items() if which(r)]:
            del self.tasks[tid]
        self.pending = deque(r for r in self.pending if not which(r))

    def _probe(self, rec: TaskRecord) -> None:
        """A stitched task killed two workers and on_error is "skip": find which of its
        sources does it, one small probe task each, then compose it without them, so only
        the bad samples are left out (not their k - 1 neighbours)."""
        rec.probes_left = len(rec.task.indices)
        for index in rec.task.indices:
            probe = TaskRecord(
                self.next_task_id,
                rec.step,
                -1,
                rec.plan_version,
                TaskPlan((index,), 1, (8, 8)),
                probe_of=rec,
            )
            self.next_task_id += 1
            self.tasks[probe.task_id] = probe
            self.pending.appendleft(probe)

    def _probe_done(self, probe: TaskRecord, bad: bool) -> None:
        parent = probe.probe_of
        assert parent is not None
        if bad:
            parent.poisoned.extend(probe.task.indices)
        parent.probes_left -= 1
        if parent.probes_left == 0 and self.tasks.get(parent.task_id) is parent:
            parent.exclude = tuple(parent.poisoned)
            parent.link = None
            self.pending.appendleft(parent)

    def _fill(self) -> None:
        """Plan batches until ``prefetch`` are planned beyond what the trainer has taken."""
        planner = self.planner
        if planner is None or self.handoff.end_step is not None:
            return
        with self.handoff.cond:
            taken = self.handoff.taken
        for step in [s for s in self.plan_starts if s < taken]:
            del self.plan_starts[step]
        while planner.step - taken < self.config.prefetch:
            plan = planner.next_plan()
            if plan is None:
                with self.handoff.cond:
                    self.handoff.end_step = planner.step
                    self.handoff.cond.notify_all()
                return
            self.plan_starts[plan.step] = plan.start
            host = self.buffers.take((len(plan.tasks), 3, *plan.out_hw))
            self.inflight[plan.step] = InflightBatch(plan, host)
            for slot, task in enumerate(plan.tasks):
                rec = TaskRecord(self.next_task_id, plan.step, slot, plan.plan_version, task)
                self.next_task_id += 1
                self.tasks[rec.task_id] = rec
                self.pending.append(rec)

    def start_epoch(self, epoch: int, position: int = 0, step: int = 0) -> int:
        """Begin ``epoch`` at shard ``position`` (batch ``step``); return the shard size."""
        self.epoch = epoch
        self.plan_version += 1
        self._drop_plans()
        n = int(self.links[0].info["dataset_len"])
        order = epoch_order(n, self.config.seed, epoch, self.config.shuffle)
        shard = shard_of(order, self.config.rank, self.config.world_size, self.config.drop_last)
        self.planner = Planner(shard, self.layout, self.mode, self.plan_version)
        self.planner.position, self.planner.step = position, step
        with self.handoff.cond:
            self.handoff.ready.clear()
            self.handoff.taken = step
            self.handoff.end_step = None
            self.handoff.fatal = None
        self.last_progress = time.monotonic()
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
        header = {
            "session": self.session,
            "plan_version": self.plan_version,
            "control_seq": self.control_seq,
            "control": self.control,
            "mode": mode,
        }
        self.pub.send_multipart(protocol.make(MsgType.CONTROL, header))
        if self.planner is not None:
            with self.handoff.cond:
                taken = self.handoff.taken
                self.handoff.ready.clear()
                self.handoff.end_step = None
            position = self.plan_starts.get(taken, self.planner.position)
            self._drop_plans()
            self.planner.rewind(taken, position, mode, self.plan_version)
        return self.plan_version

    def _drop_plans(self) -> None:
        for batch in self.inflight.values():
            self.buffers.give(batch.host)
        self.inflight.clear()
        self.plan_starts.clear()
        self.tasks.clear()
        self.pending.clear()

    def snapshot(self) -> dict[str, Any]:
        """The resumable position: the first batch the trainer has not taken."""
        with self.handoff.cond:
            taken = self.handoff.taken
        planner = self.planner
        position = self.plan_starts.get(taken, planner.position) if planner else 0
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

"""The task ledger: every task the client still wants answered, the queue of those waiting
to be sent, and what was sent where.

A ``TaskRecord`` is in the ledger while its answer is still wanted. An answer is taken
when its task is still wanted under the same plan_version, from the server it was last
sent to or the one it was hedged to (``hedged``: a second copy while the first is slow;
the first answer of the two wins, ``settle``): results are deterministic, so a second
answer (after a task was asked again, or the other copy of a hedge) is dropped. Records are created, changed and dropped only here; the plan book says which
tasks a batch needs, the engine says where one was sent.

Poison probing lives here too: a stitched task that kills workers is split into one-source
probes, and composed again without the sources that kill (``probe``, ``probe_done``).
No sockets, no threads: the I/O thread is the only caller.
"""

from __future__ import annotations

import time
from collections import deque
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field, replace
from typing import TYPE_CHECKING

from dataserver.protocol.batchsizes import BatchSizes
from dataserver_client.session.inflight import InflightBatch

if TYPE_CHECKING:
    from dataserver_client.net.serverlink import ServerLink
    from dataserver_client.plan.affinity import Affinity

PROBE_HW = (8, 8)  # a probe composes one source into a tiny image: it only asks "does it kill?"
# A task a server cancelled, or left unanswered past the deadline, is not sent back to it for
# this long (others take it at once; alone, that server gets it again after the pause).
AVOID_S = 1.0


@dataclass(eq=False)
class TaskRecord:
    """A task the client wants answered: a run of images of one batch (their slots in it),
    and which server has it. Fields are written by ``TaskLedger`` only."""

    task_id: int
    batch: InflightBatch  # the batch its images go to
    slots: tuple[int, ...]  # the batch slots of its images, in order (-1: a probe's)
    images: tuple[tuple[int, ...], ...]  # each image's source indices, in cell order
    grid: int
    sizes: BatchSizes  # its batch's (a probe's: its output size PROBE_HW)
    plan_version: int
    link: ServerLink | None = None  # the server it was last sent to, or None
    land_gen: int | None = None  # the landing generation it was last sent to land with
    exclude: tuple[int, ...] = ()  # sources to leave out (found to kill workers)
    prefer: ServerLink | None = None  # the server whose store should hold its sources
    keys: tuple[int, ...] = ()  # its images' affinity keys (several servers)
    probe_of: TaskRecord | None = None  # a one-source probe run for this stitched task
    probes_left: int = 0
    poisoned: list[int] = field(default_factory=list)
    avoid: ServerLink | None = None  # a server that cancelled it or let it expire ...
    avoid_until: float = 0.0  # ... is not given it again before this (monotonic) time
    # Every server it was ever sent to: an answer from one of them is the task's answer
    # (results are deterministic), never a wrong one, even after it was asked again.
    had: tuple[ServerLink, ...] = ()
    hedge: ServerLink | None = None  # a second server it went to while ``link`` was slow
    probing: bool = False  # ... or: the copy ``hedge`` has probes a slow server's recovery

    def sent_to(self, link: ServerLink) -> bool:
        """Whether a copy of it is out with ``link`` (the last send, or its hedge)."""
        return link is self.link or link is self.hedge

    @property
    def step(self) -> int:
        return self.batch.plan.step

    @property
    def indices(self) -> tuple[int, ...]:
        return tuple(i for image in self.images for i in image)

    @property
    def consecutive(self) -> bool:
        """Whether its slots are one run of the batch (its images can be received, or
        landed, straight into the batch buffer)."""
        first = self.slots[0]
        return self.probe_of is None and self.slots == tuple(range(first, first + len(self.slots)))


class TaskLedger:
    """Wanted tasks by id, the send queue, and the cancels owed to servers."""

    def __init__(self) -> None:
        self._tasks: dict[int, TaskRecord] = {}
        self._pending: deque[TaskRecord] = deque()
        self._next_id = 1
        self._to_cancel: list[tuple[ServerLink, int]] = []  # sent, no longer wanted
        self.skipped_poison = 0  # composed images left out: every source fine alone

    # ------------------------------------------------------------ reading

    def __contains__(self, task_id: object) -> bool:
        return task_id in self._tasks

    def __len__(self) -> int:
        return len(self._tasks)

    def __iter__(self) -> Iterator[TaskRecord]:
        return iter(list(self._tasks.values()))

    def get(self, task_id: int) -> TaskRecord | None:
        return self._tasks.get(task_id)

    def wanted(self, task_id: int, plan_version: int | None) -> TaskRecord | None:
        """The record an answer is for, if it is still wanted under that plan."""
        rec = self._tasks.get(task_id)
        if rec is None or rec.plan_version != plan_version:
            return None
        return rec

    def waiting_from(self, rec: TaskRecord, link: ServerLink) -> bool:
        """Whether ``rec`` waits to be sent again (asked again, out with no server) and
        ``link`` had it before: its answer from ``link`` is still the one wanted (a dropped
        result connection asks again for what a server owes while that server's answers are
        on their way through its front)."""
        return rec.link is None and link in rec.had

    def records(self, task_ids: list[int]) -> list[TaskRecord]:
        return [self._tasks[t] for t in task_ids if t in self._tasks]

    @property
    def pending(self) -> int:
        """Tasks waiting to be sent (some may no longer be wanted)."""
        return len(self._pending)

    def is_wanted(self, rec: TaskRecord) -> bool:
        return self._tasks.get(rec.task_id) is rec

    # ------------------------------------------------------------ creating and dropping

    def add(
        self,
        batch: InflightBatch,
        slots: tuple[int, ...],
        images: tuple[tuple[int, ...], ...],
        grid: int,
        sizes: BatchSizes,
        plan_version: int,
        *,
        prefer: ServerLink | None = None,
        keys: tuple[int, ...] = (),
        probe_of: TaskRecord | None = None,
        queue: str = "last",
    ) -> TaskRecord:
        """A new wanted task, queued ``"last"``, ``"first"`` (at the head) or ``"no"`` (the
        caller settles it at once)."""
        rec = TaskRecord(
            self._next_id,
            batch,
            slots,
            images,
            grid,
            sizes,
            plan_version,
            prefer=prefer,
            keys=keys,
            probe_of=probe_of,
        )
        self._next_id += 1
        self._tasks[rec.task_id] = rec
        if queue == "first":
            self._pending.appendleft(rec)
        elif queue == "last":
            self._pending.append(rec)
        return rec

    def done(self, rec: TaskRecord) -> None:
        """``rec`` is answered: no longer wanted."""
        self._tasks.pop(rec.task_id, None)

    def forget(self, which: Callable[[TaskRecord], bool], cancel: bool = False) -> None:
        """Stop wanting some tasks; those already sent stay outstanding until answered
        (with ``cancel``, the servers are asked to drop them if still queued)."""
        for tid in [t for t, r in self._tasks.items() if which(r)]:
            rec = self._tasks.pop(tid)
            if cancel and rec.link is not None:
                self._to_cancel.append((rec.link, tid))
        self._pending = deque(r for r in self._pending if not which(r))

    def clear(self) -> None:
        """Want nothing (a new plan: every batch is planned again)."""
        self._tasks.clear()
        self._pending.clear()

    def take_cancels(self) -> list[tuple[ServerLink, int]]:
        """The (server, task id) pairs to cancel, once: the caller sends them."""
        out, self._to_cancel = self._to_cancel, []
        return out

    @property
    def cancels(self) -> bool:
        return bool(self._to_cancel)

    # ------------------------------------------------------------ sending

    def pop_pending(
        self, link: ServerLink | None, affinity: Affinity[ServerLink]
    ) -> TaskRecord | None:
        """The next task to send to ``link``, skipping those no longer wanted.

        With several servers: the first task that prefers ``link`` (its sources belong in
        that server's store); else the first whose sources no other server has begun on
        (it moves to ``link``, with every task sharing its samples: a server with free
        credit does not idle while such work waits). None: nothing ``link`` should take
        now: what is left belongs where its sources are (or are being decoded), and is
        composed there sooner than another server could decode them again."""
        pending = self._pending
        while pending and not self.is_wanted(pending[0]):
            pending.popleft()
        if not pending:
            return None
        head = pending[0]
        now = time.monotonic()
        if link is None or (
            (head.prefer is None or head.prefer is link) and not _avoids(head, link, now)
        ):
            return self._take(0, link, affinity)
        movable = None
        for j, rec in enumerate(pending):
            if not self.is_wanted(rec) or _avoids(rec, link, now):
                continue
            if rec.prefer is None or rec.prefer is link:
                return self._take(j, link, affinity)
            if movable is None and affinity.movable(rec.keys, link):
                movable = j
        if movable is not None:
            return self._take(movable, link, affinity)
        return None

    def _take(self, j: int, link: ServerLink | None, affinity: Affinity[ServerLink]) -> TaskRecord:
        rec = self._pending[j]
        del self._pending[j]
        if rec.keys and link is not None:
            affinity.claim(rec.keys, link)
            if rec.prefer is not link:  # it moved: so do the tasks that share its samples
                keys = set(rec.keys)
                for other in self._pending:
                    if other.prefer is not link and not keys.isdisjoint(other.keys):
                        other.prefer = link
                rec.prefer = link
        return rec

    def sent(self, rec: TaskRecord, link: ServerLink, land_gen: int | None) -> None:
        """``rec`` went to ``link`` (landing with generation ``land_gen``; None keeps the
        one of an earlier send, whose landed answer may still come)."""
        rec.link = link
        if link not in rec.had:
            rec.had = (*rec.had, link)
        if land_gen is not None:
            rec.land_gen = land_gen

    def hedged(self, rec: TaskRecord, link: ServerLink, probe: bool = False) -> None:
        """A second copy of ``rec`` went to ``link`` (its first is slow where it is; with
        ``probe``, ``link`` is a slow server whose answer time is measured on a copy): the
        answer of either is taken, the first to come (``settle``)."""
        rec.hedge, rec.probing = link, probe
        if link not in rec.had:  # (its answer, however late, is never a wrong one)
            rec.had = (*rec.had, link)

    def settle(self, rec: TaskRecord, link: ServerLink) -> bool:
        """``link``'s answer to ``rec`` is taken: the other copy of a hedged task is
        cancelled (a server that has not begun it drops it; one that has answers late and
        the answer is dropped). True when the answer was the hedge's."""
        if rec.hedge is None:
            return False
        won = link is rec.hedge
        other = rec.link if won else rec.hedge
        if other is not None and not (rec.probing and not won):  # (a probe answers, late)
            self._to_cancel.append((other, rec.task_id))
        return won

    def unsent(self, rec: TaskRecord) -> None:
        """A send of ``rec`` failed (the server was not connected after all): it goes back
        to the head of the queue."""
        self._pending.appendleft(rec)

    def ask_again(
        self,
        recs: list[TaskRecord],
        away_from: ServerLink | None = None,
        lost: ServerLink | None = None,
    ) -> int:
        """Put still-wanted tasks at the head of the queue, in plan order; how many.
        ``away_from``: the server that cancelled them or let them expire: they lose their
        affinity to it (any server takes them) and it is not given them again for
        ``AVOID_S`` (a server cancelling all it gets would otherwise get the same tasks
        again at once, tens of thousands of times a second). ``lost`` (or ``away_from``):
        the server whose copy is gone; a hedged task whose other copy is still out waits
        for that one instead (its copy with the server gone is dropped when it comes)."""
        gone = away_from if away_from is not None else lost
        until = time.monotonic() + AVOID_S
        wanted: list[TaskRecord] = []
        for rec in recs:
            if not self.is_wanted(rec):
                continue
            if gone is not None and rec.hedge is not None and rec.sent_to(gone):
                rec.link = rec.hedge if rec.link is gone else rec.link
                rec.hedge, rec.probing = None, False
                rec.avoid, rec.avoid_until = gone, until  # (its late answer: dropped as late)
                continue
            wanted.append(rec)
        again = sorted(wanted, key=lambda r: (r.step, r.slots[0]))
        for rec in reversed(again):
            rec.link = None
            rec.hedge, rec.probing = None, False
            if away_from is not None:
                rec.prefer = None
                rec.avoid, rec.avoid_until = away_from, until
            self._pending.appendleft(rec)
        return len(again)

    def unprefer(self, live: set[ServerLink]) -> None:
        """Servers not in ``live`` are gone: their waiting tasks go to anyone."""
        for rec in self._pending:
            if rec.prefer is not None and rec.prefer not in live:
                rec.prefer = None

    # ------------------------------------------------------------ poison

    def split(self, rec: TaskRecord, image: int | None) -> TaskRecord | None:
        """One image of ``rec``'s run kills workers: the rest of the run is asked again and
        the image alone is returned, for the caller to blame (or skip). Without a valid
        image number, every image is asked again on its own (None)."""
        self.done(rec)
        pairs = list(zip(rec.slots, rec.images, strict=True))
        batch, grid, sizes, version = rec.batch, rec.grid, rec.sizes, rec.plan_version
        if image is None or not 0 <= image < len(pairs):
            for slot, one in reversed(pairs):
                self.add(batch, (slot,), (one,), grid, sizes, version, queue="first")
            return None
        rest = pairs[:image] + pairs[image + 1 :]
        if rest:
            slots = tuple(slot for slot, _ in rest)
            images = tuple(one for _, one in rest)
            self.add(batch, slots, images, grid, sizes, version, queue="first")
        slot, one = pairs[image]
        return self.add(batch, (slot,), (one,), grid, sizes, version, queue="no")

    def probe(self, rec: TaskRecord) -> None:
        """A stitched task killed two workers and on_error is "skip": find which of its
        sources does it, one small probe task each, then compose it without them, so only
        the bad samples are left out (not their k - 1 neighbours). ``rec`` stays wanted.
        A task being probed already is left as it is: this is a second poison answer for it,
        from a copy asked again while its workers died (the first started the probes)."""
        if rec.probes_left > 0:
            return
        rec.probes_left = len(rec.indices)
        rec.poisoned.clear()
        for index in rec.indices:
            self.add(
                rec.batch,
                (-1,),
                ((index,),),
                1,
                replace(rec.sizes, out=PROBE_HW),
                rec.plan_version,
                probe_of=rec,
                queue="first",
            )

    def probe_done(self, probe: TaskRecord, bad: bool) -> TaskRecord | None:
        """A probe's answer (``bad``: its source kills). Returns the parent task when every
        source was fine alone, yet together they kill workers: the composed image itself is
        the poison, to be left out by the caller (it is no longer wanted here)."""
        self.done(probe)
        parent = probe.probe_of
        if parent is None:
            return None
        if bad:
            parent.poisoned.extend(probe.indices)
        parent.probes_left -= 1
        if parent.probes_left > 0 or not self.is_wanted(parent):
            return None
        if parent.poisoned:
            # Asked again as a new task (a new id), so that a late answer to any earlier
            # send of the parent (one asked again, still running) cannot be taken for it.
            self.done(parent)
            again = self.add(
                parent.batch, parent.slots, parent.images, parent.grid, parent.sizes,
                parent.plan_version, keys=parent.keys, queue="first",
            )  # fmt: skip
            again.exclude = tuple(dict.fromkeys(parent.poisoned))
            return None
        self.done(parent)
        self.skipped_poison += 1
        return parent


def _avoids(rec: TaskRecord, link: ServerLink, now: float) -> bool:
    """Whether ``link`` must not be given ``rec`` now (``TaskLedger.ask_again``)."""
    return rec.avoid is link and now < rec.avoid_until

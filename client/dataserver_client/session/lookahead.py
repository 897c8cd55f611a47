"""The lookahead and mode flips: the next batch planned in the other mode too, so that a mode
flip is served by a batch that was ready before it (zero-stall flips), the rule that decides
which trainers get it, and what a flip does. Everything that happens on a mode flip is here;
the plan book (book.py) owns the plans and batches and is asked through ``PlanBookView``.

A lookahead batch costs a composition of every batch in the other mode (never a decode: its
sources are the ones the servers' stores hold or are decoding anyway) and keeps the depth
at 2 (a flip throws the deeper batches of the old mode away). Worth it for a trainer that
steers the mode often (Stitcher's feedback, every step); a waste for one that steers it once
or twice (mosaic from the start, close-mosaic): one ``set_mode("regular")`` left every later
batch composed twice and at depth 2 (0.22 of a client that never steered, 1.85 images
composed per image delivered). So the lookahead is *armed* only by steering at a rate
(``SteerRate``): a second mode steer within ``ARM_WINDOW`` batches of the one before it
(a change of mode before the client's first batch, mosaic from the start, is the mode it
starts in and does not count); and it disarms after ``IDLE_WINDOW`` batches with no mode
steer. A trainer
that steers rarely pays one replanned batch a steer, and nothing after.

A flip (``Lookahead.flip``) promotes the lookahead batch to be the next batch (ready at once
when it is complete), keeps the batch it replaces as the new lookahead (a flip back promotes
it again), and drops the deeper batches of the old mode, cancelling their tasks by id. With
no lookahead batch for the next step in that mode, the flip is a steer (book.py: everything
not taken planned again, counted as ``replanned``).
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import TYPE_CHECKING, Protocol

from dataserver.counting import Counts
from dataserver_client.counts import Flip
from dataserver_client.errors import DataServerError
from dataserver_client.plan.epoch import REGULAR, STITCH, BatchPlan, Cursor, Layout
from dataserver_client.session.inflight import Delivery, InflightBatch

if TYPE_CHECKING:
    from dataserver_client.buffers.handoff import Handoff

log = logging.getLogger("dataserver_client")

Finished = Delivery | DataServerError

# Two mode steers at most this many batches apart arm the lookahead: a trainer calling
# feedback() or set_mode() every step arms it at its second call.
ARM_WINDOW = 16
# No mode steer for this many batches: disarmed again.
IDLE_WINDOW = 64


@dataclass(frozen=True)
class LookaheadState:
    """The lookahead batch: its step, its mode and whether it is finished."""

    step: int
    mode: str
    ready: bool


class SteerRate:
    """Whether the trainer steers the mode often enough for the lookahead (module doc). Its
    clock is the batches the trainer has taken over the client's life (epochs end to end):
    it is told each mode steer's time, and asked at each planning pass."""

    def __init__(self) -> None:
        self._last: int | None = None
        self.armed = False

    def steered(self, now: int) -> bool:
        """A mode steer (``feedback``/``set_mode``, changing the mode or not) when the
        trainer has taken ``now`` batches. Returns whether the lookahead is armed now."""
        last, self._last = self._last, now
        if last is not None and now - last <= ARM_WINDOW:
            self.armed = True
        return self.armed

    def idle(self, now: int) -> bool:
        """True once, when an armed trainer has stopped steering: no mode steer for
        ``IDLE_WINDOW`` batches (the caller then drops the lookahead batch, and the depth
        is ``prefetch`` again)."""
        if not self.armed or self._last is None or now - self._last < IDLE_WINDOW:
            return False
        self.armed = False
        return True


class PlanBookView(Protocol):
    """What the lookahead asks of the plan book (book.py), which owns the session's mode, the
    current mode's plans and the batches being answered or sealed."""

    @property
    def mode(self) -> str: ...

    def planned(self, step: int) -> BatchPlan | None:
        """The current mode's plan of batch ``step``, if planned."""
        ...

    def plan_tasks(self, plan: BatchPlan) -> InflightBatch:
        """A new batch for ``plan``, its tasks in the ledger."""
        ...

    def discard(self, batch: InflightBatch) -> None:
        """Forget ``batch``: its tasks (cancelled on the servers), its buffer."""
        ...

    def withdraw(self, step: int, keep: InflightBatch | None) -> InflightBatch | None:
        """Take the current mode's batch ``step`` (not ``keep``) out of the trainer's way, at
        whatever stage it is (being answered or sealed)."""
        ...

    def drop_deeper(self, step: int) -> None:
        """Forget the batches after ``step`` (their tasks cancelled on the servers)."""
        ...

    def adopt(self, plan: BatchPlan, batch: InflightBatch | None) -> None:
        """``plan`` is the plan of its step now, ``batch`` (if any) its batch in flight."""
        ...

    def switch(self, mode: str, step: int, position: int) -> None:
        """The session's mode is ``mode``; the next batch planned is ``step`` at
        ``position``."""
        ...


class Lookahead:
    """Batch ``taken`` planned in the other mode: its plan, its batch while being answered
    or sealed, its result once finished; and what a flip does with it. Off unless
    ``enabled`` (the config asks for it and the servers keep stores: ``stores_kept``) and
    armed by ``rate`` (the trainer steers the mode often). ``flips`` counts what the flips
    did (``counts.Flip``)."""

    def __init__(
        self, wanted: bool, layout: Layout, handoff: Handoff[Delivery], plans: PlanBookView
    ) -> None:
        self._wanted = wanted  # the config asks for it, and the layout stitches
        self.enabled = wanted
        self.rate = SteerRate()
        self.flips = Counts(Flip, shown=Flip)
        self._layout = layout
        self._handoff = handoff
        self._book = plans
        self._plan: BatchPlan | None = None
        self._batch: InflightBatch | None = None
        self._ready: Finished | None = None
        self._tried: tuple[int, int, str] | None = None
        # Batches taken in the epochs before this one, and the step this one began at: the
        # clock of ``rate`` (batches taken over the client's life) is their sum with taken.
        self._clock = 0
        self._began_at = 0

    @property
    def armed(self) -> bool:
        return self.rate.armed

    @property
    def active(self) -> bool:
        return self.enabled and self.rate.armed

    @property
    def plan(self) -> BatchPlan | None:
        return self._plan

    @property
    def batch(self) -> InflightBatch | None:
        return self._batch

    @property
    def ready(self) -> Finished | None:
        return self._ready

    def state(self) -> LookaheadState | None:
        if self._plan is None:
            return None
        return LookaheadState(self._plan.step, self._plan.mode, self._ready is not None)

    # ------------------------------------------------------------ the trainer's steers

    def steered(self, changes: bool = True) -> bool:
        """The trainer steers the mode (``feedback``/``set_mode``; ``changes``: to another
        mode), before the next batch it takes: whether the lookahead is armed now (it steers
        often). One that steers once or twice pays nothing for the lookahead. A change
        before the client's first batch picks the mode it starts in (mosaic from the
        start): configuration, not steering, so it is not counted."""
        now = self._clock + self._handoff.taken()
        if changes and now == 0:
            return self.rate.armed
        return self.rate.steered(now)

    def epoch_began(self, step: int) -> None:
        """A new epoch begins at batch ``step`` (called before the handoff begins it): the
        batches taken in the one before go on the clock."""
        self._clock += max(0, self._handoff.taken() - self._began_at)
        self._began_at = step

    def replanned(self) -> None:
        """A mode flip with no lookahead batch to serve it: everything was planned again."""
        self.flips.count(Flip.REPLANNED)

    def stores_kept(self, kept: bool) -> None:
        """Whether every server keeps a store of the sources it decoded (``serve
        --cache-gb``): the lookahead composes the next batch in both modes from the same
        sources, worth it only where they are kept (without a store, it would decode them
        twice). Off, it drops its batch and flips replan (zero stale either way)."""
        if not self._wanted or kept == self.enabled:
            return
        if not kept:
            log.info("a server keeps no store of sources (--cache-gb 0): lookahead is off")
        self.enabled = kept
        if not kept and self._plan is not None:
            self.drop()

    def depth(self, prefetch: int) -> int:
        """Batches planned beyond the trainer: ``prefetch``, but at most 2 while the trainer
        steers the mode often (armed). A flip throws away every batch prepared in the old
        mode (and, without a store, what the workers hold: ``--only feedback``, 20% of steps
        flipped, 30-45 extra decodes a flip at depth 4, 24-25 at depth 2), and the batch
        prepared in the other mode (the lookahead, planned again at every step) queues
        behind those already sent: at depth 4 it was ready at 3 of 13 flips of a 60 ms
        step."""
        if self.armed:
            return min(prefetch, 2)
        return prefetch

    def key(self, plan: BatchPlan, j: int, cursor: Cursor | None) -> int:
        """The key that picks the server for image ``j`` of ``plan``: while active, the
        first sample of its group of k shard positions (one stitched image's worth), so the
        samples that one flip may stitch together are decoded into one server's store; else
        its first sample (the same server every epoch: cross-epoch cache hits)."""
        first = plan.images[j].indices[0]
        if not self.active or cursor is None:
            return first
        k = self._layout.stitch_k
        position = plan.start + j * self._layout.samples_per_image(plan.mode)
        return int(cursor.shard[position - position % k])

    # ------------------------------------------------------------ planning

    def moved_on(self, taken: int) -> None:
        """The book's planning pass, before it plans the next batch: drop the lookahead
        batch once the trainer took its step as it was, or stopped steering (full depth
        again)."""
        idle = self.rate.idle(self._clock + taken)
        if self._plan is not None and (idle or self._plan.step != taken):
            self.drop()

    def plan_next(self, cursor: Cursor, taken: int) -> None:
        """While active, plan batch ``taken`` in the other mode, from the same shard
        position as the current mode's (the same samples)."""
        if not self.active or self._plan is not None:
            return
        primary = self._book.planned(taken)
        if primary is not None:
            start = primary.start
        elif cursor.step == taken:  # the current mode has no batch left there; the other may
            start = cursor.position
        else:
            return
        other = STITCH if self._book.mode == REGULAR else REGULAR
        if self._tried == (taken, start, other):
            return  # tried already: the shard has too few samples left for it
        self._tried = (taken, start, other)
        plan = cursor.plan_at(taken, start, other)
        if plan is None:
            return
        self._hold(plan, self._book.plan_tasks(plan), None)

    def finished(self, item: Finished) -> None:
        """Its batch is done (delivered or failed): kept until a flip promotes it (the
        trainer gets an error only then) or the step passes."""
        self._batch, self._ready = None, item

    def drop(self) -> None:
        """Forget the lookahead batch: its tasks (cancelled on the servers), its buffer."""
        if self._batch is not None:
            self._book.discard(self._batch)
        self._hold(None, None, None)

    def reset(self) -> InflightBatch | None:
        """Nothing planned, nothing tried (a new plan: the book drops every batch and gives
        their buffers back). Returns the batch it held, whose buffer the caller gives."""
        batch = self._batch
        self._hold(None, None, None)
        self._tried = None
        return batch

    # ------------------------------------------------------------ flips

    def flip(self, mode: str) -> bool:
        """Switch to ``mode`` from the next batch on by promoting the lookahead batch, which
        is that batch in that mode (ready at once when complete). False when there is no
        such batch: the caller then steers, planning everything again. The book has caught
        up with the trainer (planned) before."""
        promoted = self._plan
        if promoted is None or promoted.mode != mode or mode == self._book.mode:
            return False
        taken = self._handoff.taken()
        primary = self._book.planned(taken)
        if promoted.step != taken or (primary is not None and primary.start != promoted.start):
            return False
        old_ready = self._handoff.drop_from(taken)  # (the deeper batches of the old mode too)
        # The old mode's batch ``taken``, at whatever stage it is, becomes the lookahead.
        old = self._book.withdraw(taken, self._batch)
        self._book.drop_deeper(taken)
        new, new_ready = self._batch, self._ready
        self._hold(primary, old, old_ready)
        self._book.adopt(promoted, new if new_ready is None else None)
        self.flips.count(Flip.PROMOTED)
        if new_ready is not None:
            self.flips.count(Flip.PROMOTED_READY)
            self._handoff.put(taken, promoted.plan_version, new_ready)
        self._book.switch(mode, taken + 1, promoted.stop)
        return True

    def _hold(
        self, plan: BatchPlan | None, batch: InflightBatch | None, ready: Finished | None
    ) -> None:
        self._plan, self._batch, self._ready = plan, batch, ready

"""The lookahead: the next batch planned in the other mode too, so that a mode flip is served
by a batch that was ready before it (zero-stall flips), and the rule that decides which
trainers get it.

A lookahead batch costs a composition of every batch in the other mode (never a decode: its
sources are the ones the servers' stores hold or are decoding anyway) and keeps the depth
at 2 (a flip throws the deeper batches of the old mode away). Worth it for a trainer that
steers the mode often (Stitcher's feedback, every step); a waste for one that steers it once
or twice (mosaic from the start, close-mosaic): one ``set_mode("regular")`` left every later
batch composed twice and at depth 2 (0.22 of a client that never steered, 1.85 images
composed per image delivered). So the lookahead is *armed* only by steering at a rate
(``SteerRate``): a second mode steer within ``ARM_WINDOW`` batches of the one before it; and
it disarms after ``IDLE_WINDOW`` batches with no mode steer. A trainer
that steers rarely pays one replanned batch a steer, and nothing after.
"""

from __future__ import annotations

from dataclasses import dataclass

from dataserver_client.assembly import Delivery, InflightBatch
from dataserver_client.epoch import BatchPlan
from dataserver_client.errors import DataServerError

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


class Lookahead:
    """Batch ``taken`` planned in the other mode: its plan, its batch while being answered
    or sealed, its result once finished. Off unless ``enabled`` (the config asks for it and
    the servers keep stores) and armed by ``rate`` (the trainer steers the mode often).
    ``flips`` counts what the flips did: promoted (served by the lookahead batch),
    promoted_ready (it was complete already), replanned (no lookahead batch: planned
    again)."""

    def __init__(self, enabled: bool) -> None:
        self.enabled = enabled
        self.rate = SteerRate()
        self.flips = {"promoted": 0, "promoted_ready": 0, "replanned": 0}
        self._plan: BatchPlan | None = None
        self._batch: InflightBatch | None = None
        self._ready: Finished | None = None
        self._tried: tuple[int, int, str] | None = None

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

    def enable(self, on: bool) -> None:
        self.enabled = on

    def first_try(self, key: tuple[int, int, str]) -> bool:
        """False when ``key`` (step, start, mode) was tried already: the shard has too few
        samples left for it."""
        if self._tried == key:
            return False
        self._tried = key
        return True

    def hold(
        self, plan: BatchPlan | None, batch: InflightBatch | None, ready: Finished | None
    ) -> None:
        self._plan, self._batch, self._ready = plan, batch, ready

    def finished(self, item: Finished) -> None:
        """Its batch is done (delivered or failed): kept until a flip promotes it."""
        self._batch, self._ready = None, item

    def reset(self) -> None:
        """Nothing planned, nothing tried (a new plan)."""
        self.hold(None, None, None)
        self._tried = None

    def state(self) -> LookaheadState | None:
        if self._plan is None:
            return None
        return LookaheadState(self._plan.step, self._plan.mode, self._ready is not None)

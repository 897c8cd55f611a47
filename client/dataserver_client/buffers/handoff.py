"""The hand-off between the client's I/O thread and the trainer's thread: finished batches
by step, the epoch's end once known, and the error that stopped the I/O thread.

The only object both threads touch. Every field is private and guarded by ``_cond``; the
I/O thread changes it through ``begin``, ``put``, ``drop_from``, ``end_at`` and ``fail``,
the trainer through ``take``. Only batches of the current plan are ever held: ``put``
refuses a batch planned under another plan version, or for a step already taken, so a
steer (``drop_from`` with the new version) can never be undone by a late delivery.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from typing import Generic, TypeVar

from dataserver_client.errors import DataServerError

T = TypeVar("T")
WAIT_S = 0.25  # how often a waiting trainer looks at the I/O thread's health


class Stuck(DataServerError):
    """No batch came for longer than the backstop although the I/O thread is alive."""


class Handoff(Generic[T]):
    """Finished batches (``T``, or the ``DataServerError`` that replaced one), by step."""

    def __init__(self) -> None:
        self._cond = threading.Condition()
        self._ready: dict[int, T | DataServerError] = {}  # guarded by _cond
        self._taken = 0  # steps handed to the trainer in this epoch; guarded by _cond
        self._end: int | None = None  # the epoch's last step + 1, once planned
        self._fatal: BaseException | None = None  # why the I/O thread cannot go on
        self._version = 0  # the plan version whose batches are accepted

    # ------------------------------------------------------------ the I/O thread

    def begin(self, step: int, version: int) -> None:
        """A new epoch (or a resumed one) starts at ``step`` under plan ``version``."""
        with self._cond:
            self._ready.clear()
            self._taken = step
            self._end = None
            self._fatal = None
            self._version = version

    def put(self, step: int, version: int, item: T | DataServerError) -> bool:
        """Hand batch ``step`` of plan ``version`` (or its error) to the trainer. False, and
        nothing kept, when that plan was superseded or the step was taken already."""
        with self._cond:
            if version != self._version or step < self._taken:
                return False
            self._ready[step] = item
            self._cond.notify_all()
            return True

    def drop_from(self, step: int, version: int | None = None) -> T | DataServerError | None:
        """Forget every batch from ``step`` on and the epoch's end (they are planned again);
        with ``version``, accept only that plan's batches from now on. Returns what was
        ready for ``step`` (a mode flip keeps it as the lookahead)."""
        with self._cond:
            first = self._ready.pop(step, None)
            for later in [s for s in self._ready if s > step]:
                del self._ready[later]
            self._end = None
            if version is not None:
                self._version = version
            return first

    def end_at(self, step: int) -> None:
        """The epoch has no batch ``step``: a trainer that reaches it stops."""
        with self._cond:
            self._end = step
            self._cond.notify_all()

    def fail(self, error: BaseException) -> None:
        """Stop the trainer with ``error`` (the first one given is kept)."""
        with self._cond:
            if self._fatal is None:
                self._fatal = error
            self._cond.notify_all()

    # ------------------------------------------------------------ either thread

    def taken(self) -> int:
        """Steps the trainer has taken in this epoch."""
        with self._cond:
            return self._taken

    def ended(self) -> bool:
        with self._cond:
            return self._end is not None

    def fatal(self) -> BaseException | None:
        with self._cond:
            return self._fatal

    def dead_error(self) -> DataServerError:
        """The error to raise once the I/O thread has stopped: its reason, as a
        ``DataServerError``."""
        cause = self.fatal()
        if isinstance(cause, DataServerError):
            return cause
        err = DataServerError(
            f"the client's I/O thread has stopped: {cause!r}" if cause else "the client is closed"
        )
        err.__cause__ = cause
        return err

    # ------------------------------------------------------------ the trainer

    def take(self, timeout: float, alive: Callable[[], bool]) -> T | DataServerError:
        """The next batch (or the error that replaced it), waiting for it. Raises
        ``StopIteration`` at the epoch's end, the I/O thread's error once it failed or
        stopped (``alive()`` false), and ``Stuck`` after ``timeout`` seconds with neither."""
        last = time.monotonic()
        with self._cond:
            while True:
                if self._fatal is not None:
                    raise self._fatal
                item = self._ready.pop(self._taken, None)
                if item is not None:
                    self._taken += 1
                    return item
                if self._end is not None and self._taken >= self._end:
                    raise StopIteration
                if not alive():
                    raise self.dead_error()  # (``_cond`` holds an RLock: re-entered safely)
                if time.monotonic() - last > timeout:
                    raise Stuck(f"no batch for {timeout:g} s (the I/O thread is stuck)")
                self._cond.wait(WAIT_S)

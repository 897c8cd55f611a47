"""A worker's control states: what each session told its dataset, kept apart.

A dataset's ``set_control(values)`` changes the dataset object itself, and one worker serves
every session of its server. If the worker applied each session's values to one shared
object, a sample would depend on whatever session last spoke (two jobs with a merge-style
``set_control`` got each other's pixels). So a sample is built by a dataset object whose
state is a function of its own session's values only:

- a session that never set values (control_seq 0) uses the dataset as built, never given
  any values (the *pristine* object);
- a session at values V uses an object made from the pristine one (``copy.deepcopy``, or,
  for a dataset that cannot be copied, a new one built from its spec) and then given
  ``set_control(V)`` once. V is the session's whole control state (the client merges
  ``control(**values)`` calls and sends the result), so that object is "the dataset as
  built, told V": the known start the issue asks for, whatever other sessions did.

Objects are keyed by the digest of V (two sessions with equal values share one); each costs
one copy of the dataset object in this worker. A session holds at most ``per_session`` of
them (its newest values, and the ones before for tasks still in flight): its next values
evict its own oldest, never another session's (a job calling ``control(v=step % 5)`` before
every batch evicted every other job's state, and made each of their tasks copy the dataset
again: 5.3x slower). At most ``keep`` in all: beyond, the least recently used object of a
session that holds more than one goes first. The copies a session causes are charged to it
in the front's fair queue (the worker time of its tasks, ``Scheduler.charge``). A dataset
without ``set_control`` is used as built for everyone, and copied never.

Values arrive once per change (CONTROL, forwarded by the front before a task that needs
them) and are remembered for the last ``sessions`` sessions; a task of a session whose
values this worker no longer has is answered ``control_missing``, and the front sends the
values again before it reruns the task (``routing.py``).
"""

from __future__ import annotations

import copy
import logging
from collections import OrderedDict
from collections.abc import Callable
from typing import Any

from dataserver.protocol import control_digest

log = logging.getLogger("dataserver.worker")

STATES_KEPT = 8
STATES_PER_SESSION = 2
SESSIONS_KEPT = 1024


def control_key(values: dict[str, Any]) -> str:
    """What identifies a set of control values (in store keys and here): their
    ``control_digest`` in hex (128 bits: another job's values must not name the same store
    entries)."""
    return control_digest(values).hex()


class ControlMissing(LookupError):
    """A task names control values this worker does not have (never came, or forgotten)."""


class ControlStates:
    """The dataset objects of one worker, one per control state in use."""

    def __init__(
        self,
        pristine: Any,
        fresh: Callable[[], Any] | None = None,
        keep: int = STATES_KEPT,
        sessions: int = SESSIONS_KEPT,
        per_session: int = STATES_PER_SESSION,
    ) -> None:
        self.pristine = pristine
        self._fresh = fresh
        self.keep = keep
        self.per_session = per_session
        self.sessions = sessions
        self.steerable = callable(getattr(pristine, "set_control", None))
        # A dataset with ``augment`` is told the values in its params, steerable or not.
        self.wants_values = self.steerable or callable(getattr(pristine, "augment", None))
        self._values: OrderedDict[bytes, tuple[int, dict[str, Any]]] = OrderedDict()
        self._states: OrderedDict[str, Any] = OrderedDict()
        self._holders: dict[str, set[bytes]] = {}  # state key -> sessions using it
        self._held: dict[bytes, OrderedDict[str, None]] = {}  # session -> its keys, LRU first
        self.made = 0  # dataset objects made for a control state (copies or rebuilds)

    def learn(self, session: bytes, control_seq: int, values: dict[str, Any]) -> None:
        """Session ``session``'s values as of ``control_seq``."""
        self._values[session] = (control_seq, values)
        self._values.move_to_end(session)
        while len(self._values) > self.sessions:
            self._values.popitem(last=False)

    def forget(self, session: bytes) -> None:
        self._values.pop(session, None)
        for key in list(self._held.get(session, ())):
            self._release(session, key)

    def for_task(
        self, session: bytes, control_seq: int, inline: dict[str, Any] | None = None
    ) -> tuple[Any, str, dict[str, Any]]:
        """(dataset object, control key, the values) for a task of ``session`` at
        ``control_seq``, or with its own values ``inline`` (a rebuilt batch). Raises
        ``ControlMissing`` when this worker lacks those values, and whatever the dataset's
        ``set_control`` raises."""
        if not self.wants_values:
            return self.pristine, "", {}
        values = inline if inline is not None else self._values_of(session, control_seq)
        if not self.steerable:
            return self.pristine, "", values
        key = control_key(values)
        if not values:
            return self.pristine, key, values
        state = self._states.get(key)
        if state is None:
            state = self._make()
            state.set_control(dict(values))
            self._states[key] = state
        else:
            self._states.move_to_end(key)
        self._hold(session, key)
        return state, key, values

    def _hold(self, session: bytes, key: str) -> None:
        """``session`` uses the state ``key``: its newest; its oldest beyond
        ``per_session`` are let go, then, beyond ``keep`` in all, others'."""
        held = self._held.setdefault(session, OrderedDict())
        held[key] = None
        held.move_to_end(key)
        self._holders.setdefault(key, set()).add(session)
        while len(held) > self.per_session:
            self._release(session, next(iter(held)))
        while len(self._states) > self.keep:
            victim = self._victim(key)
            if victim is None:
                break
            for holder in list(self._holders.get(victim, ())):
                self._release(holder, victim)
            self._states.pop(victim, None)

    def _victim(self, keep: str) -> str | None:
        """The state to evict beyond ``keep`` states (not ``keep``, the one just used): the
        least recently used one whose sessions all hold another, else the least recently
        used one."""
        others = [k for k in self._states if k != keep]
        for k in others:
            if all(len(self._held.get(s, ())) > 1 for s in self._holders.get(k, ())):
                return k
        return others[0] if others else None

    def _release(self, session: bytes, key: str) -> None:
        """``session`` no longer holds ``key``; a state nobody holds is dropped."""
        held = self._held.get(session)
        if held is not None:
            held.pop(key, None)
            if not held:
                del self._held[session]
        holders = self._holders.get(key)
        if holders is not None:
            holders.discard(session)
            if not holders:
                del self._holders[key]
                self._states.pop(key, None)

    def _values_of(self, session: bytes, control_seq: int) -> dict[str, Any]:
        if control_seq == 0:
            return {}
        known = self._values.get(session)
        if known is None or known[0] != control_seq:
            raise ControlMissing(f"control values {control_seq} of this session are not here")
        self._values.move_to_end(session)
        return known[1]

    def _make(self) -> Any:
        """A dataset object in the state the pristine one was built in."""
        self.made += 1
        try:
            return copy.deepcopy(self.pristine)
        except Exception as exc:
            if self._fresh is None:
                raise
            log.info("dataset cannot be copied (%s); building one per control state", exc)
            return self._fresh()

"""What every receive loop here shares: the shutdown idiom, and a guard that makes one bad
message cost only itself.

Shutdown (pyzmq's devices' idiom, used by the front, the workers and the client's I/O
thread alike): a loop runs until its stop flag is set, every wait in it has a timeout so
the flag is seen; ``is_shutdown`` names the one family of ZeroMQ errors that means "the
context is going away" and the loop swallows exactly those in one place; ``finally``
closes the sockets the loop's own thread created. ``serve`` is that loop, for the server's
processes (the front and each worker).

``MessageGuard.run`` calls a message's handler; any exception other than a shutdown is
counted (``internal()``: its owner's ``internal`` counter), logged once per place with its traceback, and the message
is dropped, so the loop goes on serving everyone else. Input errors (``ProtocolError``) are
counted by the handlers themselves under their own reasons; what reaches the guard is a bug,
and a bug in handling one message must not stop a server.

Fault injection, for tests that prove the guard works on live processes: the environment
variable ``DATASERVER_INJECT_FAULTS`` lists ``site:every`` pairs (``front.task:5`` raises in
the front's TASK handler on every 5th TASK); ``fault`` answers whether a fault that is not
an exception is due (``worker.lie_landed:1``: a worker that says its task landed but wrote
nothing). Unset, each is one dictionary lookup.
"""

from __future__ import annotations

import logging
import os
from collections import Counter
from collections.abc import Callable
from typing import Any, Protocol

import zmq

_SHUTDOWN_ERRNOS = (zmq.ETERM, zmq.ENOTSOCK)


def is_shutdown(exc: BaseException) -> bool:
    """True for the ZeroMQ errors a loop sees when its context or sockets are closing."""
    return isinstance(exc, zmq.ContextTerminated) or (
        isinstance(exc, zmq.ZMQError) and exc.errno in _SHUTDOWN_ERRNOS
    )


class InjectedFault(RuntimeError):
    """Raised by ``inject`` at a site named in ``DATASERVER_INJECT_FAULTS``."""


def _parse_faults(text: str) -> dict[str, int]:
    out: dict[str, int] = {}
    for part in text.split(","):
        site, _, every = part.strip().partition(":")
        if site:
            out[site] = max(1, int(every)) if every.isdigit() else 1
    return out


_FAULTS = _parse_faults(os.environ.get("DATASERVER_INJECT_FAULTS", ""))
_HITS: Counter[str] = Counter()


def configure_faults(spec: str) -> None:
    """Set the injected faults of this process (what the environment variable sets at
    start), for tests that run a client in their own process."""
    _FAULTS.clear()
    _FAULTS.update(_parse_faults(spec))
    _HITS.clear()


def fault(site: str) -> bool:
    """True on every n-th call at ``site`` when the environment asks: for faults that are
    not an exception (``worker.lie_landed``: a worker says "landed" without writing)."""
    every = _FAULTS.get(site)
    if every is None:
        return False
    _HITS[site] += 1
    return _HITS[site] % every == 0


def inject(site: str) -> None:
    """Raise ``InjectedFault`` on every n-th call at ``site`` when the environment asks."""
    if fault(site):
        raise InjectedFault(f"fault injected at {site} (call {_HITS[site]})")


class MessageGuard:
    """Runs handlers so that an exception costs one message, not the process. ``internal``
    counts one such message (a bound increment of its owner's counters); ``report``, when
    given, also tells someone (a worker tells its front, over the socket it reports on)."""

    def __init__(
        self,
        log: logging.Logger,
        internal: Callable[[], None],
        report: Callable[[str, BaseException], None] | None = None,
    ) -> None:
        self.log = log
        self._internal = internal
        self._report = report
        self._seen: set[tuple[str, str]] = set()

    def run(self, site: str, handler: Callable[..., Any], *args: Any) -> None:
        try:
            handler(*args)
        except Exception as exc:
            if is_shutdown(exc):
                raise
            self._internal()
            key = (site, type(exc).__name__)
            if key in self._seen:
                self.log.debug("%s: dropped a message (%s: %s)", site, type(exc).__name__, exc)
            else:  # once per place and kind, with the traceback; later ones are counted
                self._seen.add(key)
                self.log.error("%s: dropped a message that raised; going on", site, exc_info=True)
            if self._report is not None:
                try:
                    self._report(site, exc)
                except Exception:  # telling is best effort; the loop goes on regardless
                    self.log.debug("%s: could not report the dropped message", site)


class StopFlag:
    """A loop's stop request: ``set`` from any thread or from a signal handler (a plain
    attribute write: no lock a handler could find held), read by the loop every turn."""

    def __init__(self) -> None:
        self._set = False

    def set(self) -> None:
        self._set = True

    def is_set(self) -> bool:
        return self._set


class Stoppable(Protocol):
    def is_set(self) -> bool: ...


def serve(
    start: Callable[[], None],
    turn: Callable[[], None],
    stop: Stoppable,
    close: Callable[[], None],
) -> None:
    """The one loop of every process here: ``start()``, then ``turn()`` until ``stop`` is
    set (a turn waits at most its poll timeout, so a stop is seen within it). The ZeroMQ
    errors that mean "shutting down" (``is_shutdown``) end the loop quietly, here and
    nowhere else; anything else propagates. ``close()`` runs in every case."""
    try:
        start()
        while not stop.is_set():
            turn()
    except zmq.ZMQError as exc:
        if not is_shutdown(exc):
            raise
    finally:
        close()

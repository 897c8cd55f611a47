"""What every receive loop here shares: the shutdown idiom, and a guard that makes one bad
message cost only itself.

Shutdown (pyzmq's devices' idiom, used by the front, the workers and the client's I/O
thread alike): a loop runs until its stop flag is set; ``is_shutdown`` names the one family
of ZeroMQ errors that means "the context is going away" and the loop swallows exactly those
in one place; ``finally`` closes the sockets the loop's own thread created.

``MessageGuard.run`` calls a message's handler; any exception other than a shutdown is
counted (``counter["internal"]``), logged once per place with its traceback, and the message
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
from typing import Any

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
    """Runs handlers so that an exception costs one message, not the process."""

    def __init__(
        self,
        log: logging.Logger,
        counter: Counter[str],
        report: Callable[[str, BaseException], None] | None = None,
    ) -> None:
        self.log = log
        self.counter = counter
        self.report = report  # also tell someone (a worker tells its front)
        self._seen: set[tuple[str, str]] = set()

    def run(self, site: str, handler: Callable[..., Any], *args: Any) -> None:
        try:
            handler(*args)
        except Exception as exc:
            if is_shutdown(exc):
                raise
            self.counter["internal"] += 1
            key = (site, type(exc).__name__)
            if key in self._seen:
                self.log.debug("%s: dropped a message (%s: %s)", site, type(exc).__name__, exc)
            else:  # once per place and kind, with the traceback; later ones are counted
                self._seen.add(key)
                self.log.error("%s: dropped a message that raised; going on", site, exc_info=True)
            if self.report is not None:
                try:
                    self.report(site, exc)
                except Exception:  # telling is best effort; the loop goes on regardless
                    self.log.debug("%s: could not report the dropped message", site)

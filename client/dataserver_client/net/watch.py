"""Which of the I/O thread's sockets have something to read, at a cost in the sockets that
do, not in all of them: the poller of ``engine.py``.

``zmq.Poller`` hands every registered socket to ``zmq_poll`` on each call: the client polls
four sockets a server on every pass of its loop, so at 1,024 servers a pass checked 4,096
sockets, a cost per task that grew with the servers. ``Watch`` keeps each socket's
``ZMQ_FD`` (its mailbox's eventfd) in one epoll set instead: a pass costs the sockets that were
signalled, those still readable after the last pass (a reader takes at most so many messages
a pass), and those sent on since (``touch``).

ZeroMQ's descriptor says only that a socket's state *may* have changed: ``ZMQ_EVENTS`` says
whether it is readable, and reading it (as any send, receive or connect) takes the signal. A
send can thus take the signal of a message that arrived meanwhile: a socket sent on (or
connected anew) is asked again (``touch``), or a message could wait unseen. Plain descriptors
(the wake pipe) are polled as they are. Same interface as ``zmq.Poller`` for what the engine
uses.
"""

from __future__ import annotations

import select
from typing import Any

import zmq

Pollable = Any  # a zmq.Socket or a plain file descriptor (int)


class Watch:
    """An epoll set over ZeroMQ sockets' descriptors and plain descriptors."""

    def __init__(self) -> None:
        self._epoll = select.epoll()
        self._by_fd: dict[int, Pollable] = {}
        self._fd_of: dict[Pollable, int] = {}
        self._check: set[zmq.Socket[Any]] = set()  # to ask ZMQ_EVENTS next pass

    def register(self, item: Pollable, flags: int = zmq.POLLIN) -> None:
        """Watch ``item`` for input (``flags`` must be POLLIN: nothing else is watched)."""
        if flags != zmq.POLLIN:
            raise ValueError(f"Watch watches for input only (POLLIN), not flags {flags}")
        if item in self._fd_of:
            return
        fd = item if isinstance(item, int) else int(item.getsockopt(zmq.FD))
        self._epoll.register(fd, select.EPOLLIN)
        self._by_fd[fd] = item
        self._fd_of[item] = fd
        if not isinstance(item, int):
            self._check.add(item)  # (it may hold messages already)

    def unregister(self, item: Pollable) -> None:
        fd = self._fd_of.pop(item, None)
        if fd is None:
            return
        self._by_fd.pop(fd, None)
        self._check.discard(item)
        try:
            self._epoll.unregister(fd)
        except (OSError, ValueError):  # (closed already: epoll forgot it itself)
            pass

    def touch(self, sock: zmq.Socket[Any]) -> None:
        """``sock`` was sent on: ask it again next pass whether it is readable."""
        if sock in self._fd_of:
            self._check.add(sock)

    def poll(self, timeout_ms: int | None = None) -> list[tuple[Pollable, int]]:
        """The watched items with input, each once, waiting at most ``timeout_ms`` (None:
        for ever) when none has any now."""
        ready: dict[Pollable, int] = {}
        check, self._check = self._check, set()
        for sock in check:
            if self._readable(sock):
                ready[sock] = zmq.POLLIN
        wait = 0.0 if ready else (-1.0 if timeout_ms is None else timeout_ms / 1000.0)
        for fd, _ in self._epoll.poll(wait):
            item = self._by_fd.get(fd)
            if item is None or item in ready:
                continue
            if isinstance(item, int) or self._readable(item):
                ready[item] = zmq.POLLIN
        # Readable now: may still be after the caller read some; asked again next pass.
        self._check.update(s for s in ready if not isinstance(s, int))
        return list(ready.items())

    @staticmethod
    def _readable(sock: zmq.Socket[Any]) -> bool:
        try:
            return bool(int(sock.getsockopt(zmq.EVENTS)) & zmq.POLLIN)
        except zmq.ZMQError:  # (closed)
            return False

    def close(self) -> None:
        self._epoll.close()
        self._by_fd.clear()
        self._fd_of.clear()
        self._check.clear()

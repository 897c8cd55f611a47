"""The byte accounting of one link's connections (``Inflow``): what each TCP connection
received since a message last came whole by it, how often the connections are weighed
(``INFLOW_S``, ``INFLOW_FDS_PER_S``: ``Links.tick``), and the slack a server's budget
allows beyond its answers (``INFLOW_SLACK``, ``ANSWER_SLACK``: ``ServerLink.inflow_budget``).
"""

from __future__ import annotations

from dataserver.tcpinfo import bytes_received

INFLOW_S = 0.05  # how often a link's connections are weighed (``Inflow``), at least ...
INFLOW_FDS_PER_S = 4000  # ... and at most this many connections weighed a second
INFLOW_SLACK = 64 << 20  # bytes beyond its answers' a server may have on the way
ANSWER_SLACK = 1 << 20  # beyond a task's pixels: its header, boxes and labels


class Inflow:
    """The bytes each TCP connection of a link received since a message last came whole by
    it (the kernel's count, ``dataserver.tcpinfo``): what libzmq holds of a message not
    finished yet, and of whole ones not read yet. libzmq bounds a frame, not the frames of
    a message: a server sending one that never ends held +771 MiB in the trainer until
    the client closed. Past the link's budget (``ServerLink.inflow_budget``) the server is
    dropped and the connection closed, which frees it."""

    def __init__(self) -> None:
        self.marks: dict[int, int] = {}  # fd -> bytes received when a message last came
        self.next_check = 0.0

    def due(self, now: float, every: float) -> bool:
        """Whether it is time to weigh the connections again (then not before ``every``)."""
        if now < self.next_check:
            return False
        self.next_check = now + every
        return True

    def connected(self, fd: int) -> None:
        got = bytes_received(fd)
        if got is not None:  # (ipc: no count; nothing to weigh it by)
            self.marks[fd] = got

    def disconnected(self, fd: int) -> None:
        self.marks.pop(fd, None)

    def seen(self, fd: int) -> None:
        """A whole message came by connection ``fd``."""
        if fd in self.marks:
            got = bytes_received(fd)
            if got is not None:
                self.marks[fd] = got

    def largest(self) -> int:
        """The most bytes one connection received since its last whole message."""
        most = 0
        for fd, mark in list(self.marks.items()):
            got = bytes_received(fd)
            if got is None or got < mark:  # closed, or the fd is another socket now
                del self.marks[fd]
                continue
            most = max(most, got - mark)
        return most

"""The client's file descriptors: its ``RLIMIT_NOFILE`` (the soft limit raised to the hard
one at start), ZeroMQ's socket cap sized to it, and the budget that decides, server by
server, whether its workers' results come over direct connections or through its front.

Every ZeroMQ socket holds one descriptor (its mailbox's eventfd) and every TCP connection
one more. A server costs its link's sockets and one connection (its front's, which carries
CONTROL too); a direct result connection to each of its workers costs one each, the bulk at
scale (1,024 servers of 16 workers: 16,384). The budget gives the fronts their share first
(too little for them: the client stops with an error naming the limit to raise, and by
how much), then direct connections while they fit; a server whose workers do not fit
sends its results through its front, as the server does for any client that does not
reach its workers (the worker's direct send fails, the front forwards). ``client.stats()``
shows the budget (``fds``); the first server left without direct results is logged with
what to raise.

No sockets, no threads: the I/O thread is the only caller after start.
"""

from __future__ import annotations

import logging
import os
import resource
from dataclasses import dataclass
from typing import Any

import zmq

from dataserver.fdlimit import nr_open
from dataserver.fdlimit import raise_fd_limit as _raise_fd_limit

log = logging.getLogger("dataserver_client")

FD_RESERVE = 256  # descriptors left to the rest of the process (the trainer's files, CUDA)
MIN_MAX_SOCKETS = 1023  # ZeroMQ's default cap on a context's sockets
MAX_MAX_SOCKETS = 1 << 16  # ... and how far it is raised at most (a slot table entry each)
CONNECTIONS_PER_SERVER = 1  # its front's connection (CONTROL rides it too)


def raise_fd_limit() -> tuple[int, int]:
    """Raise this process's soft ``RLIMIT_NOFILE`` to its hard limit
    (``dataserver.fdlimit``). Returns (soft, hard) as they are after."""
    return _raise_fd_limit(log)


def open_fds() -> int:
    """How many descriptors this process holds now."""
    try:
        return len(os.listdir("/proc/self/fd")) - 1  # (less the one listdir itself held)
    except OSError:
        return 0


def new_context(limit: int) -> zmq.Context[Any]:
    """A ZeroMQ context whose socket cap follows the descriptor limit (its default, 1,023,
    held a client to ~170 servers at six sockets a server). The cap is fixed when the first
    socket is made: it is set before."""
    ctx: zmq.Context[Any] = zmq.Context(io_threads=1)
    ctx.set(zmq.MAX_SOCKETS, max(MIN_MAX_SOCKETS, min(limit, MAX_MAX_SOCKETS)))
    return ctx


@dataclass(frozen=True)
class FdStats:
    """The budget as ``client.stats()["fds"]`` shows it."""

    limit: int  # the soft RLIMIT_NOFILE
    hard: int
    open: int  # descriptors open now
    per_server: int  # a server's sockets and connections, direct results apart
    servers: int
    direct: int  # direct result connections
    through_front: int  # servers whose results come through their front (not enough fds)
    short_by: int  # raise the limit this much to give every server direct results


class FdBudget:
    """The descriptors the links may take: the fronts' share first, then direct result
    connections while they fit (``take``)."""

    def __init__(
        self, limit: int, hard: int, base: int, per_server: int, reserve: int = FD_RESERVE
    ) -> None:
        self.limit = limit if limit != resource.RLIM_INFINITY else nr_open()
        self.hard = hard if hard != resource.RLIM_INFINITY else self.limit
        self.base = base  # descriptors open before the first link
        self.reserve = reserve
        self.per_server = per_server
        self.servers = 0
        self.direct = 0
        self._short: dict[str, int] = {}  # server -> the direct connections it did without
        self._warned = False

    @classmethod
    def of_process(cls, per_server: int) -> FdBudget:
        """The budget of this process as it is now (its limit raised already)."""
        soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
        return cls(soft, hard, open_fds(), per_server)

    @classmethod
    def unlimited(cls) -> FdBudget:
        """A budget that fits anything (links made alone, in tests)."""
        return cls(1 << 62, 1 << 62, 0, 0, reserve=0)

    def need(self, servers: int) -> int:
        """The descriptors ``servers`` servers need, direct results apart, with the rest of
        the process's."""
        return self.base + self.reserve + self.per_server * servers

    def problem(self, servers: int) -> str | None:
        """Why ``servers`` servers do not fit the limit, naming what to raise and by how
        much; None when they do."""
        need = self.need(servers)
        if need <= self.limit:
            return None
        what = (
            f"raise it by {need - self.limit} (ulimit -n {need})"
            if need <= self.hard
            else f"raise the hard limit to at least {need} (limits.conf nofile, systemd "
            "LimitNOFILE, docker --ulimit nofile) and the soft one with it"
        )
        return (
            f"{servers} server(s) need about {need} file descriptors ({self.per_server} a "
            f"server for its sockets and connections, {self.base} open already, "
            f"{self.reserve} kept for the rest of the process); this process may open "
            f"{self.limit} (RLIMIT_NOFILE soft limit; hard {self.hard}): {what}"
        )

    def join(self) -> str | None:
        """A server's share, taken; or why it does not fit (then nothing is taken)."""
        problem = self.problem(self.servers + 1)
        if problem is None:
            self.servers += 1
        return problem

    def leave(self) -> None:
        self.servers = max(0, self.servers - 1)

    def room(self) -> int:
        """Descriptors left for direct result connections."""
        return self.limit - self.need(self.servers) - self.direct

    def take(self, address: str, n: int) -> bool:
        """Whether server ``address`` may open ``n`` direct result connections (taken then);
        when not, its results come through its front (logged once, with what to raise)."""
        if n <= 0:
            return True
        if n <= self.room():
            self.direct += n
            self._short.pop(address, None)
            return True
        self._short[address] = n
        if not self._warned:
            self._warned = True
            log.warning(
                "%s: its results come through its front (no direct connection to its %d "
                "worker(s)): this process's open-files limit (%d) leaves room for %d more; "
                "raise it by at least %d for direct results from every server "
                "(client.stats()['fds'] shows the budget)",
                address,
                n,
                self.limit,
                max(0, self.room()),
                self.short_by(),
            )
        return False

    def give(self, address: str, n: int) -> None:
        """``n`` direct connections of ``address`` closed (or its shortfall forgotten)."""
        self.direct = max(0, self.direct - n)
        self._short.pop(address, None)

    def short_by(self) -> int:
        return max(0, sum(self._short.values()) - max(0, self.room()))

    def stats(self) -> FdStats:
        return FdStats(
            self.limit,
            self.hard,
            open_fds(),
            self.per_server,
            self.servers,
            self.direct,
            len(self._short),
            self.short_by(),
        )

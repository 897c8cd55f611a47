"""ZeroMQ endpoints as both sides read them: the one parser of ``tcp://HOST:PORT``.

A server binds, and may ask for any free port (``*``); a client connects, and a port of
``*`` is nothing it can connect to. Both sides read an endpoint here, each saying which it
does (``bind``). HOST is an address, a name, or an IPv6 address in brackets (kept as
written); ipc endpoints (``ipc://PATH``) have no parts to read.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

IPC = "ipc://"
_TCP = re.compile(r"^tcp://(?P<host>\[[^\]]+\]|[^:/]+):(?P<port>\d+|\*)$")
_PORT = re.compile(r"^tcp://.*:(?P<port>\d+)$")
WHAT = "expected tcp://HOST:PORT or ipc://PATH"  # what an endpoint that does not parse is told


@dataclass(frozen=True)
class TcpEndpoint:
    """The parts of a ``tcp://HOST:PORT`` endpoint, as written."""

    host: str  # an IPv6 address keeps its brackets, as in an endpoint
    port: str  # digits, or "*" (any free port) in an endpoint to bind

    @property
    def address(self) -> str:
        """The host without brackets: what a socket call takes."""
        return self.host.strip("[]")


def tcp_endpoint(endpoint: str, bind: bool = False) -> TcpEndpoint | None:
    """``endpoint``'s host and port, or None when it is not ``tcp://HOST:PORT``; PORT ``*``
    (any free port) only in an endpoint to bind (``bind``): a client connects to one."""
    m = _TCP.match(endpoint)
    if m is None or (m["port"] == "*" and not bind):
        return None
    return TcpEndpoint(m["host"], m["port"])


def tcp_port(endpoint: str) -> str | None:
    """The port of a ``tcp://`` endpoint whatever its host, or None: for an endpoint a
    server announces, whose host is never used (the client connects to the host it reached
    the server by)."""
    m = _PORT.match(endpoint)
    return None if m is None else m["port"]


def endpoint_problem(endpoint: str, bind: bool = False) -> str | None:
    """What is wrong with ``endpoint`` as one to bind (``bind``) or connect to, or None: a
    tcp one needs a port in 0..65535 (or ``*`` to bind), an ipc one a path."""
    if endpoint.startswith(IPC) and len(endpoint) > len(IPC):
        return None
    parsed = tcp_endpoint(endpoint, bind=True)
    if parsed is None:
        return WHAT
    if parsed.port == "*":
        return None if bind else "a client connects to one port (* is any free port, to bind)"
    if not 0 <= int(parsed.port) <= 65535:
        return "port out of range"
    return None

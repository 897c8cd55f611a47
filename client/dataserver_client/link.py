"""One server as the client's I/O thread sees it: a DEALER, credits, outstanding tasks,
liveness. Created, used and closed only in the I/O thread."""

from __future__ import annotations

import enum
import ipaddress
import re
import socket
import time
from collections.abc import Sequence
from typing import Any

import zmq

from dataserver import protocol
from dataserver.protocol import MsgType

CLIENT_MAX_MSG = 1 << 30  # results are images: allow large ones, refuse absurd ones
_TCP = re.compile(r"^tcp://(?P<host>\[[^\]]+\]|[^:/]+):(?P<port>\d+)$")


class LinkState(enum.IntEnum):
    """CONNECTING -(WELCOME)-> READY -(silent past the heartbeat timeout)-> LOST
    -(WELCOME again)-> READY. A LOST link's tasks go to other servers."""

    CONNECTING = 1
    READY = 2
    LOST = 3


def expand_addresses(addresses: str | Sequence[str]) -> list[str]:
    """Server addresses, with DNS names that resolve to several hosts (a Kubernetes headless
    Service) expanded into one address per host. IPv4 answers are preferred when a name has
    both, since a server bound to an IPv4 interface never answers on IPv6."""
    items = [addresses] if isinstance(addresses, str) else list(addresses)
    out: list[str] = []
    for addr in items:
        m = _TCP.match(addr)
        if m is None or _is_ip(m["host"].strip("[]")) or m["host"] == "localhost":
            out.append(addr)
            continue
        try:
            infos = socket.getaddrinfo(m["host"], int(m["port"]), type=socket.SOCK_STREAM)
        except OSError:
            out.append(addr)  # let ZeroMQ keep trying; the handshake timeout will say so
            continue
        v4 = sorted({str(i[4][0]) for i in infos if i[0] == socket.AF_INET})
        v6 = sorted({str(i[4][0]) for i in infos if i[0] == socket.AF_INET6})
        hosts = v4 or [f"[{h}]" for h in v6]
        out.extend(f"tcp://{h}:{m['port']}" for h in hosts)
    return list(dict.fromkeys(out))


def _is_ip(host: str) -> bool:
    try:
        ipaddress.ip_address(host)
    except ValueError:
        return False
    return True


def control_address(data_address: str, announced: str) -> str:
    """Where to connect the PUB for a server: its announced control port on the host we
    reached it by (the server may have bound 0.0.0.0, which is no address to connect to)."""
    m = _TCP.match(data_address)
    a = re.match(r"^tcp://.*:(?P<port>\d+)$", announced)
    if m is None or a is None:
        return announced
    return f"tcp://{m['host']}:{a['port']}"


class ServerLink:
    """The client's side of one server."""

    def __init__(
        self, ctx: zmq.Context[Any], address: str, session: bytes, curve: dict[str, bytes] | None
    ) -> None:
        self.address = address
        self.session = session
        self.sock = ctx.socket(zmq.DEALER)
        self.sock.setsockopt(zmq.LINGER, 0)
        self.sock.setsockopt(zmq.MAXMSGSIZE, CLIENT_MAX_MSG)
        self.sock.setsockopt(zmq.RECONNECT_IVL, 100)
        self.sock.setsockopt(zmq.RECONNECT_IVL_MAX, 1000)
        if curve:
            self.sock.curve_serverkey = curve["server_public"]
            self.sock.curve_publickey = curve["public"]
            self.sock.curve_secretkey = curve["secret"]
        self.sock.connect(address)
        self.state = LinkState.CONNECTING
        self.info: dict[str, Any] = {}
        self.server_id = ""
        self.credit = 0
        self.outstanding: dict[int, float] = {}  # task_id -> time sent
        now = time.monotonic()
        self.last_heard = now
        self.last_sent = 0.0
        self.last_hello = 0.0
        self.sent_total = 0
        self.results_total = 0
        self.auth_failed = False

    @property
    def free(self) -> int:
        return self.credit - len(self.outstanding) if self.state is LinkState.READY else 0

    def send(self, frames: list[Any]) -> None:
        self.sock.send_multipart(frames, copy=False)
        self.last_sent = time.monotonic()

    def hello(self) -> None:
        self.send(protocol.make(MsgType.HELLO, {"session": self.session}))
        self.last_hello = time.monotonic()

    def heartbeat(self) -> None:
        self.send(protocol.make(MsgType.HEARTBEAT, {"session": self.session}))

    def welcome(self, header: dict[str, Any]) -> bool:
        """Take a WELCOME; True when it comes from a different server process than before
        (a restart: whatever it held is gone)."""
        restarted = bool(self.server_id) and header["server_id"] != self.server_id
        self.info = header
        self.server_id = header["server_id"]
        self.credit = max(1, header["credit"])
        self.state = LinkState.READY
        return restarted

    def release(self, task_id: int) -> bool:
        """The server answered ``task_id``: its credit is free again."""
        return self.outstanding.pop(task_id, None) is not None

    def close(self) -> None:
        try:
            if self.state is LinkState.READY:
                self.sock.send_multipart(
                    protocol.make(MsgType.BYE, {"session": self.session}), zmq.NOBLOCK
                )
        except zmq.ZMQError:
            pass
        self.sock.close(linger=100)  # long enough for BYE to leave, short enough not to hang

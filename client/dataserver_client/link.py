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
from zmq.utils.monitor import recv_monitor_message

from dataserver import protocol
from dataserver.protocol import MsgType

MAX_WORKER_ENDPOINTS = 1024
CLIENT_MAX_MSG = 1 << 30  # results are images: allow large ones, refuse absurd ones
MONITORED = (
    zmq.EVENT_HANDSHAKE_SUCCEEDED
    | zmq.EVENT_DISCONNECTED
    | zmq.EVENT_HANDSHAKE_FAILED_AUTH
    | zmq.EVENT_HANDSHAKE_FAILED_PROTOCOL
    | zmq.EVENT_HANDSHAKE_FAILED_NO_DETAIL
)
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
    """Where to connect to an endpoint a server announces (control, worker results): its
    port on the host we reached the server by (it may have bound 0.0.0.0, which is no
    address to connect to)."""
    m = _TCP.match(data_address)
    a = re.match(r"^tcp://.*:(?P<port>\d+)$", announced)
    if m is None or a is None:
        return announced
    return f"tcp://{m['host']}:{a['port']}"


def _dealer(ctx: zmq.Context[Any], curve: dict[str, bytes] | None) -> zmq.Socket[Any]:
    """A DEALER with the options every client socket to a server shares."""
    sock = ctx.socket(zmq.DEALER)
    sock.setsockopt(zmq.LINGER, 0)
    sock.setsockopt(zmq.MAXMSGSIZE, CLIENT_MAX_MSG)
    sock.setsockopt(zmq.RECONNECT_IVL, 100)
    sock.setsockopt(zmq.RECONNECT_IVL_MAX, 1000)
    if curve:
        sock.curve_serverkey = curve["server_public"]
        sock.curve_publickey = curve["public"]
        sock.curve_secretkey = curve["secret"]
    return sock


class ServerLink:
    """The client's side of one server."""

    def __init__(
        self, ctx: zmq.Context[Any], address: str, session: bytes, curve: dict[str, bytes] | None
    ) -> None:
        self.address = address
        self.session = session
        self.sock = _dealer(ctx, curve)
        # Queue nothing for a server that is not connected: a send fails at once instead
        # of piling up for a dead peer (or blocking when the queue is full).
        self.sock.setsockopt(zmq.IMMEDIATE, 1)
        self.monitor = self.sock.get_monitor_socket(MONITORED)
        self.sock.connect(address)
        # Results come straight from the server's workers when we can reach them: one DEALER
        # connected to every worker, named by our session so each worker can address us.
        self.results = _dealer(ctx, curve)
        self.results.setsockopt(zmq.ROUTING_ID, session)
        self.result_endpoints: set[str] = set()
        self.connected = False  # a ZMTP handshake has completed on the current connection
        self.was_lost = False
        self.last_error = ""
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

    @property
    def free(self) -> int:
        if self.state is not LinkState.READY or not self.connected:
            return 0
        return self.credit - len(self.outstanding)

    def send(self, frames: list[Any]) -> bool:
        """Send without blocking; False when the server is not connected (or saturated)."""
        try:
            self.sock.send_multipart(frames, zmq.NOBLOCK, copy=False)
        except zmq.Again:
            return False
        self.last_sent = time.monotonic()
        return True

    def hello(self) -> bool:
        self.last_hello = time.monotonic()
        return self.send(protocol.make(MsgType.HELLO, {"session": self.session}))

    def heartbeat(self) -> None:
        self.send(protocol.make(MsgType.HEARTBEAT, {"session": self.session}))

    def sync_results(self, announced: Any) -> None:
        """Connect to the workers a server announces, and let go of those it no longer does."""
        if not isinstance(announced, list):
            return
        wanted = {
            control_address(self.address, e)
            for e in announced[:MAX_WORKER_ENDPOINTS]
            if isinstance(e, str) and e.startswith(("tcp://", "ipc://"))
        }
        for endpoint in sorted(wanted - self.result_endpoints):
            self.results.connect(endpoint)
        for endpoint in sorted(self.result_endpoints - wanted):
            try:
                self.results.disconnect(endpoint)
            except zmq.ZMQError:
                pass
        self.result_endpoints = wanted

    def events(self) -> list[Any]:
        """Connection events since the last call (connected, disconnected, auth failed...)."""
        out = []
        while True:
            try:
                out.append(recv_monitor_message(self.monitor, zmq.NOBLOCK))
            except zmq.Again:
                return out

    def welcome(self, header: dict[str, Any]) -> bool:
        """Take a WELCOME; True when it comes from a different server process than before
        (a restart: whatever it held is gone)."""
        restarted = bool(self.server_id) and header["server_id"] != self.server_id
        self.info = header
        self.server_id = header["server_id"]
        self.credit = max(1, header["credit"])
        self.state = LinkState.READY
        self.connected = True  # a WELCOME came over a live connection
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
        self.sock.disable_monitor()
        self.monitor.close(linger=0)
        self.results.close(linger=0)
        self.sock.close(linger=100)  # long enough for BYE to leave, short enough not to hang

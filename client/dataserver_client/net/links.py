"""The servers as the client's I/O thread sees them: one ``ServerLink`` per server (its
sockets, credit, outstanding tasks, liveness) and ``Links``, the set of them with the
connection-level logic: handshakes, heartbeats, what socket events mean.

Created, used and closed only in the I/O thread. ``Links`` reports what happened
(``LinkEvent``s) and the engine decides what that does to tasks; nothing here knows about
batches. The session's CONTROL goes on each link's data connection (``Sender``).

Link states (each arrow one ``ServerLink`` method; nothing else writes ``state``)::

    CONNECTING -(welcome)-> READY -(lose: disconnected, or silent past the timeout)-> LOST
    LOST -(welcome again)-> READY
    READY -(forget_session: the server says it does not know the session)-> CONNECTING
    CONNECTING, READY -(drain: BYE from the server; decline: it cannot serve us)-> DRAINING
    DRAINING -(lose: disconnected)-> LOST
    any -(ban: it answered what it was not asked, or lied about a result)-> BANNED (for good)

Every WELCOME is checked once, by ``welcome_problem``, against the first one accepted (the
dataset the session serves) and this client's settings, at the handshake and after it.

Which addresses the links are made for is ``discovery.py``'s: the first are its answer at
the start (``expand_addresses``), and the engine adds and removes links from what it finds
later.
"""

from __future__ import annotations

import enum
import hashlib
import hmac
import logging
import math
import os
import time
from collections import deque
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import zmq
from zmq.utils.monitor import recv_monitor_message

from dataserver.endpoint import tcp_endpoint, tcp_port
from dataserver.landing import Handover, LandingArea, landing_socket
from dataserver.protocol import Bye, Heartbeat, Hello, Welcome
from dataserver.security import (
    CLAIM_S,
    host_proof,
    new_secret,
    proof_ends,
    read_own_file,
    reply_id,
    session_id,
)
from dataserver.tcpinfo import bytes_received
from dataserver_client.errors import DataServerError
from dataserver_client.net.beats import PacedBeat
from dataserver_client.net.discovery import expand_addresses
from dataserver_client.net.fds import CONNECTIONS_PER_SERVER, FdBudget, FdStats
from dataserver_client.net.handshakes import WelcomeMemo
from dataserver_client.net.linkindex import LinkIndex

if TYPE_CHECKING:
    from dataserver_client.config import ClientConfig  # (torch: the buffers' layer)

log = logging.getLogger("dataserver_client")

MAX_WORKER_ENDPOINTS = 1024
CLIENT_MAX_MSG = 1 << 30  # results are images: allow large ones, refuse absurd ones
HEARTBEAT_IVL_MS = 5_000  # ZMTP PINGs on every connection to a server ...
HEARTBEAT_TIMEOUT_MS = 15_000  # ... dropped when nothing comes back for this long
INFLOW_S = 0.05  # how often a link's connections are weighed (``Inflow``), at least ...
INFLOW_FDS_PER_S = 4000  # ... and at most this many connections weighed a second
INFLOW_SLACK = 64 << 20  # bytes beyond its answers' a server may have on the way
ANSWER_SLACK = 1 << 20  # beyond a task's pixels: its header, boxes and labels
# ``Links.tick`` checks every link each tick up to this many links a second; past it, a
# share of them each tick, each link at least every ``SWEEP_MAX_S`` (heartbeats, HELLOs,
# silence), so the timers cost per server, not per server and tick.
LINK_CHECKS_PER_S = 10_000
SWEEP_MAX_S = 0.1
MONITORED = (
    zmq.EVENT_HANDSHAKE_SUCCEEDED
    | zmq.EVENT_CONNECTED
    | zmq.EVENT_DISCONNECTED
    | zmq.EVENT_HANDSHAKE_FAILED_AUTH
    | zmq.EVENT_HANDSHAKE_FAILED_PROTOCOL
    | zmq.EVENT_HANDSHAKE_FAILED_NO_DETAIL
)


class LinkState(enum.IntEnum):
    CONNECTING = 1
    READY = 2
    LOST = 3
    DRAINING = 4  # the server said BYE: it is leaving; it finishes what it runs, takes nothing
    BANNED = 5  # it broke the protocol in a way only a faulty or hostile server does: ignored


class EventKind(enum.Enum):
    LOST = "lost"  # the server went away (its tasks should move)
    RESULTS_BROKEN = "results_broken"  # a direct-result connection dropped (results in it are gone)
    NOT_AUTHORIZED = "not_authorized"  # CURVE refused this client's key
    OVERFLOW = "overflow"  # a connection holds more of an unfinished message than allowed


class Problem(enum.Enum):
    """What a WELCOME can be wrong about (``welcome_problem``)."""

    TOO_LARGE = "too_large"  # more samples than max_dataset_len: the server is lying or wrong
    OTHER_DATASET = "other_dataset"  # not the dataset the other servers serve
    IMAGE_SIDE = "image_side"  # it cannot compose images as large as this client asks


@dataclass(frozen=True)
class DatasetInfo:
    """The dataset a session serves, as its first accepted WELCOME announced it."""

    dataset_len: int
    fingerprint: str
    address: str  # the server that announced it
    categories: tuple[tuple[int, str], ...] = ()  # its (label, name) pairs
    # How many per-sample (h, w) it announces (0: none; else dataset_len) and their digest:
    # the sizes themselves are asked for when needed (``announce.py``).
    sizes_count: int = 0
    sizes_digest: bytes = b""


@dataclass(frozen=True)
class WelcomeProblem:
    kind: Problem
    why: str


def welcome_problem(
    address: str, msg: Welcome, dataset: DatasetInfo | None, config: ClientConfig
) -> WelcomeProblem | None:
    """What is wrong with ``msg`` from ``address`` for this session, or None: the one check
    of a WELCOME, at the handshake and after it."""
    limit = config.max_dataset_len
    if msg.dataset_len > limit:
        # The epoch's order is built in memory from this number: a server must not be able
        # to make the trainer allocate gigabytes by a claim.
        why = f"it announces {msg.dataset_len} samples, more than max_dataset_len {limit}"
        return WelcomeProblem(Problem.TOO_LARGE, why)
    if dataset is not None and (msg.fingerprint, msg.dataset_len) != (
        dataset.fingerprint,
        dataset.dataset_len,
    ):
        return WelcomeProblem(
            Problem.OTHER_DATASET,
            f"servers disagree on the dataset: {dataset.address} serves "
            f"{dataset.fingerprint} ({dataset.dataset_len} samples), {address} "
            f"serves {msg.fingerprint} ({msg.dataset_len} samples)",
        )
    if dataset is not None and tuple(msg.categories) != dataset.categories:
        return WelcomeProblem(
            Problem.OTHER_DATASET,
            f"servers disagree on the dataset's categories: {dataset.address} announces "
            f"{len(dataset.categories)}, {address} {len(msg.categories)} "
            f"(first difference: {_first_difference(dataset.categories, msg.categories)})",
        )
    if dataset is not None and (msg.sizes_count, msg.sizes_digest) != (
        dataset.sizes_count,
        dataset.sizes_digest,
    ):
        return WelcomeProblem(
            Problem.OTHER_DATASET,
            f"servers disagree on the dataset's sizes: {dataset.address} announces "
            f"{dataset.sizes_count} ({dataset.sizes_digest.hex()}), {address} "
            f"{msg.sizes_count} ({msg.sizes_digest.hex()})",
        )
    if max(config.sizes.stored) > msg.max_image_side:
        return WelcomeProblem(
            Problem.IMAGE_SIDE,
            f"{address} serves images of at most {msg.max_image_side} pixels a side "
            f"(its --max-image-side); this client asks for {config.sizes.stored}",
        )
    one = 3 * config.sizes.stored[0] * config.sizes.stored[1]
    if one > msg.max_task_bytes:
        return WelcomeProblem(
            Problem.IMAGE_SIDE,
            f"{address} takes tasks of at most {msg.max_task_bytes} bytes (its "
            f"--max-task-mb); one image of {config.sizes.stored} takes {one}",
        )
    return None


def _first_difference(ours: Sequence[tuple[int, str]], theirs: Sequence[tuple[int, str]]) -> str:
    for a, b in zip(ours, theirs, strict=False):
        if tuple(a) != tuple(b):
            return f"{tuple(a)!r} against {tuple(b)!r}"
    return f"entry {min(len(ours), len(theirs))}"


@dataclass(frozen=True)
class LinkStats:
    """One server as ``client.stats()`` shows it."""

    address: str
    state: str
    sent: int
    results: int
    outstanding: int
    credit: int
    heartbeat_s: float = 0.5  # the interval it beats at (its server's, within bounds)


@dataclass(frozen=True)
class LinkEvent:
    kind: EventKind
    link: ServerLink
    why: str = ""


def announced_address(data_address: str, announced: str) -> str:
    """Where to connect to an endpoint a server announces (its workers' results): its
    port on the host we reached the server by (it may have bound 0.0.0.0, which is no
    address to connect to)."""
    m = tcp_endpoint(data_address)
    port = tcp_port(announced)
    if m is None or port is None:
        return announced
    return f"tcp://{m.host}:{port}"


def _same_host(
    local: Sequence[str], proof: bytes, nonce: bytes, session: bytes, ends: bytes | None
) -> bool:
    """Whether the token in the file beside the server's first ipc endpoint makes the
    ``proof`` its WELCOME gave for our HELLO's ``nonce`` on the connection ``ends`` it came
    by (``security.host_proof``): then this client shares its host and file system, and
    its ipc endpoints reach it. The token itself never goes on the wire, so no one who is
    not on the host can make the proof; and it is made for one connection, so a relay
    (ours to it is not its own to the server) cannot pass the real server's on."""
    if not proof or ends is None or not local or not local[0].startswith("ipc://"):
        return False
    path = os.path.join(os.path.dirname(local[0][len("ipc://") :]), "host-token")
    # The path comes from the server: believe only a regular file of our own user.
    raw = read_own_file(path, 128)
    if raw is None:
        return False
    token = raw.decode(errors="replace").strip()
    return hmac.compare_digest(host_proof(token, nonce, session, ends), proof)


def _dealer(ctx: zmq.Context[Any], curve: dict[str, bytes] | None) -> zmq.Socket[Any]:
    """A DEALER with the options every client socket to a server shares."""
    sock = ctx.socket(zmq.DEALER)
    sock.setsockopt(zmq.LINGER, 0)
    sock.setsockopt(zmq.MAXMSGSIZE, CLIENT_MAX_MSG)
    sock.setsockopt(zmq.RECONNECT_IVL, 100)
    sock.setsockopt(zmq.RECONNECT_IVL_MAX, 1000)
    # ZMTP heartbeats: a connection whose peer answers nothing (gone without a FIN, or a
    # server that stopped reading) is dropped by libzmq, with what it held.
    sock.setsockopt(zmq.HEARTBEAT_IVL, HEARTBEAT_IVL_MS)
    sock.setsockopt(zmq.HEARTBEAT_TIMEOUT, HEARTBEAT_TIMEOUT_MS)
    sock.setsockopt(zmq.HEARTBEAT_TTL, HEARTBEAT_TIMEOUT_MS)
    if curve:
        sock.curve_serverkey = curve["server_public"]
        sock.curve_publickey = curve["public"]
        sock.curve_secretkey = curve["secret"]
    return sock


def _no_touch(sock: zmq.Socket[Any]) -> None:
    pass


@dataclass
class Shared:
    """What a client's links share: the index each keeps current (``LinkIndex``: links by
    free credit, tasks by send time), the descriptor budget their direct result
    connections come out of (``FdBudget``), and ``touched(socket)``, told of each send (the
    engine's ``Watch`` asks that socket again whether it is readable)."""

    index: LinkIndex = field(default_factory=LinkIndex)
    budget: FdBudget = field(default_factory=FdBudget.unlimited)
    touched: Callable[[zmq.Socket[Any]], None] = _no_touch


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


def _events(monitor: zmq.Socket[Any]) -> list[Any]:
    out: list[Any] = []
    while True:
        try:
            out.append(recv_monitor_message(monitor, zmq.NOBLOCK))
        except zmq.Again:
            return out


class ServerLink:
    """The client's side of one server: a DEALER to its front, and a DEALER connected to
    every one of its workers for results sent straight to us."""

    # ZeroMQ sockets a link holds, each a descriptor (its mailbox): the two DEALERs and a
    # monitor each (a PAIR on either side); its connections come on top (``fds.py``).
    SOCKETS = 6
    FDS = SOCKETS + CONNECTIONS_PER_SERVER

    def __init__(
        self,
        ctx: zmq.Context[Any],
        address: str,
        session: bytes,
        curve: dict[str, bytes] | None,
        standing: Callable[[], tuple[int, int]] = lambda: (0, 0),
        landing: LandingArea | None = None,
        shared: Shared | None = None,
        beat_s: float = 0.5,
    ) -> None:
        self.address = address
        # What it shares with the other links (``Shared``): the index it keeps current, the
        # descriptor budget its direct connections come out of, who hears of its sends.
        self._shared = shared if shared is not None else Shared()
        self._index = self._shared.index
        self._state = LinkState.CONNECTING
        self._connected = False
        self._credit = 0
        # How often it beats, and how long it may hear nothing (``beats.PacedBeat``: the
        # server's word, within bounds).
        self.pace = PacedBeat(beat_s)
        # This session's secret on this server (each server gets its own, so no server
        # learns one that acts for the session on another), and where the session stands
        # (plan version, control sequence) for the HELLO.
        self.secret = new_secret()
        self._standing = standing
        self.salt = int.from_bytes(
            hashlib.blake2b(address.encode(), digest_size=8).digest(), "little"
        )
        self.session = session
        # Its WELCOMEs before they are decoded: the last one known by its bytes, new ones
        # at most ``handshakes.RATE`` a second (a server re-sending WELCOME in a loop).
        self.welcomes = WelcomeMemo()
        self.curve = curve is not None
        self._ctx = ctx
        self._curve_keys = curve
        self._open()
        # Our HELLOs' nonce (this link's), and the proof of the last WELCOME
        # (``security.host_proof``) with the ends of the connection it came by: a server is
        # on our host when its token, read beside its ipc endpoints, makes that proof for
        # that connection. ``came_fd``: the connection the last message came by.
        self.nonce = os.urandom(16)
        self.local_proof = b""
        self.proof_ends: bytes | None = None
        self.came_fd = -1
        # Our landing buffer's hand-over to this server's workers, done only once it has
        # proven it is on our host (``sync_results``).
        self.handover = Handover(landing, session) if landing is not None else None
        self.was_lost = False
        self.last_error = ""
        # what the server's last heartbeat reply said of its object store ("": it answers)
        self.store_stall = ""
        self.welcome_msg: Welcome | None = None
        self.server_id = ""
        self.workers = 0
        self.outstanding: dict[int, float] = {}  # task_id -> when sent
        now = time.monotonic()
        self.last_heard = now
        self.last_sent = 0.0
        self.last_hello = 0.0
        self.last_claim = 0.0
        self.sent_total = 0
        self.results_total = 0

    # State, connection and credit are what its free credit depends on: each change is
    # told to the index (``LinkIndex.moved``), which keeps the links by free credit.

    @property
    def state(self) -> LinkState:
        return self._state

    @state.setter
    def state(self, value: LinkState) -> None:
        self._state = value
        self._index.moved(self)

    @property
    def connected(self) -> bool:
        """A ZMTP handshake has completed on the current connection."""
        return self._connected

    @connected.setter
    def connected(self, value: bool) -> None:
        self._connected = value
        self._index.moved(self)

    @property
    def credit(self) -> int:
        return self._credit

    @credit.setter
    def credit(self, value: int) -> None:
        self._credit = value
        self._index.moved(self)

    @property
    def ready(self) -> bool:
        return self._state is LinkState.READY

    def _open(self) -> None:
        """Its sockets, new: a DEALER to the front, and one for the workers' results."""
        self.sock = _dealer(self._ctx, self._curve_keys)
        # Queue nothing for a server that is not connected: a send fails at once instead
        # of piling up for a dead peer (or blocking when the queue is full).
        self.sock.setsockopt(zmq.IMMEDIATE, 1)
        self.monitor = self.sock.get_monitor_socket(MONITORED)
        self.sock.connect(self.address)
        # Named by the reply id of our secret, so each worker can address us and nobody
        # else can take the name.
        self.results = _dealer(self._ctx, self._curve_keys)
        self.results.setsockopt(zmq.ROUTING_ID, reply_id(self.secret))
        self.results_monitor = self.results.get_monitor_socket(
            zmq.EVENT_DISCONNECTED | zmq.EVENT_HANDSHAKE_SUCCEEDED | zmq.EVENT_CONNECTED
        )
        self.result_endpoints: set[str] = set()
        self.inflow = Inflow()
        self.largest_answer = 0  # the most bytes a task sent here may be answered with
        self.open = True

    def _close_sockets(self, linger_ms: int = 0) -> None:
        self._shared.budget.give(self.address, len(self.result_endpoints))
        self.sock.disable_monitor()
        self.results.disable_monitor()
        self.monitor.close(linger=0)
        self.results_monitor.close(linger=0)
        self.results.close(linger=0)
        self.sock.close(linger=linger_ms)
        self.open = False

    def reopen(self) -> None:
        """New sockets in place of the old (the caller unwatched them): a lost server's
        connections are closed, and whatever they held of a message with them (a server
        that fell silent in the middle of one held it until the client closed)."""
        if self.open:
            self._close_sockets()
        self.connected = False
        self._open()

    def shut(self) -> None:
        """Close its sockets for good (a banned server: nothing it sends is read)."""
        if self.open:
            self._close_sockets()

    def inflow_budget(self) -> int:
        """What a connection of this server may hold beyond its last whole message: every
        outstanding task's answer, two more, and ``INFLOW_SLACK``."""
        answer = self.largest_answer + ANSWER_SLACK
        return (len(self.outstanding) + 2) * answer + INFLOW_SLACK

    def sockets(self) -> list[tuple[zmq.Socket[Any], str]]:
        """Its sockets the I/O thread polls, each with its role."""
        if not self.open:
            return []
        return [
            (self.sock, "front"),
            (self.results, "results"),
            (self.monitor, "monitor"),
            (self.results_monitor, "results_monitor"),
        ]

    @property
    def free(self) -> int:
        if self._state is not LinkState.READY or not self._connected:
            return 0
        return self._credit - len(self.outstanding)

    def send(self, frames: list[Any]) -> bool:
        """Send without blocking; False when the server is not connected (or saturated)."""
        try:
            self.sock.send_multipart(frames, zmq.NOBLOCK, copy=False)
        except zmq.Again:
            return False
        finally:
            self._shared.touched(self.sock)
        self.last_sent = time.monotonic()
        return True

    def hello(self) -> bool:
        self.last_hello = time.monotonic()
        plan_version, control_seq = self._standing()
        hello = Hello(
            session=self.session,
            auth=self.secret,
            plan_version=plan_version,
            control_seq=control_seq,
            nonce=self.nonce,
        )
        return self.send(hello.encode())

    def heartbeat(self) -> None:
        self.send(Heartbeat(session=self.session, auth=self.secret).encode())

    def paced(self, ms: int | None) -> bool:
        """The server asks for a beat every ``ms`` (WELCOME, heartbeat reply): followed
        within ``beats``' bounds; False when refused (the caller counts it)."""
        return self.pace.told(ms)

    def claim(self) -> None:
        """Claim our session on each worker connection, as it comes up and every
        ``CLAIM_S`` after: with CURVE a worker sends results straight only to a connection
        that claimed them with the session's key, and with or without, a claim is what
        keeps a result connection from being shut down as idle. The DEALER deals one claim
        to each connected worker in turn."""
        self.last_claim = time.monotonic()
        # (the tag the front's WELCOME gave: it admitted the session; a worker takes no
        # claim without it)
        tag = self.welcome_msg.claim if self.welcome_msg is not None else b""
        frames = Hello(session=self.session, auth=self.secret, claim=tag).encode()
        for _ in self.result_endpoints:
            try:
                self.results.send_multipart(frames, zmq.NOBLOCK)
            except zmq.Again:
                break
        self._shared.touched(self.results)

    def store_says(self, stall: str) -> None:
        """The server's heartbeat reply: why its object store gives it nothing ("": fine)."""
        self.store_stall = stall

    def sync_results(
        self, announced: Sequence[str], local: Sequence[str] = (), proof: bytes | None = None
    ) -> None:
        """Connect to the workers a server announces. A worker's ipc endpoint (``local``,
        same order) is preferred when this client is on the server's host: when the
        server's token can be read beside it.

        Endpoints no longer announced (a replaced worker's) are never disconnected: libzmq
        aborts the process (``Assertion failed: !_more``, src/fq.cpp; libzmq #3485) when a
        pipe is terminated while a multipart message from it is being read, and a message
        from that worker may be waiting. A dead endpoint costs a reconnect attempt a
        second; at most ``MAX_WORKER_ENDPOINTS`` are ever connected (past that, results
        from new workers come through the front, as for a client that cannot reach them)."""
        if proof is not None:
            self.local_proof = proof
        use_local = len(local) == len(announced) and _same_host(
            local, self.local_proof, self.nonce, self.session, self.proof_ends
        )
        chosen = local if use_local else announced
        wanted = {
            announced_address(self.address, e)
            for e in chosen[:MAX_WORKER_ENDPOINTS]
            if e.startswith(("tcp://", "ipc://"))
        }
        new = sorted(wanted - self.result_endpoints)
        new = new[: max(0, MAX_WORKER_ENDPOINTS - len(self.result_endpoints))]
        if not self._shared.budget.take(self.address, len(new)):
            new = []  # not enough descriptors: results come through the front
        for endpoint in new:
            self.results.connect(endpoint)
            self.result_endpoints.add(endpoint)
        if new:  # (a connect handles the socket's commands: a signal may have gone with them)
            self._shared.touched(self.results)
        if self.handover is not None:
            paths = [landing_socket(e) for e in local] if use_local else []
            self.handover.sync([p for p in paths[:MAX_WORKER_ENDPOINTS] if p is not None])

    @property
    def can_land(self) -> bool:
        """Whether tasks to this server may name our landing buffer: it is on our host
        and at least one of its workers took the buffer."""
        return self.handover is not None and self.handover.ready

    # ------------------------------------------------------------ state transitions

    def welcome_unchanged(self, msg: Welcome) -> bool:
        """Whether ``msg`` is the WELCOME this ready link holds already (a server saying
        it again, from the same process): nothing to check, move or plan again."""
        return (
            self.state is LinkState.READY
            and not self.was_lost
            and self.welcome_msg is not None
            and (msg is self.welcome_msg or msg == self.welcome_msg)
        )

    def came_by(self, fd: int) -> None:
        """A whole message came by connection ``fd`` (``ZMQ_SRCFD``)."""
        self.came_fd = fd
        self.inflow.seen(fd)

    def welcome(self, msg: Welcome, fd: int | None = None) -> bool:
        """CONNECTING or LOST -> READY on a WELCOME that came by connection ``fd`` (None:
        the last message's); True when it comes from a different server process than
        before (a restart: whatever it held is gone)."""
        restarted = bool(self.server_id) and msg.server_id != self.server_id
        self.welcome_msg = msg
        self.server_id = msg.server_id
        self.local_proof = msg.local_proof
        came = self.came_fd if fd is None else fd
        self.proof_ends = proof_ends(came, server=False) if msg.local_proof else None
        self.credit = max(1, msg.credit)
        self.workers = msg.workers
        self.state = LinkState.READY
        self.connected = True  # a WELCOME came over a live connection
        self.was_lost = False
        self.sync_results(msg.results, msg.local, msg.local_proof)
        return restarted

    def decline(self, msg: Welcome, why: str) -> None:
        """-> DRAINING: the server answered, but cannot serve this session (``why``)."""
        log.error("%s: not using it (%s)", self.address, why)
        self.welcome_msg = msg
        self.drain()

    def drain(self) -> None:
        """-> DRAINING: the server said BYE, it is leaving (SIGTERM, a scale-down). It gets
        nothing more; what it still runs may come back, what it had queued it answers
        CANCELLED."""
        if self.state is not LinkState.DRAINING:
            log.info("%s is draining: sending it nothing more", self.address)
        self.state = LinkState.DRAINING
        self.last_error = "draining"

    def ban(self, why: str) -> None:
        """-> BANNED: the server answered what it was not asked (or claimed what it did not
        do): it gets nothing more and what it sends is dropped, for the rest of this
        client's life. The engine moves its tasks to the other servers."""
        if self.state is not LinkState.BANNED:
            log.error("%s broke the protocol (%s): not using it any more", self.address, why)
        self.state = LinkState.BANNED
        self.last_error = f"dropped: {why}"

    def lose(self, why: str) -> LinkEvent:
        """-> LOST: the connection dropped, or the server fell silent."""
        # A server that drained was expected to go: no warning for that.
        level = logging.INFO if self.state is LinkState.DRAINING else logging.WARNING
        log.log(level, "%s lost (%s)", self.address, why)
        self.state = LinkState.LOST
        self.was_lost = True
        self.last_error = why
        return LinkEvent(EventKind.LOST, self, why)

    def forget_session(self) -> None:
        """READY -> CONNECTING: the server restarted or forgot the session; HELLO again
        (what it held is asked again once it answers, as after a loss)."""
        if self.state is LinkState.READY:
            self.state = LinkState.CONNECTING
            self.was_lost = True
            self.hello()

    def on_handshake(self) -> None:
        """A ZMTP handshake completed: greet the server unless it knows us already."""
        self.connected = True
        self.last_error = ""
        if self.state not in (LinkState.READY, LinkState.BANNED):
            self.hello()

    def on_disconnect(self) -> LinkEvent | None:
        """The front connection dropped: a LOST event when the server was in use."""
        self.connected = False
        if self.state in (LinkState.READY, LinkState.DRAINING):
            return self.lose("disconnected")
        return None

    def failed_handshake(self, why: str) -> None:
        self.last_error = why

    # ------------------------------------------------------------ tasks and traffic

    def heard(self) -> None:
        """Any traffic from the server: it is alive."""
        self.last_heard = time.monotonic()

    def sent(self, task_id: int, answer_bytes: int = 0) -> None:
        """``task_id`` went out (again: it goes last, as the newest); its answer's pixels
        are ``answer_bytes``."""
        self.largest_answer = max(self.largest_answer, answer_bytes)
        again = self.outstanding.pop(task_id, None) is not None
        now = self.outstanding[task_id] = time.monotonic()
        self.sent_total += 1
        self._index.sent(self, task_id, now, new=not again)
        self._index.moved(self)

    def answered(self) -> None:
        self.results_total += 1

    def owes(self, task_id: int) -> bool:
        return task_id in self.outstanding

    def sent_at(self, task_id: int) -> float | None:
        """When ``task_id`` was last sent here, if it is outstanding."""
        return self.outstanding.get(task_id)

    def owed(self) -> list[int]:
        """The outstanding task ids, oldest first."""
        return list(self.outstanding)

    def forget_tasks(self, task_ids: list[int]) -> list[int]:
        """Forget those of ``task_ids`` outstanding here (past their deadline: the index's
        ``late``, through ``Links.expire``); their ids."""
        gone = [t for t in task_ids if self.outstanding.pop(t, None) is not None]
        if gone:
            self._index.let_go(len(gone))
            self._index.moved(self)
        return gone

    def release(self, task_id: int) -> float | None:
        """The server answered ``task_id``: its credit is free again. Returns when it was
        sent (None if it was not outstanding here)."""
        sent = self.outstanding.pop(task_id, None)
        if sent is not None:
            self._index.let_go(1)
            self._index.moved(self)
        return sent

    def take_outstanding(self) -> list[int]:
        """Forget every outstanding task (they move elsewhere); their ids, oldest first."""
        ids = list(self.outstanding)
        self.outstanding.clear()
        self._index.let_go(len(ids))
        self._index.moved(self)
        return ids

    def stats(self) -> LinkStats:
        return LinkStats(
            self.address,
            self.state.name.lower(),
            self.sent_total,
            self.results_total,
            len(self.outstanding),
            self.credit,
            self.pace.interval_s,
        )

    def close(self) -> None:
        if self.open:
            try:
                # A server that welcomed us holds a session until BYE (or its idle timeout).
                if self.state is LinkState.READY or (
                    self.state is LinkState.DRAINING and self.welcome_msg is not None
                ):
                    bye = Bye(session=self.session, auth=self.secret)
                    self.sock.send_multipart(bye.encode(), zmq.NOBLOCK)
            except zmq.ZMQError:
                pass
            self._close_sockets(100)  # long enough for BYE to leave, short enough not to hang
        if self.handover is not None:
            self.handover.close()  # its workers let go of our buffer


class Links:
    """Every server link of one client, and what their connections are doing."""

    def __init__(
        self,
        ctx: zmq.Context[Any],
        config: ClientConfig,
        curve: dict[str, bytes] | None,
        standing: Callable[[], tuple[int, int]] = lambda: (0, 0),
        landing: LandingArea | None = None,
        budget: FdBudget | None = None,
        touched: Callable[[zmq.Socket[Any]], None] = _no_touch,
    ) -> None:
        self.config = config
        self._ctx, self._curve = ctx, curve
        self._standing = standing
        self._landing = landing
        addresses = expand_addresses(config.addresses)
        budget = budget if budget is not None else FdBudget.of_process(ServerLink.FDS)
        problem = budget.problem(len(addresses))
        if problem is not None:
            raise DataServerError(f"not enough file descriptors: {problem}")
        self.shared = Shared(LinkIndex(), budget, touched)
        self._sweep: deque[ServerLink] = deque()  # the links in the order ``tick`` checks them
        self._swept = 0.0  # when ``tick`` last checked links
        self._due = 0.0  # links it owes a check (a fraction carried over)
        self._inflow_fds = 0  # connections weighed on the last round (``Inflow``) ...
        self._round = [0, 0]  # ... and on this one so far, with the links checked
        self.dataset: DatasetInfo | None = None  # from the first WELCOME accepted
        self.links: list[ServerLink] = []
        for address in addresses:
            self.add(address)

    def add(self, address: str) -> ServerLink | None:
        """A link to a server found at ``address``; its HELLO is on its way. None: its
        sockets do not fit the descriptor limit (logged, with the limit to raise)."""
        problem = self.shared.budget.join()
        if problem is not None:
            log.error("%s: not using it: not enough file descriptors: %s", address, problem)
            return None
        # A session id of its own on each server: no server learns an id that names the
        # session anywhere else (one that forgot the session could otherwise be told that
        # id first, by whoever learnt it from another server).
        session = session_id(self._curve["public"] if self._curve else None)
        cfg = self.config
        link = ServerLink(
            self._ctx,
            address,
            session,
            self._curve,
            self._standing,
            self._landing,
            self.shared,
            beat_s=cfg.heartbeat_interval,
        )
        self.links.append(link)
        self._sweep.append(link)
        link.hello()
        return link

    def remove(self, link: ServerLink) -> None:
        """Forget a server (its address is gone): close its sockets."""
        self.links.remove(link)
        self._sweep.remove(link)
        link.close()
        self.shared.index.forget(link)
        self.shared.budget.leave()

    def __iter__(self) -> Iterator[ServerLink]:
        return iter(self.links)

    def ready(self) -> list[ServerLink]:
        return [link for link in self.links if link.state is LinkState.READY]

    def any_ready(self, besides: ServerLink | None = None) -> bool:
        return any(lk.state is LinkState.READY and lk is not besides for lk in self.links)

    def met(self) -> list[ServerLink]:
        """The servers that welcomed this session at least once."""
        return [link for link in self.links if link.welcome_msg is not None]

    def stores(self) -> bool:
        """Whether every server met keeps a store of decoded sources."""
        return all(lk.welcome_msg.store_bytes > 0 for lk in self.met() if lk.welcome_msg)

    def best(
        self, skip: set[ServerLink] | frozenset[ServerLink] = frozenset()
    ) -> ServerLink | None:
        """The link with the most free credit (leaving out ``skip``), or None when none
        has any: from the index's heap, whatever the number of links."""
        return self.shared.index.best(skip)

    def expire(self, now: float, limit: float) -> list[tuple[ServerLink, list[int]]]:
        """The tasks outstanding for ``limit`` seconds or more on ready links, forgotten
        there: each link with their ids, oldest first. Those of links not ready now wait
        until their link is (it may come back, or its tasks move when it is lost)."""
        out = []
        for link, ids in self.shared.index.late(now - limit).items():
            if link.state is LinkState.READY:
                gone = link.forget_tasks(ids)
                if gone:
                    out.append((link, gone))
            else:
                self.shared.index.park(link, ids)
        return out

    def owing(self) -> bool:
        """Whether any link has a task outstanding."""
        return self.shared.index.outstanding > 0

    def fds(self) -> FdStats:
        return self.shared.budget.stats()

    def check(self, link: ServerLink, msg: Welcome) -> WelcomeProblem | None:
        """The one check of a WELCOME (``welcome_problem``); the first accepted fixes the
        dataset the session serves."""
        problem = welcome_problem(link.address, msg, self.dataset, self.config)
        if problem is None and self.dataset is None:
            categories = tuple((int(label), str(name)) for label, name in msg.categories)
            self.dataset = DatasetInfo(
                msg.dataset_len,
                msg.fingerprint,
                link.address,
                categories,
                msg.sizes_count,
                msg.sizes_digest,
            )
        return problem

    def handshake(self) -> DatasetInfo | None:
        """The dataset once every server answered (None until then)."""
        waiting = [
            lk for lk in self.links if lk.state not in (LinkState.DRAINING, LinkState.BANNED)
        ]
        if any(link.welcome_msg is None for link in waiting):
            return None
        return self.dataset if any(lk.state is not LinkState.BANNED for lk in self.met()) else None

    def waiting_names(self) -> str:
        return ", ".join(
            link.address + (f" ({link.last_error})" if link.last_error else "")
            for link in self.links
            if link.welcome_msg is None
        )

    def on_monitor(self, link: ServerLink) -> list[LinkEvent]:
        """What the front connection's events mean."""
        out = []
        for event in _events(link.monitor):
            kind = event["event"]
            if kind == zmq.EVENT_CONNECTED:
                link.inflow.connected(event["value"])
            elif kind == zmq.EVENT_HANDSHAKE_SUCCEEDED:
                link.on_handshake()
            elif kind == zmq.EVENT_DISCONNECTED:
                link.inflow.disconnected(event["value"])
                lost = link.on_disconnect()
                if lost is not None:
                    out.append(lost)
            elif kind == zmq.EVENT_HANDSHAKE_FAILED_AUTH:
                out.append(
                    LinkEvent(
                        EventKind.NOT_AUTHORIZED,
                        link,
                        f"not authorized by {link.address}: the server does not accept this "
                        "client's CURVE key (is its public key in --curve-authorized-keys?)",
                    )
                )
            elif kind in (
                zmq.EVENT_HANDSHAKE_FAILED_PROTOCOL,
                zmq.EVENT_HANDSHAKE_FAILED_NO_DETAIL,
            ):
                link.failed_handshake(
                    "the connection handshake failed: a CURVE setting on one side only, "
                    "or not a dataserver"
                )
        return out

    def on_results_monitor(self, link: ServerLink) -> list[LinkEvent]:
        """A direct-result connection came up (claim the session on it), or dropped (results
        on their way in it are gone)."""
        events = _events(link.results_monitor)
        for e in events:
            if e["event"] == zmq.EVENT_CONNECTED:
                link.inflow.connected(e["value"])
            elif e["event"] == zmq.EVENT_DISCONNECTED:
                link.inflow.disconnected(e["value"])
        if any(e["event"] == zmq.EVENT_HANDSHAKE_SUCCEEDED for e in events):
            link.claim()
        dropped = [e for e in events if e["event"] == zmq.EVENT_DISCONNECTED]
        if dropped and link.state in (LinkState.READY, LinkState.DRAINING):
            endpoints = {str(e.get("endpoint", b""), "utf-8", "replace") for e in dropped}
            return [LinkEvent(EventKind.RESULTS_BROKEN, link, ", ".join(sorted(endpoints)))]
        return []

    def _due_links(self, now: float) -> list[ServerLink]:
        """The links to check this tick (``_share``), their connections counted: a round
        over every link gives the count ``Inflow`` is paced by."""
        due = self._share(now)
        self._round[0] += sum(len(lk.inflow.marks) for lk in due)
        self._round[1] += len(due)
        if self._round[1] >= len(self.links):
            self._inflow_fds, self._round = self._round[0], [0, 0]
        return due

    def _share(self, now: float) -> list[ServerLink]:
        """All links while they are few; past ``LINK_CHECKS_PER_S`` checks a second, the
        next share in turn, each link at least every ``SWEEP_MAX_S``."""
        n = len(self._sweep)
        period = max(0.0, min(SWEEP_MAX_S, n / LINK_CHECKS_PER_S))
        elapsed, self._swept = now - self._swept, now
        if period <= 0.0 or elapsed >= period:
            self._due = 0.0
            return list(self._sweep)
        self._due = min(float(n), self._due + n * elapsed / period)
        k = math.floor(self._due)
        self._due -= k
        out = []
        for _ in range(k):
            link = self._sweep.popleft()
            self._sweep.append(link)
            out.append(link)
        return out

    def tick(self, now: float) -> list[LinkEvent]:
        """Heartbeats, HELLOs to servers without a session, and silence past the timeout:
        of the links due a check (``_due_links``)."""
        out = []
        cfg = self.config
        due = self._due_links(now)
        every = max(INFLOW_S, self._inflow_fds / INFLOW_FDS_PER_S)
        for link in due:
            if link.open and link.inflow.due(now, every):
                held, budget = link.inflow.largest(), link.inflow_budget()
                if held > budget:
                    why = (
                        f"it sent {held >> 20} MiB of a message it did not finish (more than "
                        f"the {budget >> 20} MiB its outstanding answers can take)"
                    )
                    out.append(LinkEvent(EventKind.OVERFLOW, link, why))
                    continue
            if link.state in (LinkState.READY, LinkState.DRAINING):
                if now - link.last_sent > link.pace.interval_s:
                    link.heartbeat()
                if now - link.last_claim > CLAIM_S:
                    link.claim()
                if now - link.last_heard > link.pace.silence_s(cfg.heartbeat_timeout):
                    out.append(link.lose(f"silent for {now - link.last_heard:.1f} s"))
            elif link.state is not LinkState.BANNED:
                # Soon after a failed send (not connected yet); once a second while a sent
                # HELLO waits for its WELCOME.
                wait = 1.0 if link.connected else 0.2
                if now - link.last_hello > wait:
                    link.hello()
        return out

    def close(self) -> None:
        for link in self.links:
            link.close()
